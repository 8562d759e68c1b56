"""Launch configuration of the skinny matmul.

Decode-width products stream their weights once, so a launch is sized to keep every SM reading:
column tiles of 64 (128-byte rows of bf16 weights) over all the weights of a group, times row
blocks, times K splits. K is split into as many parts as bring the programs to SPLIT_TARGET per
SM, each part writing fp32 partial sums that one small XLA reduction adds (deterministic, unlike
atomics); the partials' bytes are held to PARTIAL_BYTES of the weights' bytes, so wide row counts
split less.
"""
from __future__ import annotations

import dataclasses

from .._backend import num_sms

SPLIT_TARGET = 2  # programs a streaming multiprocessor, the aim of the K split
PARTIAL_BYTES = 0.05  # fp32 partials written + read, at most this fraction of the weight bytes
MAX_BLOCK_M = 128


@dataclasses.dataclass(frozen=True)
class SkinnyConfig:
    """Fields left None are chosen by `skinny_config` from the shape."""
    block_m: int | None = None   # rows a program (a power of two, at least 16: the dot's minimum)
    block_n: int | None = None   # weight columns a program (a power of two, at least 16)
    block_k: int | None = None   # K step (a power of two dividing K, at least 16)
    split: int | None = None     # K parts (dividing K / block_k), each a program
    num_warps: int | None = None
    num_stages: int | None = None


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _largest_pow2_divisor(n: int, cap: int) -> int:
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


def skinny_config(m: int, k: int, ns: tuple, config: SkinnyConfig | None = None) -> SkinnyConfig:
    """The configuration for x [m, k] times weights [k, n] for n in ns."""
    config = config or SkinnyConfig()
    block_m = config.block_m or min(MAX_BLOCK_M, max(16, _pow2_ceil(m)))
    block_n = config.block_n or 64
    block_k = config.block_k or _largest_pow2_divisor(k, 256 if block_m <= 32 else 128)
    for name, v, low in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_k", block_k, 16)):
        if v < low or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two of at least {low}")
    if k % block_k:
        raise ValueError(f"block_k={block_k} must divide K={k}")
    steps = k // block_k
    split = config.split
    if split is None:
        programs = -(-m // block_m) * sum(-(-n // block_n) for n in ns)
        most = max(1, int(PARTIAL_BYTES * k / (2 * max(m, 1))))  # fp32 partials vs bf16 weights
        fits = [d for d in range(1, steps + 1) if steps % d == 0 and d <= most]
        split = next((d for d in fits if programs * d >= SPLIT_TARGET * num_sms()), fits[-1])
    if steps % split:
        raise ValueError(f"split={split} must divide K / block_k = {steps}")
    num_warps = config.num_warps or (8 if block_m * block_n >= 8192 else 4)
    return SkinnyConfig(block_m=block_m, block_n=block_n, block_k=block_k, split=split,
                        num_warps=num_warps, num_stages=config.num_stages or 3)
