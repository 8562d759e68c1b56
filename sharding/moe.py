"""The MoE layer on a mesh, in shard_map: MoE dedup under tensor parallelism and expert
parallelism. The math is kimik3.layers.moe.moe_apply, run per shard; the placement is
rules.moe_axes (the same specs that init / load place the weights by); the model's MoE layers
call `moe_sharded` whenever a mesh with a tensor or expert axis > 1 is active.

MoE dedup (SEED_NOTES area 2). Every TP rank holds the same latent vector after the experts'
reduction and the latent RMSNorm. Without dedup each rank multiplies it by the whole latent ->
hidden up-projection and adds the result to the all-reduced shared-expert output. With dedup each
rank multiplies only by the up-projection columns it owns (D / TP output coordinates, the only
rows of HF's [D, L] weight it loads), adds them into its own slice of the shared experts' partial
sum, and the all-reduce the shared experts need anyway assembles both: no new collective, a 1/TP
share of the up-projection FLOPs and weights per rank, and every coordinate receives its routed
contribution exactly once. Collectives per layer either way: one all-reduce of the routed latent
partial sums (when the experts' intermediate is split over TP) and one of the output. Measured on
8 CPU devices: with dedup exactly these two; without it XLA may combine the two (independent
there) into one all-reduce op of the same bytes (tests/test_moe_sharding.py).

Expert parallelism (Config.moe_placement "expert", or "auto" on a mesh with an `expert` axis > 1):
the routed experts' weights are split over `expert` along the expert dimension, so each rank holds
E / ep whole experts (and, with a tensor axis too, 1/TP of their intermediate). Tokens reach the
MoE replicated over `expert` (the attention before it is not split over that axis), so every rank
already holds all of them: the token gather costs nothing. Each rank routes every token, runs the
grouped matmuls on the (token, expert) pairs of its own experts only, and the weighted combine is
one all-reduce over (expert, tensor) of the latent partial sums (no latent: folded into the
output's). Shared experts and the up-projection stay under tensor parallelism (dedup included).
"""
from __future__ import annotations

import jax
from jax import shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

from kimik3.layers.moe import moe_apply
from .rules import moe_axes, param_spec


def moe_param_specs(cfg, moe_params, mesh):
    """PartitionSpecs for one MoE layer's params (its own tree: gate, experts, shared_experts, ...)."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: param_spec(path, leaf.shape, mesh, cfg),
                                            moe_params)


def place_moe_params(cfg, moe_params, mesh):
    """Put a MoE layer's params on `mesh` (each rank receives only its own rows/columns/experts)."""
    specs = moe_param_specs(cfg, moe_params, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), moe_params, specs)


def moe_sharded(cfg, moe_params, x, backend=None, mesh=None):
    """One MoE layer, tokens x [N, D] -> [N, D] (replicated in and out), per shard on `mesh`
    (default: the ambient one); traceable inside jit."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    axes = moe_axes(cfg, mesh.shape)
    specs = moe_param_specs(cfg, moe_params, mesh)
    f = shard_map(lambda p, x: moe_apply(cfg, p, x, backend, axes), mesh=mesh, in_specs=(specs, P()),
                  out_specs=P(), check_vma=False)
    return f(moe_params, x)


def moe_layer(cfg, mesh, backend=None):
    """A jitted f(moe_params, x [N, D]) -> [N, D]: the MoE layer as the model runs it on `mesh`
    (params placed by `place_moe_params` with the same cfg)."""
    moe_axes(cfg, mesh.shape)  # bad placements fail here, not at the first call
    return jax.jit(lambda moe_params, x: moe_sharded(cfg, moe_params, x, backend, mesh))


def moe_layer_tp(cfg, mesh, dedup: bool = True, backend=None):
    """`moe_layer` with MoE dedup on or off, refusing shapes that would leave a weight unsplit over
    `tensor` (the experts' intermediate, hidden, the shared experts' intermediate)."""
    tp = mesh.shape["tensor"]
    if not cfg.routed_expert_hidden_size:
        raise ValueError("MoE dedup applies to the latent MoE (routed_expert_hidden_size set)")
    for name, dim in (("moe_intermediate_size", cfg.moe_intermediate_size),
                      ("hidden_size", cfg.hidden_size),
                      ("shared intermediate", cfg.moe_intermediate_size * cfg.num_shared_experts)):
        group = 32 * tp if cfg.expert_format == "mxfp4" and name == "moe_intermediate_size" else tp
        if dim % group:
            raise ValueError(f"{name}={dim} must be divisible by {group} to split over {tp} 'tensor' ranks")
    return moe_layer(cfg.replace(moe_dedup=dedup), mesh, backend)


def count_collectives(hlo_text: str) -> dict:
    ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    lines = [l for l in hlo_text.splitlines() if "=" in l]
    return {op: sum(f" {op}(" in l or f" {op}-start(" in l for l in lines) for op in ops}


def per_device_param_bytes(cfg, moe_params, mesh) -> int:
    """Bytes of one MoE layer's params held by each device under these specs."""
    specs = moe_param_specs(cfg, moe_params, mesh)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(moe_params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        split = 1
        for s in spec:
            if s is not None:
                split *= mesh.shape[s]
        total += leaf.size * leaf.dtype.itemsize // split
    return total
