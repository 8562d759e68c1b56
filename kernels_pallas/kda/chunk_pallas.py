"""Chunked KDA prefill in Pallas (Triton lowering: CUDA and ROCm). Reference: reference.py.

Chunks of C = 64 tokens, sub-blocks of 16. Five launches, each small enough to stay in registers:
  1. `_diag_kernel_tiled` (chunk, b, h; the default) or `_diag_kernel` (whole rows,
     `ChunkConfig.diag_block_k=None`): G, the in-chunk cumulative log-decay in base 2 (g * log2 e
     summed, so every decay below is one exp2; g past `lengths` is zeroed so G stays flat there);
     the 16x16 diagonal blocks of Aqk (incl. diagonal) and of L = beta * K K^T (strictly lower,
     with decay), fp32; the rows' inverse l2 norms. A block whose decay spans <= MATMUL_SPAN
     (natural log) uses one matmul with G at its first row as reference (both factors stay in
     fp32 range); wider spans take the exact path, one exp2 per (row, column, key dim).
     `safe_gate=True` (the caller promises g >= -5 per token, K3's bounded gate) skips the
     check. The tiled form loops over key tiles of `diag_block_k` on the device.
  2. `_inter_kernel`  (chunk, b, h): the off-diagonal 16x16 blocks (reference: the cumulative decay
     at the first row of the later block, so both factors are <= 1 for any gate), looping over key
     tiles (a device loop, software-pipelined, when num_stages_inter >= 2); then T = (I + L)^-1
     in fp32 (the diagonal blocks by the product form or forward substitution,
     `ChunkConfig.diag_inverse`; block substitution for the rest) and only the finished T
     rounded to the operand dtype.
     `ChunkConfig.split_inverse`: the same as two launches (`_offdiag_kernel` storing L in fp32,
     then `_inverse_kernel`), each with fewer live registers; `num_warps_inverse` applies to
     that second launch only. `ChunkConfig.inverse_precision`:
     how the inverse's 16x16 products are computed (bf16x3 by default for bf16 operands).
  3. `_wu_kernel`     (chunk, b, h): W = T diag(beta) (K exp G), U = T diag(beta) V,
     Kg = K exp(G_C - G), exp(G_C): 64-row matmuls.
  4. `_state_kernel`  (b, h, V-tile), sequential over chunks with the fp32 state in registers:
     stores the state entering each chunk, V' = U - W S, and S <- exp(G_C) S + Kg^T V'.
     Two-level variant (ChunkConfig.scan_groups > 1, or 0 = `auto_scan_groups` by shape) for few
     sequences x heads: the chunks split into equal groups; each group's affine map
     S -> P S + Q runs in parallel (the same kernel: P with U = 0 from the identity, Q from 0),
     a short fp32 scan over the groups (plain JAX) gives each group's entering state, and the
     groups replay in parallel, storing the per-chunk states.
  5. `_out_kernel`    (chunk, b, h, V-tile), parallel: O = (scale Q exp G) S_n + Aqk V'.
Rows past `lengths[b]` are masked where they are loaded (they may hold garbage, even NaN); their
outputs are zero.

Triton-lowering limits respected: every loaded/stored array is a power of two, every dot has all
dims >= 16, no value slicing (rows come from refs or masked sums), static grids.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import num_sms, triton_params

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
C = 64          # chunk
SB = 16         # sub-block
NSB = C // SB   # sub-blocks per chunk
MATMUL_SPAN = 80.0  # a sub-block whose decay spans more than this (natural log) takes the exact path
# The launches carry G in base-2 units (log2 of the decay: g * LOG2E, summed), so each decay is
# one exp2, a single MUFU.EX2 on NVIDIA; jnp.exp lowers to libdevice's expf, ~7 instructions
# around the same MUFU (sm_90 SASS, upstream Triton 3.6). G never leaves the kernels.
LOG2E = 1.4426950408889634
SPAN2 = MATMUL_SPAN * LOG2E


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters of the kernels (see module docstring). The defaults are the fastest
    settings measured on the GPU at the benchmark's prefill shapes (`python -m benchmarks kda`;
    figures in BENCHMARKS.md); the comments say why each one wins."""
    # launch 2's key tile: 16 at 1 warp (32 keys at 1 warp spill offline)
    block_k_inter: int = 16
    block_v_state: int | None = None   # None: `_pick_block_v`
    # 128: q, G and A are read once per chunk instead of once per V tile
    block_v_out: int = 128
    # Few warps: a 16x16 dot's accumulator is replicated on every warp past the first two, so
    # at 4 warps each warp redoes the whole inverse and its layout conversions (offline sm_90
    # SASS of launch 2). FLA's autotuner picks 1 warp for its matching kernels too.
    # None: 1 for the key-tiled launch (faster than 2 or 4), 4 for the whole-row one (its
    # measured setting; 1, 2 and 8 were slower there)
    num_warps_diag: int | None = None
    # launch 2, fused or split: 1 warp with 16-key tiles beat 2 warps with 32 keys, 4 and 8 warps
    num_warps_inter: int = 1
    num_warps_wu: int = 4
    num_warps_state: int = 4
    num_stages_state: int = 2
    num_warps_out: int = 4
    # two-level scan over this many runs of chunks; 0 = `auto_scan_groups` by shape (faster than
    # the sequential scan on long single sequences)
    scan_groups: int = 0
    # launch 2 as two: off-diagonal blocks (L stored in fp32), then the inverse (its own warps).
    # With an unrolled key loop the fused launch spilled on sm_90 and the split was faster; with
    # the pipelined device loop the fused one is faster again.
    split_inverse: bool = False
    # the split launch's inverse only. 8 warps with "ieee" products (2 or 4 warps spill);
    # 4 with "bf16x3" (faster than ieee at 8, and than bf16x3 at 8)
    num_warps_inverse: int = 4
    # the diagonal 16x16 blocks' inverse: "substitution" (15 dependent steps) or "product" (six
    # matmuls per block, no loop, several times faster); see `_invert`.
    diag_inverse: str = "product"
    # the inverse's 16x16 products (launch 2b, or 2 fused) with bf16 operands: "ieee" (fp32 on
    # the CUDA cores, no tensor cores), "bf16x3" (each fp32 factor split into a bf16 high and low
    # part, three tensor-core products: ~16 mantissa bits, far below the bf16 rounding of the
    # finished T) or "tf32" (one tensor-core product, 10 bits; FLA's choice, a little faster
    # and less exact). fp32 operands always take "ieee".
    inverse_precision: str = "bf16x3"
    # Key tiles as device loops, so Triton software-pipelines their loads (q, k, G, h through
    # shared memory with cp.async, num_stages deep) behind the previous tile's products: the
    # unrolled launches were latency-bound at 2 blocks per SM (Nsight Compute), which is what
    # prefetching answers, and every launch got faster as a device loop. Stages and tiles below
    # are the fastest of a sweep; out's 3 stages would need more shared memory than MI300X's
    # 64 KiB of LDS. diag_block_k None: the whole-row diagonal launch (`_diag_kernel`,
    # unrolled); otherwise the key-tiled one (`_diag_kernel_tiled`, always a device loop).
    # num_stages_inter / _wu: 1 keeps their tile loops unrolled, >= 2 makes them device loops.
    # block_k_out None: out's q h product in one piece.
    diag_block_k: int | None = 32
    num_stages_diag: int = 2
    num_stages_inter: int = 3
    num_stages_wu: int = 3
    block_wu: int = 64           # the W/U launch's column tile
    num_stages_out: int = 2
    block_k_out: int | None = 32


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _dot(a, b, prec, trans_a=False, trans_b=False):
    dn = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dn, precision=prec, preferred_element_type=F32)


def _row(x, i, n):
    """Row i (traced or static) of a [n, X] value, as [X] (masked sum: no dynamic value slicing)."""
    r = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(r == i, x, 0.0), axis=0)


def _valid_rows(length, start, n):
    return (start + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)) < length


def _masked(ref, rows, cols, valid, scale=None):
    """ref[rows, cols] in fp32, zero on invalid rows (garbage there may be NaN), times a per-row
    scale (the inverse l2 norm) when given."""
    x = ref[rows, cols].astype(F32)
    if scale is not None:
        x = x * scale[:, None]
    return jnp.where(valid[:, None], x, 0.0)


def _gate_q(q, G, scale):
    """Out's Q operand in fp32, scale Q exp(G), from masked (normalised) q and its G."""
    return q * jnp.exp2(G) * scale


def _gate_w(k, G, beta):
    """W's K operand in fp32, beta K exp(G), from masked (normalised) k and its G."""
    return beta[:, None] * k * jnp.exp2(G)


def _gate_kg(k, G, GC):
    """The state update's K operand in fp32, Kg = K exp(G_C - G) (G_C: G at the chunk's end)."""
    return k * jnp.exp2(GC[None, :] - G)


def _gate_block(g_ref, rows, vm):
    """A sub-block's g, zero past `length` (so G stays flat there), and its in-block cumsum.
    rows: the sub-block's rows (all columns), or a (rows, columns) pair."""
    g = jnp.where(vm, g_ref[rows if isinstance(rows, tuple) else (rows, slice(None))] * LOG2E, 0.0)
    return g, jnp.cumsum(g, axis=0)


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
        kE = _row(k, j, SB)[None, :] * jnp.exp2(jnp.minimum(G - _row(G, j, SB)[None, :], 0.0))
        return (aq + jnp.where(ci == j, jnp.sum(q * kE, axis=1)[:, None], 0.0),
                ak + jnp.where(ci == j, jnp.sum(k * kE, axis=1)[:, None], 0.0))
    return jax.lax.fori_loop(0, SB, col, acc)


def _diag_kernel(len_ref, q_ref, k_ref, g_ref, b_ref, G_ref, aq_ref, ak_ref, rq_ref, rk_ref,
                 *, scale, l2norm, safe_gate, prec_mm):
    n = pl.program_id(0)
    length = len_ref[...]
    K = q_ref.shape[-1]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)
    sub = lambda i: (slice(i * SB, (i + 1) * SB), _valid_rows(length, n * C + i * SB, SB))
    beta_of = lambda rows, valid: jnp.where(valid, b_ref[rows].astype(F32), 0.0)
    carry = jnp.zeros((K,), F32)
    for i in range(NSB):
        rows, valid = sub(i)
        vm = valid[:, None]
        # G: cumulative decay from the chunk's start
        g, cs = _gate_block(g_ref, rows, vm)
        G = cs + carry[None, :]
        # G at the block's first row, from that row's g loaded again (a cached [K] load instead
        # of a masked reduction over the block's rows); zero past `length` like `_gate_block`
        G0 = carry + jnp.where(n * C + i * SB < length, g_ref[i * SB, :] * LOG2E, 0.0)
        carry = carry + jnp.sum(g, axis=0)
        G_ref[rows, :] = G
        q = jnp.where(vm, q_ref[rows, :].astype(F32), 0.0)
        k = jnp.where(vm, k_ref[rows, :].astype(F32), 0.0)
        if l2norm:
            rq = jax.lax.rsqrt(jnp.sum(q * q, axis=1) + 1e-6)
            rk = jax.lax.rsqrt(jnp.sum(k * k, axis=1) + 1e-6)
            q, k = q * rq[:, None], k * rk[:, None]
        else:
            rq = rk = jnp.ones((SB,), F32)
        rq_ref[rows] = rq
        rk_ref[rows] = rk

        def by_matmul(_, q=q, k=k, G=G, G0=G0):
            # exp(G_r - G_j) = exp(G_r - G_0) exp(G_0 - G_j): within fp32 range while the
            # block's decay spans <= MATMUL_SPAN (checked below, or promised by safe_gate)
            ek = k * jnp.exp2(G0[None, :] - G)
            eq = jnp.exp2(G - G0[None, :])
            return (_dot(q * eq, ek, prec_mm, trans_b=True),
                    _dot(k * eq, ek, prec_mm, trans_b=True))

        def exact(_, q=q, k=k, G=G):
            z = jnp.zeros((SB, SB), F32)
            return _exact_blocks(q, k, G, (z, z))

        if safe_gate:
            aq, ak = by_matmul(None)
        else:
            span = jnp.max(G0 - carry)                 # carry is now G at the block's last row
            aq, ak = jax.lax.cond(span <= SPAN2, by_matmul, exact, None)
        beta = beta_of(rows, valid)
        aq_ref[rows, :] = jnp.where(ri >= ci, aq * scale, 0.0)
        ak_ref[rows, :] = jnp.where(ri > ci, ak * beta[:, None], 0.0)


def _diag_kernel_tiled(len_ref, q_ref, k_ref, g_ref, b_ref, G_ref, aq_ref, ak_ref, rq_ref,
                       rk_ref, *, scale, l2norm, safe_gate, prec_mm, block_k):
    """`_diag_kernel` with the key dimension as a device loop over tiles of `block_k` columns
    (ChunkConfig.diag_block_k), the four sub-blocks inside each tile. The decay's cumsum runs down
    each column, so a tile needs nothing from the others; the products are formed on the raw
    (masked) q and k and the l2 norms scale the 16x16 results after (A_rj = rq_r rk_j sum_k ...).
    Only one tile's operands are live (no full-width [16, K] dot operand, which each warp holds
    whole), and with num_stages_diag >= 2 Triton pipelines the next tile's loads behind this
    tile's math. The span check takes the maximum over the tiles; a sub-block past it is redone
    by the exact path, tile by tile from the refs."""
    n = pl.program_id(0)
    length = len_ref[...]
    K = q_ref.shape[-1]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)
    z = jnp.zeros((SB, SB), F32)
    rows = [slice(i * SB, (i + 1) * SB) for i in range(NSB)]
    valid = [_valid_rows(length, n * C + i * SB, SB) for i in range(NSB)]

    def tile(t, acc):
        cols = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
        aq, ak, ssq_q, ssq_k, span = (list(a) for a in acc)
        carry = jnp.zeros((block_k,), F32)
        for i in range(NSB):
            vm = valid[i][:, None]
            g, cs = _gate_block(g_ref, (rows[i], cols), vm)
            G = cs + carry[None, :]
            G0 = carry + jnp.where(n * C + i * SB < length, g_ref[i * SB, cols] * LOG2E, 0.0)
            carry = carry + jnp.sum(g, axis=0)
            G_ref[rows[i], cols] = G
            q = jnp.where(vm, q_ref[rows[i], cols].astype(F32), 0.0)
            k = jnp.where(vm, k_ref[rows[i], cols].astype(F32), 0.0)
            ssq_q[i] = ssq_q[i] + jnp.sum(q * q, axis=1)
            ssq_k[i] = ssq_k[i] + jnp.sum(k * k, axis=1)
            eq = jnp.exp2(G - G0[None, :])              # as in `_diag_kernel`'s by_matmul
            ek = k * jnp.exp2(G0[None, :] - G)
            aq[i] = aq[i] + _dot(q * eq, ek, prec_mm, trans_b=True)
            ak[i] = ak[i] + _dot(k * eq, ek, prec_mm, trans_b=True)
            if not safe_gate:
                span[i] = jnp.maximum(span[i], jnp.max(G0 - carry))
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
                    cols = slice(t * block_k, (t + 1) * block_k)
                    # only differences G_r - G_j within the sub-block enter, so its own cumsum
                    # serves (the rows before it would cancel)
                    _, cs = _gate_block(g_ref, (rows[i], cols), vm)
                    q = jnp.where(vm, q_ref[rows[i], cols].astype(F32), 0.0) * rq[:, None]
                    k = jnp.where(vm, k_ref[rows[i], cols].astype(F32), 0.0) * rk[:, None]
                    acc = _exact_blocks(q, k, cs, acc)
                return acc
            aqi, aki = jax.lax.cond(span[i] <= SPAN2, lambda _, a=(aqi, aki): a, exact, None)
        beta = jnp.where(valid[i], b_ref[rows[i]].astype(F32), 0.0)
        aq_ref[rows[i], :] = jnp.where(ri >= ci, aqi * scale, 0.0)
        ak_ref[rows[i], :] = jnp.where(ri > ci, aki * beta[:, None], 0.0)


# ----------------------------------------------------------------------------------------------
# 2. off-diagonal blocks + fp32 inverse
# ----------------------------------------------------------------------------------------------
def _offdiag_blocks(n, length, q_ref, k_ref, G_ref, rq_ref, rk_ref, block_k, prec_mm, device_loop):
    """The off-diagonal 16x16 blocks (i > j) of Q K^T and K K^T with decay, fp32, looping over
    key tiles: dicts (i, j) -> [SB, SB]; and the sub-blocks' valid-row masks. `device_loop`:
    the key tiles as a device loop, whose loads Triton software-pipelines through shared memory
    when the launch has num_stages >= 2; else unrolled."""
    K = q_ref.shape[-1]
    valid = [_valid_rows(length, n * C + i * SB, SB) for i in range(NSB)]
    rows = [slice(i * SB, (i + 1) * SB) for i in range(NSB)]
    rq = [rq_ref[r] for r in rows]
    rk = [rk_ref[r] for r in rows]
    pairs = [(i, j) for i in range(1, NSB) for j in range(i)]
    z = jnp.zeros((SB, SB), F32)

    def tile(kt, acc):
        cols = (slice(kt * block_k, (kt + 1) * block_k) if isinstance(kt, int)
                else pl.ds(pl.multiple_of(kt * block_k, block_k), block_k))
        Aq, Ak = dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1]))
        ks = [_masked(k_ref, rows[i], cols, valid[i], rk[i]) for i in range(NSB)]
        Gs = [G_ref[rows[i], cols] for i in range(NSB)]
        for i in range(1, NSB):
            gn = G_ref[i * SB, cols][None, :]         # G at block i's first row
            e = jnp.exp2(Gs[i] - gn)                   # <= 1
            qe = _masked(q_ref, rows[i], cols, valid[i], rq[i]) * e
            ke = ks[i] * e
            for j in range(i):
                kt_j = ks[j] * jnp.exp2(gn - Gs[j])    # <= 1
                Aq[i, j] = Aq[i, j] + _dot(qe, kt_j, prec_mm, trans_b=True)
                Ak[i, j] = Ak[i, j] + _dot(ke, kt_j, prec_mm, trans_b=True)
        return [Aq[ij] for ij in pairs], [Ak[ij] for ij in pairs]

    if device_loop:
        acc = jax.lax.fori_loop(0, K // block_k, tile, ([z] * len(pairs), [z] * len(pairs)))
    else:
        acc = ([z] * len(pairs), [z] * len(pairs))
        for kt in range(K // block_k):
            acc = tile(kt, acc)
    return dict(zip(pairs, acc[0])), dict(zip(pairs, acc[1])), valid


def _dot_bf16x3(a, b):
    """a @ b for fp32 a, b on bf16 tensor cores: hi*hi + hi*lo + lo*hi, fp32 accumulation. The
    dropped lo*lo term and the low parts' own rounding leave ~16 mantissa bits: far below the
    bf16 rounding of the finished T, far above fp32's 24."""
    bf = jnp.bfloat16
    ah, bh = a.astype(bf), b.astype(bf)
    al, bl = (a - ah.astype(F32)).astype(bf), (b - bh.astype(F32)).astype(bf)
    return _dot(ah, bl, None) + _dot(al, bh, None) + _dot(ah, bh, None)


INVERSE_DOTS = {
    "ieee": lambda a, b: _dot(a, b, HIGHEST),
    "tf32": lambda a, b: _dot(a, b, jax.lax.Precision.DEFAULT),
    "bf16x3": _dot_bf16x3,
}


def _invert(L, akd_ref, diag_inverse="substitution", precision="ieee"):
    """T = (I + L)^-1 in fp32 from L's off-diagonal blocks (dict (i, j) -> [SB, SB], i > j) and
    its diagonal blocks (akd_ref [C, SB], strictly lower), block substitution for the
    off-diagonal part. The four diagonal blocks D (nilpotent: D^16 = 0):
      "substitution": forward substitution, 15 dependent steps (the chains of the four blocks
        interleave), each reading one row of D from memory;
      "product": (I + D)^-1 = (I - D)(I + D^2)(I + D^4)(I + D^8), six 16x16 fp32 matmuls per
        block, no loop and no loads after the first.
    `precision`: how the 16x16 products are computed (ChunkConfig.inverse_precision).
    """
    if precision not in INVERSE_DOTS:
        raise ValueError(f"inverse_precision={precision!r}: one of {sorted(INVERSE_DOTS)}")
    mm = INVERSE_DOTS[precision]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    rvec = jax.lax.broadcasted_iota(jnp.int32, (SB,), 0)
    eye = (ri == jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)).astype(F32)

    if diag_inverse == "product":
        T = {}
        for i in range(NSB):
            D = akd_ref[i * SB:(i + 1) * SB, :].astype(F32)
            P, X = eye - D, D
            for _ in range(3):
                X = mm(X, X)                             # D^2, D^4, D^8
                P = mm(P, eye + X)
            T[i, i] = P
    elif diag_inverse == "substitution":
        def fsub(r, Ts):
            out = []
            for i, Ti in enumerate(Ts):
                lr = akd_ref[i * SB + r, :]                  # L[r, :], zero at columns >= r
                new = (rvec == r).astype(F32) - jnp.sum(lr[:, None] * Ti, axis=0)
                out.append(jnp.where(ri == r, new[None, :], Ti))
            return tuple(out)
        T = dict(zip([(i, i) for i in range(NSB)], jax.lax.fori_loop(1, SB, fsub, (eye,) * NSB)))
    else:
        raise ValueError(f"diag_inverse={diag_inverse!r}: 'substitution' or 'product'")
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


def _store_a_get_l(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, a_ref, *, scale,
                   block_k, prec_mm, device_loop):
    """Launch 2's shared first half: stores A (scaled Q K^T blocks, diagonal from aqd_ref) and
    returns L's off-diagonal blocks (beta-scaled K K^T), fp32."""
    Aq, Ak, valid = _offdiag_blocks(pl.program_id(0), len_ref[...], q_ref, k_ref, G_ref, rq_ref,
                                    rk_ref, block_k, prec_mm, device_loop)
    beta = [jnp.where(valid[i], b_ref[i * SB:(i + 1) * SB].astype(F32), 0.0) for i in range(NSB)]
    _store_lower(a_ref, {ij: x * scale for ij, x in Aq.items()}, diag=aqd_ref)
    return {ij: Ak[ij] * beta[ij[0]][:, None] for ij in Ak}


def _inter_kernel(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, akd_ref,
                  a_ref, t_ref, *, scale, block_k, op_dtype, prec_mm, diag_inverse, inv_prec,
                  device_loop):
    L = _store_a_get_l(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, a_ref,
                       scale=scale, block_k=block_k, prec_mm=prec_mm, device_loop=device_loop)
    _store_lower(t_ref, _invert(L, akd_ref, diag_inverse, inv_prec))


def _offdiag_kernel(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, a_ref, l_ref, *,
                    scale, block_k, prec_mm, device_loop):
    """Launch 2a of the split variant: A (as `_inter_kernel` stores it) and L's off-diagonal
    blocks in fp32 (the inverse reads them back in launch 2b)."""
    L = _store_a_get_l(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, a_ref,
                       scale=scale, block_k=block_k, prec_mm=prec_mm, device_loop=device_loop)
    _store_lower(l_ref, {**L, **{(i, i): jnp.zeros((SB, SB), F32) for i in range(NSB)}})


def _inverse_kernel(l_ref, akd_ref, t_ref, *, diag_inverse, inv_prec):
    """Launch 2b of the split variant: T from L (off-diagonal blocks, fp32) and its diagonal."""
    L = {(i, j): l_ref[i * SB:(i + 1) * SB, j * SB:(j + 1) * SB] for i in range(1, NSB) for j in range(i)}
    _store_lower(t_ref, _invert(L, akd_ref, diag_inverse, inv_prec))


# ----------------------------------------------------------------------------------------------
# 3. W, U, Kg, exp(G_C)
# ----------------------------------------------------------------------------------------------
def _wu_kernel(len_ref, k_ref, v_ref, G_ref, b_ref, rk_ref, t_ref, w_ref, u_ref, kg_ref, ec_ref, *,
               op_dtype, prec_mm, tile, device_loop):
    """W = T (beta K exp G), U = T (beta V), Kg = K exp(G_C - G), exp(G_C), in column tiles of
    `tile`; `device_loop`: the tiles as device loops (pipelined loads with num_stages >= 2)."""
    n = pl.program_id(0)
    valid = _valid_rows(len_ref[...], n * C, C)
    K, V = w_ref.shape[-1], v_ref.shape[-1]
    T = t_ref[...]
    beta = jnp.where(valid, b_ref[...].astype(F32), 0.0)
    rk = rk_ref[...]

    def cols_of(ct, width):
        if isinstance(ct, int):
            return slice(ct * width, (ct + 1) * width)
        return pl.ds(pl.multiple_of(ct * width, width), width)

    def k_tile(ct, _):
        cols = cols_of(ct, tile_k)
        k = _masked(k_ref, slice(None), cols, valid, rk)
        G = G_ref[:, cols]
        GC = G_ref[C - 1, cols]                       # decay to the chunk's end (g masked: flat)
        w_ref[:, cols] = _dot(T, _gate_w(k, G, beta).astype(op_dtype), prec_mm).astype(w_ref.dtype)
        kg_ref[:, cols] = _gate_kg(k, G, GC).astype(kg_ref.dtype)
        ec_ref[cols] = jnp.exp2(GC)
        return _

    def v_tile(ct, _):
        cols = cols_of(ct, tile_v)
        v = _masked(v_ref, slice(None), cols, valid)
        u_ref[:, cols] = _dot(T, (beta[:, None] * v).astype(op_dtype), prec_mm).astype(u_ref.dtype)
        return _

    tile_k, tile_v = min(tile, K), min(tile, V)
    for body, width, total in ((k_tile, tile_k, K), (v_tile, tile_v, V)):
        if device_loop:
            jax.lax.fori_loop(0, total // width, body, 0)
        else:
            for ct in range(total // width):
                body(ct, 0)


# ----------------------------------------------------------------------------------------------
# 4. sequential state scan
# ----------------------------------------------------------------------------------------------
def _state_kernel(*refs, n_chunks, transition, store, op_dtype, prec_mm):
    """S <- exp(G_C) S + Kg^T (U - W S) over `n_chunks` chunks, fp32 S in registers; with `store`
    the state entering each chunk and V' = U - W S are written. `transition`: U = 0 and S starts
    as the identity's column tile, so the result is the chunks' product map (two-level scan)."""
    if transition:
        w_ref, kg_ref, ec_ref, *outs = refs
        u_ref = h0_ref = None
    else:
        w_ref, u_ref, kg_ref, ec_ref, h0_ref, *outs = refs
    h_ref, vn_ref, ht_ref = outs if store else (None, None, outs[0])
    K = w_ref.shape[-1]
    bv = ht_ref.shape[-1]

    def body(n, S):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        Sd = S.astype(op_dtype)
        if store:
            h_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = Sd.astype(h_ref.dtype)
        vn = -_dot(w_ref[rows, :], Sd, prec_mm)
        if u_ref is not None:
            vn = vn + u_ref[rows, :].astype(F32)
        vnd = vn.astype(op_dtype)
        if store:
            vn_ref[rows, :] = vnd.astype(vn_ref.dtype)
        return S * ec_ref[n, :][:, None] + _dot(kg_ref[rows, :], vnd, prec_mm, trans_a=True)

    if transition:
        r = jax.lax.broadcasted_iota(jnp.int32, (K, bv), 0)
        c = jax.lax.broadcasted_iota(jnp.int32, (K, bv), 1) + pl.program_id(2) * bv
        S0 = (r == c).astype(F32)
    else:
        S0 = h0_ref[...].astype(F32)
    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, body, S0)


# ----------------------------------------------------------------------------------------------
# 5. output
# ----------------------------------------------------------------------------------------------
def _out_kernel(len_ref, q_ref, G_ref, rq_ref, a_ref, h_ref, vn_ref, o_ref, *, scale, op_dtype,
                prec_mm, block_k):
    """o = (scale q exp G) h + A vn; with `block_k` the first product as a device loop over key
    tiles (pipelined loads with num_stages >= 2), else one product over all keys."""
    n = pl.program_id(0)
    valid = _valid_rows(len_ref[...], n * C, C)
    rq = rq_ref[...]
    K = q_ref.shape[-1]
    o = _dot(a_ref[...], vn_ref[...], prec_mm)
    if block_k is None:
        q = _masked(q_ref, slice(None), slice(None), valid, rq)
        o = o + _dot(_gate_q(q, G_ref[...], scale).astype(op_dtype), h_ref[...], prec_mm)
    else:
        def tile(t, o):
            cols = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
            q = _masked(q_ref, slice(None), cols, valid, rq)
            qg = _gate_q(q, G_ref[:, cols], scale).astype(op_dtype)
            return o + _dot(qg, h_ref[cols, :], prec_mm)
        o = jax.lax.fori_loop(0, K // block_k, tile, o)
    o_ref[...] = jnp.where(valid[:, None], o, 0.0).astype(o_ref.dtype)


def _pick_block_v(B, H, V, n_sm=None):
    """The scan's value-column tile. Each V tile re-reads the chunk's W and Kg, so the scan is
    bound by those bytes: 64 columns beat 32 even with fewer programs than SMs, and beat 128
    columns at 8 warps. Narrower tiles only where 64-column ones would leave more than half the SMs idle (not timed)."""
    n_sm = n_sm or num_sms()
    for bv in (64, 32, 16):
        if V % bv == 0 and (B * H * (V // bv) >= n_sm // 2 or bv == 16):
            return bv
    return V


def _launch_diag(lens, q, k, g, beta, *, scale, l2norm, safe_gate, op_dtype, prec_mm, cfg,
                 interpret):
    """-> G, Aqk and L diagonal blocks, rq, rk."""
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    out_specs = [tok(K), per(SB), per(SB), vec, vec]
    out_shape = [sds((B, Tp, H, K), F32), sds((B, H, Tp, SB), F32), sds((B, H, Tp, SB), F32),
                 sds((B, H, Tp), F32), sds((B, H, Tp), F32)]
    if cfg.diag_block_k is not None:   # checked by `resolve_config`
        kernel = functools.partial(_diag_kernel_tiled, block_k=cfg.diag_block_k)
    else:
        kernel = _diag_kernel
    return pl.pallas_call(
        functools.partial(kernel, scale=scale, l2norm=l2norm, safe_gate=safe_gate,
                          prec_mm=prec_mm),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec],
        out_specs=out_specs,
        out_shape=tuple(out_shape),
        compiler_params=triton_params(num_warps=cfg.num_warps_diag, num_stages=cfg.num_stages_diag),
        interpret=interpret, name="kda_chunk_diag",
    )(lens, q, k, g, beta)


def _chunk_specs():
    tok = lambda X: pl.BlockSpec((None, C, None, X), lambda n, b, h: (b, n, h, 0))
    per = lambda X: pl.BlockSpec((None, None, C, X), lambda n, b, h: (b, h, n, 0))
    vec = pl.BlockSpec((None, None, C), lambda n, b, h: (b, h, n))
    beta = pl.BlockSpec((None, C, None), lambda n, b, h: (b, n, h))
    length = pl.BlockSpec((None,), lambda n, b, h: (b,))
    return tok, per, vec, beta, length


def _chunk_row_spec(X):
    """One row per chunk of a [B, H, N, X] array (exp(G_C)), grid (chunk, b, h)."""
    return pl.BlockSpec((None, None, None, X), lambda n, b, h: (b, h, n, 0))


def _launch_inter(lens, q, k, G, beta, rq, rk, aqd, akd, *, scale, op_dtype, prec_mm, cfg,
                  interpret):
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_inter_kernel, scale=scale, block_k=cfg.block_k_inter,
                          op_dtype=op_dtype, prec_mm=prec_mm, diag_inverse=cfg.diag_inverse,
                          inv_prec=_inverse_precision(cfg, op_dtype),
                          device_loop=cfg.num_stages_inter >= 2),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec, vec, vec, per(SB), per(SB)],
        out_specs=[per(C), per(C)],
        out_shape=(sds((B, H, Tp, C), op_dtype), sds((B, H, Tp, C), op_dtype)),
        compiler_params=triton_params(num_warps=cfg.num_warps_inter, num_stages=cfg.num_stages_inter),
        interpret=interpret, name="kda_chunk_inter",
    )(lens, q, k, G, beta, rq, rk, aqd, akd)


def _launch_offdiag(lens, q, k, G, beta, rq, rk, aqd, *, scale, op_dtype, prec_mm, cfg, interpret):
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_offdiag_kernel, scale=scale, block_k=cfg.block_k_inter, prec_mm=prec_mm,
                          device_loop=cfg.num_stages_inter >= 2),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec, vec, vec, per(SB)],
        out_specs=[per(C), per(C)],
        out_shape=(sds((B, H, Tp, C), op_dtype), sds((B, H, Tp, C), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_inter, num_stages=cfg.num_stages_inter),
        interpret=interpret, name="kda_chunk_offdiag",
    )(lens, q, k, G, beta, rq, rk, aqd)


def _launch_inverse(L, akd, *, op_dtype, cfg, interpret):
    B, H, Tp, _ = L.shape
    _, per, _, _, _ = _chunk_specs()
    return pl.pallas_call(
        functools.partial(_inverse_kernel, diag_inverse=cfg.diag_inverse,
                          inv_prec=_inverse_precision(cfg, op_dtype)),
        grid=(Tp // C, B, H),
        in_specs=[per(C), per(SB)],
        out_specs=per(C),
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, C), op_dtype),
        compiler_params=triton_params(num_warps=cfg.num_warps_inverse, num_stages=1),
        interpret=interpret, name="kda_chunk_inverse",
    )(L, akd)


def _inverse_precision(cfg, op_dtype):
    """fp32 operands keep the fp32 inverse; bf16 ones take the configured products."""
    if cfg.inverse_precision not in INVERSE_DOTS:
        raise ValueError(f"inverse_precision={cfg.inverse_precision!r}: one of "
                         f"{sorted(INVERSE_DOTS)}")
    return "ieee" if op_dtype == F32 else cfg.inverse_precision


def _launch_wu(lens, v, beta, Tinv, k, G, rk, *, op_dtype, prec_mm, cfg, interpret):
    """-> w, u, kg [B, H, Tp, .] (operand dtype) and ec [B, H, N, K]."""
    B, Tp, H, V = v.shape
    K, N = k.shape[-1], Tp // C
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_wu_kernel, op_dtype=op_dtype, prec_mm=prec_mm, tile=cfg.block_wu,
                          device_loop=cfg.num_stages_wu >= 2),
        grid=(N, B, H),
        in_specs=[length, tok(K), tok(V), tok(K), beta_spec, vec, per(C)],
        out_specs=[per(K), per(V), per(K), _chunk_row_spec(K)],
        out_shape=(sds((B, H, Tp, K), op_dtype), sds((B, H, Tp, V), op_dtype),
                   sds((B, H, Tp, K), op_dtype), sds((B, H, N, K), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_wu, num_stages=cfg.num_stages_wu),
        interpret=interpret, name="kda_chunk_wu",
    )(lens, k, v, G, beta, rk, Tinv)


def _launch_state(w, u, kg, ec, h0, *, groups=1, transition=False, store=True, op_dtype,
                  prec_mm, cfg, interpret):
    """The scan over each of `groups` equal runs of chunks in parallel (program p = b * groups +
    group). Inputs [B, H, Tp, .] and ec [B, H, N, K]; h0 [B * groups, H, K, V] (absent with
    `transition`). Returns (h, vn, final states) or (final states,) without `store`."""
    B, H, Tp, K = w.shape
    N = Tp // C
    per = N // groups
    V = K if transition else u.shape[-1]
    bv = _pick_block_v(B * groups, H, V) if cfg.block_v_state is None else cfg.block_v_state
    run = lambda cols, X: pl.BlockSpec((None, None, cols, X),
                                       lambda p, h, j: (p // groups, h, p % groups, 0))
    run_tile = lambda rows: pl.BlockSpec((None, None, rows, bv),
                                         lambda p, h, j: (p // groups, h, p % groups, j))
    own = lambda rows: pl.BlockSpec((None, None, rows, bv), lambda p, h, j: (p, h, 0, j))
    sds = jax.ShapeDtypeStruct
    in_specs = [run(per * C, K)] + ([] if transition else [run_tile(per * C)]) + [
        run(per * C, K), run(per, K)] + ([] if transition else [own(K)])
    args = (w, kg, ec) if transition else (w, u, kg, ec, h0)
    out_specs = ([own(per * K), own(per * C)] if store else []) + [own(K)]
    out_shape = ([sds((B * groups, H, per * K, V), op_dtype),
                  sds((B * groups, H, per * C, V), op_dtype)] if store else []) + [
        sds((B * groups, H, K, V), F32)]
    return pl.pallas_call(
        functools.partial(_state_kernel, n_chunks=per, transition=transition, store=store,
                          op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(B * groups, H, V // bv),
        in_specs=in_specs, out_specs=out_specs, out_shape=tuple(out_shape),
        compiler_params=triton_params(num_warps=cfg.num_warps_state,
                                      num_stages=cfg.num_stages_state),
        interpret=interpret, name="kda_chunk_state",
    )(*args)


def _group_starts(P, Q, h0, groups):
    """Two-level scan, middle step: the state entering each group from the groups' maps
    S -> P_g S + Q_g (P [B*G, H, K, K], Q [B*G, H, K, V]), in fp32 plain JAX: a short
    sequential loop of batched matmuls. -> starts [B*G, H, K, V], final state [B, H, K, V]."""
    BG, H, K, V = Q.shape
    B = BG // groups
    P = P.reshape(B, groups, H, K, K).swapaxes(0, 1)
    Q = Q.reshape(B, groups, H, K, V).swapaxes(0, 1)

    def step(S, pq):
        Pg, Qg = pq
        return jnp.einsum("bhkl,bhlv->bhkv", Pg, S, precision=HIGHEST) + Qg, S
    # unrolled (up to 16 steps at a time): straight-line batched matmuls instead of a device
    # while loop, whose predicate XLA copies back every step (memcpy32_post in the profile); a
    # small gain. The cap keeps a large user-set scan_groups from unrolling hundreds of steps.
    final, starts = jax.lax.scan(step, h0, (P, Q), unroll=min(groups, 16))
    return starts.swapaxes(0, 1).reshape(BG, H, K, V), final


def auto_scan_groups(B, H, V, n_chunks, n_sm=None, min_chunks=8):
    """Groups for the two-level scan when B * H sequential programs leave the GPU idle: the
    smallest power of two that gives >= 2 programs per SM (32 value columns a program), keeping
    >= `min_chunks` chunks a group; 1 (plain sequential scan) when the batch fills the GPU.
    A cost model, timed at one shape (BENCHMARKS.md). n_sm: the device's SM count."""
    n_sm = n_sm or num_sms()
    groups = 1
    while (B * H * groups * max(V // 32, 1) < 2 * n_sm
           and n_chunks // (groups * 2) >= min_chunks):
        groups *= 2
    return groups


def _launch_out(lens, A, h, vn, q, G, rq, *, groups, scale, out_dtype, op_dtype, prec_mm, cfg,
                interpret):
    """h, vn come from the scan in its layout: [B * groups, H, chunks per group * (K | C), V]."""
    B, H, Tp, _ = A.shape
    K, V, N = q.shape[-1], vn.shape[-1], Tp // C
    per = N // groups
    hist = lambda n, b, h, j: (b * groups + n // per, h, n % per, j)
    bvo = min(cfg.block_v_out, V)
    spec = lambda shape, idx: pl.BlockSpec(shape, idx)
    chunk = lambda X: spec((None, None, C, X), lambda n, b, h, j: (b, h, n, 0))
    tok = spec((None, C, None, K), lambda n, b, h, j: (b, n, h, 0))
    q_specs = [tok, tok, spec((None, None, C), lambda n, b, h, j: (b, h, n))]
    return pl.pallas_call(
        functools.partial(_out_kernel, scale=scale, op_dtype=op_dtype, prec_mm=prec_mm,
                          block_k=cfg.block_k_out),
        grid=(N, B, H, V // bvo),
        in_specs=[spec((None,), lambda n, b, h, j: (b,))] + q_specs + [
            chunk(C), spec((None, None, K, bvo), hist), spec((None, None, C, bvo), hist)],
        out_specs=spec((None, C, None, bvo), lambda n, b, h, j: (b, n, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype),
        compiler_params=triton_params(num_warps=cfg.num_warps_out, num_stages=cfg.num_stages_out),
        interpret=interpret, name="kda_chunk_out",
    )(lens, q, G, rq, A, h, vn)


def resolve_config(config: ChunkConfig, K: int, V: int) -> ChunkConfig:
    """The config the launches run with for heads of K keys and V values: tiles no wider than
    the head, num_warps_diag resolved by the diagonal launch's form; refuses tiles that do not
    divide the head or are narrower than 16 (Triton's smallest dot)."""
    tiled = config.diag_block_k is not None
    cfg = dataclasses.replace(
        config, block_k_inter=min(config.block_k_inter, K),
        block_k_out=None if config.block_k_out is None else min(config.block_k_out, K),
        diag_block_k=min(config.diag_block_k, K) if tiled else None,
        num_warps_diag=config.num_warps_diag or (1 if tiled else 4))
    tiles = {"block_k_inter": (cfg.block_k_inter, K), "block_v_out": (min(cfg.block_v_out, V), V),
             "block_wu": (min(cfg.block_wu, K), K), "block_wu ": (min(cfg.block_wu, V), V)}
    if cfg.block_k_out is not None:
        tiles["block_k_out"] = (cfg.block_k_out, K)
    if tiled:
        tiles["diag_block_k"] = (cfg.diag_block_k, K)
    bad = [f"{name.strip()}={t} (head {n})" for name, (t, n) in tiles.items()
           if t < 16 or n % t]
    if bad:
        raise ValueError(f"ChunkConfig tiles {', '.join(bad)}: each must divide the head's "
                         "K / V and be >= 16")
    return cfg


def chunk_stages(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                 use_qk_l2norm=False, interpret=False, safe_gate=False,
                 config: ChunkConfig = ChunkConfig()):
    """The forward as a list of (name, jitted stage, stage inputs -> outputs), run in order.

    `kda_chunk_pallas` is exactly these stages composed; benchmarks time them one by one.
    Returns (stages, final (o, state)) where each stage entry is (name, fn, args)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not (_is_pow2(K) and _is_pow2(V) and K >= 16 and V >= 16):
        raise ValueError(f"K={K} and V={V} must be powers of two >= 16")
    cfg = resolve_config(config, K, V)
    scale = float(K ** -0.5 if scale is None else scale)
    out_dtype = v.dtype
    op_dtype = F32 if q.dtype == F32 else jnp.bfloat16
    common = dict(prec_mm=HIGHEST if op_dtype == F32 else None, cfg=cfg, interpret=interpret)
    h0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    N = -(-T // C)
    if N == 0:
        return [], (jnp.zeros((B, 0, H, V), out_dtype), h0)
    groups = (auto_scan_groups(B, H, V, N) if cfg.scan_groups == 0
              else max(1, min(cfg.scan_groups, N)))
    N = -(-N // groups) * groups     # equal runs of chunks; padded chunks are masked (identity)
    Tp = N * C
    lens = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.minimum(
        jnp.asarray(lengths, jnp.int32), T)

    def prepare(q, k, v, g, beta):
        g = g.astype(F32)
        if Tp != T:  # keep every block in bounds; the padded rows are masked in-kernel
            pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
            q, k, v, g, beta = map(pad, (q, k, v, g, beta))
        return q, k, v, g, beta

    stages = []

    def run(name, fn, *args):
        stages.append((name, fn, args))
        return fn(*args)

    j = lambda f, **kw: jax.jit(functools.partial(f, **kw))
    q, k, v, g, beta = run("pad", jax.jit(prepare), q, k, v, g, beta)
    G, aqd, akd, rq, rk = run("diag", j(_launch_diag, scale=scale, l2norm=use_qk_l2norm,
                                                safe_gate=safe_gate, op_dtype=op_dtype, **common),
                                      lens, q, k, g, beta)
    if cfg.split_inverse:  # off-diagonal blocks, then the inverse, as two launches
        A, L = run("offdiag", j(_launch_offdiag, scale=scale, op_dtype=op_dtype, **common),
                   lens, q, k, G, beta, rq, rk, aqd)
        Tinv = run("inverse", j(_launch_inverse, op_dtype=op_dtype, cfg=cfg, interpret=interpret),
                   L, akd)
    else:
        A, Tinv = run("inter", j(_launch_inter, scale=scale, op_dtype=op_dtype, **common),
                      lens, q, k, G, beta, rq, rk, aqd, akd)
    w, u, kg, ec = run("wu", j(_launch_wu, op_dtype=op_dtype, **common),
                       lens, v, beta, Tinv, k, G, rk)
    state = lambda **kw: j(_launch_state, op_dtype=op_dtype, groups=groups, **kw, **common)
    if groups == 1:
        h, vn, ht = run("state", state(), w, u, kg, ec, h0)
    else:  # two-level: each group's map in parallel, the short scan over groups, parallel replay
        (P,) = run("state_maps_P", state(transition=True, store=False), w, None, kg, ec, None)
        (Q,) = run("state_maps_Q", state(store=False), w, u, kg, ec,
                   jnp.zeros((B * groups, H, K, V), F32))
        starts, ht = run("group_scan", jax.jit(functools.partial(_group_starts, groups=groups)),
                         P, Q, h0)
        h, vn, _ = run("state_replay", state(), w, u, kg, ec, starts)
    o = run("out", j(_launch_out, groups=groups, scale=scale, out_dtype=out_dtype,
                     op_dtype=op_dtype, **common), lens, A, h, vn,
            q, G, rq)
    if Tp != T:
        o = o[:, :T]
    return stages, (o, ht)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "safe_gate",
                                             "config"))
def kda_chunk_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                     use_qk_l2norm=False, interpret=False, safe_gate=False,
                     config: ChunkConfig = ChunkConfig()):
    """Chunked KDA forward. q,k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] (fp32 log-decay), beta
    [B,T,H], initial_state [B,H,K,V] fp32, lengths [B] (valid prefix per row) ->
    (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] fp32)."""
    return chunk_stages(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        lengths=lengths, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                        safe_gate=safe_gate, config=config)[1]
