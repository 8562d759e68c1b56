"""What the chunked KDA launches share: the chunk geometry, the base-2 decay, masked loads, the
gated operands and the block specs of the (chunk, b, h) grids."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST
C = 64          # chunk
SB = 16         # sub-block
NSB = C // SB   # sub-blocks per chunk
MATMUL_SPAN = 80.0  # a sub-block whose decay spans more than this (natural log) takes the exact path
# The launches carry G in base-2 units (log2 of the decay: g * LOG2E, summed), so each decay is
# one exp2, a single hardware instruction where exp needs several around it. G never leaves the
# kernels.
LOG2E = 1.4426950408889634
SPAN2 = MATMUL_SPAN * LOG2E


def dot(a, b, prec, trans_a=False, trans_b=False):
    dn = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return jax.lax.dot_general(a, b, dn, precision=prec, preferred_element_type=F32)


def row(x, i):
    """Row i (traced or static) of a [n, X] value, as [X] (masked sum: no dynamic value slicing)."""
    r = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(r == i, x, 0.0), axis=0)


def valid_rows(length, start, n):
    return (start + jax.lax.broadcasted_iota(jnp.int32, (n,), 0)) < length


def masked(ref, rows, cols, valid, scale=None):
    """ref[rows, cols] in fp32, zero on invalid rows (garbage there may be NaN), times a per-row
    scale (the inverse l2 norm) when given."""
    x = ref[rows, cols].astype(F32)
    if scale is not None:
        x = x * scale[:, None]
    return jnp.where(valid[:, None], x, 0.0)


def gate_block(g_ref, rows, vm):
    """A sub-block's g (base 2), zero past `length` (so G stays flat there), and its in-block
    cumsum. rows: a (rows, columns) pair."""
    g = jnp.where(vm, g_ref[rows] * LOG2E, 0.0)
    return g, jnp.cumsum(g, axis=0)


def tile_cols(t, width):
    """Columns of key / value tile t: static slices for a Python index, else a device-loop slice."""
    if isinstance(t, int):
        return slice(t * width, (t + 1) * width)
    return pl.ds(pl.multiple_of(t * width, width), width)


def chunk_specs():
    """Block specs of the (chunk, b, h) grids: tok(X) [B, T, H, X] rows of the chunk, per(X)
    [B, H, T, X] rows, vec [B, H, T], beta [B, T, H], length [B]."""
    tok = lambda X: pl.BlockSpec((None, C, None, X), lambda n, b, h: (b, n, h, 0))
    per = lambda X: pl.BlockSpec((None, None, C, X), lambda n, b, h: (b, h, n, 0))
    vec = pl.BlockSpec((None, None, C), lambda n, b, h: (b, h, n))
    beta = pl.BlockSpec((None, C, None), lambda n, b, h: (b, n, h))
    length = pl.BlockSpec((None,), lambda n, b, h: (b,))
    return tok, per, vec, beta, length
