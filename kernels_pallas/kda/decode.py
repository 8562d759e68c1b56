"""Fused one-token KDA decode: one Pallas launch per layer (Triton lowering).

Per (sequence, head) program, for the one new token:
  conv update (depthwise, width W, SiLU; q, k, v each with its own weights; the conv state rolls
  in place), q/k l2 norm, the gate (softplus or bounded form) from the raw f, A_log, dt_bias,
  beta = sigmoid(b), the recurrent update of the fp32 state in place (input_output_aliases),
  o = S^T (scale q), then gated RMSNorm (o_norm weight, eps, x sigmoid(output gate)) written
  straight into the [B, H*V] destination.

Layouts follow the model (kimik3/layers/kda.py): qkv = (q, k, v) projections [B, P] each (P =
H*K), conv_state [B, W-1, 3P] (q | k | v channels), conv_w = (q, k, v) conv weights [P, W] each,
f [B, P] raw gate projection, A_log [>= H],
dt_bias [P], b [B, H] beta logits, gate [B, P] raw output gate, o_norm_w [K], state [B, H, K, K]
fp32. Rounding points follow the model: the conv output is rounded to qkv's dtype before the norm.
q, k, v and their conv weights come as the model holds them, not concatenated: at decode each
concatenation was a launch of its own.

Warps: 4 by default (`python -m benchmarks kda`, BENCHMARKS.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import resolve_backend, triton_params
from .reference import kda_gate, kda_recurrent, l2norm

F32 = jnp.float32


def _decode_kernel(q_ref, k_ref, v_ref, cs_ref, wq_ref, wk_ref, wv_ref, f_ref, alog_ref, dtb_ref,
                   b_ref, gate_ref, onw_ref, s_ref, live_ref, o_ref, cs_out_ref, s_out_ref, **kw):
    live = live_ref[...] != 0

    @pl.when(live)
    def _():
        _decode_row((q_ref, k_ref, v_ref), cs_ref, (wq_ref, wk_ref, wv_ref), f_ref, alog_ref,
                    dtb_ref, b_ref, gate_ref, onw_ref, s_ref, o_ref, cs_out_ref, s_out_ref, **kw)

    @pl.when(~live)  # an idle row: both states stay in place untouched (aliased), its output is 0
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _decode_row(x_refs, cs_ref, w_refs, f_ref, alog_ref, dtb_ref, b_ref, gate_ref, onw_ref,
                s_ref, o_ref, cs_out_ref, s_out_ref, *, W, scale, lower_bound, eps, xdtype):
    K = x_refs[0].shape[-1]
    col = jax.lax.broadcasted_iota(jnp.int32, (K, W), 1)
    ys, hists, xs = [], [], []
    for j in range(3):  # q, k, v
        hist = [cs_ref[i, j, :].astype(F32) for i in range(W - 1)]
        x = x_refs[j][...].astype(F32)
        w = w_refs[j][...].astype(F32)  # [K, W]
        y = x * jnp.sum(jnp.where(col == W - 1, w, 0.0), axis=1)
        for i in range(W - 1):
            y = y + hist[i] * jnp.sum(jnp.where(col == i, w, 0.0), axis=1)
        y = y * jax.nn.sigmoid(y)
        ys.append(y.astype(xdtype).astype(F32))
        hists.append(hist)
        xs.append(x)
    q, k, v = ys
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + 1e-6) * scale
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + 1e-6)

    z = f_ref[...].astype(F32) + dtb_ref[...].astype(F32)
    a = jnp.exp(alog_ref[...].astype(F32))
    if lower_bound is None:
        sp = jnp.where(z > 20.0, z, jnp.log1p(jnp.exp(jnp.minimum(z, 20.0))))
        g = -a * sp
    else:
        g = lower_bound * jax.nn.sigmoid(a * z)
    beta = jax.nn.sigmoid(b_ref[...].astype(F32))

    S = s_ref[...] * jnp.exp(g)[:, None]
    p = jnp.sum(S * k[:, None], axis=0)
    delta = beta * (v - p)
    S = S + k[:, None] * delta[None, :]
    s_out_ref[...] = S
    o = jnp.sum(S * q[:, None], axis=0)

    o = o * jax.lax.rsqrt(jnp.mean(o * o) + eps) * onw_ref[...].astype(F32)
    o = o * jax.nn.sigmoid(gate_ref[...].astype(F32))
    o_ref[...] = o.astype(o_ref.dtype)
    # The conv state rolls in place (its output aliases its input). Written last, after the
    # state's cross-warp reductions: a warp's store must not overtake another warp's load of the
    # same row (Triton can hold a K-vector in several warps at once).
    for j in range(3):
        for i in range(W - 2):
            cs_out_ref[i, j, :] = hists[j][i + 1].astype(cs_out_ref.dtype)
        cs_out_ref[W - 2, j, :] = xs[j].astype(cs_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_heads", "lower_bound", "eps", "scale",
                                             "interpret", "num_warps"),
                   donate_argnames=("conv_state", "state"))
def kda_decode_pallas(qkv, conv_state, conv_w, f, A_log, dt_bias, b, gate, o_norm_w, state,
                      live=None, *, num_heads, lower_bound=None, eps=1e-5, scale=None,
                      interpret=False, num_warps=4):
    B, P = qkv[0].shape
    live = jnp.ones((B,), jnp.int32) if live is None else live.astype(jnp.int32)
    H = num_heads
    K = P // H
    W = conv_w[0].shape[-1]
    scale = float(K ** -0.5 if scale is None else scale)
    xs = [x.reshape(B, H, K) for x in qkv]
    cs5 = conv_state.reshape(B, W - 1, 3, H, K)
    ws = [w.reshape(H, K, W) for w in conv_w]
    row = pl.BlockSpec((None, None, K), lambda b_, h: (b_, h, 0))  # one (row, head)'s K values
    f3 = f.reshape(B, H, K)
    dtb = dt_bias.reshape(H, K)
    alog = A_log.reshape(-1)[:H]
    g3 = gate.reshape(B, H, K)
    out, cs_new, s_new = pl.pallas_call(
        functools.partial(_decode_kernel, W=W, scale=scale, lower_bound=lower_bound, eps=eps,
                          xdtype=qkv[0].dtype),
        grid=(B, H),
        in_specs=[
            row, row, row,                                                         # q, k, v
            pl.BlockSpec((None, W - 1, 3, None, K), lambda b_, h: (b_, 0, 0, h, 0)),  # conv state
            *[pl.BlockSpec((None, K, W), lambda b_, h: (h, 0, 0))] * 3,            # conv w q, k, v
            row,                                                                   # f
            pl.BlockSpec((None,), lambda b_, h: (h,)),                            # A_log
            pl.BlockSpec((None, K), lambda b_, h: (h, 0)),                         # dt_bias
            pl.BlockSpec((None, None), lambda b_, h: (b_, h)),                     # beta logit
            row,                                                                   # out gate
            pl.BlockSpec((K,), lambda b_, h: (0,)),                                # o_norm w
            pl.BlockSpec((None, None, K, K), lambda b_, h: (b_, h, 0, 0)),         # state
            pl.BlockSpec((None,), lambda b_, h: (b_,)),                            # live
        ],
        out_specs=[
            row,
            pl.BlockSpec((None, W - 1, 3, None, K), lambda b_, h: (b_, 0, 0, h, 0)),
            pl.BlockSpec((None, None, K, K), lambda b_, h: (b_, h, 0, 0)),
        ],
        out_shape=(jax.ShapeDtypeStruct((B, H, K), qkv[0].dtype),
                   jax.ShapeDtypeStruct(cs5.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(state.shape, F32)),
        input_output_aliases={3: 1, 13: 2},
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode",
    )(*xs, cs5, *ws, f3, alog, dtb, b, g3, o_norm_w, state, live)
    return out.reshape(B, P), cs_new.reshape(conv_state.shape), s_new


def kda_decode_reference(qkv, conv_state, conv_w, f, A_log, dt_bias, b, gate, o_norm_w, state,
                         live=None, *, num_heads, lower_bound=None, eps=1e-5, scale=None):
    """The same step composed from reference.py (kda_gate, l2norm, kda_recurrent)."""
    qkv, conv_w = jnp.concatenate(qkv, axis=-1), jnp.concatenate(conv_w)  # [B, 3P], [3P, W]
    B, P3 = qkv.shape
    H = num_heads
    P = P3 // 3
    K = P // H
    xx = jnp.concatenate([conv_state.astype(F32), qkv.astype(F32)[:, None]], axis=1)  # [B, W, 3P]
    y = jnp.einsum("bwc,cw->bc", xx, conv_w.astype(F32), precision=jax.lax.Precision.HIGHEST)
    y = jax.nn.silu(y).astype(qkv.dtype)
    new_conv = xx[:, 1:].astype(conv_state.dtype)
    q, k, v = (a.reshape(B, 1, H, K) for a in jnp.split(y, 3, axis=-1))
    g = kda_gate(f.reshape(B, 1, H, K), A_log, dt_bias, lower_bound=lower_bound)
    beta = jax.nn.sigmoid(b.astype(F32)).reshape(B, 1, H)
    o, S = kda_recurrent(l2norm(q), l2norm(k), v.astype(F32), g, beta, scale=scale,
                         initial_state=state)
    o = o.reshape(B, H, K)
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * o_norm_w.astype(F32)
    o = o * jax.nn.sigmoid(gate.astype(F32).reshape(B, H, K))
    o = o.reshape(B, P).astype(qkv.dtype)
    if live is not None:  # idle rows keep both states; their output is 0
        on = live != 0
        o = jnp.where(on[:, None], o, jnp.zeros_like(o))
        new_conv = jnp.where(on[:, None, None], new_conv, conv_state)
        S = jnp.where(on[:, None, None, None], S, state)
    return o, new_conv, S


def kda_decode(qkv, conv_state, conv_w, f, A_log, dt_bias, b, gate, o_norm_w, state, live=None, *,
               num_heads, lower_bound=None, eps=1e-5, scale=None, backend=None, num_warps=4):
    """One decode step of a KDA layer -> (out [B, P] in q's dtype, new conv_state, new state).
    qkv: the (q, k, v) projections [B, P] each; conv_w: their conv weights ([P, W] each); the
    other layouts in the module docstring. live [B] (default: every row): rows where it is 0
    take no token, keep both states and output 0 (an engine's idle slots).

    On the Pallas backends conv_state and state are donated and updated in place."""
    backend = resolve_backend(backend)
    kw = dict(num_heads=num_heads, lower_bound=lower_bound, eps=eps, scale=scale)
    if backend == "reference":
        return kda_decode_reference(qkv, conv_state, conv_w, f, A_log, dt_bias, b, gate, o_norm_w,
                                    state, live, **kw)
    return kda_decode_pallas(qkv, conv_state, conv_w, f, A_log, dt_bias, b, gate, o_norm_w, state,
                             live, interpret=backend == "interpret", num_warps=num_warps, **kw)
