"""Launch configuration of the skinny matmul.

Decode-width products stream their weights once. Column tiles of 64 (128-byte rows of bf16
weights) over every weight of a group give a K3 rank's groups 36 to 100 programs that each stream
their whole K (`python -m benchmarks dense --sweep` chose them; table in BENCHMARKS.md). 32- and
128-column tiles were no better by more than a few points, except for MLA's small q_b group.
Splitting K into parts that a second pass adds helped only at 64 rows for two groups and lost
at 1 and 16 rows, so there is one path, without splits. Past 64 rows (row blocks of 128) tiles of
128 columns were fastest at 256 rows for two of the three long-K groups and second for the third;
rows between 64 and 256 were not measured.
"""
from __future__ import annotations

import dataclasses

MAX_BLOCK_M = 128


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Fields left None are chosen by `skinny_config` from the shape."""
    block_m: int | None = None   # rows a program (a power of two, at least 16: the dot's minimum)
    block_n: int | None = None   # weight columns a program (a power of two, at least 16)
    block_k: int | None = None   # K step (a power of two dividing K, at least 16)
    num_warps: int | None = None
    num_stages: int | None = None


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def skinny_config(m: int, k: int, config: SkinnyConfig | None = None) -> SkinnyConfig:
    """The configuration for x [m, k] times a group of [k, n] weights."""
    config = config or SkinnyConfig()
    block_m = config.block_m or min(MAX_BLOCK_M, max(16, _pow2_ceil(m)))
    block_n = config.block_n or (64 if m <= 64 else 128)
    block_k = config.block_k or _largest_pow2_divisor(k, 256 if block_m <= 32 else 128)
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two of at least 16")
    if k % block_k:
        raise ValueError(f"block_k={block_k} must divide K={k}")
    num_warps = config.num_warps or (8 if block_m * block_n >= 8192 else 4)
    return SkinnyConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                        num_stages=config.num_stages or 3)
