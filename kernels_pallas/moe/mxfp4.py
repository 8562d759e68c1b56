"""MXFP4 (OCP microscaling FP4) as K3 ships its routed experts (compressed-tensors
`mxfp4-pack-quantized`): 4-bit E2M1 values, two per byte (column 2j in the low nibble, 2j+1 in the
high nibble), one E8M0 scale byte per 32 consecutive input columns: value * 2^(scale - 127).
Weights are stored [..., out, in/2] (packed) and [..., out, in/32] (scales); the quantized axis is
the input (last) axis. Every representable value is exact in bf16 and fp32.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

GROUP = 32
# E2M1 magnitudes for nibble bits 0-2; bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
_LUT = np.concatenate([E2M1_VALUES, -E2M1_VALUES])  # index = nibble


def check_shapes(packed_shape, scale_shape):
    """Return the logical [..., out, in] shape, or raise naming what does not fit."""
    *lead, n, half = packed_shape
    *slead, sn, groups = scale_shape
    if lead != slead or n != sn or half * 2 != groups * GROUP:
        raise ValueError(f"MXFP4 packed {tuple(packed_shape)} and scales {tuple(scale_shape)} do not "
                         f"describe one [..., out, in] matrix with groups of {GROUP}")
    return (*lead, n, half * 2)


def dequantize(packed, scales, dtype=jnp.bfloat16):
    """[..., out, in/2] uint8 + [..., out, in/32] uint8 -> [..., out, in] in `dtype` (exact)."""
    shape = check_shapes(packed.shape, scales.shape)
    packed = jnp.asarray(packed, jnp.uint8)
    lut = jnp.asarray(_LUT)
    lo = lut[(packed & 0x0F).astype(jnp.int32)]
    hi = lut[(packed >> 4).astype(jnp.int32)]
    vals = jnp.stack([lo, hi], axis=-1).reshape(shape)  # column 2j, 2j+1
    # ldexp, not exp2: XLA's exp2 on CPU is inexact for most integer exponents.
    scale = jnp.ldexp(jnp.float32(1.0), jnp.asarray(scales, jnp.int32) - 127)
    vals = vals.reshape(*shape[:-1], shape[-1] // GROUP, GROUP) * scale[..., None]
    return vals.reshape(shape).astype(dtype)


def quantize(w):
    """NumPy round-to-nearest MXFP4 quantizer ([..., out, in] float -> packed, scales).

    The scale of each group of 32 is the power of two that maps the group's max |w| into
    [0, 6] (E2M1's largest value); each value then rounds to the nearest grid point.
    Used to build test checkpoints and random MXFP4 weights.
    """
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    if k % GROUP:
        raise ValueError(f"input dim {k} is not a multiple of the MXFP4 group size {GROUP}")
    g = w.reshape(*lead, n, k // GROUP, GROUP)
    amax = np.max(np.abs(g), axis=-1, keepdims=True)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127)
    exp = np.clip(exp, -127, 127)
    x = g / np.exp2(exp)
    idx = np.argmin(np.abs(np.abs(x)[..., None] - E2M1_VALUES), axis=-1)
    nib = (idx | np.where(x < 0, 8, 0)).astype(np.uint8).reshape(*lead, n, k)
    packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    return packed, scales
