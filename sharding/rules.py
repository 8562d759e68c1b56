"""Logical placement of every parameter: tensor parallelism over heads, MLP columns and expert
intermediate columns; routed experts over the `expert` axis (expert parallelism); everything
else replicated. Outside the MoE a dimension is only split when the axis size divides it, so any
config runs on any tensor size; the MoE's placement (`moe_axes`) is what its shard_map'd layer
computes with, and it refuses an expert axis it cannot use."""
from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# Projections whose output columns are heads / intermediate units: split the output dim.
COLUMN = {"q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "q_b_proj", "kv_b_proj", "b_proj",
          "gate_proj", "up_proj", "g_b_proj"}
# Projections reading those columns back: split the input dim.
ROW = {"o_proj", "down_proj"}
# Per-channel KDA parameters laid out along heads.
PER_CHANNEL = {"q_conv1d", "k_conv1d", "v_conv1d", "dt_bias", "A_log"}


class MoEAxes(NamedTuple):
    """Mesh axes one shard's MoE weights are split over (None: the whole dimension on every rank).

    expert: the routed experts' expert dimension (expert parallelism): rank r holds experts
      [r * E_local, (r + 1) * E_local) and computes only the (token, expert) pairs routed to them.
    expert_inner: the routed experts' intermediate dimension (tensor parallelism).
    shared: the shared experts' intermediate dimension.
    up: the latent up-projection's output columns (MoE dedup: each rank computes the hidden
      coordinates it owns and adds them into the shared experts' partial sum).
    """
    expert: str | None = None
    expert_inner: str | None = None
    shared: str | None = None
    up: str | None = None


def _names(path):
    return [str(getattr(k, "key", k)) for k in path]


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


def _expert_inner_dim(leaf: str) -> int:
    """Intermediate dim of a routed expert weight: dense w1/w3 [E, in, I], w2 [E, I, in]; MXFP4
    (packed and scales, [E, out, in / g]) w1/w3 [E, I, .], w2 [E, in, I / g]."""
    if leaf in ("w1", "w3", "w2"):
        return 1 if leaf == "w2" else 2
    return 2 if leaf.startswith("w2") else 1


def _moe_spec(names, shape, mesh, cfg) -> P | None:
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    in_shared = "shared_experts" in names
    if owner != "experts" and not in_shared and owner != "routed_expert_up_proj":
        return None
    axes = moe_axes(cfg, mesh.shape)
    spec = [None] * len(shape)
    if owner == "experts":
        spec[0], spec[_expert_inner_dim(leaf)] = axes.expert, axes.expert_inner
    elif in_shared:
        spec[-1 if owner in ("gate_proj", "up_proj") else 0] = axes.shared
    else:  # MoE dedup's owned rows: each rank loads only the up-projection outputs it computes
        spec[-1] = axes.up
    return P(*spec)


def param_spec(path, shape, mesh, cfg) -> P:
    """PartitionSpec of the parameter at `path` (a model tree path, or one inside a MoE layer's
    own tree) for `mesh` (anything with a `.shape` dict of axis sizes)."""
    names = _names(path)
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
    moe = _moe_spec(names, shape, mesh, cfg)
    if moe is not None:
        return moe
    t = mesh.shape.get("tensor", 1)

    def split(dim):
        spec = [None] * len(shape)
        if t > 1 and shape[dim] % t == 0:
            spec[dim] = "tensor"
        return P(*spec)

    if leaf == "kernel" and owner in COLUMN:
        return split(-1 % len(shape))
    if leaf == "kernel" and owner in ROW:
        return split(0)
    if leaf in PER_CHANNEL:
        return split(0)
    return P()


def param_shardings(abstract_params, cfg, mesh):
    """NamedSharding per parameter for `mesh` (a pytree matching `abstract_params`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, leaf.shape, mesh, cfg)), abstract_params)


def place_model(model, mesh):
    """`model` with its weights moved onto `mesh` by these rules (e.g. after switching
    Config.moe_dedup or moe_placement: `place_model(model.replace(cfg=model.cfg.replace(...)), mesh)`)."""
    return model.replace(params=jax.device_put(model.params, param_shardings(model.params, model.cfg, mesh)))
