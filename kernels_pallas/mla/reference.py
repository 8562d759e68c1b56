"""Plain-JAX references for MLA attention (the oracles the Pallas kernels are tested against).

Absorbed decode against the paged latent cache
----------------------------------------------
cache  [num_pages, page_size, 576]: per token the kv_a_layernorm-normalised latent c (512 values)
       then the shared key part k_rot (64 values, NoPE: no rotary).
q      [B, Tq, Hq, 576]: per query token and head, q_lat = W_uk^T q_nope (512) then q_rope (64).
page_table [B, max_pages] int32: page ids of each sequence's history, in order.
lengths    [B] int32: history length per sequence, the Tq new tokens included.

    score[b,t,h,s] = (q_lat . c_s + q_rope . krot_s) * scale
    query t of sequence b sees positions s < lengths[b] - Tq + t + 1   (causal multi-token)
    o[b,t,h]   = sum_s softmax(score)[s] * c_s                (512; the caller applies W_uv)
    lse[b,t,h] = logsumexp_s score[b,t,h,s]  (fp32; -inf where the query sees no key, o = 0 there)

fp8 cache: `cache` is float8_e4m3fn and `cache_scale` the fp32 dequantisation scale, either one
per tensor (shape () or (1,)) or one per token (shape [num_pages, page_size]); the value used is
cache * cache_scale (the same scale for all 576 values of a token).

fp8 words (`fp8_to_words` / `words_to_fp8`): the same fp8 cache stored as uint16
[num_pages, page_size, 288], word d of a token holding its e4m3 values 2d (low byte) and 2d + 1
(high byte): the bytes of the float8 array, little-endian, in a 16-bit container. The decode
kernel's "words" upcasts read it as a 16-bit tile (decode.py); converting between the two forms
is a copy (XLA does not bitcast across element sizes in place), so a cache lives in one of them.

`merge_partials` combines results computed over disjoint parts of the history (decode context
parallel shards, or the flash-decoding splits) exactly; an empty part has lse = -inf.

Causal MLA prefill in expanded form
-----------------------------------
q, k [B, T, H, 192] (128 nope + 64 rope), v [B, T, H, 128], lengths [B]: query i of sequence b
sees keys j <= i with j < lengths[b]; rows i >= lengths[b] are 0 (lse -inf).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LATENT = 512
ROPE = 64
CACHE_DIM = LATENT + ROPE
_HI = jax.lax.Precision.HIGHEST


WORDS = CACHE_DIM // 2
WORDS_DTYPE = jnp.uint16


def is_words(cache) -> bool:
    """Whether `cache` is an fp8 cache in the words form (uint16; the decode kernel's is
    [..., 288], the model's [..., cache width / 2])."""
    return jnp.dtype(cache.dtype) == WORDS_DTYPE


def fp8_to_words(cache):
    """float8_e4m3fn [..., 2n] -> the same bytes as uint16 words [..., n] (a copy); the decode
    kernel reads n = 288 (576 values a token)."""
    if jnp.dtype(cache.dtype) != jnp.float8_e4m3fn or cache.shape[-1] % 2:
        raise ValueError(f"fp8_to_words takes a float8_e4m3fn [..., 2n] cache ([..., "
                         f"{CACHE_DIM}] for the decode kernel), got {cache.dtype} {cache.shape}")
    b = jax.lax.bitcast_convert_type(cache, jnp.uint8).astype(WORDS_DTYPE)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def words_to_fp8(words):
    """uint16 words [..., n] -> float8_e4m3fn [..., 2n] (a copy)."""
    if jnp.dtype(words.dtype) != WORDS_DTYPE:
        raise ValueError(f"words_to_fp8 takes uint16 words [..., n] ([..., {WORDS}] for the "
                         f"decode kernel), got {words.dtype} {words.shape}")
    b = jnp.stack([words & 0xFF, words >> 8], axis=-1).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(b.reshape(*words.shape[:-1], 2 * words.shape[-1]),
                                        jnp.float8_e4m3fn)


E4M3_MAX = 448.0  # e4m3's largest finite value


def quantize_words(x, scale: float):
    """Values [..., 2n] -> fp8 words [..., n] holding e4m3(x / scale), saturated at +-E4M3_MAX
    (the cast would give NaN past it)."""
    q = jnp.clip(x.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return fp8_to_words(q)


def dequant_cache(cache, cache_scale=None):
    """The cache's values in fp32 (cache * cache_scale); an fp8 words cache is read as fp8."""
    if is_words(cache):
        cache = words_to_fp8(cache)
    c = cache.astype(jnp.float32)
    if cache_scale is None:
        return c
    s = jnp.asarray(cache_scale, jnp.float32)
    if s.size == 1:
        return c * s.reshape(())
    if s.shape != cache.shape[:2]:
        raise ValueError(f"cache_scale shape {s.shape}: expected () / (1,) or {cache.shape[:2]}")
    return c * s[..., None]


def mla_decode_reference(q, cache, page_table, lengths, *, scale, cache_scale=None,
                         out_dtype=None):
    """(o [B,Tq,Hq,512] in out_dtype (default q.dtype), lse [B,Tq,Hq] fp32); computed in fp32."""
    B, Tq, Hq, D = q.shape
    width = cache.shape[-1] * (2 if is_words(cache) else 1)
    if D != CACHE_DIM or width != CACHE_DIM:
        raise ValueError(f"q last dim {D}, cache values a token {width}: both must be 576")
    _, page_size, _ = cache.shape
    max_pages = page_table.shape[1]
    kv = dequant_cache(cache, cache_scale)[page_table]            # [B, maxp, ps, 576]
    kv = kv.reshape(B, max_pages * page_size, CACHE_DIM)
    pos = jnp.arange(max_pages * page_size)
    # Slots past a sequence's length may hold anything (NaN too): they must not reach p @ c.
    kv = jnp.where((pos[None, :] < lengths[:, None])[..., None], kv, 0.0)
    lim = lengths.astype(jnp.int32)[:, None] - Tq + jnp.arange(Tq)[None, :] + 1   # [B, Tq]
    mask = pos[None, None, :] < lim[:, :, None]                                  # [B, Tq, S]
    s = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), kv, precision=_HI) * scale
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    l = jnp.sum(p, axis=-1)
    o = jnp.einsum("bths,bsd->bthd", p, kv[..., :LATENT], precision=_HI)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.where(l > 0, m_safe + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return o.astype(out_dtype or q.dtype), lse


def merge_stacked(o, lse, axis: int = 0, out_dtype=None):
    """Exact log-sum-exp merge of partials stacked along `axis` (o [..., D], lse [...] fp32).

    Parts with lse = -inf contribute nothing; if every part is empty the result is o = 0,
    lse = -inf. Returns (o in out_dtype (default o.dtype), lse fp32).
    """
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m_safe), 0.0)        # [..S..]
    wsum = jnp.sum(w, axis=axis, keepdims=True)
    ok = wsum > 0
    wn = w / jnp.where(ok, wsum, 1.0)
    o_m = jnp.sum(wn[..., None] * o.astype(jnp.float32), axis=axis)
    lse_m = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, wsum, 1.0)), -jnp.inf)
    return o_m.astype(out_dtype or o.dtype), jnp.squeeze(lse_m, axis=axis)


def merge_partials(o_list, lse_list, out_dtype=None):
    """Merge per-shard (o, lse) pairs computed over disjoint key sets into the unsplit (o, lse)."""
    if len(o_list) != len(lse_list) or not o_list:
        raise ValueError("merge_partials needs equally many (>= 1) outputs and lses")
    return merge_stacked(jnp.stack(o_list), jnp.stack(lse_list), axis=0,
                         out_dtype=out_dtype or o_list[0].dtype)


def mla_prefill_reference(q, k, v, lengths, starts=None, key_start=None, *, scale,
                          return_lse: bool = False):
    """Dense causal variable-length attention (materialises T x S; the oracle for tests).
    starts / key_start: positions of query 0 of each row and of key 0 (prefill.py)."""
    B, T, H, _ = q.shape
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=_HI) * scale
    i = jnp.arange(T)
    L = lengths.astype(jnp.int32)[:, None, None, None]
    q0 = (jnp.zeros((B,), jnp.int32) if starts is None else starts.astype(jnp.int32))[:, None, None, None]
    kpos = (0 if key_start is None else jnp.reshape(key_start, ())) + jnp.arange(k.shape[1])
    mask = (kpos[None, None, None, :] <= q0 + i[None, None, :, None]) & (kpos[None, None, None, :] < q0 + L)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    l = jnp.sum(p, axis=-1)
    row_ok = (i[None, None, :] < L[..., 0]) & (l > 0)
    o = jnp.einsum("bhij,bjhd->bihd", p, v.astype(jnp.float32), precision=_HI)
    lden = jnp.where(row_ok, l, 1.0)                               # [B, H, T]
    o = jnp.where(jnp.swapaxes(row_ok, 1, 2)[..., None],
                  o / jnp.swapaxes(lden, 1, 2)[..., None], 0.0).astype(q.dtype)
    if not return_lse:
        return o
    lse = jnp.where(row_ok, m_safe + jnp.log(lden), -jnp.inf)
    return o, jnp.swapaxes(lse, 1, 2)                                 # [B, T, H]
