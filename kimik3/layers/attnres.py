"""Block Attention Residuals (K3): a softmax over depth mixes the stored block sums and the running
partial sum before each attention, each MLP and the final norm.

Mix(rows, g, w): k_j = row_j * rsqrt(mean(row_j^2) + eps); score_j = sum_h k_j[h] g[h] w[h];
p = softmax_j(score) (fp32); mixture = sum_j p_j row_j in fp32, rounded to the model dtype
(the reference's rounding point). State machine: reference/k3_checkpoint.md section 3.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

F32 = jnp.float32


class AttnResMix(nn.Module):
    dim: int
    eps: float
    param_dtype: jnp.dtype = F32

    @nn.compact
    def __call__(self, rows: list):
        g = self.param("norm", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (self.dim,),
                       self.param_dtype)
        # HF stores the pseudo-query as a Linear [1, H]; kept here as a vector.
        w = self.param("proj", nn.with_logical_partitioning(nn.initializers.normal(0.1), ("embed",)),
                       (self.dim,), self.param_dtype)
        return attn_res_mix(rows, g, w, self.eps)


def attn_res_mix(rows, g, w, eps):
    out_dtype = rows[-1].dtype
    R = jnp.stack([r.astype(F32) for r in rows], axis=-2)  # [..., n, H]
    r = jax.lax.rsqrt(jnp.mean(R * R, axis=-1) + eps)
    c = g.astype(F32) * w.astype(F32)
    scores = jnp.einsum("...nh,h->...n", R, c, precision=jax.lax.Precision.HIGHEST) * r
    p = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("...n,...nh->...h", p, R, precision=jax.lax.Precision.HIGHEST).astype(out_dtype)
