"""64-bit load/store offsets for large 1-byte arrays in Pallas' Triton lowering.

jax 0.11.x (`jax._src.pallas.triton.lowering._compute_offsets_from_indices`) switches element
offsets to 64 bits only when the array is over 2**32 *bytes*; offsets are counted in elements and
are signed, so a 1-byte array (MXFP4 packed weights, scale bytes, an fp8 cache) of 2**31 to 2**32
elements gets int32 offsets that wrap negative past element 2**31. For example K3's routed
gate/up weights of one TP2 rank ([896, 1536, 1792] uint8, 2.47e9 bytes) made the MoE
kernel read out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS) for experts past id ~780.

`apply()` wraps that function so that any array of more than 2**31 elements takes the 64-bit path
(in-bounds offsets of smaller arrays fit in int32; a masked-off lane may wrap, but is never read).
The wrapper hands the original a copy of the block info whose dtype is 8 bytes wide, which moves
only its size test (the dtype is used for nothing else there). Kernels on smaller arrays lower exactly as before. If the function is missing or changed
in another jax version, `apply()` returns False and patches nothing (tests/kernels/test_triton_offsets.py
checks the lowered IR either way).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

_WIDE_ELEMENTS = 2 ** 31


def apply() -> bool:
    """Install the wrapper once; True if it is in place."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:  # no Triton lowering in this jax: nothing to fix
        return False
    orig = getattr(lowering, "_compute_offsets_from_indices", None)
    if orig is None or not dataclasses.is_dataclass(getattr(lowering, "BlockInfo", None)):
        return False
    if getattr(orig, "_kimik3_wide", False):
        return True

    def compute_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if math.prod(aval.shape) > _WIDE_ELEMENTS and jnp.dtype(aval.dtype).itemsize < 8:
            block_info = dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=jnp.int64))
        return orig(block_info, nd_indexer)

    compute_offsets._kimik3_wide = True
    compute_offsets.__wrapped__ = orig
    lowering._compute_offsets_from_indices = compute_offsets
    return True
