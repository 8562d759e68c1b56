"""Block Attention Residuals (K3): a softmax over depth mixes the stored block sums and the running
partial sum before each attention, each MLP and the final norm. The math (plain JAX on the
reference backend, one kernel with the RMSNorm after it on the Pallas ones) lives in
kernels_pallas/attnres; state machine: reference/k3_checkpoint.md section 3.
"""
from __future__ import annotations

import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas.attnres import attn_res_norm
from .common import RMSNorm

F32 = jnp.float32


class AttnResMix(nn.Module):
    dim: int
    eps: float
    param_dtype: jnp.dtype = F32

    def setup(self):
        self.norm = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                               (self.dim,), self.param_dtype)
        # HF stores the pseudo-query as a Linear [1, H]; kept here as a vector.
        self.proj = self.param("proj", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed",)),
                               (self.dim,), self.param_dtype)

    def weights(self):
        """(key-norm gain, pseudo-query), for the fused kernel."""
        return self.norm, self.proj


def mixed_norm(cfg, mix_name: str, norm_name: str, bank: list, residual, delta, backend):
    """(the RMSNorm `norm_name` of the AttnRes mix `mix_name` over bank + [s], s) where s is the
    residual stream residual + delta (either may be None). No mix where the bank is empty or
    AttnRes is off. The Pallas backends run it as one kernel with the add; s is bit-identical on
    every backend. The weights live here, declared once; the math in kernels_pallas/attnres."""
    D, eps, pdt = cfg.hidden_size, cfg.rms_norm_eps, cfg.jnp_param_dtype
    mix = AttnResMix(D, eps, pdt, name=mix_name) if cfg.attn_res_block_size and bank else None
    norm = RMSNorm(D, eps, pdt, name=norm_name)
    g, w = mix.weights() if mix else (None, None)
    return attn_res_norm(bank if mix else [], residual, delta, g, w, norm.gain(), eps=eps,
                         backend=backend)
