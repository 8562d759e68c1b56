"""Plain-JAX AttnRes mix and the Kimi RMSNorm after it: the model's math and the kernel's oracle.

Mix(rows, g, w): k_j = row_j * rsqrt(mean(row_j^2) + eps); score_j = sum_h k_j[h] g[h] w[h];
p = softmax_j(score) (fp32); mixture = sum_j p_j row_j in fp32, rounded to the model dtype
(the reference's rounding point). Kimi RMSNorm: normalise in fp32, cast to the input dtype, then
multiply by the gain (attnres_cache_spec.md 1.5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def rms_normalize(x, eps):
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def attn_res_mix(rows, g, w, eps):
    out_dtype = rows[-1].dtype
    R = jnp.stack([r.astype(F32) for r in rows], axis=-2)  # [..., n, H]
    r = jax.lax.rsqrt(jnp.mean(R * R, axis=-1) + eps)
    c = g.astype(F32) * w.astype(F32)
    scores = jnp.einsum("...nh,h->...n", R, c, precision=jax.lax.Precision.HIGHEST) * r
    p = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...n,...nh->...h", p, R, precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


def residual_sum(residual, delta):
    """The residual stream after a pending sublayer output: residual + delta in their promoted
    dtype, or whichever of the two is given (a block's first sublayer starts a new partial sum)."""
    if residual is None or delta is None:
        return delta if residual is None else residual
    return residual + delta


def attn_res_norm_reference(bank, residual, delta, g, w, gain, *, eps):
    """(gain * RMSNorm(Mix(bank + [s])), s) with s = residual_sum(residual, delta); with an
    empty bank the mix is s itself (softmax over one row), as at the model's first layer."""
    s = residual_sum(residual, delta)
    h = attn_res_mix(list(bank) + [s], g, w, eps) if len(bank) else s
    return gain.astype(h.dtype) * rms_normalize(h, eps), s
