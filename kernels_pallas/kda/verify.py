"""Multi-token KDA verify (speculative decoding): T = 2..8 new tokens per sequence, and the fp32
state after EVERY position, so a rejected draft rolls back by choosing a state.

One Pallas launch (Triton lowering); grid (sequence, head, V-tile) with narrow value-column tiles
(block_v = 8 by default: 12 heads x 128 columns -> 192 programs per sequence) so one sequence fills
the GPU. Each program keeps its [K, block_v] fp32 state tile in registers across the T positions.
Inputs are the prepared q, k, v, g, beta (FLA conventions, as kda_chunk); `lengths[b]` (<= T)
marks the valid positions of row b: later positions leave the state unchanged and output zeros.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import resolve_backend, triton_params
from .reference import kda_recurrent

F32 = jnp.float32


def _verify_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, hs_ref, *,
                   T, scale, l2norm):
    length = len_ref[...]
    S = h0_ref[...].astype(F32)
    for t in range(T):
        valid = t < length
        q = jnp.where(valid, q_ref[t, :].astype(F32), 0.0)
        k = jnp.where(valid, k_ref[t, :].astype(F32), 0.0)
        if l2norm:
            q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6)
            k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)
        v = jnp.where(valid, v_ref[t, :].astype(F32), 0.0)
        g = jnp.where(valid, g_ref[t, :].astype(F32), 0.0)
        beta = jnp.where(valid, b_ref[t].astype(F32), 0.0)
        S = S * jnp.exp(g)[:, None]
        p = jnp.sum(S * k[:, None], axis=0)
        S = S + k[:, None] * (beta * (v - p))[None, :]
        hs_ref[t, :, :] = S
        o_ref[t, :] = (jnp.sum(S * q[:, None], axis=0) * scale).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "block_v",
                                             "num_warps"))
def kda_verify_pallas(q, k, v, g, beta, initial_state, *, scale=None, lengths=None,
                      use_qk_l2norm=False, interpret=False, block_v=8, num_warps=2):
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = float(K ** -0.5 if scale is None else scale)
    bv = min(block_v, V)
    lens = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    tok = lambda X: pl.BlockSpec((None, T, None, X), lambda b, h, j: (b, 0, h, 0))
    o, hs = pl.pallas_call(
        functools.partial(_verify_kernel, T=T, scale=scale, l2norm=use_qk_l2norm),
        grid=(B, H, V // bv),
        in_specs=[pl.BlockSpec((None,), lambda b, h, j: (b,)), tok(K), tok(K),
                  pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j)), tok(K),
                  pl.BlockSpec((None, T, None), lambda b, h, j: (b, 0, h)),
                  pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))],
        out_specs=[pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j)),
                   pl.BlockSpec((None, T, None, K, bv), lambda b, h, j: (b, 0, h, 0, j))],
        out_shape=(jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                   jax.ShapeDtypeStruct((B, T, H, K, V), F32)),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_verify",
    )(lens, q, k, v, g.astype(F32), beta, initial_state.astype(F32))
    return o, hs


def kda_verify_reference(q, k, v, g, beta, initial_state, *, scale=None, lengths=None,
                         use_qk_l2norm=False):
    """kda_recurrent run to every prefix length: (o [B,T,H,V], states [B,T,H,K,V])."""
    B, T = q.shape[:2]
    lens = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    o, _ = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         lengths=lens, use_qk_l2norm=use_qk_l2norm)
    states = [kda_recurrent(q[:, :t + 1], k[:, :t + 1], v[:, :t + 1], g[:, :t + 1],
                            beta[:, :t + 1], scale=scale, initial_state=initial_state,
                            lengths=jnp.minimum(lens, t + 1), use_qk_l2norm=use_qk_l2norm)[1]
              for t in range(T)]
    return o, jnp.stack(states, axis=1)


def kda_verify(q, k, v, g, beta, initial_state, *, scale=None, lengths=None,
               use_qk_l2norm=False, backend=None, block_v=8, num_warps=2):
    """T (2..8) new tokens per sequence -> (o [B,T,H,V], state after each position
    [B,T,H,K,V] fp32)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return kda_verify_reference(q, k, v, g, beta, initial_state, scale=scale,
                                    lengths=lengths, use_qk_l2norm=use_qk_l2norm)
    return kda_verify_pallas(q, k, v, g, beta, initial_state, scale=scale, lengths=lengths,
                             use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret",
                             block_v=block_v, num_warps=num_warps)
