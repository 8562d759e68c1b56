"""Per-device memory accounting for a config on a mesh: parameters (by the placement rules: MoE
dedup's owned up-projection rows, routed experts over the expert axis), the MLA latent cache
(positions split over DCP) and the KDA recurrent + conv state (heads split over TP). Pure
arithmetic on abstract shapes (`kimik3.abstract(cfg)`): no device memory. `kimik3.memory_report`
supplies the abstract tree for a config."""
from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import numpy as np

from .rules import param_spec


def memory_report(cfg, abstract_params, tensor: int = 1, dcp: int = 1, tokens: int = 0, batch: int = 1,
                  cache_dtype: str | None = None, dedup: bool = True, expert: int = 1) -> dict:
    """Bytes per device. `abstract_params`: the config's parameter tree (ShapeDtypeStructs are
    enough); `tokens` is the context per sequence, `batch` the sequences held.

    DCP ranks are TP ranks for everything except the cache: with
    dcp > 1 each device holds 1/dcp of every sequence's MLA positions and still 1/tensor of the
    heads. With expert > 1 (expert parallelism, cfg.moe_placement "auto" or "expert") each device
    holds num_experts / expert of the routed experts; everything else is as on `tensor` alone.
    cache_dtype None: the config's cache (cfg.mla_cache_dtype: "auto", the model dtype, or
    "fp8", 1 byte a value); "float8_e4m3fn" is 1 byte per value.
    "routed_experts": the routed experts' share of "params"; "dedup_saved": the up-projection
    bytes MoE dedup frees. Parameters are placed by their logical axes (`cfg.param_axes()`).
    """
    mesh = SimpleNamespace(shape={"tensor": tensor, "dcp": dcp, "data": 1, "expert": expert})
    cfg = cfg.replace(moe_dedup=dedup)
    params = experts = dedup_saved = 0
    all_axes = jax.tree.leaves(cfg.param_axes(), is_leaf=lambda a: isinstance(a, tuple))
    for leaf, axes in zip(jax.tree.leaves(abstract_params), all_axes, strict=True):
        spec = param_spec(axes, leaf.shape, mesh, cfg)
        split = math.prod(mesh.shape[s] for s in spec if s is not None)
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        params += nbytes // split
        if "expert" in axes:
            experts += nbytes // split
        if "dedup_embed" in axes and split > 1:
            dedup_saved += nbytes - nbytes // split
    if cache_dtype is None and cfg.mla_cache_dtype == "fp8":
        cache_dtype = "float8_e4m3fn"
    item = np.dtype(cache_dtype or cfg.dtype).itemsize
    mla = len(cfg.mla_layers) * batch * math.ceil(tokens / dcp) * cfg.mla_cache_dim * item
    heads = cfg.kda_num_heads // tensor if cfg.kda_num_heads % tensor == 0 else cfg.kda_num_heads
    P_local = heads * cfg.kda_head_dim
    kda = len(cfg.kda_layers) * batch * (heads * cfg.kda_head_dim ** 2 * 4
                                         + (cfg.conv_size - 1) * 3 * P_local * np.dtype(cfg.dtype).itemsize)
    return {"params": params, "mla_cache": mla, "kda_state": kda, "total": params + mla + kda,
            "routed_experts": experts, "dedup_saved": dedup_saved}

