"""Absorbed MLA decode against a paged latent cache: flash-decoding in Pallas (Triton lowering).

Math and shapes: see reference.py; entry point: ops.mla_decode; configuration: tuning.py.

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
* Each step reads block_k tokens, the latent part [block_k, 512] and the rope part [block_k, 64]
  as two power-of-two operands of one load each (576 is not a power of two), and runs
  s = q_lat c^T + q_rope k_rot^T and o += p c with the same latent tile (read from memory once),
  with an fp32 online softmax in base 2. Two ways to find the tokens (`load`):
  - "page" (where page_size % block_k == 0): a step never crosses a page, so it needs one page
    id and reads block_k consecutive rows of that page. The page ids of a chunk of steps are
    read into a vector before the inner loop, so no tile address inside that loop depends on a
    load of the same loop and Triton pipelines num_stages - 1 tiles ahead.
  - "token": a page-table lookup per token inside the loop (any page_size). Triton treats the
    tile load as indirect: one tile in flight, whatever num_stages says.
  Masked loads (other = 0) keep garbage in unused slots out of the result.
* fp8 caches run fp16 dots (e4m3 -> fp16 is exact): each q row is divided by its max |q| (the
  score multiplied back) so that no bf16 q overflows fp16; in the kernel at 16-row blocks,
  before it for larger blocks. A per-tensor cache scale is folded into the score multiplier and
  the output; a per-token scale multiplies the score columns and the probabilities (p * s_t)
  before the PV dot, never the [block_k, 576] tile. A float8_e4m3fn cache ("operand") is
  converted where the dots read it; the words form (uint16) is converted in registers
  (fp8_words.py).
* Each program writes its normalised partial o (bf16 when the output is 16-bit, else fp32) and
  lse (fp32, -inf when it saw no key); the splits are merged exactly by one more Pallas kernel
  (merge.py). One split needs no merge.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import kernel_platform, triton_params
from . import fp8_words
from .merge import merge_splits_pallas
from .reference import CACHE_DIM, LATENT, ROPE, is_words
from .softmax import online_softmax_step

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _decode_kernel(len_ref, scal_ref, roff_ref, q_ref, pt_ref, cache_ref, *rest,
                   block_k: int, page_size: int, max_pages: int, num_splits: int,
                   has_token_scale: bool, row_scale: str | None, compute_dtype, load: str,
                   fp8_upcast: str | None, word_ptx: bool, split_qk_acc: bool):
    rest = list(rest)
    tscale_ref = rest.pop(0) if has_token_scale else None
    qmul_ref = rest.pop(0) if row_scale == "input" else None
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

    block_h = q_ref.shape[0]
    # fp16 dots (row_scale): "kernel": each row divided by its max |q| here; "input": q arrives
    # divided, cast and (words) in the kernel's column order, qmul beside it
    if row_scale == "input":
        score_mult = score_mult * qmul_ref[...][:, None]
    elif row_scale == "kernel":
        amax = jnp.maximum(  # two power-of-two loads (Triton's blocks), not one of 576
            jnp.max(jnp.abs(q_ref[:, pl.ds(0, LATENT)].astype(jnp.float32)), axis=1),
            jnp.max(jnp.abs(q_ref[:, pl.ds(LATENT, ROPE)].astype(jnp.float32)), axis=1))
        qmul = jnp.where(amax > 0, amax, 1.0)
        score_mult = score_mult * qmul[:, None]

    def scaled(v):
        if row_scale == "kernel":
            v = v.astype(jnp.float32) / qmul[:, None]
        return v.astype(compute_dtype)

    words = fp8_upcast in fp8_words.WORD_CONVERSIONS
    lat_w, rope_w = (LATENT // 2, ROPE // 2) if words else (LATENT, ROPE)
    # q's operands of the QK^T dots (words: two each, one per dot)
    if words:
        q_lat, q_rope = fp8_words.q_word_operands(q_ref, fp8_upcast, row_scale == "input",
                                                  scaled)
    else:
        q_lat = (scaled(q_ref[:, pl.ds(0, LATENT)]),)
        q_rope = (scaled(q_ref[:, pl.ds(LATENT, ROPE)]),)
    lim = length + roff_ref[...]                       # [block_h]: row r sees pos < lim[r]
    offs = jnp.arange(block_k, dtype=jnp.int32)
    zero = jnp.zeros((), cache_ref.dtype)     # typed, so an fp8 cache gets an fp8 fill value

    def step(carry, base, page):
        """One key block at positions base + [0, block_k); page = its page id ("page" loads)."""
        acc, m_i, l_i = carry
        pos = base + offs                               # [block_k]
        valid = pos < end
        vmask = valid[:, None]

        def ld(ref, mask, fill=zero):
            return plgpu.load(ref, mask=mask, other=fill)

        if load == "page":
            rows = pl.ds(lax.rem(base, page_size), block_k)
            c = ld(cache_ref.at[page, rows, pl.ds(0, lat_w)], vmask)
            kr = ld(cache_ref.at[page, rows, pl.ds(lat_w, rope_w)], vmask)
            ts = ld(tscale_ref.at[page, rows], valid, 0.0) if has_token_scale else None
        else:
            slot = jnp.minimum(lax.div(pos, page_size), max_pages - 1)
            tok = pt_ref[slot] * page_size + lax.rem(pos, page_size)
            cols_lat = jnp.arange(lat_w, dtype=jnp.int32)
            cols_rope = lat_w + jnp.arange(rope_w, dtype=jnp.int32)
            # Gathers with two integer indexers (the interpreter has no int-array + slice mix).
            c = ld(cache_ref.at[tok[:, None], cols_lat[None, :]], vmask)
            kr = ld(cache_ref.at[tok[:, None], cols_rope[None, :]], vmask)
            ts = ld(tscale_ref.at[tok], valid, 0.0) if has_token_scale else None
        mult = ts[None, :] * score_mult if has_token_scale else score_mult   # [bh, bk] or [bh, 1]
        # the operands of each dot: c_qk / r_qk for QK^T, c_pv for PV
        if words:
            c_qk, c_pv, r_qk = fp8_words.word_tile_operands(c, kr, fp8_upcast, word_ptx)
        else:   # 16/32-bit, or a float8 tile converted where the dots read it ("operand")
            c_qk = c_pv = (c.astype(compute_dtype),)
            r_qk = (kr.astype(compute_dtype),)
        dots = [plgpu.dot(qq, kk, trans_b=True)
                for qq, kk in list(zip(q_lat, c_qk)) + list(zip(q_rope, r_qk))]
        if split_qk_acc:  # each dot scaled before the sum: Triton cannot fold the sum into one
            s = sum(d * mult for d in dots)     # accumulator chain
        else:
            s = sum(dots[1:], dots[0]) * mult
        s = jnp.where(pos[None, :] < lim[:, None], s, -jnp.inf)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)
        if has_token_scale:
            p = p * ts[None, :]
        pc = p.astype(compute_dtype)
        # an accumulator per PV operand (words: the low bytes' columns, the high bytes')
        acc = tuple(a * alpha[:, None] + plgpu.dot(pc, cc) for a, cc in zip(acc, c_pv))
        return acc, m_new, l_new

    acc0 = (jnp.zeros((block_h, lat_w), jnp.float32),) * (2 if words else 1)
    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    carry = (acc0, m0, l0)
    if load == "page":
        # The page ids of `chunk` steps are read up front into a vector and each step takes its
        # own from it (a masked sum), so inside the inner loop no tile address depends on a load
        # of that loop: Triton's pipeliner then keeps num_stages - 1 tiles in flight. The
        # pipeline refills once per chunk of 32 steps (a 64-step chunk costs more registers).
        chunk = 32
        steps = jnp.arange(chunk, dtype=jnp.int32)

        def outer(ci, carry):
            t0 = ci * chunk
            slots = lax.div(start + (t0 + steps) * block_k, page_size)
            pages = pt_ref[jnp.minimum(slots, max_pages - 1)]            # [chunk]

            def inner(j, carry):
                page = jnp.sum(jnp.where(steps == j, pages, 0))
                return step(carry, start + (t0 + j) * block_k, page)

            return lax.fori_loop(0, jnp.minimum(chunk, n_iter - t0), inner, carry)

        carry = lax.fori_loop(0, lax.div(n_iter + (chunk - 1), chunk), outer, carry)
    else:
        carry = lax.fori_loop(0, n_iter, lambda i, cr: step(cr, start + i * block_k, None),
                              carry)
    acc, m_i, l_i = carry
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    omul = (out_mult / l_safe)[:, None]
    o = fp8_words.interleave_columns(*acc) if words else acc[0]
    o_ref[...] = (o * omul).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_splits", "block_h", "block_k", "num_warps",
                                             "num_stages", "load", "fp8_upcast",
                                             "split_qk_acc", "interpret", "out_dtype",
                                             "partial_dtype"))
def decode_pallas(q, cache, page_table, lengths, scale, cache_scale, *, num_splits, block_h,
                  block_k, num_warps, num_stages, load, fp8_upcast, split_qk_acc, interpret,
                  out_dtype, partial_dtype):
    """The decode kernel and the merge of its splits, with the fields of a resolved
    tuning.DecodeConfig -> (o [B, Tq, Hq, 512] in out_dtype, lse [B, Tq, Hq] fp32)."""
    B, Tq, Hq, _ = q.shape
    num_pages, page_size, _ = cache.shape
    max_pages = page_table.shape[1]
    rows = Tq * Hq
    n_hblk = -(-rows // block_h)
    rows_p = n_hblk * block_h
    words = is_words(cache)
    is_fp8 = jnp.dtype(cache.dtype).itemsize == 1 or words
    compute_dtype = jnp.float16 if is_fp8 else cache.dtype
    # Where q rows are scaled for fp16 dots: in the kernel at 16-row blocks (saves a few small
    # XLA kernels a call, which matter at batch 1), outside for larger blocks
    row_scale = None if not is_fp8 else ("kernel" if block_h == 16 else "input")

    qf = q.reshape(B, rows, CACHE_DIM)
    qmul = None
    if row_scale == "input":
        q32 = qf.astype(jnp.float32)
        amax = jnp.max(jnp.abs(q32), axis=-1)
        qmul = jnp.where(amax > 0, amax, 1.0)
        qf = q32 / qmul[..., None]
        qmul = jnp.pad(qmul, ((0, 0), (0, rows_p - rows)), constant_values=1.0)
        if words:
            qf = fp8_words.q_in_word_order(qf, fp8_upcast)
    if row_scale != "kernel":   # the kernel scales and casts its rows itself
        qf = qf.astype(compute_dtype)
    if rows_p != rows:
        qf = jnp.pad(qf, ((0, 0), (0, rows_p - rows), (0, 0)))
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
            token_scale = cs
    if words:
        conv_scale = fp8_words.CONV_SCALE[fp8_words.WORD_CONVERSIONS[fp8_upcast]]
        score_mult, out_mult = score_mult * conv_scale, out_mult * conv_scale
    scal = jnp.stack([score_mult, out_mult]).astype(jnp.float32)
    ntok = num_pages * page_size
    width = cache.shape[-1]

    grid = (n_hblk, num_splits, B)
    if load == "page":
        cache_arg = cache
        cache_spec = pl.BlockSpec((num_pages, page_size, width), lambda h, s, b: (0, 0, 0))
        ts_arg = token_scale
        ts_spec = pl.BlockSpec((num_pages, page_size), lambda h, s, b: (0, 0))
    else:
        cache_arg = cache.reshape(ntok, width)
        cache_spec = pl.BlockSpec((ntok, width), lambda h, s, b: (0, 0))
        ts_arg = None if token_scale is None else token_scale.reshape(ntok)
        ts_spec = pl.BlockSpec((ntok,), lambda h, s, b: (0,))
    in_specs = [
        pl.BlockSpec((B,), lambda h, s, b: (0,)),                                 # lengths
        pl.BlockSpec((2,), lambda h, s, b: (0,)),                                 # scalars
        pl.BlockSpec((block_h,), lambda h, s, b: (h,)),                           # row offsets
        pl.BlockSpec((None, block_h, CACHE_DIM), lambda h, s, b: (b, h, 0)),      # q
        pl.BlockSpec((None, max_pages), lambda h, s, b: (b, 0)),                  # page table
        cache_spec,
    ]
    args = [lengths.astype(jnp.int32), scal, row_off, qf, page_table.astype(jnp.int32),
            cache_arg]
    if token_scale is not None:
        in_specs.append(ts_spec)
        args.append(ts_arg)
    if qmul is not None:
        in_specs.append(pl.BlockSpec((None, block_h), lambda h, s, b: (b, h)))
        args.append(qmul)
    out_specs = [
        pl.BlockSpec((None, None, block_h, LATENT), lambda h, s, b: (b, s, h, 0)),
        pl.BlockSpec((None, None, block_h), lambda h, s, b: (b, s, h)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, num_splits, rows_p, LATENT), partial_dtype),
                 jax.ShapeDtypeStruct((B, num_splits, rows_p), jnp.float32)]
    kernel = functools.partial(
        _decode_kernel, block_k=block_k, page_size=page_size, max_pages=max_pages,
        num_splits=num_splits, has_token_scale=token_scale is not None,
        row_scale=row_scale, compute_dtype=compute_dtype, load=load,
        fp8_upcast=fp8_upcast if is_fp8 else None, split_qk_acc=split_qk_acc,
        word_ptx=words and not interpret and kernel_platform() != "rocm")
    o_part, lse_part = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"mla_decode_bh{block_h}_bk{block_k}_{load}",
    )(*args)
    if num_splits == 1:             # nothing to merge
        o, lse = o_part[:, 0, :rows].astype(out_dtype), lse_part[:, 0, :rows]
    else:
        o, lse = merge_splits_pallas(o_part, lse_part, rows=rows, out_dtype=out_dtype,
                                     interpret=interpret)
    return o.reshape(B, Tq, Hq, LATENT), lse.reshape(B, Tq, Hq)
