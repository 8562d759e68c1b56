"""MLA (multi-head latent attention, NoPE) with a latent cache of kv_lora_rank + rope values per
token. Prefill/forward use the expanded form; decode and short verifies use the absorbed form
(query projected into latent space, attention over the latent cache, value up-projection after)."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas import resolve_backend
from kernels_pallas.mla import merge_partials, mla_decode, mla_prefill, mla_prefill_chunked
from kernels_pallas.mla.reference import CACHE_DIM, dequant_cache, quantize_words
from kernels_pallas.mla.softmax import online_softmax_step
from kernels_pallas.mla.prefill import QK_DIM, V_DIM

from .common import F32, RMSNorm, Weight, kernel, project
from .kda import RECURRENT_MAX_T

LONG_PREFILL = 1024  # causal passes longer than this use the chunked / flash prefill attention
HISTORY_CHUNK = 1024  # key positions a step of `history_attention` (rounded to whole pages)
FLASH_KEY_ROWS = 16384  # expanded keys (rows x positions) a step of `history_flash`: 168 MB at 16 heads
MASKED = -1e30  # finite, so a row with no visible keys stays finite (it is padding anyway)
HIGHEST = jax.lax.Precision.HIGHEST


def mla_cache_shapes(cfg, batch: int, max_seq_len: int):
    if cfg.mla_cache_dtype == "fp8":    # e4m3 words: two values a uint16
        return {"latent": ((batch, max_seq_len, cfg.mla_cache_dim // 2), jnp.uint16)}
    return {"latent": ((batch, max_seq_len, cfg.mla_cache_dim), cfg.jnp_dtype)}


def cache_scale(cfg):
    """The fp8 cache's dequantisation scale, or None for a cache in the activation dtype."""
    return cfg.mla_cache_scale if cfg.mla_cache_dtype == "fp8" else None


def read_cache(values, scale, dtype):
    """Cache entries as values in `dtype`: fp8 words dequantised (scale not None) or as they are."""
    return values if scale is None else dequant_cache(values, scale).astype(dtype)


def dcp_attention(q_lat, q_rope, cache, start, n_new, scale, dcp_axes, backend=None, page_table=None,
                  cache_scale=None):
    """Absorbed MLA attention with the cache's positions split over `dcp_axes` (decode context
    parallelism). Queries are gathered to every rank (replicated in_spec), each rank attends its
    own slice of every sequence's history, and the partial results merge exactly through their
    log-sum-exp: a global max (pmax), then sums of rescaled numerators and denominators (psum).
    A rank with no visible key contributes weight 0.

    cache: contiguous [B, S, C] (page_table None), or a page pool [num_pages, P, C] with
    page_table [B, pages per row]; either way its second axis is split over `dcp_axes`, so rank r
    holds positions r * P/n .. (r + 1) * P/n - 1 of every page (of every row when contiguous).
    One-token decode on a 576-wide cache with a kernel backend runs the Pallas flash-decoding
    kernel on the rank's slice (its (o, lse) merged the same way); prefill chunks and verifies
    (T > 1) and the reference backend attend in plain JAX, each rank walking its slice
    HISTORY_CHUNK positions at a time (no [B, H, T, S / n] scores). cache_scale: an fp8 cache in
    words (mla_cache_dtype "fp8")."""
    from jax import shard_map
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(a not in mesh.axis_names for a in dcp_axes):
        raise ValueError(f"decode context parallelism over {dcp_axes} needs a mesh with those axes: "
                         "run inside `with jax.set_mesh(mesh):` (kimik3's functions do this for a cache "
                         "made with init_cache(..., mesh=...))")
    n = math.prod(mesh.shape[a] for a in dcp_axes)
    R = q_lat.shape[-1]
    B, T = q_lat.shape[:2]
    paged = page_table is not None
    table = page_table if paged else jnp.arange(B, dtype=jnp.int32)[:, None]  # contiguous: a page per row
    if cache.shape[1] % n:
        raise ValueError(f"decode context parallelism over {n} ranks needs the cache's positions per page "
                         f"({cache.shape[1]}) to be a multiple of {n}")
    width = cache.shape[-1] * (1 if cache_scale is None else 2)
    use_kernel = T == 1 and resolve_backend(backend) != "reference" and width == CACHE_DIM

    def local(q_lat, q_rope, pool, table, start, n_new):
        # The rank's keys one chunk of about HISTORY_CHUNK positions at a time (a prefill chunk
        # of T queries over a long history never holds [B, H, T, S / n] scores), merged across
        # ranks through each one's (max, sum, numerator).
        r = jax.lax.axis_index(dcp_axes)
        if paged:  # this rank's part of each of the row's pages, in position order
            P_loc = pool.shape[1]
            per_step = max(1, HISTORY_CHUNK // P_loc)
            page_span = P_loc * n                              # positions a whole page holds
            position = lambda u: (u // P_loc) * page_span + r * P_loc + u % P_loc
        else:      # row b holds positions r * S_loc .. in one block: cut it into sub-pages
            S_loc = pool.shape[1]
            P_loc = _largest_divisor_at_most(S_loc, HISTORY_CHUNK)
            if P_loc * 8 < min(S_loc, HISTORY_CHUNK):   # no useful divisor: the block at once
                P_loc = S_loc
            k = S_loc // P_loc
            pool = pool.reshape(B * k, P_loc, pool.shape[-1])
            table = jnp.arange(B * k, dtype=jnp.int32).reshape(B, k)
            per_step = 1
            position = lambda u: r * S_loc + u
        C = per_step * P_loc
        steps = _cdiv(table.shape[1], per_step)
        table = jnp.pad(table, ((0, 0), (0, steps * per_step - table.shape[1])))  # masked below
        end = start + n_new
        qpos = start[:, None] + jnp.arange(T)[None, :]
        log2_scale = scale * math.log2(math.e)

        def key_chunk(i):
            pages = jax.lax.dynamic_slice_in_dim(table, i * per_step, per_step, axis=1)
            keys = read_cache(pool[pages], cache_scale, q_lat.dtype).reshape(B, C, width)
            s = (jnp.einsum("bthc,bsc->bhts", q_lat, keys[..., :R], precision=HIGHEST)
                 + jnp.einsum("bthr,bsr->bhts", q_rope, keys[..., R:], precision=HIGHEST)
                 ).astype(F32) * log2_scale
            kpos = position(i * C + jnp.arange(C))
            return jnp.where(visible(kpos, qpos, end)[:, None], s, -jnp.inf), lambda p: jnp.einsum(
                "bhts,bsc->bhtc", p.astype(keys.dtype), keys[..., :R], precision=HIGHEST,
                preferred_element_type=F32)

        # only the chunks holding a position below the batch's longest end
        if paged:
            n_steps = jnp.minimum(_cdiv(_cdiv(jnp.max(end), page_span), per_step), steps)
        else:
            n_steps = jnp.clip(_cdiv(jnp.max(end) - r * S_loc, C), 0, steps)
        acc, m_i, l_i = attend_in_chunks(n_steps, key_chunk, (B, q_lat.shape[2], T), R)
        o = merge_over_ranks(acc, m_i, l_i, dcp_axes, jnp.exp2)
        return jnp.swapaxes(o, 1, 2).astype(q_lat.dtype)          # [B, T, H, R]

    def local_kernel(q_lat, q_rope, pool, table, start, n_new):
        P_loc = pool.shape[1]
        # one query sees positions < L = start + n_new: all of this rank's part of the first L // P
        # pages, and a prefix of its part of page L // P; in the rank's own order that is a prefix
        L = start + n_new
        full = L // (P_loc * n)
        part = L - full * (P_loc * n) - jax.lax.axis_index(dcp_axes) * P_loc
        lengths = (full * P_loc + jnp.clip(part, 0, P_loc)).astype(jnp.int32)
        o, lse = mla_decode(jnp.concatenate([q_lat, q_rope], -1), pool, table, lengths, scale=scale,
                            backend=backend, out_dtype=F32, cache_scale=cache_scale)
        # the kernel's o is normalised, so each rank's sum is 1 (weight 0 where lse is -inf)
        return merge_over_ranks(o, lse, jnp.ones_like(lse), dcp_axes, jnp.exp).astype(q_lat.dtype)

    return shard_map(local_kernel if use_kernel else local, mesh=mesh,
                     in_specs=(P(), P(), P(None, dcp_axes, None), P(), P(), P()), out_specs=P(),
                     check_vma=False)(q_lat, q_rope, cache, table, start, n_new)


def merge_over_ranks(acc, m, l, axes, exp):
    """Exact merge of per-rank partial attention: acc [..., X] (numerator), m [...] (max score
    or log-sum-exp, in the base of `exp`), l [...] (sum of weights): a global max (pmax), each
    rank's terms rescaled by exp(m - max), then psum. A rank with m = -inf adds nothing; a row
    with no key on any rank gives 0."""
    top = jax.lax.pmax(m, axes)
    w = exp(m - jnp.where(jnp.isfinite(top), top, 0.0))
    return normalise(jax.lax.psum(acc * w[..., None], axes), jax.lax.psum(l * w, axes))


def visible(kpos, qpos, end):
    """[B, T, S]: query t of row b (at position qpos[b, t]) sees key position kpos[s] when it is
    causal (kpos <= qpos) and already written (kpos < end[b] = start + n_new)."""
    return (kpos[None, None, :] <= qpos[..., None]) & (kpos[None, None, :] < end[:, None, None])


def _cdiv(a, b):
    return -(-a // b)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of n that is <= cap (n itself when n <= cap)."""
    return next(d for d in range(min(n, cap), 0, -1) if n % d == 0)


def per_head_shards(fn, head_args, shared_args, num_heads, with_lse=False):
    """fn(*head_args, *shared_args) -> [B, T, H, X] (and lse [B, T, H] with_lse), run per tensor
    rank's heads in shard_map when the ambient mesh's tensor axis divides the heads (head_args
    split on their axis 2, shared_args replicated): a Pallas kernel is a custom call XLA's
    partitioner cannot split by heads."""
    from jax import shard_map
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_abstract_mesh()
    t = 1 if mesh.empty else mesh.shape.get("tensor", 1)
    if t == 1 or num_heads % t:
        return fn(*head_args, *shared_args)
    heads = P(None, None, "tensor", None)
    out_specs = (heads, P(None, None, "tensor")) if with_lse else heads
    return shard_map(fn, mesh=mesh, in_specs=(heads,) * len(head_args) + (P(),) * len(shared_args),
                     out_specs=out_specs, check_vma=False)(*head_args, *shared_args)


def history_attention(q_nope, q_rope, latent, table, start, n_new, w_uk, w_uv, scale, cache_scale,
                      dtype, chunk: int = HISTORY_CHUNK):
    """Causal attention of T new queries (at positions start + t) over a paged cache that already
    holds them, in expanded form, one chunk of key positions at a time with an online softmax:
    the memory is O(B H T chunk), where attending the whole table at once took the T x S scores
    and the B x S x H expanded keys (tens of GiB for 64 rows of 1024 new tokens over 32K
    positions). Steps past the batch's longest history are not run.
    q_nope [B, T, H, dn], q_rope [B, T, H, dr]; latent [pages, P, C] with table [B, pages a row];
    w_uk [R, H, dn], w_uv [R, H, dv]. Returns [B, T, H, dv] in `dtype` (0 where no key)."""
    B, T, H, _ = q_nope.shape
    P = latent.shape[1]
    R, dv = w_uk.shape[0], w_uv.shape[-1]
    per_step = max(1, chunk // P)               # whole pages a step
    C = per_step * P
    steps = _cdiv(table.shape[1], per_step)
    table = jnp.pad(table, ((0, 0), (0, steps * per_step - table.shape[1])))  # masked below
    end = start + n_new
    qpos = start[:, None] + jnp.arange(T)[None, :]                             # [B, T]
    log2_scale = scale * math.log2(math.e)

    def key_chunk(i):
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_step, per_step, axis=1)
        keys = read_cache(latent[pages], cache_scale, dtype).reshape(B, C, -1)
        k_nope = jnp.einsum("bsc,chn->bshn", keys[..., :R], w_uk, precision=HIGHEST)
        v = jnp.einsum("bsc,chv->bshv", keys[..., :R], w_uv, precision=HIGHEST)
        s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, precision=HIGHEST)
             + jnp.einsum("bthr,bsr->bhts", q_rope, keys[..., R:], precision=HIGHEST)).astype(F32) * log2_scale
        kpos = i * C + jnp.arange(C)
        return jnp.where(visible(kpos, qpos, end)[:, None], s, -jnp.inf), lambda p: jnp.einsum(
            "bhts,bshv->bhtv", p.astype(dtype), v, precision=HIGHEST, preferred_element_type=F32)

    n_steps = jnp.minimum(_cdiv(jnp.max(end), C), steps)
    acc, _, l_i = attend_in_chunks(n_steps, key_chunk, (B, H, T), dv)
    return jnp.swapaxes(normalise(acc, l_i), 1, 2).astype(dtype)


def history_flash(h, latent, table, start, n_new, key_rows: int = FLASH_KEY_ROWS,
                  min_keys: int = HISTORY_CHUNK):
    """`history_attention` on the flash prefill kernel: the cached history's keys expanded one
    chunk of whole pages at a time (C positions a row: about key_rows / B, at least min_keys,
    so that many rows do not make many small steps), the kernel run for the new
    queries over each chunk, the chunks' (o, lse) merged exactly; steps past the batch's longest
    history are not run. Needs the kernel's head dimensions (`flash_dims`). Returns
    [B, T, H, dv] in h.dtype (0 where no key)."""
    B, T, H, _ = h.q_nope.shape
    P, dv = latent.shape[1], h.w_uv.shape[-1]
    per_step = max(1, min(max(key_rows // B, min_keys), table.shape[1] * P) // P)  # pages a step
    C = per_step * P
    steps = _cdiv(table.shape[1], per_step)
    table = jnp.pad(table, ((0, 0), (0, steps * per_step - table.shape[1])))  # masked by position
    qk = jnp.concatenate([h.q_nope, h.q_rope], -1)

    def attend(qk, k, v, n_new, start, k0):
        return mla_prefill(qk, k, v, n_new, starts=start, key_start=k0, scale=h.scale,
                           backend=h.backend, return_lse=True, out_dtype=F32)

    def step(i, carry):
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_step, per_step, axis=1)
        k, v = expand_keys(h, read_cache(latent[pages], h.cache_scale, h.dtype).reshape(B, C, -1))
        o, lse = per_head_shards(attend, (qk, k, v), (n_new, start, i * C), H, with_lse=True)
        return merge_partials([carry[0], o], [carry[1], lse])

    init = (jnp.zeros((B, T, H, dv), F32), jnp.full((B, T, H), -jnp.inf, F32))
    n_steps = jnp.minimum(_cdiv(jnp.max(start + n_new), C), steps)
    return jax.lax.fori_loop(0, n_steps, step, init)[0].astype(h.dtype)


def attend_in_chunks(n_steps, chunk, shape, width):
    """Softmax attention one key chunk at a time (online softmax, base 2): chunk(i) returns the
    masked scores s [*shape, C] (times scale * log2 e; -inf = not visible) and pv(p) -> the
    chunk's p @ values [*shape, width] in fp32. Runs chunks 0 .. n_steps - 1 (a traced bound);
    returns the unnormalised (acc [*shape, width], running max m, sum l) in base 2, so a caller
    can normalise or merge them with other shards' (rows without a visible key: m -inf, l 0)."""
    def step(i, carry):
        acc, m_i, l_i = carry
        s, pv = chunk(i)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)   # the kernels' update
        return acc * alpha[..., None] + pv(p), m_new, l_new

    init = (jnp.zeros((*shape, width), F32), jnp.full(shape, -jnp.inf, F32), jnp.zeros(shape, F32))
    return jax.lax.fori_loop(0, n_steps, step, init)


def normalise(acc, l_i):
    """acc / l from `attend_in_chunks`, 0 where a row saw no key."""
    return jnp.where((l_i > 0)[..., None], acc / jnp.where(l_i > 0, l_i, 1.0)[..., None], 0.0)


def _softmax_attend(scores, mask, values_fn):
    scores = jnp.where(mask, scores.astype(F32), MASKED)
    p = jax.nn.softmax(scores, axis=-1)
    return values_fn(p)


class Heads(NamedTuple):
    """What every attention path takes: the queries split into their no-position and rotary parts
    [B, T, H, dn] / [B, T, H, dr], the up-projections w_uk [R, H, dn] / w_uv [R, H, dv] from the
    latent, the softmax scale, the activation dtype, the fp8 cache's scale (None: not fp8) and the
    kernel backend."""
    q_nope: jax.Array
    q_rope: jax.Array
    w_uk: jax.Array
    w_uv: jax.Array
    scale: float
    dtype: object
    cache_scale: object
    backend: object


def write_cache(latent, entries, start, n_new, page_table, cscale, dcp_axes):
    """The cache with the T new entries [B, T, C] written at positions start + t (padding past
    n_new dropped), and the page table it is read through. The cache is pages [num_pages, P, C]
    with a table [B, pages a row]; without a table it is contiguous [B, S, C]: row b is one page."""
    B, T, _ = entries.shape
    t = jnp.arange(T)
    table = jnp.arange(B, dtype=jnp.int32)[:, None] if page_table is None else page_table
    P = latent.shape[1]
    pos = start[:, None] + t[None, :]
    slot = jnp.take_along_axis(table, jnp.clip(pos // P, 0, table.shape[1] - 1), axis=1)
    slot = jnp.where(t[None, :] < n_new[:, None], slot, latent.shape[0])  # padding: dropped
    stored = entries if cscale is None else quantize_words(entries, cscale)
    latent = latent.at[slot, pos % P].set(stored, mode="drop")
    if dcp_axes:  # the written cache keeps its positions over the DCP axes (no regather)
        latent = jax.lax.with_sharding_constraint(latent, jax.sharding.PartitionSpec(None, tuple(dcp_axes), None))
    return latent, table


def _absorb(h):
    return jnp.einsum("bthn,chn->bthc", h.q_nope, h.w_uk, precision=HIGHEST)


def _expand(h, o_lat):
    return jnp.einsum("bthc,chv->bthv", o_lat, h.w_uv, precision=HIGHEST)


def decode_kernel(h, latent, table, start, n_new):
    """One-token decode: the Pallas flash-decoding kernel reads the pages directly (absorbed)."""
    H = h.q_nope.shape[2]
    o_lat = per_head_shards(
        lambda q, latent, table, lengths: mla_decode(q, latent, table, lengths, scale=h.scale,
                                                     backend=h.backend, cache_scale=h.cache_scale)[0],
        (jnp.concatenate([_absorb(h), h.q_rope], -1).astype(h.dtype),),
        (latent, table, (start + n_new).astype(jnp.int32)), H)
    return _expand(h, o_lat)


def over_dcp_shards(h, latent, start, n_new, page_table, dcp_axes):
    """Decode context parallelism: each rank attends its slice of the positions (absorbed), the
    partial softmaxes merged exactly over the ranks."""
    o_lat = dcp_attention(_absorb(h).astype(h.dtype), h.q_rope.astype(h.dtype), latent, start, n_new,
                          h.scale, dcp_axes, backend=h.backend, page_table=page_table,
                          cache_scale=h.cache_scale)
    return _expand(h, o_lat)


def absorbed(h, latent, table, start, n_new):
    """Short passes over a cache (decode on the reference path, verifies): the query projected
    into latent space attends the whole latent cache; the value up-projection after."""
    B, T = h.q_nope.shape[:2]
    P, R = latent.shape[1], h.w_uk.shape[0]
    S = table.shape[1] * P
    keys = read_cache(latent[table], h.cache_scale, h.dtype).reshape(B, S, -1)
    pos = start[:, None] + jnp.arange(T)[None, :]
    visible_keys = visible(jnp.arange(S), pos, start + n_new)
    lat_k, rot_k = keys[..., :R], keys[..., R:]
    scores = (jnp.einsum("bthc,bsc->bhts", _absorb(h), lat_k, precision=HIGHEST)
              + jnp.einsum("bthr,bsr->bhts", h.q_rope, rot_k, precision=HIGHEST)) * h.scale
    o_lat = _softmax_attend(scores, visible_keys[:, None], lambda p: jnp.einsum(
        "bhts,bsc->bthc", p.astype(h.dtype), lat_k, precision=HIGHEST))
    return _expand(h, o_lat)


def flash_dims(h) -> bool:
    """Whether the heads have the flash prefill kernel's dimensions (QK_DIM, V_DIM)."""
    return (h.q_nope.shape[-1] + h.q_rope.shape[-1], h.w_uv.shape[-1]) == (QK_DIM, V_DIM)


def expand_keys(h, entries):
    """The expanded form of cache entries [B, S, R + dr] (latent | rope): keys [B, S, H, dn + dr]
    (the rope part shared by every head) and values [B, S, H, dv]."""
    B, S, _ = entries.shape
    R, H, dr = h.w_uk.shape[0], h.w_uk.shape[1], h.q_rope.shape[-1]
    k_nope = jnp.einsum("bsc,chn->bshn", entries[..., :R], h.w_uk, precision=HIGHEST)
    v = jnp.einsum("bsc,chv->bshv", entries[..., :R], h.w_uv, precision=HIGHEST)
    return jnp.concatenate([k_nope, jnp.broadcast_to(entries[:, :, None, R:], (B, S, H, dr))], -1), v


def long_causal(h, entries, n_new):
    """A long causal pass without a cache: flash attention (the Pallas kernel at its head
    dimensions, else the chunked form), no T x T scores."""
    k, v = expand_keys(h, entries)
    qk = jnp.concatenate([h.q_nope, h.q_rope], -1)
    if flash_dims(h):
        return per_head_shards(lambda qk, k, v, n: mla_prefill(qk, k, v, n, scale=h.scale, backend=h.backend),
                               (qk, k, v), (n_new,), qk.shape[2])
    return mla_prefill_chunked(qk, k, v, n_new, scale=h.scale)[0]


def causal(h, entries, n_new):
    """A causal pass without a cache, expanded form (keys and values per head), over x itself."""
    B, T = entries.shape[:2]
    R = h.w_uk.shape[0]
    t = jnp.arange(T)
    key_pos = t[None, :].repeat(B, 0)
    visible_keys = key_pos[:, None, :] <= t[None, :, None]  # [B, T, S]
    lat_k, rot_k = entries[..., :R], entries[..., R:]
    k_nope = jnp.einsum("bsc,chn->bshn", lat_k, h.w_uk, precision=HIGHEST)
    v = jnp.einsum("bsc,chv->bshv", lat_k, h.w_uv, precision=HIGHEST)
    scores = (jnp.einsum("bthn,bshn->bhts", h.q_nope, k_nope, precision=HIGHEST)
              + jnp.einsum("bthr,bsr->bhts", h.q_rope, rot_k, precision=HIGHEST)) * h.scale
    return _softmax_attend(scores, visible_keys[:, None], lambda p: jnp.einsum(
        "bhts,bshv->bthv", p.astype(h.dtype), v, precision=HIGHEST))


class MLA(nn.Module):
    cfg: object

    @nn.compact
    def __call__(self, x, cache, start, n_new, backend=None, page_table=None, dcp_axes=()):
        """x [B, T, D]; cache {"latent": [B, S, C]} (contiguous) or {"latent": [pages, P, C]} with
        page_table [B, pages per row], or None (no cache: causal over x itself); start [B] tokens
        already cached; n_new [B] valid new tokens. dcp_axes: mesh axes the contiguous cache's
        positions are split over (decode context parallelism; needs an ambient jax.set_mesh)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dr, dv, R = (cfg.mla_num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.kv_lora_rank)
        scale = (dn + dr) ** -0.5
        dt = cfg.jnp_dtype
        cscale = cache_scale(cfg)

        D = cfg.hidden_size
        # every projection of x (queries, the latent + rope entry, the output gate) in one launch
        ins = [kernel((D, cfg.q_lora_rank), ("embed", "q_lora"), cfg, "q_a_proj") if cfg.q_lora_rank
               else kernel((D, H * (dn + dr)), ("embed", "q_heads"), cfg, "q_proj"),
               kernel((D, R + dr), ("embed", "kv_lora_rope"), cfg, "kv_a_proj_with_mqa")]
        if cfg.mla_use_output_gate:
            ins.append(kernel((D, H * dv), ("embed", "v_heads"), cfg, "g_proj"))
        q, ckv, *gate = project(x, ins, dt, backend)
        if cfg.q_lora_rank:
            qa = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps, cfg.jnp_param_dtype, "q_lora", name="q_a_layernorm")(q)
            q_b = kernel((cfg.q_lora_rank, H * (dn + dr)), ("q_lora", "q_heads"), cfg, "q_b_proj")
            q = project(qa, [q_b], dt, backend)[0]
        q = q.reshape(B, T, H, dn + dr)
        q_nope, q_rope = q[..., :dn], q[..., dn:]

        latent = RMSNorm(R, cfg.mla_norm_eps, cfg.jnp_param_dtype, "kv_lora", name="kv_a_layernorm")(ckv[..., :R])
        entries = jnp.concatenate([latent, ckv[..., R:]], axis=-1).astype(dt)  # [B, T, R + dr]
        kv_b = Weight((R, H * (dn + dv)), cfg.jnp_param_dtype, ("kv_lora", "kv_heads"), name="kv_b_proj")().astype(dt)
        kv_b = kv_b.reshape(R, H, dn + dv)
        w_uk, w_uv = kv_b[..., :dn], kv_b[..., dn:]

        h = Heads(q_nope, q_rope, w_uk, w_uv, scale, dt, cscale, backend)
        if cache is None:
            new_cache = None
            o = (long_causal if T > LONG_PREFILL else causal)(h, entries, n_new)
        else:
            latent, table = write_cache(cache["latent"], entries, start, n_new, page_table, cscale,
                                        dcp_axes)
            new_cache = {"latent": latent}
            if dcp_axes:
                o = over_dcp_shards(h, latent, start, n_new, page_table, dcp_axes)
            elif T == 1 and resolve_backend(backend) != "reference" and R + dr == CACHE_DIM:
                o = decode_kernel(h, latent, table, start, n_new)
            elif T <= RECURRENT_MAX_T:
                o = absorbed(h, latent, table, start, n_new)
            elif flash_dims(h) and resolve_backend(backend) != "reference":  # chunked prefill
                o = history_flash(h, latent, table, start, n_new)
            else:  # chunked prefill over the cached history in plain JAX: no T x S scores
                o = history_attention(q_nope, q_rope, latent, table, start, n_new, w_uk, w_uv, scale,
                                      cscale, dt)

        o = o.reshape(B, T, H * dv).astype(dt)
        if gate:
            o = (o.astype(F32) * jax.nn.sigmoid(gate[0].astype(F32))).astype(dt)
        o_proj = kernel((H * dv, D), ("v_heads", "embed"), cfg, "o_proj")
        return project(o, [o_proj], dt, backend)[0], new_cache
