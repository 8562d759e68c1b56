"""Per-device memory accounting for a config on a mesh: parameters (by the placement rules, with
MoE dedup's owned up-projection rows), the MLA latent cache (positions split over DCP) and the KDA
recurrent + conv state (heads split over TP). Pure arithmetic on shapes: no device memory."""
from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from .rules import param_spec


def memory_report(cfg, tensor: int = 1, dcp: int = 1, tokens: int = 0, batch: int = 1,
                  cache_dtype: str | None = None, dedup: bool = True) -> dict:
    """Bytes per device. `tokens` is the context per sequence, `batch` the sequences held.

    DCP ranks are TP ranks for everything except the cache (reference/jax_inference.md 0.6): with
    dcp > 1 each device holds 1/dcp of every sequence's MLA positions and still 1/tensor of the
    heads. cache_dtype None keeps the model dtype (bf16); "float8_e4m3fn" is 1 byte per value.
    """
    from kimik3.params import abstract

    mesh = SimpleNamespace(shape={"tensor": tensor, "dcp": dcp, "data": 1, "expert": 1})
    params = 0
    dedup_saved = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract(cfg))[0]:
        spec = param_spec(path, leaf.shape, mesh)
        names = [str(getattr(k, "key", k)) for k in path]
        if "routed_expert_up_proj" in names:  # owned rows with dedup, else every rank holds it all
            spec = P(None, "tensor") if dedup and leaf.shape[-1] % tensor == 0 else P()
        split = math.prod(mesh.shape[s] for s in spec if s is not None)
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        params += nbytes // split
        if "routed_expert_up_proj" in names and split > 1:
            dedup_saved += nbytes - nbytes // split
    item = np.dtype(cache_dtype or cfg.dtype).itemsize
    mla = len(cfg.mla_layers) * batch * math.ceil(tokens / dcp) * cfg.mla_cache_dim * item
    heads = cfg.kda_num_heads // tensor if cfg.kda_num_heads % tensor == 0 else cfg.kda_num_heads
    P_local = heads * cfg.kda_head_dim
    kda = len(cfg.kda_layers) * batch * (heads * cfg.kda_head_dim ** 2 * 4
                                         + (cfg.conv_size - 1) * 3 * P_local * np.dtype(cfg.dtype).itemsize)
    return {"params": params, "mla_cache": mla, "kda_state": kda, "total": params + mla + kda,
            "dedup_saved": dedup_saved}
