"""Chunked KDA prefill in Pallas (Triton lowering: CUDA and ROCm). Reference: reference.py.

Chunks of C = 64 tokens, sub-blocks of 16. Five launches, each small enough to stay in registers:
  1. `_diag_kernel`   (chunk, b, h): G, the in-chunk cumulative log-decay (g past `lengths` is
     zeroed so G stays flat there); the 16x16 diagonal blocks of Aqk (incl. diagonal) and of
     L = beta * K K^T (strictly lower, with decay), fp32; the rows' inverse l2 norms. A block
     whose decay spans <= MATMUL_SPAN uses one matmul with G at its first row as reference (both
     factors stay in fp32 range); wider spans take the exact path, one exp per (row, column, key
     dim). `safe_gate=True` (the caller promises g >= -5 per token, K3's bounded gate) skips the
     check.
  2. `_inter_kernel`  (chunk, b, h): the off-diagonal 16x16 blocks (reference: the cumulative decay
     at the first row of the later block, so both factors are <= 1 for any gate), looping over key
     tiles; then T = (I + L)^-1 in fp32 (forward substitution on the diagonal blocks, block
     substitution for the rest) and only the finished T rounded to the operand dtype.
  3. `_wu_kernel`     (chunk, b, h): W = T diag(beta) (K exp G), U = T diag(beta) V,
     Kg = K exp(G_C - G), exp(G_C): 64-row matmuls.
  4. `_state_kernel`  (b, h, V-tile), sequential over chunks with the fp32 state in registers:
     stores the state entering each chunk, V' = U - W S, and S <- exp(G_C) S + Kg^T V'.
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

from .._backend import triton_params

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
C = 64          # chunk
SB = 16         # sub-block
NSB = C // SB   # sub-blocks per chunk
MATMUL_SPAN = 80.0  # a sub-block whose decay spans more than this (natural log) takes the exact path


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters of the five kernels (see module docstring). The defaults are the best of
    the sweep on one H200 (2026-11-29, benchmarks/results_kda.md)."""
    block_k_inter: int = 32
    block_v_state: int | None = None   # None: by occupancy (_pick_block_v)
    block_v_out: int = 64
    num_warps_diag: int = 4
    num_warps_inter: int = 2
    num_warps_wu: int = 4
    num_warps_state: int = 4
    num_stages_state: int = 2
    num_warps_out: int = 4


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


# ----------------------------------------------------------------------------------------------
# 1. diagonal 16x16 blocks
# ----------------------------------------------------------------------------------------------
def _diag_kernel(len_ref, q_ref, k_ref, g_ref, b_ref, G_ref, aq_ref, ak_ref, rq_ref, rk_ref, *,
                 scale, l2norm, safe_gate, prec_mm):
    n = pl.program_id(0)
    length = len_ref[...]
    K = q_ref.shape[-1]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)
    carry = jnp.zeros((K,), F32)
    for i in range(NSB):
        rows = slice(i * SB, (i + 1) * SB)
        valid = _valid_rows(length, n * C + i * SB, SB)
        vm = valid[:, None]
        # G: cumulative decay from the chunk's start (g past `length` is zero: G flat there)
        g = jnp.where(vm, g_ref[rows, :], 0.0)
        G = jnp.cumsum(g, axis=0) + carry[None, :]
        G0 = carry + _row(g, 0, SB)
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
            ek = k * jnp.exp(G0[None, :] - G)
            eq = jnp.exp(G - G0[None, :])
            return (_dot(q * eq, ek, prec_mm, trans_b=True),
                    _dot(k * eq, ek, prec_mm, trans_b=True))

        def exact(_, q=q, k=k, G=G):
            def col(j, acc):
                aq, ak = acc
                E = jnp.exp(jnp.minimum(G - _row(G, j, SB)[None, :], 0.0))  # rows >= j: exact
                kE = _row(k, j, SB)[None, :] * E
                aq = jnp.where(ci == j, jnp.sum(q * kE, axis=1)[:, None], aq)
                ak = jnp.where(ci == j, jnp.sum(k * kE, axis=1)[:, None], ak)
                return aq, ak
            z = jnp.zeros((SB, SB), F32)
            return jax.lax.fori_loop(0, SB, col, (z, z))

        if safe_gate:
            aq, ak = by_matmul(None)
        else:
            span = jnp.max(G0 - carry)                 # carry is now G at the block's last row
            aq, ak = jax.lax.cond(span <= MATMUL_SPAN, by_matmul, exact, None)
        beta = jnp.where(valid, b_ref[rows].astype(F32), 0.0)
        aq_ref[rows, :] = jnp.where(ri >= ci, aq * scale, 0.0)
        ak_ref[rows, :] = jnp.where(ri > ci, ak * beta[:, None], 0.0)


# ----------------------------------------------------------------------------------------------
# 2. off-diagonal blocks + fp32 inverse
# ----------------------------------------------------------------------------------------------
def _inter_kernel(len_ref, q_ref, k_ref, G_ref, b_ref, rq_ref, rk_ref, aqd_ref, akd_ref,
                  a_ref, t_ref, *, scale, block_k, op_dtype, prec_mm):
    n = pl.program_id(0)
    length = len_ref[...]
    K = q_ref.shape[-1]
    ri = jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 0)
    rvec = jax.lax.broadcasted_iota(jnp.int32, (SB,), 0)
    eye = (ri == jax.lax.broadcasted_iota(jnp.int32, (SB, SB), 1)).astype(F32)
    valid = [_valid_rows(length, n * C + i * SB, SB) for i in range(NSB)]
    rows = [slice(i * SB, (i + 1) * SB) for i in range(NSB)]
    rq = [rq_ref[r] for r in rows]
    rk = [rk_ref[r] for r in rows]

    z = jnp.zeros((SB, SB), F32)
    Aq = {(i, j): z for i in range(1, NSB) for j in range(i)}
    Ak = dict(Aq)
    for kt in range(K // block_k):
        cols = slice(kt * block_k, (kt + 1) * block_k)
        ks = [_masked(k_ref, rows[i], cols, valid[i], rk[i]) for i in range(NSB)]
        Gs = [G_ref[rows[i], cols] for i in range(NSB)]
        for i in range(1, NSB):
            gn = G_ref[i * SB, cols][None, :]         # G at block i's first row
            e = jnp.exp(Gs[i] - gn)                   # <= 1
            qe = _masked(q_ref, rows[i], cols, valid[i], rq[i]) * e
            ke = ks[i] * e
            for j in range(i):
                kt_j = ks[j] * jnp.exp(gn - Gs[j])    # <= 1
                Aq[i, j] = Aq[i, j] + _dot(qe, kt_j, prec_mm, trans_b=True)
                Ak[i, j] = Ak[i, j] + _dot(ke, kt_j, prec_mm, trans_b=True)

    beta = [jnp.where(valid[i], b_ref[rows[i]].astype(F32), 0.0) for i in range(NSB)]
    L = {(i, j): Ak[i, j] * beta[i][:, None] for (i, j) in Ak}
    # forward substitution on the four diagonal blocks at once (independent chains interleave)
    def fsub(r, Ts):
        out = []
        for i, Ti in enumerate(Ts):
            lr = akd_ref[i * SB + r, :]                  # L[r, :], zero at columns >= r
            new = (rvec == r).astype(F32) - jnp.sum(lr[:, None] * Ti, axis=0)
            out.append(jnp.where(ri == r, new[None, :], Ti))
        return tuple(out)
    T = dict(zip([(i, i) for i in range(NSB)], jax.lax.fori_loop(1, SB, fsub, (eye,) * NSB)))
    for dlt in range(1, NSB):
        for i in range(dlt, NSB):
            j = i - dlt
            acc = None
            for m in range(j, i):
                t = _dot(L[i, m], T[m, j], HIGHEST)
                acc = t if acc is None else acc + t
            T[i, j] = -_dot(T[i, i], acc, HIGHEST)

    for i in range(NSB):
        for j in range(NSB):
            cols = slice(j * SB, (j + 1) * SB)
            if j < i:
                a, t = Aq[i, j] * scale, T[i, j]
            elif j == i:
                a, t = aqd_ref[rows[i], :], T[i, i]
            else:
                a = t = z
            a_ref[rows[i], cols] = a.astype(a_ref.dtype)
            t_ref[rows[i], cols] = t.astype(t_ref.dtype)


# ----------------------------------------------------------------------------------------------
# 3. W, U, Kg, exp(G_C)
# ----------------------------------------------------------------------------------------------
def _wu_kernel(len_ref, k_ref, v_ref, G_ref, b_ref, rk_ref, t_ref, w_ref, u_ref, kg_ref, ec_ref,
               *, op_dtype, prec_mm):
    n = pl.program_id(0)
    valid = _valid_rows(len_ref[...], n * C, C)
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    T = t_ref[...]
    beta = jnp.where(valid, b_ref[...].astype(F32), 0.0)
    rk = rk_ref[...]
    tile = 64
    for ct in range(max(K // tile, 1)):
        cols = slice(ct * tile, min((ct + 1) * tile, K))
        k = _masked(k_ref, slice(None), cols, valid, rk)
        G = G_ref[:, cols]
        GC = _row(G, C - 1, C)                        # decay to the chunk's end (g masked: flat)
        w_ref[:, cols] = _dot(T, (beta[:, None] * k * jnp.exp(G)).astype(op_dtype),
                              prec_mm).astype(w_ref.dtype)
        kg_ref[:, cols] = (k * jnp.exp(GC[None, :] - G)).astype(kg_ref.dtype)
        ec_ref[cols] = jnp.exp(GC)
    for ct in range(max(V // tile, 1)):
        cols = slice(ct * tile, min((ct + 1) * tile, V))
        v = _masked(v_ref, slice(None), cols, valid)
        u_ref[:, cols] = _dot(T, (beta[:, None] * v).astype(op_dtype), prec_mm).astype(u_ref.dtype)


# ----------------------------------------------------------------------------------------------
# 4. sequential state scan
# ----------------------------------------------------------------------------------------------
def _state_kernel(w_ref, u_ref, kg_ref, ec_ref, h0_ref, h_ref, vn_ref, ht_ref, *,
                  n_chunks, op_dtype, prec_mm):
    K = w_ref.shape[-1]

    def body(n, S):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        Sd = S.astype(op_dtype)
        h_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = Sd.astype(h_ref.dtype)
        vn = u_ref[rows, :].astype(F32) - _dot(w_ref[rows, :], Sd, prec_mm)
        vnd = vn.astype(op_dtype)
        vn_ref[rows, :] = vnd.astype(vn_ref.dtype)
        return S * ec_ref[n, :][:, None] + _dot(kg_ref[rows, :], vnd, prec_mm, trans_a=True)

    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, body, h0_ref[...].astype(F32))


# ----------------------------------------------------------------------------------------------
# 5. output
# ----------------------------------------------------------------------------------------------
def _out_kernel(len_ref, q_ref, G_ref, rq_ref, a_ref, h_ref, vn_ref, o_ref, *,
                scale, op_dtype, prec_mm):
    n = pl.program_id(0)
    valid = _valid_rows(len_ref[...], n * C, C)
    q = _masked(q_ref, slice(None), slice(None), valid, rq_ref[...])
    qg = (q * jnp.exp(G_ref[...]) * scale).astype(op_dtype)
    o = _dot(qg, h_ref[...], prec_mm) + _dot(a_ref[...], vn_ref[...], prec_mm)
    o_ref[...] = jnp.where(valid[:, None], o, 0.0).astype(o_ref.dtype)


def _pick_block_v(B, H, V, n_sm=132):
    for bv in (64, 32, 16):
        if V % bv == 0 and B * H * (V // bv) >= 2 * n_sm:
            return bv
    return 16 if V % 16 == 0 else V


def _launch_diag(lens, q, k, g, beta, *, scale, l2norm, safe_gate, prec_mm, cfg, interpret):
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_diag_kernel, scale=scale, l2norm=l2norm, safe_gate=safe_gate,
                          prec_mm=prec_mm),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec],
        out_specs=[tok(K), per(SB), per(SB), vec, vec],
        out_shape=(sds((B, Tp, H, K), F32), sds((B, H, Tp, SB), F32), sds((B, H, Tp, SB), F32),
                   sds((B, H, Tp), F32), sds((B, H, Tp), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_diag, num_stages=1),
        interpret=interpret, name="kda_chunk_diag",
    )(lens, q, k, g, beta)


def _chunk_specs():
    tok = lambda X: pl.BlockSpec((None, C, None, X), lambda n, b, h: (b, n, h, 0))
    per = lambda X: pl.BlockSpec((None, None, C, X), lambda n, b, h: (b, h, n, 0))
    vec = pl.BlockSpec((None, None, C), lambda n, b, h: (b, h, n))
    beta = pl.BlockSpec((None, C, None), lambda n, b, h: (b, n, h))
    length = pl.BlockSpec((None,), lambda n, b, h: (b,))
    return tok, per, vec, beta, length


def _launch_inter(lens, q, k, G, beta, rq, rk, aqd, akd, *, scale, op_dtype, prec_mm, cfg,
                  interpret):
    B, Tp, H, K = q.shape
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_inter_kernel, scale=scale, block_k=cfg.block_k_inter,
                          op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(Tp // C, B, H),
        in_specs=[length, tok(K), tok(K), tok(K), beta_spec, vec, vec, per(SB), per(SB)],
        out_specs=[per(C), per(C)],
        out_shape=(sds((B, H, Tp, C), op_dtype), sds((B, H, Tp, C), op_dtype)),
        compiler_params=triton_params(num_warps=cfg.num_warps_inter, num_stages=1),
        interpret=interpret, name="kda_chunk_inter",
    )(lens, q, k, G, beta, rq, rk, aqd, akd)


def _launch_wu(lens, k, v, G, beta, rk, Tinv, *, op_dtype, prec_mm, cfg, interpret):
    B, Tp, H, K = k.shape
    V, N = v.shape[-1], Tp // C
    tok, per, vec, beta_spec, length = _chunk_specs()
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_wu_kernel, op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(N, B, H),
        in_specs=[length, tok(K), tok(V), tok(K), beta_spec, vec, per(C)],
        out_specs=[per(K), per(V), per(K),
                   pl.BlockSpec((None, None, None, K), lambda n, b, h: (b, h, n, 0))],
        out_shape=(sds((B, H, Tp, K), op_dtype), sds((B, H, Tp, V), op_dtype),
                   sds((B, H, Tp, K), op_dtype), sds((B, H, N, K), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_wu, num_stages=1),
        interpret=interpret, name="kda_chunk_wu",
    )(lens, k, v, G, beta, rk, Tinv)


def _launch_state(w, u, kg, ec, h0, *, op_dtype, prec_mm, cfg, interpret):
    B, H, Tp, K = w.shape
    V, N = u.shape[-1], Tp // C
    bv = _pick_block_v(B, H, V) if cfg.block_v_state is None else cfg.block_v_state
    full = lambda X: pl.BlockSpec((None, None, Tp, X), lambda b, h, j: (b, h, 0, 0))
    tile = lambda rows: pl.BlockSpec((None, None, rows, bv), lambda b, h, j: (b, h, 0, j))
    sds = jax.ShapeDtypeStruct
    return pl.pallas_call(
        functools.partial(_state_kernel, n_chunks=N, op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(B, H, V // bv),
        in_specs=[full(K), tile(Tp), full(K),
                  pl.BlockSpec((None, None, N, K), lambda b, h, j: (b, h, 0, 0)), tile(K)],
        out_specs=[tile(N * K), tile(Tp), tile(K)],
        out_shape=(sds((B, H, N * K, V), op_dtype), sds((B, H, Tp, V), op_dtype),
                   sds((B, H, K, V), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_state,
                                      num_stages=cfg.num_stages_state),
        interpret=interpret, name="kda_chunk_state",
    )(w, u, kg, ec, h0)


def _launch_out(lens, q, G, rq, A, h, vn, *, scale, out_dtype, op_dtype, prec_mm, cfg,
                interpret):
    B, Tp, H, K = q.shape
    V, N = vn.shape[-1], Tp // C
    bvo = min(cfg.block_v_out, V)
    spec = lambda shape, idx: pl.BlockSpec(shape, idx)
    return pl.pallas_call(
        functools.partial(_out_kernel, scale=scale, op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(N, B, H, V // bvo),
        in_specs=[spec((None,), lambda n, b, h, j: (b,)),
                  spec((None, C, None, K), lambda n, b, h, j: (b, n, h, 0)),
                  spec((None, C, None, K), lambda n, b, h, j: (b, n, h, 0)),
                  spec((None, None, C), lambda n, b, h, j: (b, h, n)),
                  spec((None, None, C, C), lambda n, b, h, j: (b, h, n, 0)),
                  spec((None, None, K, bvo), lambda n, b, h, j: (b, h, n, j)),
                  spec((None, None, C, bvo), lambda n, b, h, j: (b, h, n, j))],
        out_specs=spec((None, C, None, bvo), lambda n, b, h, j: (b, n, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype),
        compiler_params=triton_params(num_warps=cfg.num_warps_out, num_stages=2),
        interpret=interpret, name="kda_chunk_out",
    )(lens, q, G, rq, A, h, vn)


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
    cfg = config
    if K % cfg.block_k_inter or V % min(cfg.block_v_out, V):
        raise ValueError(f"config {cfg} does not tile K={K}, V={V}")
    scale = float(K ** -0.5 if scale is None else scale)
    out_dtype = v.dtype
    op_dtype = F32 if q.dtype == F32 else jnp.bfloat16
    common = dict(prec_mm=HIGHEST if op_dtype == F32 else None, cfg=cfg, interpret=interpret)
    h0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    N = -(-T // C)
    if N == 0:
        return [], (jnp.zeros((B, 0, H, V), out_dtype), h0)
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
                                     safe_gate=safe_gate, **common), lens, q, k, g, beta)
    A, Tinv = run("inter", j(_launch_inter, scale=scale, op_dtype=op_dtype, **common),
                  lens, q, k, G, beta, rq, rk, aqd, akd)
    w, u, kg, ec = run("wu", j(_launch_wu, op_dtype=op_dtype, **common),
                       lens, k, v, G, beta, rk, Tinv)
    h, vn, ht = run("state", j(_launch_state, op_dtype=op_dtype, **common), w, u, kg, ec, h0)
    o = run("out", j(_launch_out, scale=scale, out_dtype=out_dtype, op_dtype=op_dtype,
                     **common), lens, q, G, rq, A, h, vn)
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
