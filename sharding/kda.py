"""The KDA layer under tensor parallelism, in shard_map over heads.

Each tensor rank holds H / TP heads: their q/k/v/f/b/g projection columns, conv channels, A_log,
dt_bias (the placement rules in rules.py) and their slice of the recurrent state and conv state.
`kda_apply` runs on those local heads (the Pallas decode / chunk kernels see only them, so no
custom call is ever partitioned by XLA), and the output projection's partial sums meet in one
all-reduce. The conv state's channels are laid out per rank ([q | k | v] of rank 0's heads, then
rank 1's, ...), which is what splitting its last dimension over `tensor` gives each rank.
"""
from __future__ import annotations

import jax
from jax import shard_map
from jax.sharding import PartitionSpec as P

from kimik3.layers.kda import kda_apply
from .rules import param_spec

AXIS = "tensor"


def kda_tensor_axis(cfg, mesh):
    """"tensor" when `mesh` (abstract or concrete) splits KDA heads: a tensor axis > 1 that divides
    the head count; else None (the layer then runs unsplit, replicated)."""
    if mesh is None or getattr(mesh, "empty", False):
        return None
    t = mesh.shape.get(AXIS, 1)
    return AXIS if t > 1 and cfg.kda_num_heads % t == 0 else None


def kda_cache_specs(cfg, mesh) -> dict:
    """PartitionSpecs of one KDA layer's cache on `mesh`: heads over tensor when they split."""
    if kda_tensor_axis(cfg, mesh) is None:
        return {"state": P(), "conv": P()}
    return {"state": P(None, AXIS, None, None), "conv": P(None, None, AXIS)}


def kda_sharded(cfg, p, x, cache, n_new, backend=None, mesh=None, all_positions=False):
    """One KDA layer per rank's heads on `mesh` (default: the ambient one); traceable in jit.
    x [B, T, D] and the output are replicated; the cache stays split over heads."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    specs = jax.tree_util.tree_map_with_path(lambda path, w: param_spec(path, w.shape, mesh, cfg), p)
    cspecs = kda_cache_specs(cfg, mesh)
    out_cspecs = cspecs
    if all_positions:  # the state after every position: [B, T, H, K, K], heads still split
        out_cspecs = {**cspecs, "state": P(None, None, *cspecs["state"][1:])}
    f = shard_map(lambda p, x, c, n: kda_apply(cfg, p, x, c, n, backend, tensor_axis=AXIS,
                                               all_positions=all_positions),
                  mesh=mesh, in_specs=(specs, P(), cspecs, P()), out_specs=(P(), out_cspecs),
                  check_vma=False)
    return f(p, x, cache, n_new)
