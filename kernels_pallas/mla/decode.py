"""Absorbed MLA decode against a paged latent cache: flash-decoding in Pallas (Triton lowering).

Math and shapes: see reference.py. Kernel layout:

* Rows. The Tq query tokens and Hq heads of a sequence are flattened into Tq*Hq rows (row
  r = t*Hq + h) and padded to a multiple of the row block `block_h` (a power of two >= 16: Triton
  dots need >= 16 rows), e.g. 12 heads x 1 token -> 16 rows. Padded rows are computed and then
  discarded. Each row carries its causal offset t - Tq + 1, so row r sees positions
  < length + offset.
* Grid (head_blocks, num_splits, batch), head blocks fastest so the programs that read the same
  stretch of cache run side by side (the second read hits L2). Program (h, s, b) walks split s of
  sequence b: the history [0, length) is cut into num_splits equal spans (rounded up to block_k),
  computed from the runtime length, so a short sequence in a large page table does not leave
  most programs idle and a long one is spread over all of them.
* Each step gathers block_k tokens through the page table (any page_size), loads the latent part
  [block_k, 512] and the rope part [block_k, 64] as two power-of-two operands (576 is not one),
  runs s = q_lat c^T + q_rope k_rot^T and o += p c, with an fp32 online softmax in base 2.
  Masked loads (other = 0) keep garbage in unused pages out of the result.
* fp8 cache (float8_e4m3fn): tiles are upcast to bf16 before the dots; a per-tensor scale is
  folded into the score multiplier and the output, a per-token scale multiplies the score columns
  and the probabilities (p * s_t) before the PV dot.
* Each program writes its normalised partial o (fp32) and lse (-inf when it saw no key); the
  splits are merged exactly with `merge_stacked` (plain JAX, one fused XLA reduction).

Shared memory: per pipeline stage block_k * (512 + 64) * 2 B (bf16 tiles; fp8 tiles are half),
e.g. block_k 64 -> 72 KiB, x num_stages. For ROCm MI300X (64 KiB LDS) use block_k 32, num_stages 1
(36 KiB); the H200 default (block_k 64, 2 stages) needs about 144 KiB.

Measured on an H200 (benchmarks/results_mla.md, 2026-11-29): 56-63% of copy bandwidth at 32K-128K
with 16 heads and B >= 16 (target 80%), about 120-160 TFLOP/s with 128 heads, and an fp8 path
that is slower than bf16. The default configuration has not been tuned yet.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .softmax import online_softmax_step
from .._backend import resolve_backend, triton_params
from .reference import CACHE_DIM, LATENT, ROPE, merge_stacked, mla_decode_reference

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_sms() -> int:
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", 0) or 132)
    except Exception:  # pragma: no cover
        return 132


def default_config(batch: int, rows: int, capacity: int, dtype) -> dict:
    """Block configuration: row block, key block, warps, stages, number of splits."""
    block_h = min(max(16, _next_pow2(rows)), 64)
    n_hblk = -(-rows // block_h)
    block_k = 64 if block_h <= 32 else 32
    num_warps = 4 if block_h <= 16 else 8
    num_stages = 2
    cap_blocks = max(1, -(-capacity // block_k))
    target = 2 * _num_sms()
    # Enough programs to fill the chip, but each split should keep >= ~256 tokens of work.
    splits = max(1, -(-target // (batch * n_hblk)))
    splits = min(splits, max(1, capacity // 256), cap_blocks)
    return dict(block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                num_splits=splits)


def _decode_kernel(len_ref, scal_ref, roff_ref, qlat_ref, qrope_ref, pt_ref, cache_ref, *rest,
                   block_k: int, page_size: int, max_pages: int, num_splits: int,
                   has_token_scale: bool, compute_dtype):
    if has_token_scale:
        tscale_ref, o_ref, lse_ref = rest
    else:
        tscale_ref = None
        o_ref, lse_ref = rest
    s_idx = pl.program_id(1)
    b = pl.program_id(2)
    length = len_ref[b]
    score_mult = scal_ref[0]        # softmax scale * log2(e) (* per-tensor cache scale)
    out_mult = scal_ref[1]          # per-tensor cache scale (1 otherwise)

    # This split's span of the history, from the runtime length.
    nblk_total = lax.div(length + (block_k - 1), block_k)
    blk_per_split = lax.div(nblk_total + (num_splits - 1), num_splits)
    start = s_idx * blk_per_split * block_k
    end = jnp.minimum(start + blk_per_split * block_k, length)
    n_iter = jnp.maximum(lax.div(end - start + (block_k - 1), block_k), 0)

    block_h = qlat_ref.shape[0]
    q_lat = qlat_ref[...]
    q_rope = qrope_ref[...]
    lim = length + roff_ref[...]                       # [block_h]: row r sees pos < lim[r]
    offs = jnp.arange(block_k, dtype=jnp.int32)
    cols_lat = jnp.arange(LATENT, dtype=jnp.int32)
    cols_rope = LATENT + jnp.arange(ROPE, dtype=jnp.int32)
    zero = jnp.zeros((), cache_ref.dtype)     # typed, so an fp8 cache gets an fp8 fill value

    def body(i, carry):
        acc, m_i, l_i = carry
        pos = start + i * block_k + offs                # [block_k]
        valid = pos < end
        slot = jnp.minimum(lax.div(pos, page_size), max_pages - 1)
        page = pt_ref[slot]
        tok = page * page_size + lax.rem(pos, page_size)
        vmask = valid[:, None]
        # Gathers with two integer indexers (the interpreter has no int-array + slice mix).
        c = plgpu.load(cache_ref.at[tok[:, None], cols_lat[None, :]], mask=vmask, other=zero)
        kr = plgpu.load(cache_ref.at[tok[:, None], cols_rope[None, :]], mask=vmask, other=zero)
        c = c.astype(compute_dtype)
        kr = kr.astype(compute_dtype)
        s = plgpu.dot(q_lat, c, trans_b=True) + plgpu.dot(q_rope, kr, trans_b=True)  # [bh, bk] f32
        if has_token_scale:
            ts = plgpu.load(tscale_ref.at[tok], mask=valid, other=0.0)
            s = s * (ts * score_mult)[None, :]
        else:
            s = s * score_mult
        ok = pos[None, :] < lim[:, None]
        s = jnp.where(ok, s, -jnp.inf)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)
        if has_token_scale:
            p = p * ts[None, :]
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(compute_dtype), c)
        return acc, m_new, l_new

    acc0 = jnp.zeros((block_h, LATENT), jnp.float32)
    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(0, n_iter, body, (acc0, m0, l0))
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    o_ref[...] = acc * (out_mult / l_safe)[:, None]
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_splits", "block_h", "block_k", "num_warps",
                                             "num_stages", "interpret", "out_dtype",
                                             "return_partials"))
def _mla_decode_pallas(q, cache, page_table, lengths, scale, cache_scale, *, num_splits, block_h,
                       block_k, num_warps, num_stages, interpret, out_dtype,
                       return_partials=False):
    B, Tq, Hq, _ = q.shape
    num_pages, page_size, _ = cache.shape
    max_pages = page_table.shape[1]
    rows = Tq * Hq
    n_hblk = -(-rows // block_h)
    rows_p = n_hblk * block_h
    compute_dtype = jnp.bfloat16 if jnp.dtype(cache.dtype).itemsize == 1 else cache.dtype

    qf = q.reshape(B, rows, CACHE_DIM).astype(compute_dtype)
    qf = jnp.pad(qf, ((0, 0), (0, rows_p - rows), (0, 0)))
    q_lat = qf[..., :LATENT]
    q_rope = qf[..., LATENT:]
    t_of_row = jnp.arange(rows_p, dtype=jnp.int32) // Hq
    row_off = jnp.where(t_of_row < Tq, t_of_row - Tq + 1, -Tq).astype(jnp.int32)

    score_mult = jnp.asarray(scale, jnp.float32) * _LOG2E
    out_mult = jnp.float32(1.0)
    token_scale = None
    if cache_scale is not None:
        cs = jnp.asarray(cache_scale, jnp.float32)
        if cs.size == 1:
            score_mult = score_mult * cs.reshape(())
            out_mult = cs.reshape(())
        else:
            if cs.shape != (num_pages, page_size):
                raise ValueError(f"cache_scale shape {cs.shape}: expected () / (1,) or "
                                 f"{(num_pages, page_size)}")
            token_scale = cs.reshape(num_pages * page_size)
    scal = jnp.stack([score_mult, out_mult]).astype(jnp.float32)
    cache_flat = cache.reshape(num_pages * page_size, CACHE_DIM)
    ntok = num_pages * page_size

    grid = (n_hblk, num_splits, B)
    in_specs = [
        pl.BlockSpec((B,), lambda h, s, b: (0,)),                                 # lengths
        pl.BlockSpec((2,), lambda h, s, b: (0,)),                                 # scalars
        pl.BlockSpec((block_h,), lambda h, s, b: (h,)),                           # row offsets
        pl.BlockSpec((None, block_h, LATENT), lambda h, s, b: (b, h, 0)),         # q_lat
        pl.BlockSpec((None, block_h, ROPE), lambda h, s, b: (b, h, 0)),           # q_rope
        pl.BlockSpec((None, max_pages), lambda h, s, b: (b, 0)),                  # page table
        pl.BlockSpec((ntok, CACHE_DIM), lambda h, s, b: (0, 0)),                  # cache
    ]
    args = [lengths.astype(jnp.int32), scal, row_off, q_lat, q_rope,
            page_table.astype(jnp.int32), cache_flat]
    if token_scale is not None:
        in_specs.append(pl.BlockSpec((ntok,), lambda h, s, b: (0,)))
        args.append(token_scale)
    out_specs = [
        pl.BlockSpec((None, None, block_h, LATENT), lambda h, s, b: (b, s, h, 0)),
        pl.BlockSpec((None, None, block_h), lambda h, s, b: (b, s, h)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, num_splits, rows_p, LATENT), jnp.float32),
                 jax.ShapeDtypeStruct((B, num_splits, rows_p), jnp.float32)]
    kernel = functools.partial(
        _decode_kernel, block_k=block_k, page_size=page_size, max_pages=max_pages,
        num_splits=num_splits, has_token_scale=token_scale is not None,
        compute_dtype=compute_dtype)
    o_part, lse_part = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"mla_decode_bh{block_h}_bk{block_k}",
    )(*args)
    o_part = o_part[:, :, :rows]
    lse_part = lse_part[:, :, :rows]
    if return_partials:
        return o_part, lse_part
    o, lse = merge_stacked(o_part, lse_part, axis=1, out_dtype=out_dtype)
    return o.reshape(B, Tq, Hq, LATENT), lse.reshape(B, Tq, Hq)


def mla_decode(q, cache, page_table, lengths, *, scale, backend: str | None = None,
               num_splits: int | None = None, cache_scale=None, out_dtype=None,
               block_h: int | None = None, block_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None):
    """Absorbed MLA decode / multi-token verify over a paged latent cache.

    q [B, Tq, Hq, 576] (q_lat 512 | q_rope 64), cache [num_pages, page_size, 576] (bf16, fp32, or
    float8_e4m3fn with `cache_scale` () / (1,) / [num_pages, page_size] fp32), page_table
    [B, max_pages] int32, lengths [B] int32 (history incl. the Tq new tokens), scale: softmax
    scale. Returns (o [B, Tq, Hq, 512] in out_dtype (default q.dtype), lse [B, Tq, Hq] fp32,
    -inf where a query sees no key; o is 0 there).

    num_splits / block_h / block_k / num_warps / num_stages override `default_config`.
    """
    backend = resolve_backend(backend)
    if q.ndim != 4 or q.shape[-1] != CACHE_DIM:
        raise ValueError(f"q must be [B, Tq, Hq, {CACHE_DIM}], got {q.shape}")
    if cache.ndim != 3 or cache.shape[-1] != CACHE_DIM:
        raise ValueError(f"cache must be [num_pages, page_size, {CACHE_DIM}], got {cache.shape}")
    if jnp.dtype(cache.dtype).itemsize == 1 and cache_scale is None:
        raise ValueError("an fp8 cache needs cache_scale")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if backend == "reference":
        return mla_decode_reference(q, cache, page_table, lengths, scale=scale,
                                    cache_scale=cache_scale, out_dtype=out_dtype)
    B, Tq, Hq, _ = q.shape
    capacity = page_table.shape[1] * cache.shape[1]
    cfg = default_config(B, Tq * Hq, capacity, cache.dtype)
    for k, v in dict(block_h=block_h, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages, num_splits=num_splits).items():
        if v is not None:
            cfg[k] = int(v)
    if cfg["block_h"] < 16 or cfg["block_h"] & (cfg["block_h"] - 1):
        raise ValueError(f"block_h={cfg['block_h']} must be a power of two >= 16")
    if cfg["block_k"] < 16 or cfg["block_k"] & (cfg["block_k"] - 1):
        raise ValueError(f"block_k={cfg['block_k']} must be a power of two >= 16")
    return _mla_decode_pallas(q, cache, page_table, lengths, scale, cache_scale,
                              interpret=backend == "interpret", out_dtype=out_dtype, **cfg)
