"""Plain-JAX KDA (Kimi Delta Attention): the oracle every KDA kernel is checked against.

Conventions follow FLA's `chunk_kda` / `fused_recurrent_kda`:
  q, k  [B, T, H, K]   v [B, T, H, V]   g [B, T, H, K] log-decay (<= 0, fp32)   beta [B, T, H]
  state [B, H, K, V] fp32.  Returns (o [B, T, H, V] in v's dtype, final_state fp32).
Per token (decay first, delta rule on the decayed state, read from the updated state):
  S <- diag(exp g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale q_t)
`lengths[b]` marks the valid prefix of row b: positions >= lengths[b] get g = 0 and beta = 0, so they
leave the state untouched and the returned state is the state after the last valid token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def kda_gate(f, A_log, dt_bias, *, lower_bound: float | None = None):
    """Per-(head, key-dim) log-decay from the raw forget-gate projection f [..., H, K].

    lower_bound None: Kimi Linear's -exp(A_log) * softplus(f + dt_bias) (unbounded below).
    lower_bound lb:   K3's lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0).
    A_log may be longer than H (K3 stores 128 entries, the first H are used).
    """
    H, K = f.shape[-2:]
    z = f.astype(F32) + dt_bias.astype(F32).reshape(H, K)
    a = jnp.exp(A_log.astype(F32).reshape(-1)[:H])[:, None]
    if lower_bound is None:
        return -a * jax.nn.softplus(z)
    return lower_bound * jax.nn.sigmoid(a * z)


def l2norm(x, eps: float = 1e-6):
    """x / sqrt(sum x^2 + eps) in fp32 (eps inside the square root, as FLA and HF do)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, initial_state, lengths, use_qk_l2norm):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, T, H, K) or g.shape != (B, T, H, K):
        raise ValueError(f"q {q.shape}, k {k.shape}, g {g.shape} must all be [B, T, H, K]")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v {v.shape} must be [B, T, H, V] and beta {beta.shape} [B, T, H]")
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q, k, v, g, beta = (x.astype(F32) for x in (q, k, v, g, beta))
    if lengths is not None:
        valid = jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]  # [B, T]
        # Padding may hold anything (even NaN); zero it so it cannot reach the state.
        q, k, v, g = (jnp.where(valid[..., None, None], x, 0.0) for x in (q, k, v, g))
        beta = jnp.where(valid[..., None], beta, 0.0)
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, V), F32)
    elif initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state {initial_state.shape} must be [B, H, K, V] = {(B, H, K, V)}")
    return q, k, v, g, beta, scale, initial_state.astype(F32)


def kda_recurrent(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                  use_qk_l2norm: bool = False):
    """The naive per-token recurrence (the oracle). Also the multi-token decode path."""
    out_dtype = v.dtype
    q, k, v, g, beta, scale, S0 = _prepare(q, k, v, g, beta, scale, initial_state, lengths,
                                           use_qk_l2norm)

    def step(S, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, H, *]
        S = S * jnp.exp(g_t)[..., None]
        pred = jnp.einsum("bhkv,bhk->bhv", S, k_t, precision=HIGHEST)
        delta = b_t[..., None] * (v_t - pred)
        S = S + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", S, q_t * scale, precision=HIGHEST)
        return S, o_t

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    S, o = jax.lax.scan(step, S0, xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), S


def kda_chunk_reference(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                        use_qk_l2norm: bool = False, chunk_size: int = 64):
    """Chunked form (FLA's chunk algorithm, exact fp32 math).

    Per chunk (rows r, columns j, G = in-chunk inclusive cumsum of g):
      Aqk[r,j] = scale sum_d q_r k_j exp(G_r - G_j)      (j <= r)
      L[r,j]   = beta_r sum_d k_r k_j exp(G_r - G_j)     (j < r)
      W = (I+L)^-1 diag(beta) (K * exp G),  U = (I+L)^-1 diag(beta) V   (fp32 triangular solve)
      V' = U - W S;  O = scale (Q * exp G) S + Aqk V'
      S <- exp(G_C) * S + (K * exp(G_C - G))^T V'
    The pairwise decay is formed explicitly per chunk ([C, C, K]), so any gate (bounded or not) is
    exact; kernels fold it into the operands instead.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, scale, S0 = _prepare(q, k, v, g, beta, scale, initial_state, lengths,
                                           use_qk_l2norm)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C) if T else 0
    pad = N * C - T
    if pad:  # padded tokens: g = 0, beta = 0 -> no effect on the state
        padw = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padw, (q, k, v, g, beta))
    if N == 0:
        return jnp.zeros((B, 0, H, V), out_dtype), S0

    # [B, N*C, H, X] -> [N, B, H, C, X]
    to_chunks = lambda x: jnp.moveaxis(x.reshape(B, N, C, H, *x.shape[3:]), (1, 3), (0, 2))
    qc, kc, vc, gc = map(to_chunks, (q, k, v, g))
    bc = jnp.moveaxis(beta.reshape(B, N, C, H), (1, 3), (0, 2))  # [N, B, H, C]
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    eye = jnp.eye(C, dtype=F32)
    mm = lambda s, *a: jnp.einsum(s, *a, precision=HIGHEST)

    def step(S, xs):
        q_, k_, v_, g_, b_ = xs
        G = jnp.cumsum(g_, axis=-2)  # [B, H, C, K]
        diff = G[..., :, None, :] - G[..., None, :, :]  # [B, H, C(r), C(j), K]
        D = jnp.where(incl[..., None], jnp.exp(jnp.where(incl[..., None], diff, 0.0)), 0.0)
        Aqk = scale * mm("bhrd,bhjd,bhrjd->bhrj", q_, k_, D)
        L = jnp.where(strict, mm("bhrd,bhjd,bhrjd->bhrj", k_, k_, D), 0.0) * b_[..., :, None]
        eG = jnp.exp(G)
        rhs = jnp.concatenate([b_[..., None] * k_ * eG, b_[..., None] * v_], axis=-1)
        sol = jax.lax.linalg.triangular_solve(eye + L, rhs, left_side=True, lower=True,
                                              unit_diagonal=True)
        W, U = sol[..., :K], sol[..., K:]
        Vp = U - mm("bhck,bhkv->bhcv", W, S)
        O = mm("bhck,bhkv->bhcv", scale * q_ * eG, S) + mm("bhrj,bhjv->bhrv", Aqk, Vp)
        GC = G[..., -1, :]  # [B, H, K]
        S = jnp.exp(GC)[..., None] * S + mm("bhck,bhcv->bhkv", k_ * jnp.exp(GC[..., None, :] - G), Vp)
        return S, O

    S, O = jax.lax.scan(step, S0, (qc, kc, vc, gc, bc))
    o = jnp.moveaxis(O, (0, 2), (1, 3)).reshape(B, N * C, H, V)[:, :T]
    return o.astype(out_dtype), S
