"""Launches 1-2 of the chunked KDA prefill: the intra-chunk matrices and the inverse.

1. `_diag_kernel` (chunk, b, h): G, the in-chunk cumulative log-decay in base 2 (g past
   `lengths` is zeroed so G stays flat there); the 16x16 diagonal blocks of Aqk (incl. diagonal)
   and of L = beta * K K^T (strictly lower, with decay), fp32; the rows' inverse l2 norms. The
   key dimension is a device loop over tiles of `diag_block_k` columns. A block whose decay spans
   <= MATMUL_SPAN (natural log) uses one matmul with G at its first row as reference (both
   factors stay in fp32 range); wider spans take the exact path, one exp2 per (row, column, key
   dim). `safe_gate=True` (the caller promises g >= -5 per token, K3's bounded gate) skips the
   check.
2. `_inter_kernel` (chunk, b, h): the off-diagonal 16x16 blocks (reference: the cumulative decay
   at the first row of the later block, so both factors are <= 1 for any gate), a device loop
   over key tiles; then T = (I + L)^-1 in fp32 and only the finished T rounded to the operand
   dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params
from .chunk_common import (C, F32, HIGHEST, LOG2E, NSB, SB, SPAN2, chunk_specs, dot, gate_block,
                           masked, row, tile_cols, valid_rows)


# ----------------------------------------------------------------------------------------------
# 1. diagonal 16x16 blocks
# ----------------------------------------------------------------------------------------------
def _exact_blocks(q, k, G, acc):
    """acc + the diagonal block's Q K^T and K K^T (all columns; the caller masks the upper
    triangle) over these key columns, one exp2 per (row, column, key): exp2(min(G_r - G_j, 0))
    (G in base 2) is exact for rows r >= j at any decay span. q, k, G [SB, X] fp32; acc: two
    [SB, SB]."""
    ci = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)

    def col(j, acc):
        aq, ak = acc
        kE = row(k, j)[None, :] * jnp.exp2(jnp.minimum(G - row(G, j)[None, :], 0.0))
        return (aq + jnp.where(ci == j, jnp.sum(q * kE, axis=1)[:, None], 0.0),
                ak + jnp.where(ci == j, jnp.sum(k * kE, axis=1)[:, None], 0.0))
    return jax.lax.fori_loop(0, SB, col, acc)


def _diag_kernel(len_ref, q_ref, k_ref, g_ref, b_ref, G_ref, aq_ref, ak_ref, rq_ref, rk_ref, *,
                 scale, l2norm, safe_gate, prec_mm, block_k):
    """The four sub-blocks inside each key tile of `block_k` columns. The decay's cumsum runs down
    each column, so a tile needs nothing from the others; the products are formed on the raw
    (masked) q and k and the l2 norms scale the 16x16 results after (A_rj = rq_r rk_j sum_k ...).
    Only one tile's operands are live (no full-width [16, K] dot operand, which each warp holds
    whole), and with num_stages >= 2 Triton pipelines the next tile's loads behind this tile's
    math. The span check takes the maximum over the tiles; a sub-block past it is redone by the
    exact path, tile by tile from the refs."""
    n = pl.program_id(0)
    length = len_ref[...]
    K = q_ref.shape[-1]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)
    z = jnp.zeros((SB, SB), F32)
    rows = [slice(i * SB, (i + 1) * SB) for i in range(NSB)]
    valid = [valid_rows(length, n * C + i * SB, SB) for i in range(NSB)]

    def tile(t, acc):
        cols = tile_cols(t, block_k)
        aq, ak, ssq_q, ssq_k, span = (list(a) for a in acc)
        carry = jnp.zeros((block_k,), F32)
        for i in range(NSB):
            vm = valid[i][:, None]
            g, cs = gate_block(g_ref, (rows[i], cols), vm)
            G = cs + carry[None, :]
            # G at the block's first row, from that row's g loaded again (a cached [X] load
            # instead of a masked reduction over the block's rows); zero past `length`
            G0 = carry + jnp.where(n * C + i * SB < length, g_ref[i * SB, cols] * LOG2E, 0.0)
            carry = carry + jnp.sum(g, axis=0)
            G_ref[rows[i], cols] = G
            q = jnp.where(vm, q_ref[rows[i], cols].astype(F32), 0.0)
            k = jnp.where(vm, k_ref[rows[i], cols].astype(F32), 0.0)
            ssq_q[i] = ssq_q[i] + jnp.sum(q * q, axis=1)
            ssq_k[i] = ssq_k[i] + jnp.sum(k * k, axis=1)
            # exp(G_r - G_j) = exp(G_r - G_0) exp(G_0 - G_j): within fp32 range while the
            # block's decay spans <= MATMUL_SPAN (checked below, or promised by safe_gate)
            eq = jnp.exp2(G - G0[None, :])
            ek = k * jnp.exp2(G0[None, :] - G)
            aq[i] = aq[i] + dot(q * eq, ek, prec_mm, trans_b=True)
            ak[i] = ak[i] + dot(k * eq, ek, prec_mm, trans_b=True)
            if not safe_gate:
                span[i] = jnp.maximum(span[i], jnp.max(G0 - carry))  # carry: G at the last row
        return aq, ak, ssq_q, ssq_k, span

    zv = jnp.zeros((SB,), F32)
    aq, ak, ssq_q, ssq_k, span = jax.lax.fori_loop(
        0, K // block_k, tile, ([z] * NSB, [z] * NSB, [zv] * NSB, [zv] * NSB,
                                [jnp.float32(0.0)] * NSB))
    for i in range(NSB):
        if l2norm:
            rq, rk = jax.lax.rsqrt(ssq_q[i] + 1e-6), jax.lax.rsqrt(ssq_k[i] + 1e-6)
        else:
            rq = rk = jnp.ones((SB,), F32)
        rq_ref[rows[i]] = rq
        rk_ref[rows[i]] = rk
        aqi = aq[i] * rq[:, None] * rk[None, :]
        aki = ak[i] * rk[:, None] * rk[None, :]
        if not safe_gate:
            def exact(_, i=i, rq=rq, rk=rk):
                vm = valid[i][:, None]
                acc = (z, z)
                for t in range(K // block_k):
                    cols = tile_cols(t, block_k)
                    # only differences G_r - G_j within the sub-block enter, so its own cumsum
                    # serves (the rows before it would cancel)
                    _, cs = gate_block(g_ref, (rows[i], cols), vm)
                    q = jnp.where(vm, q_ref[rows[i], cols].astype(F32), 0.0) * rq[:, None]
                    k = jnp.where(vm, k_ref[rows[i], cols].astype(F32), 0.0) * rk[:, None]
                    acc = _exact_blocks(q, k, cs, acc)
                return acc
            aqi, aki = jax.lax.cond(span[i] <= SPAN2, lambda _, a=(aqi, aki): a, exact, None)
        beta = jnp.where(valid[i], b_ref[rows[i]].astype(F32), 0.0)
        aq_ref[rows[i], :] = jnp.where(ri >= ci, aqi * scale, 0.0)
        ak_ref[rows[i], :] = jnp.where(ri > ci, aki * beta[:, None], 0.0)


def launch_diag(lens, q, k, g, beta, *, scale, l2norm, safe_gate, prec_mm, cfg, interpret):
    """-> G [B, Tp, H, K], the diagonal blocks of Aqk and L [B, H, Tp, SB], rq, rk [B, H, Tp]."""
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_diag_kernel, scale=scale, l2norm=l2norm, safe_gate=safe_gate,
                          prec_mm=prec_mm, block_k=cfg.diag_block_k),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec],
        out_specs=[tok(K), per(SB), per(SB), vec, vec],
        out_shape=(sds((B, Tp, H, K), F32), sds((B, H, Tp, SB), F32), sds((B, H, Tp, SB), F32),
                   sds((B, H, Tp), F32), sds((B, H, Tp), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_diag, num_stages=cfg.num_stages_diag),
        interpret=interpret, name="kda_chunk_diag",
    )(lens, q, k, g, beta)


# ----------------------------------------------------------------------------------------------
# 2. off-diagonal blocks + fp32 inverse
# ----------------------------------------------------------------------------------------------
def _offdiag_blocks(n, length, q_ref, k_ref, G_ref, rq_ref, rk_ref, block_k, prec_mm):
    """The off-diagonal 16x16 blocks (i > j) of Q K^T and K K^T with decay, fp32, a device loop
    over key tiles (its loads software-pipelined through shared memory when the launch has
    num_stages >= 2): dicts (i, j) -> [SB, SB]; and the sub-blocks' valid-row masks."""
    K = q_ref.shape[-1]
    valid = [valid_rows(length, n * C + i * SB, SB) for i in range(NSB)]
    rows = [slice(i * SB, (i + 1) * SB) for i in range(NSB)]
    rq = [rq_ref[r] for r in rows]
    rk = [rk_ref[r] for r in rows]
    pairs = [(i, j) for i in range(1, NSB) for j in range(i)]
    z = jnp.zeros((SB, SB), F32)

    def tile(kt, acc):
        cols = tile_cols(kt, block_k)
        Aq, Ak = dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1]))
        ks = [masked(k_ref, rows[i], cols, valid[i], rk[i]) for i in range(NSB)]
        Gs = [G_ref[rows[i], cols] for i in range(NSB)]
        for i in range(1, NSB):
            gn = G_ref[i * SB, cols][None, :]         # G at block i's first row
            e = jnp.exp2(Gs[i] - gn)                   # <= 1
            qe = masked(q_ref, rows[i], cols, valid[i], rq[i]) * e
            ke = ks[i] * e
            for j in range(i):
                kt_j = ks[j] * jnp.exp2(gn - Gs[j])    # <= 1
                Aq[i, j] = Aq[i, j] + dot(qe, kt_j, prec_mm, trans_b=True)
                Ak[i, j] = Ak[i, j] + dot(ke, kt_j, prec_mm, trans_b=True)
        return [Aq[ij] for ij in pairs], [Ak[ij] for ij in pairs]

    acc = jax.lax.fori_loop(0, K // block_k, tile, ([z] * len(pairs), [z] * len(pairs)))
    return dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1])), valid


def _dot_bf16x3(a, b):
    """a @ b for fp32 a, b on bf16 tensor cores: hi*hi + hi*lo + lo*hi, fp32 accumulation. The
    dropped lo*lo term and the low parts' own rounding leave ~16 mantissa bits: far below the
    bf16 rounding of the finished T, far above fp32's 24."""
    bf = jnp.bfloat16
    ah, bh = a.astype(bf), b.astype(bf)
    al, bl = (a - ah.astype(F32)).astype(bf), (b - bh.astype(F32)).astype(bf)
    return dot(ah, bl, None) + dot(al, bh, None) + dot(ah, bh, None)


def _invert(L, akd_ref, mm):
    """T = (I + L)^-1 in fp32 from L's off-diagonal blocks (dict (i, j) -> [SB, SB], i > j) and
    its diagonal blocks (akd_ref [C, SB], strictly lower). Each diagonal block D is nilpotent
    (D^16 = 0): (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8), six 16x16 matmuls and no
    dependent loop; block substitution for the off-diagonal part. `mm`: the 16x16 product
    (fp32 for fp32 operands; bf16x3 for bf16 ones, far inside T's bf16 rounding)."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    eye = (ri == jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)).astype(F32)
    T = {}
    for i in range(NSB):
        D = akd_ref[i * SB:(i + 1) * SB, :].astype(F32)
        P, X = eye - D, D
        for _ in range(3):
            X = mm(X, X)                             # D^2, D^4, D^8
            P = mm(P, eye + X)
        T[i, i] = P
    for dlt in range(1, NSB):
        for i in range(dlt, NSB):
            j = i - dlt
            acc = None
            for m in range(j, i):
                t = mm(L[i, m], T[m, j])
                acc = t if acc is None else acc + t
            T[i, j] = -mm(T[i, i], acc)
    return T


def _store_lower(ref, blocks, diag=None):
    """ref [C, C] <- the block-lower matrix of `blocks` ((i, j) -> [SB, SB], i > j; plus (i, i)
    unless `diag` (a [C, SB] ref) gives the diagonal blocks), zeros above."""
    z = jnp.zeros((SB, SB), F32)
    for i in range(NSB):
        for j in range(NSB):
            if j < i or (j == i and diag is None):
                x = blocks[i, j]
            elif j == i:
                x = diag[i * SB:(i + 1) * SB, :]
            else:
                x = z
            ref[i * SB:(i + 1) * SB, j * SB:(j + 1) * SB] = x.astype(ref.dtype)


def _inter_kernel(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, akd_ref,
                  a_ref, t_ref, *, scale, block_k, prec_mm, inverse_mm):
    """Stores A (scaled Q K^T blocks, diagonal from aqd_ref) and T from L (beta-scaled K K^T)."""
    Aq, Ak, valid = _offdiag_blocks(pl.program_id(0), len_ref[...], q_ref, k_ref, G_ref, rq_ref,
                                    rk_ref, block_k, prec_mm)
    beta = [jnp.where(valid[i], b_ref[i * SB:(i + 1) * SB].astype(F32), 0.0) for i in range(NSB)]
    _store_lower(a_ref, {ij: x * scale for ij, x in Aq.items()}, diag=aqd_ref)
    L = {ij: Ak[ij] * beta[ij[0]][:, None] for ij in Ak}
    _store_lower(t_ref, _invert(L, akd_ref, inverse_mm))


def launch_inter(lens, q, k, G, beta, rq, rk, aqd, akd, *, scale, op_dtype, prec_mm, cfg,
                 interpret):
    """-> A, T [B, H, Tp, C] in the operand dtype."""
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = chunk_specs()
    sds = jax.ShapeDtypeStruct
    inverse_mm = (lambda a, b: dot(a, b, HIGHEST)) if op_dtype == F32 else _dot_bf16x3
    return pl.pallas_call(
        functools.partial(_inter_kernel, scale=scale, block_k=cfg.block_k_inter, prec_mm=prec_mm,
                          inverse_mm=inverse_mm),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec, vec, vec, per(SB), per(SB)],
        out_specs=[per(C), per(C)],
        out_shape=(sds((B, H, Tp, C), op_dtype), sds((B, H, Tp, C), op_dtype)),
        compiler_params=triton_params(num_warps=cfg.num_warps_inter, num_stages=cfg.num_stages_inter),
        interpret=interpret, name="kda_chunk_inter",
    )(lens, q, k, G, beta, rq, rk, aqd, akd)
