"""Small shared pieces: linear layers, the Kimi RMSNorm, activations, the depthwise short conv.

Every parameter is declared with its logical axes (`nn.with_logical_partitioning`): names that
say what each dimension is, from which sharding/rules.py places it on a mesh. The vocabulary:
  vocab, embed                 the token table and the model's hidden dimension
  mlp                          a dense MLP's (or the shared experts') intermediate units
  q_heads, kv_heads, v_heads   MLA's head-major projections: queries, keys|values, values
  q_lora, kv_lora, kv_lora_rope  MLA's low ranks (kv_lora_rope: the latent plus its rope part)
  kda_heads, kda_channels      KDA's heads and its head-major channels (heads x head_dim)
  kda_head_dim, gate_rank      one KDA head's width; the low-rank gates' bottleneck
  conv_kernel                  the short conv's taps
  expert_score                 one value per routed expert (the router's output)
  expert, expert_mlp, expert_embed  the routed experts: their stack, intermediate and model-side
                               dims (dense, MXFP4-packed or its scale groups alike)
  moe_latent, dedup_embed      the latent MoE's width; its up-projection's output (MoE dedup's
                               owned rows)"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas.attnres.reference import rms_normalize
from kernels_pallas.dense import skinny_matmul
from kernels_pallas.moe.reference import glu as moe_glu
from sharding.rules import logical_axes

F32 = jnp.float32
INIT_STD = 0.02


def project(x, kernels, dt, backend=None, out_dtypes=None) -> tuple:
    """x @ each of `kernels` ([in, out]) in the compute dtype dt, what flax's Dense does: at decode
    widths one skinny-matmul launch for the whole group (the weights one input meets) on the
    Pallas backend, XLA's dots otherwise. `out_dtypes`: a wider output for some (fp32: the fp32
    accumulation itself). A mesh that XLA partitions keeps XLA's dots: it would gather a custom
    call's sharded weights to every device; inside shard_map (every axis manual) the weights are
    the rank's own."""
    mesh = jax.sharding.get_abstract_mesh()
    if not (mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual):
        backend = "reference"
    # kernels are cast to x's dtype
    return skinny_matmul(x.astype(dt), kernels, out_dtypes=out_dtypes, backend=backend)


def kernel(shape: tuple, axes: tuple, cfg, name: str):
    """Declare a bias-free projection's [in, out] kernel as flax's Dense would (same tree and init)
    and return it, for `project`."""
    return Weight(shape, cfg.jnp_param_dtype, axes, name=name)()


class Weight(nn.Module):
    """A bare parameter (default: an [in, out] `kernel` initialised like flax's Dense), for weights
    used in more than one way or handed to pure functions (the MoE under shard_map)."""
    shape: tuple
    dtype: jnp.dtype
    axes: tuple
    init: object = nn.initializers.normal(INIT_STD)
    param_name: str = "kernel"

    @nn.compact
    def __call__(self):
        return self.param(self.param_name, nn.with_logical_partitioning(self.init, self.axes),
                          self.shape, self.dtype)


class Declared(nn.Module):
    """The weights `declare(module, cfg)` declares in a module of their own (for their axes)."""
    declare: object
    cfg: object

    @nn.compact
    def __call__(self):
        return self.declare(self, self.cfg)


@functools.cache
def declared_axes(declare, cfg):
    """Logical axes of the weights `declare(module, cfg)` declares (a tree of tuples shaped like
    them; shapes only, no memory)."""
    module = Declared(declare, cfg, parent=None)  # not a child of a module being applied
    return logical_axes(jax.eval_shape(module.init, jax.random.key(0))["params"])


class RMSNorm(nn.Module):
    """Kimi RMSNorm: normalise in fp32, cast to the input dtype, then multiply by the gain."""
    dim: int
    eps: float
    param_dtype: jnp.dtype = F32
    axis: str = "embed"

    def setup(self):
        self.weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, (self.axis,)),
                                 (self.dim,), self.param_dtype)

    def __call__(self, x):
        return self.weight.astype(x.dtype) * rms_normalize(x, self.eps)

    def gain(self):
        """The weight, for kernels that fuse the norm with what precedes it."""
        return self.weight


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
