"""Calibration of the fp8 MLA cache's scale (Config.mla_cache_scale) from sample prompts.

The fp8 cache stores each latent value v as e4m3(v / scale), saturated at +-448 (the format's
largest finite value). With the default scale 1.0 a checkpoint whose latents (the normed 512-wide
part or the unnormed 64-wide rope part) exceed 448 is clipped, and one whose values sit far below 1
spends its few mantissa bits on subnormals. `calibrate_mla_cache_scale` runs the prompts through the
model with a full-precision cache and returns max|latent| / 448 with some headroom:

    scale = kimik3.calibrate_mla_cache_scale(model, prompts)
    model = model.replace(cfg=model.cfg.replace(mla_cache_dtype="fp8", mla_cache_scale=scale))

One scale for every MLA layer (the cache and the decode kernel take one per-tensor scale).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla.reference import E4M3_MAX
from .runtime import prefill


def mla_latent_amax(model, prompts, max_seq_len: int | None = None, backend=None) -> float:
    """max |value| over every MLA layer's cache entries (latent and rope parts) after prefilling
    `prompts` with a full-precision cache (the model's dtype; an fp8 config is run without it)."""
    cfg = model.cfg
    if not cfg.mla_layers:
        raise ValueError(f"{cfg.name} has no MLA layer: there is no MLA cache to calibrate")
    full = model.replace(cfg=cfg.replace(mla_cache_dtype="auto"))
    lens = [len(p) for p in prompts]
    _, cache = prefill(full, prompts, max_seq_len or max(lens), backend=backend)
    held = (jnp.arange(cache.max_seq_len)[None, :] < cache.lengths[:, None])[..., None]  # [B, S, 1]
    # prefill's cache is contiguous [B, S, C] per MLA layer; positions past a row's length are 0
    return float(max(jnp.max(jnp.where(held, jnp.abs(e["latent"].astype(jnp.float32)), 0.0))
                     for e in cache.layers if "latent" in e))


def calibrate_mla_cache_scale(model, prompts, headroom: float = 2.0, max_seq_len: int | None = None,
                              backend=None) -> float:
    """The fp8 MLA cache scale for `model`: max|latent| over `prompts` / 448, times `headroom` (>= 1:
    tokens after calibration may hold larger values; 2.0 costs one of e4m3's 16 exponents), rounded
    up to a power of two (dequantisation by the scale is then exact). Prompts: lists of token ids,
    as for `kimik3.prefill`."""
    if not prompts:
        raise ValueError("calibrate_mla_cache_scale needs at least one prompt")
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1 (values beyond the calibration's are clipped at 448 "
                         f"x scale), got {headroom}")
    amax = mla_latent_amax(model, prompts, max_seq_len=max_seq_len, backend=backend)
    if not np.isfinite(amax):
        raise ValueError(f"the MLA cache held non-finite values (max |latent| = {amax}): check the "
                         "weights before calibrating")
    if amax == 0.0:
        return 1.0
    return float(2.0 ** math.ceil(math.log2(amax * headroom / E4M3_MAX)))
