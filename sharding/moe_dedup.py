"""MoE dedup under tensor parallelism (SEED_NOTES area 2), as one shard_map'd MoE layer.

Every TP rank holds the same latent vector after the experts' reduction and the latent RMSNorm.
Without dedup each rank multiplies it by the whole latent -> hidden up-projection and adds the
result to the all-reduced shared-expert output. With dedup each rank multiplies only by the up-
projection columns it owns (D / TP output coordinates, the only rows of HF's [D, L] weight it
loads), adds them into its own slice of the shared experts' partial sum, and the all-reduce the
shared experts need anyway assembles both: no new collective, a 1/TP share of the up-projection
FLOPs and weights per rank, and every coordinate receives its routed contribution exactly once.

Collectives per layer either way: one all-reduce of the routed latent partial sums (the experts'
intermediate dimension is split over TP) and one all-reduce of the output. Measured on 8 CPU
devices: with dedup exactly these two; without it XLA may combine the two (independent there)
into one all-reduce op of the same bytes, since dedup makes the output reduction wait for the
latent one (tests/test_moe_dedup.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from kimik3.layers.common import F32, glu, rms_normalize
from kimik3.layers.moe import Experts, route

HIGHEST = jax.lax.Precision.HIGHEST


def moe_param_specs(moe_params, axis: str = "tensor", dedup: bool = True):
    """PartitionSpecs for one latent-MoE layer's params: expert intermediate columns, shared-expert
    columns over `axis`; with dedup the up-projection's output columns too (owned rows)."""
    def spec(path, leaf):
        names = [str(getattr(k, "key", k)) for k in path]
        leaf_name, owner = names[-1], names[-2] if len(names) > 1 else ""
        if owner == "experts":
            if leaf_name in ("w1", "w3"):
                return P(None, None, axis)
            if leaf_name == "w2":
                return P(None, axis, None)
            return P(None, axis, None) if leaf_name.startswith(("w1", "w3")) else P(None, None, axis)
        if "shared_experts" in names:
            return P(None, axis) if owner in ("gate_proj", "up_proj") else P(axis, None)
        if owner == "routed_expert_up_proj" and dedup:
            return P(None, axis)
        return P()
    return jax.tree_util.tree_map_with_path(spec, moe_params)


def place_moe_params(moe_params, mesh, axis: str = "tensor", dedup: bool = True):
    """Put a MoE layer's params on `mesh` (each rank receives only its owned rows/columns)."""
    specs = moe_param_specs(moe_params, axis, dedup)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), moe_params, specs)


def moe_layer_tp(cfg, mesh, axis: str = "tensor", dedup: bool = True, backend=None):
    """A jitted f(moe_params, x [N, D]) -> [N, D] computing kimik3's latent MoE layer under TP on
    `mesh` (params placed by `place_moe_params` with the same `dedup`)."""
    tp = mesh.shape[axis]
    if not cfg.routed_expert_hidden_size:
        raise ValueError("MoE dedup applies to the latent MoE (routed_expert_hidden_size set)")
    for name, dim in (("moe_intermediate_size", cfg.moe_intermediate_size),
                      ("hidden_size", cfg.hidden_size),
                      ("shared intermediate", cfg.moe_intermediate_size * cfg.num_shared_experts)):
        group = 32 * tp if cfg.expert_format == "mxfp4" and name == "moe_intermediate_size" else tp
        if dim % group:
            raise ValueError(f"{name}={dim} must be divisible by {group} to split over {tp} '{axis}' ranks")
    local_cfg = cfg.replace(moe_intermediate_size=cfg.moe_intermediate_size // tp)
    D = cfg.hidden_size

    def body(p, x):
        logits = jnp.dot(x.astype(F32), p["gate"].astype(F32), precision=HIGHEST)
        idx, w = route(logits, p["e_score_correction_bias"], cfg)
        u = x @ p["routed_expert_down_proj"]["kernel"].astype(x.dtype)
        partial = Experts(local_cfg).apply({"params": p["experts"]}, u, idx, w, backend)  # [N, L] partial
        latent = jax.lax.psum(partial, axis)  # collective 1: the experts' intermediate is split
        latent = latent.astype(x.dtype)
        if cfg.latent_moe_use_norm:
            latent = p["routed_expert_norm"]["weight"].astype(x.dtype) * rms_normalize(latent, cfg.rms_norm_eps)
        se = p["shared_experts"]
        h = glu(cfg, (x @ se["gate_proj"]["kernel"]).astype(F32), (x @ se["up_proj"]["kernel"]).astype(F32))
        shared_partial = h.astype(x.dtype) @ se["down_proj"]["kernel"]  # [N, D], partial over ranks
        up = p["routed_expert_up_proj"]["kernel"]
        if dedup:  # this rank's D/TP output coordinates only, added into its slice of the partial sum
            own = latent @ up  # [N, D / TP]
            r = jax.lax.axis_index(axis)
            shared_partial = jax.lax.dynamic_update_slice_in_dim(
                shared_partial, jax.lax.dynamic_slice_in_dim(shared_partial, r * (D // tp), D // tp, 1) + own,
                r * (D // tp), 1)
            return jax.lax.psum(shared_partial, axis)  # collective 2 assembles shared + routed
        return jax.lax.psum(shared_partial, axis) + latent @ up  # every rank: the whole up-projection

    @jax.jit
    def run(moe_params, x):
        specs = moe_param_specs(moe_params, axis, dedup)
        f = shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
        return f(moe_params, x)

    return run


def count_collectives(hlo_text: str) -> dict:
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    lines = [l for l in hlo_text.splitlines() if "=" in l]
    return {op: sum(f" {op}(" in l or f" {op}-start(" in l for l in lines) for op in ops}


def per_device_param_bytes(moe_params, mesh, axis: str = "tensor", dedup: bool = True) -> int:
    """Bytes of one MoE layer's params held by each device under these specs."""
    specs = moe_param_specs(moe_params, axis, dedup)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(moe_params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        split = 1
        for s in spec:
            if s is not None:
                split *= mesh.shape[s]
        total += leaf.size * leaf.dtype.itemsize // split
    return total
