"""Small shared pieces: linear layers, the Kimi RMSNorm, activations, the depthwise short conv."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas.moe.reference import glu as moe_glu

F32 = jnp.float32
INIT_STD = 0.02


def dense(features: int, name: str, cfg, dtype=None, param_dtype=None) -> nn.Dense:
    """Bias-free projection; kernel stored [in, out] (HF stores [out, in])."""
    return nn.Dense(features, use_bias=False, name=name, dtype=dtype or cfg.jnp_dtype,
                    param_dtype=param_dtype or cfg.jnp_param_dtype,
                    kernel_init=nn.initializers.normal(INIT_STD))


class Weight(nn.Module):
    """A bare parameter (default: an [in, out] `kernel` initialised like `dense`'s), for weights
    used in more than one way or handed to pure functions (the MoE under shard_map)."""
    shape: tuple
    dtype: jnp.dtype
    init: object = nn.initializers.normal(INIT_STD)
    param_name: str = "kernel"

    @nn.compact
    def __call__(self):
        return self.param(self.param_name, self.init, self.shape, self.dtype)


class RMSNorm(nn.Module):
    """Kimi RMSNorm: normalise in fp32, cast to the input dtype, then multiply by the gain."""
    dim: int
    eps: float
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (self.dim,), self.param_dtype)
        return w.astype(x.dtype) * rms_normalize(x, self.eps)


def rms_normalize(x, eps):
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def glu(cfg, a, b):
    """The config's gated activation (SwiGLU, or K3's SiTU-and-mul), the one definition the
    grouped-matmul kernels also use."""
    return moe_glu(a, b, "situ" if cfg.hidden_act == "situ" else "swiglu",
                   situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)


def causal_conv(x, conv_state, weight, n_new):
    """Causal depthwise conv + SiLU over new tokens, continuing from a conv state.

    x [B, T, C] new inputs (rows past n_new[b] are padding); conv_state [B, W-1, C] the previous
    W-1 inputs (zeros at a sequence start); weight [C, W] (HF's [C, 1, W] squeezed).
    y[t] = silu(sum_i w[:, i] * xx[t + i]) with xx = concat(conv_state, x).
    Returns (y [B, T, C], new conv state = the last W-1 inputs up to each row's n_new).
    """
    W = weight.shape[-1]
    T = x.shape[1]
    xx = jnp.concatenate([conv_state.astype(F32), x.astype(F32)], axis=1)  # [B, W-1+T, C]
    w = weight.astype(F32)
    y = sum(xx[:, i:i + T] * w[:, i] for i in range(W))
    new_state = jax.vmap(lambda r, n: jax.lax.dynamic_slice_in_dim(r, n, W - 1, axis=0))(xx, n_new)
    return jax.nn.silu(y).astype(x.dtype), new_state.astype(conv_state.dtype)
