"""The product the skinny-matmul kernel computes: x @ w for each weight, in x's dtype (what a
bias-free flax Dense does once its input and kernel are in the compute dtype)."""
from __future__ import annotations


def skinny_matmul_reference(x, weights):
    """x [..., K]; weights: a sequence of [K, N_i] -> a tuple of [..., N_i] in x's dtype."""
    return tuple(x @ w.astype(x.dtype) for w in weights)
