"""Block configurations of the grouped matmul: a table of the tuned ones, keyed by platform and
shape class, and the regime rules for every shape no row covers.

A shape is classed (`shape_class`) by its regime, rows per group: "sparse" (< 0.5: most experts
that got rows got one, a decode step of a few tokens, where the programs are few), "decode" (< 24:
streaming the weights of the experts that got rows), "middle" (< 96), "prefill" (>= 96:
matmul-bound); its weights ("dense" bf16 / fp32, or "mxfp4") and their byte layout ("k3" |
"paired"); the activation dtype (the inline PTX decodes for bf16 activations only); fused
gate/up or not; K (a multiple of 256; else at most `_X_RESIDENT_MAX_K_BLOCKS` blocks of 128;
else longer) and N (>= 256 or narrower).

Small experts (K in at most 4 blocks of 128 and N < 256: the tiny models) stay in "decode" up
to the prefill regime. Re-reading an expert's few weights for each 16-row tile costs nothing;
the middle rule's blocks made the tiny-code model's verify passes (32 to 48 rows an expert)
many times slower than its decode steps on the GPU; and on the decode step's blocks a verify
pass computes each row's product as that step does.

`TUNED` rows are matched in order, "*" matching anything; the first row whose platform and
class match wins, else `_regime_rule`. The rows were chosen on the GPU at K3's shapes
(`python -m benchmarks moe`; figures in BENCHMARKS.md) except where a comment says they were
not measured.

A row gives the blocks at full width; `_fit` narrows them to the shape: block_n to the next
power of two covering N (at least 16), halved for the fused gate/up (each program holds two
accumulators and streams two weight tiles); block_k halved until it divides K (at least 32),
except in a row that names K classes, which takes its block_k as it is. In the sparse regime on
CUDA, MXFP4 weights in a plain K loop whose programs (about min(M, G) row tiles times the column
blocks) would not fill the GPU split K over up to 4 programs (bf16 activations, `_split_k`).
Last, paired MXFP4 weights on CUDA with bf16 activations take "split_asm_t" in every regime: it
is the only kernel that decodes their bytes there.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import kernel_platform
from .kernel import GmmConfig

_X_RESIDENT_MAX_K_BLOCKS = 4  # x kept resident up to this many K blocks of 128 (16 KiB of x tiles)
# programs that keep an H100 / H200 (132 SMs) streaming weights: about three an SM, so that one
# program's dequantisation overlaps another's loads (of the splits timed at one row an expert,
# the one nearest this count was the fastest)
_FILL_PROGRAMS = 384
_MAX_SPLIT_K = 4


class ShapeClass(NamedTuple):
    """The class of one call (`shape_class`), or a pattern in `TUNED`: a field "*" matches any
    value, a tuple any of its values."""
    regime: str = "*"   # "sparse" | "decode" | "middle" | "prefill"
    weights: str = "*"  # "dense" | "mxfp4"
    layout: str = "*"   # "k3" | "paired" (MXFP4 bytes; dense weights are "k3")
    x: str = "*"        # "bf16" | "other": the activation dtype
    glu: object = "*"   # fused gate/up (moe_gmm_glu(fuse=True)): True | False
    k: str = "*"        # "k256" (K % 256 == 0) | "k128_short" (<= 4 blocks of 128) | "k128"
    n: str = "*"        # "n256" (N >= 256) | "narrow"


_C = GmmConfig
# (platform, shape class) -> config at full width. Platform "cuda" (an NVIDIA GPU) or "*" (any:
# CUDA where no "cuda" row matches, ROCm, CPU, the interpreter).
DEC = ("sparse", "decode")
TUNED: tuple[tuple[str, ShapeClass, GmmConfig], ...] = (
    # CUDA sparse decode (a TP8 rank's gate or up, K 3584 N 384; its down, K 384 N 3584):
    # half-width column blocks, and two column blocks a program for the short K, give the
    # programs that one row an expert leaves too few (plus `_split_k`). K3's bytes take the
    # paired bytes' blocks (down: without x resident, as in their decode row).
    ("cuda", ShapeClass("sparse", "mxfp4", x="bf16", glu=False, k="k256"),
     _C(16, 64, 256, num_warps=4, num_stages=4, dequant="split_asm_t")),
    ("cuda", ShapeClass("sparse", "mxfp4", "paired", "bf16", k="k128_short"),
     _C(16, 128, 128, num_warps=4, num_stages=3, dequant="split_asm_t", n_per_program=2,
        x_resident=True)),
    ("cuda", ShapeClass("sparse", "mxfp4", "k3", "bf16", k=("k128_short", "k128")),
     _C(16, 128, 128, num_warps=4, num_stages=3, dequant="split_asm_t", n_per_program=2)),
    # CUDA decode, bf16 activations: the inline-PTX dequantisation. The fused gate/up in K3's
    # layout keeps "split_asm_sub" (its "split_asm_t" form was not timed).
    ("cuda", ShapeClass(DEC, "mxfp4", "k3", "bf16", glu=True),
     _C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm_sub")),
    ("cuda", ShapeClass(DEC, "mxfp4", x="bf16", k="k256"),
     _C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm_t")),
    # K not a multiple of 256 (a TP8 rank's down projection, K 384): K blocks of 128 only in the
    # loop over several column blocks: in the plain K loop they gave different outputs from call
    # to call on the GPU (not root-caused). Paired bytes (shorter PTX): x resident, 7 blocks.
    ("cuda", ShapeClass(DEC, "mxfp4", "paired", "bf16", k="k128_short"),
     _C(16, 128, 128, num_warps=4, num_stages=3, dequant="split_asm_t", n_per_program=7,
        x_resident=True)),
    ("cuda", ShapeClass(DEC, "mxfp4", x="bf16", k=("k128_short", "k128")),
     _C(16, 128, 128, num_warps=4, num_stages=3, dequant="split_asm_t", n_per_program=4)),
    # CUDA decode, other activation dtypes (the fp32 tiny models): the portable dequantisation
    # at CUDA's K block. Not measured.
    ("cuda", ShapeClass(DEC, "mxfp4"),
     _C(16, 128, 256, num_warps=4, num_stages=4, dequant="split")),
    # Dense decode: at copy bandwidth on the GPU.
    ("*", ShapeClass(DEC, "dense"), _C(16, 128, 128, num_warps=4, num_stages=4)),
    # Portable MXFP4 decode (ROCm, CPU): K blocks of 128 keep four stages' inputs inside MI300X's
    # 64 KiB of LDS. Not measured on any GPU in this form.
    ("*", ShapeClass(DEC, "mxfp4"),
     _C(16, 128, 128, num_warps=4, num_stages=4, dequant="split")),
    # Dense prefill, wide N: the short tiles as w^T . x^T (wgmma 64 x 32 instead of mma.sync) and
    # fused into their group's last tile (one weight stream a group).
    ("*", ShapeClass("prefill", "dense", glu=False, n="n256"),
     _C(128, 256, 64, block_m_small=32, num_warps=8, num_stages=4, transpose_small=True,
        fuse_tail=True)),
)


def _regime_rule(regime: str, glu_: bool) -> GmmConfig:
    """The blocks where no `TUNED` row matches: the middle regime, MXFP4 prefill, the fused
    gate/up's and narrow dense prefill (MXFP4: the portable "interleave"). Not tuned: of the
    "split_asm_t" row blocks of 64 and 128 tried at K3's TP8 shapes on the H200, each one with K
    blocks under 256 gave outputs that differed from call to call at one or more of the shapes
    (as its K blocks of 128 do in the plain K loop at decode), and the K-256 one won a little on
    gate / up and lost more on down (the sweep is in moe.json's details)."""
    if regime == "middle":
        return _C(64, 128, 64, block_m_small=16, num_warps=4, num_stages=4)
    return _C(128, 128, 64, block_m_small=32, num_warps=8 if glu_ else 4, num_stages=3)


def _k_class(k: int) -> str:
    if k % 256 == 0:
        return "k256"
    return "k128_short" if pl.cdiv(k, 128) <= _X_RESIDENT_MAX_K_BLOCKS else "k128"


def shape_class(m: int, g: int, k: int, n: int, quant: bool, glu_: bool = False, *,
                x_dtype=jnp.bfloat16, layout: str = "k3") -> ShapeClass:
    """The class of a moe_gmm call of x [m, k] on g groups of [k, n] weights."""
    rows_per_group = m / max(g, 1)
    k_cls, n_cls = _k_class(k), "n256" if n >= 256 else "narrow"
    small = k_cls == "k128_short" and n_cls == "narrow"
    regime = ("sparse" if rows_per_group < 0.5 else
              "decode" if rows_per_group < (96 if small else 24) else
              "middle" if rows_per_group < 96 else "prefill")
    return ShapeClass(regime, "mxfp4" if quant else "dense", layout if quant else "k3",
                      "bf16" if jnp.dtype(x_dtype) == jnp.bfloat16 else "other", bool(glu_),
                      k_cls, n_cls)


def _matches(pattern: ShapeClass, cls: ShapeClass) -> bool:
    return all(p == "*" or p == c or (isinstance(p, tuple) and c in p)
               for p, c in zip(pattern, cls))


def lookup(platform: str, cls: ShapeClass) -> tuple[ShapeClass | None, GmmConfig]:
    """The first `TUNED` row for (platform, cls) as (its pattern, its config), else (None, the
    regime rule)."""
    for plat, pattern, cfg in TUNED:
        if plat in ("*", platform) and _matches(pattern, cls):
            return pattern, cfg
    return None, _regime_rule(cls.regime, cls.glu)


def _fit(cfg: GmmConfig, pattern: ShapeClass | None, k: int, n: int, glu_: bool) -> GmmConfig:
    bn = min(cfg.block_n, max(16, pl.next_power_of_2(n)))
    if glu_:
        bn = max(16, bn // 2)
    bk = cfg.block_k
    if pattern is None or pattern.k == "*":
        while bk > 32 and k % bk:
            bk //= 2
    return dataclasses.replace(cfg, block_n=bn, block_k=bk)


def _split_k(m: int, g: int, k: int, n: int, cfg: GmmConfig) -> int:
    """K splits that bring a sparse decode's programs (about one row tile an expert that got a
    row) up to `_FILL_PROGRAMS`, keeping at least two K blocks a split; 1 where they fill it."""
    programs = min(m, g) * pl.cdiv(n, cfg.block_n)
    want = pl.cdiv(_FILL_PROGRAMS, programs)
    return max(1, min(want, _MAX_SPLIT_K, pl.cdiv(k, cfg.block_k) // 2))


def default_config(m: int, g: int, k: int, n: int, quant: bool, glu_: bool = False, *,
                   platform: str | None = None, x_dtype=jnp.bfloat16,
                   layout: str = "k3") -> GmmConfig:
    """The config moe_gmm runs for x [m, k], g groups of [k, n] weights (`quant`: MXFP4, in byte
    `layout` "k3" | "paired"), `glu_`: the fused gate/up kernel.

    platform: where the kernel will run, "cuda" | "rocm" | anything else (e.g. "cpu", or
    "interpret" for the Pallas interpreter); None: `kernel_platform()`. moe_gmm / moe_gmm_glu pass
    "interpret" for backend="interpret" and None otherwise."""
    platform = platform or kernel_platform()
    cls = shape_class(m, g, k, n, quant, glu_, x_dtype=x_dtype, layout=layout)
    pattern, cfg = lookup(platform, cls)
    cfg = _fit(cfg, pattern, k, n, glu_)
    if (platform == "cuda" and cls.regime == "sparse" and quant and cls.x == "bf16" and not glu_
            and cfg.n_per_program == 1):  # where it was measured
        cfg = dataclasses.replace(cfg, split_k=_split_k(m, g, k, n, cfg))
    if quant and layout == "paired" and platform == "cuda" and cls.x == "bf16":
        cfg = dataclasses.replace(cfg, dequant="split_asm_t")
    return cfg
