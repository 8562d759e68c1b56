"""Placement of one MoE layer's weights on a mesh, and the accounting that checks it: the specs
`rules.param_spec` gives a MoE layer's own tree by its logical axes (routed experts over `expert`
and/or their intermediate over `tensor`, shared experts' intermediate over `tensor`, MoE dedup's
owned rows of the latent up-projection), the bytes each device holds under them, and the
collectives a compiled program contains. The layer that computes with this placement (shard_map
over `moe_apply`) lives beside its math in kimik3/layers/moe.py.

`moe_params` below is one MoE layer's tree boxed with its logical axes (as `MoE(cfg).init`
returns it), or plain with `axes` (the tree of their logical axes tuples) given.
"""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from .rules import logical_axes, param_specs, unboxed


def moe_param_specs(cfg, moe_params, mesh, axes=None):
    """PartitionSpecs for one MoE layer's params (its own tree: gate, experts, shared_experts, ...)."""
    return param_specs(logical_axes(moe_params) if axes is None else axes, unboxed(moe_params), mesh, cfg)


def place_moe_params(cfg, moe_params, mesh, axes=None):
    """Put a MoE layer's params on `mesh` (each rank receives only its own rows/columns/experts)."""
    specs = moe_param_specs(cfg, moe_params, mesh, axes)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), unboxed(moe_params), specs)


def count_collectives(hlo_text: str) -> dict:
    """How many of each collective op a compiled program's HLO text contains."""
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    lines = [l for l in hlo_text.splitlines() if "=" in l]
    return {op: sum(f" {op}(" in l or f" {op}-start(" in l for l in lines) for op in ops}


def per_device_param_bytes(cfg, moe_params, mesh, axes=None) -> int:
    """Bytes of one MoE layer's params held by each device under these specs."""
    specs = moe_param_specs(cfg, moe_params, mesh, axes)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(unboxed(moe_params)),
                          jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        split = 1
        for s in spec:
            if s is not None:
                split *= mesh.shape[s]
        total += leaf.size * leaf.dtype.itemsize // split
    return total
