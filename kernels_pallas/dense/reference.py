"""The product the skinny-matmul kernel computes: x @ w for each weight, in x's dtype (what a
bias-free flax Dense does once its input and kernel are in the compute dtype), or a wider output
dtype that keeps the fp32 accumulation (the router's logits)."""
from __future__ import annotations

import jax.numpy as jnp


def skinny_matmul_reference(x, weights, out_dtypes=None):
    """x [..., K]; weights: a sequence of [K, N_i] -> a tuple of [..., N_i], each in its
    out_dtypes entry (None, or no list: x's dtype)."""
    out_dtypes = out_dtypes or [None] * len(weights)
    return tuple(x @ w.astype(x.dtype) if dt is None or jnp.dtype(dt) == x.dtype
                 else jnp.dot(x, w.astype(x.dtype), preferred_element_type=dt)
                 for w, dt in zip(weights, out_dtypes))
