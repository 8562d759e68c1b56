"""Data-parallel replicas: the `data` axis of a mesh cut into one sub-mesh per replica, each of
which runs its own engine (its own slots and scheduler) on the weights the whole mesh holds.

A replica is the devices of one index along `data`; over several processes `make_mesh` puts
`data` across processes first, so a replica usually lives inside one process (or one group of
processes, when the other axes also span processes), and no collective ever crosses replicas.
The weights are placed once on the whole mesh, replicated over `data`; `on_replica` views them
on one replica's sub-mesh without copying (its arrays are the whole mesh's buffers).
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding


@dataclasses.dataclass(frozen=True)
class Replica:
    index: int          # along the `data` axis
    mesh: Mesh          # its devices, with the mesh's axes (`data` of size 1)
    processes: tuple    # the process ids holding its devices, ascending

    @property
    def leader(self) -> int:
        """The process that speaks for this replica (its lowest process id)."""
        return self.processes[0]

    @property
    def local(self) -> bool:
        return jax.process_index() in self.processes


def replicas(mesh: Mesh) -> list[Replica]:
    """One Replica per index of `mesh`'s `data` axis."""
    axis = mesh.axis_names.index("data")
    out = []
    for r in range(mesh.shape["data"]):
        devices = np.take(mesh.devices, [r], axis=axis)
        procs = tuple(sorted({d.process_index for d in devices.flat}))
        out.append(Replica(r, Mesh(devices, mesh.axis_names), procs))
    return out


def on_replica(tree, replica: Replica):
    """`tree`'s arrays (placed on the whole mesh, not split over `data`) as arrays on `replica`'s
    sub-mesh, made of the same device buffers; other leaves unchanged. Call it on the processes
    of the replica."""
    devices = set(replica.mesh.devices.flat)

    def view(x):
        if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
            return x
        spec = x.sharding.spec
        if any(p == "data" or (isinstance(p, tuple) and "data" in p) for p in spec):
            raise ValueError(f"an array split over the 'data' axis ({spec}) has no copy on one replica: place the "
                             "weights replicated over 'data'")
        shards = [s.data for s in x.addressable_shards if s.device in devices]
        return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(replica.mesh, spec), shards)

    return jax.tree.map(view, tree)
