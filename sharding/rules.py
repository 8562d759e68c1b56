"""Logical placement of every parameter: tensor parallelism over heads, MLP columns and expert
intermediate columns; everything else replicated. A dimension is only split when the axis size
divides it, so any config runs on any mesh."""
from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

# Projections whose output columns are heads / intermediate units: split the output dim.
COLUMN = {"q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "q_b_proj", "kv_b_proj", "b_proj",
          "gate_proj", "up_proj", "g_b_proj",
          # MoE dedup's owned rows: each rank loads only the up-projection outputs it computes
          "routed_expert_up_proj"}
# Projections reading those columns back: split the input dim.
ROW = {"o_proj", "down_proj"}
# Per-channel KDA parameters laid out along heads.
PER_CHANNEL = {"q_conv1d", "k_conv1d", "v_conv1d", "dt_bias", "A_log"}


def _names(path):
    return [str(getattr(k, "key", k)) for k in path]


def param_spec(path, shape, mesh) -> P:
    names = _names(path)
    leaf, owner = names[-1], names[-2] if len(names) > 1 else ""
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
    if owner == "experts":  # [E, in, I] gate/up, [E, I, in] down; packed: [E, out, in/2]
        base = leaf.split("_")[0]
        if leaf in ("w1", "w3"):
            return split(2)
        if leaf == "w2":
            return split(1)
        if base in ("w1", "w3"):
            return split(1)
        if base == "w2":
            return split(2)
    return P()


def param_shardings(abstract_params, cfg, mesh):
    """NamedSharding per parameter for `mesh` (a pytree matching `abstract_params`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(path, leaf.shape, mesh)), abstract_params)
