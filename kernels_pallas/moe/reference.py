"""Plain-JAX reference for the MoE grouped matmul: `jax.lax.ragged_dot` on dequantised weights.

Semantics (shared with the Pallas kernel, `ops.moe_gmm`):
  x [M, K] rows sorted by group; w [G, K, N] dense, or `MXFP4Weight(packed [G, N, K/2] uint8,
  scales [G, N, K/32] uint8)` (K3's [out, in] storage, quantized along in = K); group_sizes [G]
  int32 with sum <= M. Row i of group g gets x[i] @ w[g]; rows past sum(group_sizes) are zero.
  The product accumulates in fp32; the output dtype is `preferred_element_type` or x's dtype.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import mxfp4, paired


class MXFP4Weight(NamedTuple):
    """Per-expert MXFP4 weights as K3 stores them: [G, N(out), K(in)/2] and [G, N, K/32] uint8."""

    packed: jax.Array
    scales: jax.Array
    layout = "k3"  # the byte layout of `packed` (a class attribute: not a pytree leaf)

    def k3_packed(self):
        """`packed` in K3's byte layout (decoding the paired layout)."""
        return self.packed

    @property
    def shape(self):
        """Logical [G, K, N] shape (the ragged_dot orientation)."""
        g, n, k = mxfp4.check_shapes(self.packed.shape, self.scales.shape)
        return (g, k, n)


class MXFP4PairedWeight(MXFP4Weight):
    """MXFP4 weights whose packed bytes are in the paired layout (`paired.py`): the same numbers,
    re-encoded at load time for the CUDA decode kernel's cheaper nibble decode. Build it with
    `pair_mxfp4` (or the checkpoint loader's mxfp4_layout="paired")."""

    __slots__ = ()
    layout = "paired"

    def k3_packed(self):
        return paired.decode(self.packed, jnp)


def pair_mxfp4(w: MXFP4Weight) -> MXFP4PairedWeight:
    """Re-encode K3-layout MXFP4 weights in the paired layout (N a multiple of 16), jitted on the
    device that holds them (a model's experts: kimik3.params.with_mxfp4_layout)."""
    if isinstance(w, MXFP4PairedWeight):
        return w
    return MXFP4PairedWeight(_encode_jit(w.packed), w.scales)


_encode_jit = jax.jit(lambda p: paired.encode(p, jnp))


def is_mxfp4(w) -> bool:
    return isinstance(w, MXFP4Weight)


def dense_weight(w, dtype) -> jax.Array:
    """[G, K, N] in `dtype` (dequantising MXFP4: only the reference does this)."""
    if is_mxfp4(w):
        return jnp.swapaxes(mxfp4.dequantize(w.k3_packed(), w.scales, dtype), -1, -2)
    return jnp.asarray(w).astype(dtype)


def _compute_dtype(x, w):
    if is_mxfp4(w):
        return x.dtype
    return jnp.promote_types(x.dtype, jnp.asarray(w).dtype)


def moe_gmm_reference(x, w, group_sizes=None, *, row_groups=None, preferred_element_type=None):
    """out[M, N] = ragged_dot(x, w, group_sizes), fp32 accumulation. With row_groups [M] in
    place of group_sizes (rows in any order, each its group's; G is a zero row): the rows sorted
    by group, the same product, the rows put back."""
    out_dtype = preferred_element_type or x.dtype
    if row_groups is not None:
        g = w.shape[0]
        order = jnp.argsort(row_groups, stable=True)
        sizes = jnp.bincount(row_groups, length=g + 1)[:g].astype(jnp.int32)
        y = moe_gmm_reference(x[order], w, sizes, preferred_element_type=out_dtype)
        return jnp.zeros_like(y).at[order].set(y)
    cdt = _compute_dtype(x, w)
    wd = dense_weight(w, cdt)
    y = jax.lax.ragged_dot(x.astype(cdt), wd, group_sizes.astype(jnp.int32),
                           precision=jax.lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def situ(a, beta: float = 4.0):
    """K3's SiTU gate activation: beta * tanh(a / beta) * sigmoid(a)."""
    return beta * jnp.tanh(a / beta) * jax.nn.sigmoid(a)


def glu(a, b, activation: str = "swiglu", *, situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """act(a) * b in fp32: "swiglu" -> silu(a) * b; "situ" -> SiTU(a) * (25 tanh(b / 25))."""
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if activation in ("swiglu", "silu"):
        return jax.nn.silu(a) * b
    if activation == "situ":
        return situ(a, situ_beta) * (situ_linear_beta * jnp.tanh(b / situ_linear_beta))
    raise ValueError(f"activation={activation!r} is not 'swiglu' or 'situ'")


def moe_gmm_glu_reference(x, w1, w3, group_sizes=None, *, row_groups=None,
                          activation: str = "swiglu", preferred_element_type=None,
                          situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """act(x @ w1[g]) * (x @ w3[g]) per group (K3's gate/up pair), rows past the sum (or of
    row group G) are zero."""
    out_dtype = preferred_element_type or x.dtype
    a, b = (moe_gmm_reference(x, w, group_sizes, row_groups=row_groups,
                              preferred_element_type=jnp.float32) for w in (w1, w3))
    y = glu(a, b, activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    # glu(0, 0) == 0, so rows past the sum stay zero.
    return y.astype(out_dtype)
