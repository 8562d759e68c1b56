"""Placement of the KDA layer under tensor parallelism: heads over `tensor`.

Each tensor rank holds H / TP heads: their q/k/v/f/b/g projection columns, conv channels, A_log,
dt_bias (the placement rules in rules.py) and their slice of the recurrent state and conv state.
The conv state's channels are laid out per rank ([q | k | v] of rank 0's heads, then rank 1's,
...), which is what splitting its last dimension over `tensor` gives each rank. The layer that
computes with this placement (shard_map over `kda_apply`) lives in kimik3/layers/kda.py.
"""
from __future__ import annotations

from jax.sharding import PartitionSpec as P

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
