"""Launch configuration of the fused AttnRes mix + RMSNorm kernel.

A program holds its tokens' whole hidden rows in registers (the running mixture and the row being
read), so the tile is sized by tokens x hidden: ELEMENTS values per array. At K3's hidden size that
is one token a program and 8 warps (28 fp32 values a thread per array); no shared memory is
allocated, so the same configuration fits MI300X's 64 KiB LDS.
"""
from __future__ import annotations

import dataclasses

ELEMENTS = 8192  # values of one [block_t, hidden] array a program keeps in registers
MAX_CHUNK = 1024  # widest hidden slice one load takes


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Fields left None are chosen by `norm_config` from the shape."""
    block_t: int | None = None    # tokens a program (a power of two)
    block_h: int | None = None    # hidden slice a load takes (a power of two dividing hidden)
    num_warps: int | None = None


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def norm_config(tokens: int, hidden: int, config: NormConfig | None = None) -> NormConfig:
    config = config or NormConfig()
    block_h = config.block_h or min(MAX_CHUNK, hidden & -hidden)  # largest power of two dividing
    if hidden % block_h or block_h & (block_h - 1):
        raise ValueError(f"block_h={block_h} must be a power of two dividing hidden={hidden}")
    block_t = config.block_t or max(1, min(_pow2_floor(ELEMENTS // hidden), _pow2_floor(tokens)))
    if block_t & (block_t - 1):
        raise ValueError(f"block_t={block_t} must be a power of two")
    num_warps = config.num_warps or (8 if block_t * hidden >= 4096 else 4)
    return NormConfig(block_t=block_t, block_h=block_h, num_warps=num_warps)
