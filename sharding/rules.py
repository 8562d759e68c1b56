"""Placement of every parameter from its logical axes: each weight declares what its dimensions
are where it is declared (`nn.with_logical_partitioning` in kimik3/layers/), and this table maps
those logical axes to mesh axes. Tensor parallelism over heads, MLP columns and expert
intermediate columns; routed experts over the `expert` axis (expert parallelism); everything
else replicated. Outside the MoE a dimension is only split when the axis size divides it, so any
config runs on any tensor size; the MoE's placement (`moe_axes`) is what its shard_map'd layer
computes with, and it refuses an expert axis it cannot use.

The model-level functions read the logical axes of every parameter from the config:
`cfg.param_axes()`, a tree of axis-name tuples shaped like the parameter tree (kimik3/params.py
builds it from the declarations; sharding imports nothing from kimik3)."""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# Logical axes split over "tensor" where the tensor axis size divides the dimension.
TENSOR = frozenset({"q_heads", "kv_heads", "v_heads", "kda_heads", "kda_channels", "mlp"})
# Logical axes the MoE placement decides: the `MoEAxes` field naming their mesh axis.
MOE = {"expert": "expert", "expert_mlp": "expert_inner", "dedup_embed": "up"}
# Every other logical axis (vocab, embed, the low ranks, per-head and conv widths, expert scores,
# the experts' and the latent MoE's model-side widths) stays whole on every rank.


class MoEAxes(NamedTuple):
    """Mesh axes one shard's MoE weights are split over (None: the whole dimension on every rank).

    expert: the routed experts' expert dimension (expert parallelism): rank r holds experts
      [r * E_local, (r + 1) * E_local) and computes only the (token, expert) pairs routed to them.
    expert_inner: the routed experts' intermediate dimension (tensor parallelism).
    shared: the shared experts' intermediate dimension (their `mlp` axis: `tensor` where it divides).
    up: the latent up-projection's output columns (MoE dedup: each rank computes the hidden
      coordinates it owns and adds them into the shared experts' partial sum).
    """
    expert: str | None = None
    expert_inner: str | None = None
    shared: str | None = None
    up: str | None = None


def moe_axes(cfg, mesh_shape) -> MoEAxes:
    """Where the MoE layers' weights live on a mesh of these axis sizes (and so which partial sums
    the layer reduces). Routed experts: the expert dimension over `expert` when the placement is
    "expert" ("auto": when the mesh has an expert axis > 1), the intermediate over `tensor` when it
    splits evenly (MXFP4: whole 32-value scale groups per rank). Shared experts: intermediate over
    `tensor`. Latent up-projection: output columns over `tensor` with Config.moe_dedup."""
    t, e = mesh_shape.get("tensor", 1), mesh_shape.get("expert", 1)
    placement = cfg.moe_placement
    if placement == "auto":
        placement = "expert" if e > 1 else "tensor"
    if placement == "tensor" and e > 1:
        raise ValueError(f"the mesh has an 'expert' axis of size {e}, but Config.moe_placement='tensor' keeps "
                         "every routed expert on every rank; use moe_placement='expert' (or 'auto') to split "
                         "the experts over it, or a mesh without an expert axis")
    if placement == "expert":
        if e == 1:
            raise ValueError("Config.moe_placement='expert' needs a mesh with an 'expert' axis > 1, e.g. "
                             "sharding.make_mesh(expert=8) or make_mesh(tensor=2, expert=4)")
        if cfg.num_experts % e:
            raise ValueError(f"Config.num_experts={cfg.num_experts} is not divisible by the mesh's 'expert' "
                             f"axis ({e}): expert parallelism gives each rank num_experts / {e} whole experts")
    group = t * (32 if cfg.expert_format == "mxfp4" else 1)
    split = lambda ok: "tensor" if t > 1 and ok else None  # noqa: E731
    return MoEAxes(
        expert="expert" if e > 1 else None,
        expert_inner=split(cfg.moe_intermediate_size % group == 0),
        shared=split(cfg.num_shared_experts and cfg.moe_intermediate_size * cfg.num_shared_experts % t == 0),
        up=split(cfg.moe_dedup and cfg.routed_expert_hidden_size and cfg.hidden_size % t == 0))


def param_spec(axes, shape, mesh, cfg) -> P:
    """PartitionSpec of a parameter with logical `axes` (one name per dimension) and `shape` on
    `mesh` (anything with a `.shape` dict of axis sizes); P() when no rule names any of its axes."""
    if not any(a in TENSOR or a in MOE for a in axes):
        return P()
    moe = moe_axes(cfg, mesh.shape) if any(a in MOE for a in axes) else None
    t = mesh.shape.get("tensor", 1)

    def place(name, dim):
        if name in MOE:
            return getattr(moe, MOE[name])
        return "tensor" if name in TENSOR and t > 1 and dim % t == 0 else None
    return P(*map(place, axes, shape))


def param_specs(axes, params, mesh, cfg):
    """PartitionSpec per parameter of `params` (a model's tree or one layer's), given the tree of
    their logical axes."""
    return jax.tree.map(lambda x, a: param_spec(a, x.shape, mesh, cfg), params, axes)


def _is_box(x) -> bool:
    return isinstance(x, nn.Partitioned)


def logical_axes(boxed):
    """The logical axes tuple of every parameter of a tree boxed by `nn.with_logical_partitioning`
    (what a Linen module's `init` returns)."""
    return jax.tree.map(lambda b: b.names, boxed, is_leaf=_is_box)


def unboxed(boxed):
    """The tree's plain values (no sharding constraint applied, unlike `nn.unbox` under a mesh)."""
    return jax.tree.map(lambda b: b.value if _is_box(b) else b, boxed, is_leaf=_is_box)


def param_shardings(abstract_params, cfg, mesh):
    """NamedSharding per parameter for `mesh` (a pytree matching `abstract_params`, the config's
    parameter tree; its logical axes: `cfg.param_axes()`)."""
    return jax.tree.map(lambda x, a: NamedSharding(mesh, param_spec(a, x.shape, mesh, cfg)),
                        abstract_params, cfg.param_axes())


def place_model(model, mesh):
    """`model` with its weights moved onto `mesh` by these rules (e.g. after switching
    Config.moe_dedup or moe_placement: `place_model(model.replace(cfg=model.cfg.replace(...)), mesh)`)."""
    return model.replace(params=jax.device_put(model.params, param_shardings(model.params, model.cfg, mesh)))
