"""MLA entry points: `mla_decode` (absorbed decode / multi-token verify over the paged latent
cache) and `mla_prefill` (causal variable-length prefill attention, expanded form).

Each takes `backend=` ("reference" | "pallas" | "interpret"; None = pallas on GPU, reference
elsewhere: `_backend.resolve_backend`) and `config=` (tuning.DecodeConfig / PrefillConfig: the
fields it sets override the tuned configuration).
"""
from __future__ import annotations

import jax.numpy as jnp

from .._backend import kernel_platform, resolve_backend
from .decode import decode_pallas
from .prefill import QK_DIM, V_DIM, mla_prefill_chunked, prefill_pallas
from .reference import CACHE_DIM, WORDS, is_words, mla_decode_reference
from .tuning import DecodeConfig, PrefillConfig, decode_config, prefill_config


def mla_decode(q, cache, page_table, lengths, *, scale, backend: str | None = None,
               cache_scale=None, out_dtype=None, config: DecodeConfig | None = None):
    """Absorbed MLA decode / multi-token verify over a paged latent cache.

    q [B, Tq, Hq, 576] (q_lat 512 | q_rope 64), cache [num_pages, page_size, 576] (bf16, fp32, or
    float8_e4m3fn with `cache_scale` () / (1,) / [num_pages, page_size] fp32) or an fp8 cache in
    the words form, uint16 [num_pages, page_size, 288] (`fp8_to_words`; the fast fp8 path, with
    `cache_scale` likewise), page_table [B, max_pages] int32, lengths [B] int32 (history incl.
    the Tq new tokens), scale: softmax scale. Returns (o [B, Tq, Hq, 512] in out_dtype (default
    q.dtype), lse [B, Tq, Hq] fp32, -inf where a query sees no key; o is 0 there): the lse lets
    a caller merge results over disjoint parts of the history (`merge_partials`).

    The kernel's per-split outputs are bf16 when out_dtype is a 16-bit type (the result is
    rounded to 16 bits anyway; half the merge's traffic), else fp32. `tuning.decode_config`
    gives the configuration a call runs with; decode.py describes the kernel."""
    backend = resolve_backend(backend)
    if q.ndim != 4 or q.shape[-1] != CACHE_DIM:
        raise ValueError(f"q must be [B, Tq, Hq, {CACHE_DIM}], got {q.shape}")
    if cache.ndim != 3 or cache.shape[-1] != (WORDS if is_words(cache) else CACHE_DIM):
        raise ValueError(f"cache must be [num_pages, page_size, {CACHE_DIM}] (bf16, fp32, "
                         f"float8_e4m3fn) or fp8 words [num_pages, page_size, {WORDS}] uint16, "
                         f"got {cache.dtype} {cache.shape}")
    if (jnp.dtype(cache.dtype).itemsize == 1 or is_words(cache)) and cache_scale is None:
        raise ValueError("an fp8 cache needs cache_scale")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if backend == "reference":
        return mla_decode_reference(q, cache, page_table, lengths, scale=scale,
                                    cache_scale=cache_scale, out_dtype=out_dtype)
    cfg = decode_config(q.shape, cache.shape, cache.dtype, page_table.shape, config)
    partial_dtype = jnp.dtype(jnp.bfloat16 if out_dtype.itemsize == 2 else jnp.float32)
    return decode_pallas(q, cache, page_table, lengths, scale, cache_scale,
                         interpret=backend == "interpret", out_dtype=out_dtype,
                         partial_dtype=partial_dtype, **cfg.as_dict())


def mla_prefill(q, k, v, lengths, *, scale, starts=None, key_start=None, backend: str | None = None,
                return_lse: bool = False, out_dtype=None, config: PrefillConfig | None = None,
                chunk: int = 512):
    """Causal variable-length MLA prefill attention (expanded form; prefill.py): q [B, T, H, 192],
    k [B, S, H, 192], v [B, S, H, 128], lengths [B] -> o [B, T, H, 128] in out_dtype (default
    q.dtype) (and lse [B, T, H] fp32 with return_lse). starts [B] / key_start (a scalar): the
    positions of each row's query 0 and of key 0, for a chunk of queries over a chunk of its
    history (default 0, with S = T). The reference backend is the chunked plain-JAX form
    (`mla_prefill_chunked`, key chunks of `chunk`)."""
    backend = resolve_backend(backend)
    if q.shape[-1] != QK_DIM or k.shape[-1] != QK_DIM or v.shape[-1] != V_DIM:
        raise ValueError(f"q, k must end in {QK_DIM} and v in {V_DIM}: "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k {k.shape} and v {v.shape} need q's batch and heads {q.shape[0], q.shape[2]} "
                         f"and one key length")
    if starts is None and key_start is None and k.shape[1] != q.shape[1]:
        raise ValueError(f"{q.shape[1]} queries over {k.shape[1]} keys: give starts / key_start "
                         f"for a chunk over its history")
    out_dtype = None if out_dtype is None else jnp.dtype(out_dtype).name
    if backend == "reference":
        o, lse = mla_prefill_chunked(q, k, v, lengths, starts, key_start, scale=float(scale),
                                     chunk=chunk, out_dtype=out_dtype)
    else:
        cfg = prefill_config("interpret" if backend == "interpret" else kernel_platform(),
                             config)
        o, lse = prefill_pallas(q, k, v, lengths, starts, key_start, scale=float(scale),
                                block_q=cfg.block_q, block_k=cfg.block_k, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages, interpret=backend == "interpret",
                                out_dtype=out_dtype)
    return (o, lse) if return_lse else o
