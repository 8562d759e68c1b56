"""Device meshes with the library's axis names, over one process's devices or every process's.

Over many processes (after `initialize_distributed`) the axes that talk least cross between
processes (hosts): by default `data` (no communication), then `expert`, then `dcp`, then `tensor`
(an all-reduce every layer), so TP and DCP stay inside a host's fast links where they fit."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "tensor", "dcp", "expert")
HOST_AXES = ("data", "expert", "dcp", "tensor")  # which axes span processes first


def make_mesh(data: int = 1, tensor: int = 1, dcp: int = 1, expert: int = 1, devices=None,
              host_axes=HOST_AXES) -> Mesh:
    """A mesh over data x tensor x dcp x expert (axes of size 1 are kept, so specs stay valid).

    `devices`: laid out in the order given; default: all devices, and over many processes each
    axis of `host_axes` in turn takes as much of the process count as it divides (the rest of
    every axis stays inside a process). One process: the first data*tensor*dcp*expert devices."""
    sizes = (data, tensor, dcp, expert)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive ints, got {dict(zip(AXES, sizes))}")
    n = math.prod(sizes)
    if devices is None and jax.process_count() > 1:
        return Mesh(_host_major(dict(zip(AXES, sizes)), tuple(host_axes)), AXES)
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ValueError(f"a {dict(zip(AXES, sizes))} mesh needs {n} devices, only {len(devices)} are visible")
    return Mesh(np.array(devices[:n]).reshape(sizes), AXES)


def host_split(sizes: dict, processes: int, host_axes=HOST_AXES) -> dict:
    """How many processes each axis spans: `host_axes` in order, each taking the largest factor
    of the processes still unplaced that divides its size."""
    unknown = [a for a in host_axes if a not in sizes]
    if unknown:
        raise ValueError(f"host_axes {unknown} are not mesh axes {tuple(sizes)}")
    order = list(host_axes) + [a for a in sizes if a not in host_axes]
    left, split = processes, {a: 1 for a in sizes}
    for a in order:
        split[a] = math.gcd(sizes[a], left)
        left //= split[a]
    if left != 1:
        raise ValueError(f"a {sizes} mesh cannot be laid out over {processes} processes: the axis sizes must "
                         f"factor into {processes} (processes) x {math.prod(sizes.values()) // processes} "
                         "(devices per process)")
    return split


def _host_major(sizes: dict, host_axes) -> np.ndarray:
    """The device array of a mesh over every process's devices: each axis indexes (process part,
    local part), process part outermost, per `host_split`."""
    procs, total = jax.process_count(), jax.device_count()
    n = math.prod(sizes.values())
    if n != total:
        raise ValueError(f"a {sizes} mesh uses {n} devices, but the {procs} processes hold {total}: a multi-process "
                         f"mesh must use every device (make the axis sizes multiply to {total})")
    by_proc = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    local = total // procs
    if any(sum(d.process_index == p for d in by_proc) != local for p in range(procs)):
        raise ValueError("every process must hold the same number of devices for a multi-process mesh")
    split = host_split(sizes, procs, host_axes)
    outer = [split[a] for a in AXES]
    inner = [sizes[a] // split[a] for a in AXES]
    grid = np.array(by_proc, dtype=object).reshape(outer + inner)  # process-major: outer dims index processes
    k = len(AXES)
    grid = grid.transpose([i for pair in zip(range(k), range(k, 2 * k)) for i in pair])
    return grid.reshape([sizes[a] for a in AXES])
