"""MoE grouped matmul (ragged_dot) as a Pallas kernel with the Triton lowering.

x [M, K] rows sorted by group, w [G, K, N] dense (bf16 / fp32) or `MXFP4Weight` ([G, N, K/2] +
[G, N, K/32] uint8, dequantised tile by tile inside the kernel: the bf16 weights never exist in HBM),
group_sizes [G] int32 (sum <= M; rows past the sum are written as zeros).

Work decomposition. A small kernel before the matmul (`tiles.tile_plan`, one launch; its plain-JAX
definition is `tile_metadata`) turns group_sizes into a static-length list of row tiles: tile t
covers rows [start, end) of one group (end - start <= block_m);
there are at most cdiv(M, block_m) + G tiles, so the grid is static. Rows past sum(group_sizes)
form a "zero group" whose tiles only store zeros; unused tile slots do nothing. The grid is
(N / block_n, tiles) with the column block fastest, so the programs that share a tile's rows (and a
group's weights) run side by side and hit L2. Only non-empty groups have tiles, so an empty
expert's weights are never read: at decode, the cost is streaming the weights of the experts that
received tokens. A tile with few rows (the tail of a group) runs a smaller `block_m_small` row block
so prefill does not pay a full block_m of padding per expert.
With `n_per_program` > 1 a program takes that many column blocks in one flattened (column block,
K block) loop: one pipeline fill per program instead of per block, which is what a short K needs
(a TP8 rank's down projection, K 384: close to twice the bandwidth of one column block a program).
With `x_resident` as well, the row tile's x is loaded once (all K blocks, before the loop) and the
loop walks the column blocks with the K blocks unrolled inside: a column block no longer reloads
x, and the loop's per-step bookkeeping is paid once per column block (offline sm_90: 300 instead of
408 instructions a warp per K block; a little faster on the TP8 down slice). The default for K of
at most 4 blocks.

MXFP4 in the kernel: every dequantisation variant (`GmmConfig.dequant`) produces the exact weight
times 2^-14 in the activation dtype; the 2^14 is applied once to the fp32 accumulator.
  "interleave" (the first version): each E2M1 nibble is placed into the bits of an fp16 (sign -> bit
    15, the three magnitude bits -> bits 9-11: exactly value * 2^-14, the subnormal 0.5 included),
    widened to fp32, multiplied by the E8M0 scale 2^(s-127) (s shifted into an fp32 exponent; s = 0
    flushes to zero), rounded to the activation dtype (exact), and the low/high nibbles interleaved
    back into columns 2j, 2j+1 (join + reshape). Exact for scale bytes >= 16.
  "split*" (no interleave): x's even and odd columns are separated (outside the kernel, one small XLA
    transpose of x, or by strided loads: `x_split="stride"`), so out = x_even @ W_lo^T + x_odd @
    W_hi^T: two dots of K = block_k / 2 on the low and high nibbles in the packed tile's own layout.
  "*_bf16" (no fp16 -> fp32 -> bf16 conversions): the magnitude bits go to bf16 bits 6-8 (value *
    2^-126, the 0.5 a bf16 subnormal) and m + min(m, 0x80) lifts that to value * 2^-125 with every
    value normal; then one bf16 multiply by 2^(s-16) (exponent field s + 111, built on the small
    [block_n, block_k / 32] scale tile). Exact for scale bytes 16..143 (2^-111..2^16: real weights sit
    near 127) and all-zero groups (s = 0); bytes above 143 give inf/nan (loud, not silently wrong).
  "split_asm": the "split_bf16" bits from inline PTX that treats two nibbles per 32-bit op (prmt
    spreads 2 bytes into the high bytes of the two 16-bit halves; min.u16x2 does the lift). CUDA
    sm_90+ only; the interpreter (which cannot run PTX) computes the same bits with the jnp code.
  "split_asm_sub": as "split_asm" without the lift (value * 2^-126, factor 2^(s-15), scale bytes
    16..142): it relies on the bf16x2 multiply taking the subnormal 0.5 exactly, as NVIDIA GPUs do
    (the CPU flushes it, so the interpreter runs the "split_asm" bits instead); the benchmark checks
    every byte bit-exactly on the device.
  "split_asm_t": the "split_asm_sub" weights (same bits, factor, scale bytes 16..142) in a
    transposed product, out^T = W_lo . x_even^T + W_hi . x_odd^T: the dequantised weights are the
    dot's first operand, so on Hopper Triton issues wgmma with them in registers and x read from
    shared memory (in "split_asm_sub", x's mma.sync fragments cost 0.5 instructions per weight in
    register copies: Triton loads them as pairs that straddle the quads). The packed columns of
    each K block are taken in a fixed order (`_perm_t`), x's even/odd columns gathered in the same
    order (outside the kernel with K padded to whole blocks, or by the strided x indices), so that
    a thread's registers for one 16-wide step of a weight row come from the four bytes of one 32-bit
    word; each thread then needs 2 scale groups per row (8 scale bytes per K block instead of 32),
    and Triton loads the packed tile with 128-bit ld.shared (no ldmatrix needed). Its PTX per
    4 bytes (from two rows): prmt places each row's two bytes 16 bits apart, and keeps the two
    nibbles, one integer multiply (by 2^6 + 2^12, or 2^2 + 2^8 for the high nibbles) writes each
    nibble twice without overlap, and keeps bits 6-8 and 15 of each half: as many instructions as
    the "split_asm_sub" PTX, one per two weights an IMAD (FMA pipe) where that has an integer-ALU
    shift. Elementwise exact like the other PTX (output i depends on input byte i only), so the
    weights do not depend on Triton's register order; the interpreter computes the "split_asm" bits
    in the same column order. The fp32 sums run in another order than in the other variants
    (permuted K, wgmma), so outputs agree with theirs to rounding, the weights bit for bit (the
    one-hot device check is exact). CUDA only, like the other "split_asm*" variants.
The paired layout (`MXFP4PairedWeight`, `paired.py`): the packed bytes re-encoded at load time so
  that "split_asm_t"'s nibble PTX is 8 integer instructions per 8 weights instead of 14 (offline
  1184 -> 992 SASS instructions in the TP8 kernel; faster on the GPU, bit-exact). Its decode
  depends on Triton packing bytes c, c + 1 of rows r and r + 8 into one asm operand, which the
  device's one-hot check confirms. Each such operand is stored as one 32-bit word (rows r, r + 8
  interleaved), so the loaded word is the operand: 992 -> 960 instructions (the pairing prmt
  gone). On a GPU only "split_asm_t" decodes it; the interpreter decodes it back to K3 bytes per
  tile and runs any variant.
K blocks of 128 in "split_asm_t" gave different outputs from call to call on the GPU in some
  configs of both layouts (not root-caused) in the plain K loop:
  `default_config` uses 256, and 128 only in the flattened loop over several column blocks
  (`n_per_program`), which never differed in the probes and is the fast form for a short K.
Triton notes (upstream Triton 3.6 compiled for sm_90 on CPU, SASS of the K loop, decode tile 16 x 128
x 256, per dequantised weight): interleave 9.5 instructions (3.8 on the integer pipe), split 8.7,
split_bf16 7.9, split_asm 5.3, split_asm_sub 4.0 (nibble PTX 1.75, scale multiply 0.5, x fragment
copies 0.51, scale factors 0.46, mma 0.25, loads / addresses / loop 0.55), split_asm_t 3.18 (nibble
PTX 1.75 + 0.125 to pack the bytes of two rows, scale multiply 0.5, scale factors 0.11, wgmma
0.125, loads 0.12, addresses / loop / wgmma bookkeeping 0.44; 179 registers vs 150, no spill). The
join + reshape and the scale reshape are absorbed by Triton's linear layouts (no shared-memory round
trip: the dequantised tile is produced in the dot-operand layout), so the cost is the per-element
integer work, which Triton issues once per element (only the PTX variants process two nibbles per
instruction). A per-32-column-group loop with [block_n, 1] scale columns (a variant tried) was
slower: 13 instructions, with a shared-memory round trip per group. Tried and not kept: prmt as a
byte table (entries: the low and high bytes of the bf16 values, sign included; a selector needs each
nibble's two low and two high bits in two selector nibbles: 3 instructions per 4 weights, so no
fewer than the multiply, and ptxas re-materialised the table register from a uniform register at
every use: 4.59 per weight in the "split_asm_sub" kernel); the packed weights as 32-bit words (a
pair per word needs no prmt: 13 instead of 15 instructions per 8 weights) need an int32 view of the
uint8 array, which XLA computes as a pass over all weights (seen on XLA:CPU, which expands the
bitcast-convert into shifts), and building the words in the kernel (a reduction) breaks Triton's
layout propagation (a shared-memory round trip).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import kernel_platform, resolve_backend, triton_params
from . import mxfp4, paired
from .tiles import group_tiles, tile_plan
from .reference import MXFP4Weight, glu, is_mxfp4, moe_gmm_glu_reference, moe_gmm_reference

_X_RESIDENT_MAX_K_BLOCKS = 4  # x_resident by default up to this many K blocks (16 KiB of x tiles)
_F16_SHIFT = 2.0 ** 14  # every dequant variant yields value * 2^(s-127) * 2^-14
_BF16_SCALE_BIAS = 125 - 14  # scale byte s -> bf16 exponent field of 2^(s-16)
_BF16_MAX_SCALE = 254 - _BF16_SCALE_BIAS  # 143: the largest scale byte the bf16 path keeps exact

# MXFP4 dequantisation variants (GmmConfig.dequant); see the module docstring.
DEQUANT_VARIANTS = ("interleave", "interleave_bf16", "split", "split_bf16", "split_asm",
                    "split_asm_sub", "split_asm_t")
X_SPLITS = ("pre", "stride")


def dequant_variant(name: str):
    """(split, bits) of a `GmmConfig.dequant` name; bits: "f16" | "bf16" | "asm" | "asm_sub" |
    "asm_t" (how a nibble becomes a number: `_nibble_bits`, `_nibble_asm`, `_nibble_asm_t`)."""
    if name not in DEQUANT_VARIANTS:
        raise ValueError(f"dequant={name!r} is not one of {DEQUANT_VARIANTS}")
    bits = "f16"
    for b in ("bf16", "asm_sub", "asm_t", "asm"):
        if name.endswith(b):
            bits = b
            break
    return name.startswith("split"), bits


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Static configuration of one moe_gmm kernel: row / column / K blocks, the smaller row block
    for short tiles, warps, software-pipeline stages, and for MXFP4 weights the dequantisation
    variant and how x's even/odd columns are separated (see the module docstring).

    The PTX variants ("split_asm*") exist only on NVIDIA GPUs (inline PTX; there
    is no ROCm equivalent, and Pallas' Triton lowering is also used on AMD). A config that names
    one is taken as given: compiling it for ROCm fails. `default_config` picks one only when
    `kernel_platform()` (or its `platform` argument) says the kernel runs on a CUDA device.
    """
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    block_m_small: int | None = None  # row block for tiles with <= this many rows (None: off)
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "interleave"  # MXFP4 only: one of DEQUANT_VARIANTS ("split_asm*": CUDA only)
    x_split: str = "pre"  # split variants: x's even/odd columns gathered "pre" kernel or "stride"
    # Column blocks per program, walked in one flattened (column block, K block) loop that the
    # software pipeline streams through without a break; each block's result is stored when its
    # last K block is done. For short K (a TP8 rank's down projection: 3 K blocks of 128), where
    # a program per column block is mostly pipeline fill and drain.
    n_per_program: int = 1
    # Dense weights: the short tiles (block_m_small rows) as the transposed product
    # w^T [block_n, K] . x^T -> [block_n, rows], so that the weights fill the MMA's M side (a
    # 32-row tile is below the 64 rows of one Hopper wgmma) and the rows are its N side.
    transpose_small: bool = False
    # With n_per_program > 1: x's K blocks loaded once a program (before the loop), which then
    # walks the column blocks with the K blocks unrolled inside (short K only: n_k x-tiles live
    # in shared memory / registers for the whole program). A row tile's x is otherwise reloaded
    # for every column block.
    x_resident: bool = False
    # A group's last row tile also takes up to block_m_small rows past block_m
    # (`tiles.group_tiles`), computed in one program as a block_m product and a block_m_small
    # one (transposed when transpose_small) on the same weight tile of each K step: the group's
    # weights are streamed (and MXFP4 ones dequantised, "split_asm_t" only) once instead of
    # once more for its short tail tile. The bf16 prefill default; opt-in for MXFP4 (4 warps:
    # faster at 8192 tokens; 8 warps gave call-to-call differences and NaN on the TP8 shapes).
    fuse_tail: bool = False

    def __post_init__(self):
        dequant_variant(self.dequant)
        if self.x_split not in X_SPLITS:
            raise ValueError(f"x_split={self.x_split!r} is not one of {X_SPLITS}")
        if self.n_per_program < 1:
            raise ValueError(f"n_per_program must be >= 1, got {self.n_per_program}")
        if self.fuse_tail and not (self.block_m_small and self.block_m_small < self.block_m
                                   and self.n_per_program == 1):
            raise ValueError("fuse_tail needs block_m_small < block_m (the tail's row block) and "
                             f"n_per_program 1 (got {self})")
        if self.x_resident and self.n_per_program == 1:
            raise ValueError("x_resident keeps x over several column blocks a program: set "
                             "n_per_program > 1 with it")

    def name(self) -> str:
        """Short label: bm/small, bn, bk, warps, stages (+ MXFP4 dequant options when not default)."""
        s = (f"bm{self.block_m}/{self.block_m_small}_bn{self.block_n}_bk{self.block_k}"
             f"_w{self.num_warps}_s{self.num_stages}"
             + (f"_np{self.n_per_program}" if self.n_per_program > 1 else "")
             + ("_tsmall" if self.transpose_small else "")
             + ("_xres" if self.x_resident else "")
             + ("_ftail" if self.fuse_tail else ""))
        if self.dequant != "interleave":
            s += f"_{self.dequant}"
            if self.x_split != "pre" and self.dequant.startswith("split"):
                s += f"_x{self.x_split}"
        return s

    def smem_bytes(self, x_itemsize: int, quant: bool, glu_: bool = False) -> int:
        """Shared memory the software pipeline asks for (inputs of one stage x num_stages)."""
        w_tile = self.block_n * self.block_k // 2 + self.block_n * self.block_k // 32 if quant \
            else self.block_n * self.block_k * x_itemsize
        per_stage = self.block_m * self.block_k * x_itemsize + w_tile * (2 if glu_ else 1)
        return per_stage * max(self.num_stages - 1, 1)


def default_config(m: int, g: int, k: int, n: int, quant: bool, glu_: bool = False, *,
                   platform: str | None = None, x_dtype=jnp.bfloat16,
                   layout: str = "k3") -> GmmConfig:
    """Block sizes by regime: rows per group decides decode (weight streaming) vs prefill.

    layout: the MXFP4 weights' byte layout ("k3" | "paired"); "paired" on CUDA with bf16
    activations takes "split_asm_t" in every regime (the only kernel that decodes it there).

    platform: where the kernel will run, "cuda" | "rocm" | anything else (e.g. "cpu", or
    "interpret" for the Pallas interpreter); None: `kernel_platform()`. moe_gmm / moe_gmm_glu pass
    "interpret" for backend="interpret" and None otherwise. It decides only the MXFP4 decode
    dequantisation (and its K block): "split_asm_t" ("split_asm_sub" for the fused gate/up;
    inline PTX) on "cuda" with bf16 activations (x_dtype; the only case checked bit-exact on the
    device), the portable "split" everywhere else, ROCm included.

    Chosen on the GPU at K3's shapes (896 experts, top-16; `python -m benchmarks moe`, against
    torch._grouped_mm and the copy bandwidth in the same run; figures in BENCHMARKS.md):
    * MXFP4 decode (< 24 rows per expert): bm16 bn128 bk256 w4 s4 with the inline-PTX
      dequantisation, the fastest variant, each checked bit-exact on the device ("split_asm" and
      the portable "split" and "interleave" slower in that order). "split_asm_sub" needs scale
      bytes <= 142 (larger ones give inf, not a silent error; real weights sit near 127). Off
      CUDA: "split" with bk128 (12.5 KiB of inputs a pipeline stage, <= 50 KiB with four
      buffers: inside MI300X's 64 KiB LDS; bk256 takes 25 KiB a stage); not measured on any GPU
      in this form.
    * bf16 decode: bm16 bn128 bk128 w4 s4, at copy bandwidth.
    * bf16 prefill (>= 96 rows per expert, N >= 256, not fused): bm128/32 bn256 bk64 w8 s4 with
      transposed, fused tails (see `_default_config`).
    * Not measured with these choices: the middle regime, MXFP4 prefill (still "interleave"),
      ROCm.
    * The fused gate/up (`glu_`) takes half the plain kernel's block_n (and 8 warps at prefill):
      each program holds two accumulators and streams two weight tiles. At the plain blocks it
      ran at about half the unfused product's rate, and offline (upstream Triton, sm_90, K3's
      gate/up) it took 129 KB of shared memory at decode (one block per SM) and spilled at
      prefill. With half the block_n: 77 KB and 168 registers at decode, no spill at prefill
      (128 x 64, 8 warps: 174 registers), and faster in the K3 layer. The unfused form (two plain
      products) is faster still and is the layer's default.
    """
    cfg = _default_config(m, g, k, n, quant, glu_, platform, x_dtype, layout)
    if quant and layout == "paired" and (platform or kernel_platform()) == "cuda" \
            and jnp.dtype(x_dtype) == jnp.bfloat16:
        # the paired layout decodes only in "split_asm_t" (any K block of 32s; the middle and
        # prefill regimes' MXFP4 kernels are otherwise "interleave"). Prefill keeps bk 64: it
        # showed no call-to-call differences (the bk-128 race).
        cfg = dataclasses.replace(cfg, dequant="split_asm_t")
    return cfg


def _default_config(m, g, k, n, quant, glu_, platform, x_dtype, layout) -> GmmConfig:
    rows_per_group = m / max(g, 1)
    bn = 128 if n >= 128 else max(16, pl.next_power_of_2(n))
    if glu_:
        bn = max(16, bn // 2)
    if rows_per_group < 24:  # decode: few rows per expert; stream weights
        if not quant:
            return GmmConfig(block_m=16, block_n=bn, block_k=_fit_k(128, k), num_warps=4,
                             num_stages=4)
        on_cuda = (platform or kernel_platform()) == "cuda"
        asm = on_cuda and jnp.dtype(x_dtype) == jnp.bfloat16
        # "split_asm_t" (faster than "split_asm_sub" at 64 and 512 tokens, bit-exact on the
        # device) for the plain matmul; the fused gate/up keeps "split_asm_sub"
        # (its "split_asm_t" form compiles to 255 registers offline and was not timed).
        asm_variant = "split_asm_sub" if glu_ and layout != "paired" else "split_asm_t"
        bk = _fit_k(256 if on_cuda else 128, k)
        stages, n_per, x_res = 4, 1, False
        if asm and asm_variant == "split_asm_t" and bk < 256:
            # "split_asm_t" with K blocks of 128 in the plain K loop gave different outputs from
            # call to call on the GPU in some configs of both layouts (NaN in the K3 layout at
            # bn64 s4, K 384; not root-caused). The same blocks in the flattened loop over 4
            # column blocks (n_per_program) showed no difference in repeated calls of 6 configs
            # x 2 layouts at 64 and 512 tokens, and they are the fast form for a short K: a TP8
            # rank's down projection (K 384), where one column block per program at bk 256 ran
            # at about half the rate.
            bk, stages, n_per = 128, 3, 4
            if layout == "paired" and pl.cdiv(k, 128) <= _X_RESIDENT_MAX_K_BLOCKS:
                # x's K blocks once a program, 7 column blocks in the loop: at the TP8 down slice
                # a little faster than the flattened loop over 4 (7 of 2 / 4 / 7 / 14 the best at
                # 64 tokens, within noise of 14 at 512; 2 and 4 stages slower). In the K3 layout
                # (longer nibble PTX) the same form was slower than the flattened loop.
                n_per, x_res = 7, True
        return GmmConfig(block_m=16, block_n=bn, block_k=bk, num_warps=4, num_stages=stages,
                         dequant=asm_variant if asm else "split", n_per_program=n_per,
                         x_resident=x_res)
    if rows_per_group < 96:
        return GmmConfig(block_m=64, block_n=bn, block_k=_fit_k(64, k), block_m_small=16,
                         num_warps=4, num_stages=4)
    if quant or glu_ or n < 256:
        return GmmConfig(block_m=128, block_n=bn, block_k=_fit_k(64, k), block_m_small=32,
                         num_warps=8 if glu_ else 4, num_stages=3)
    # bf16 prefill: the short tiles as w^T . x^T (wgmma 64 x 32 instead of mma.sync): a small
    # gain on the whole gate+up, a tie on the other shapes. Tails of up to 32 rows fused into
    # their group's last tile (one weight stream a group): faster on every K3 shape, which takes
    # the kernel past torch._grouped_mm; 3 stages and untransposed tails slower.
    return GmmConfig(block_m=128, block_n=256, block_k=_fit_k(64, k), block_m_small=32,
                     num_warps=8, num_stages=4, transpose_small=True, fuse_tail=True)


def _fit_k(bk: int, k: int) -> int:
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def _inclusive_cumsum(v):
    """Inclusive cumsum along the last axis as one masked reduction (O(n^2) work, n <= ~1k here):
    on the GPU one fused kernel, where jnp.cumsum becomes a chain of reduce-window kernels."""
    n = v.shape[-1]
    tri = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]  # [i, j]: j <= i
    return jnp.sum(jnp.where(tri, v[..., None, :], 0), axis=-1)


def tile_metadata(group_sizes, m: int, block_m: int, tail: int = 0):
    """[3, T] int32: (group, row start, row end) of each row tile; T = cdiv(M, block_m) + G.
    tail > 0: a group's last tile holds up to block_m + tail rows (`group_tiles`; the zero
    group's tiles stay within block_m).

    group == G marks a tile of the rows past sum(group_sizes) (written as zeros); group == -1 marks
    an unused slot. The definition (and the reference of `tiles.tile_plan`, which the kernel path
    runs: XLA makes 4 kernels of this, about twice the time of the one launch).
    Groups past row M (sum(group_sizes) > M breaks the contract) are clipped: their tiles past M
    are unused slots.
    """
    g = group_sizes.shape[0]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    n_tiles = pl.cdiv(m, block_m) + g
    cum = _inclusive_cumsum(jnp.stack([gs, group_tiles(gs, block_m, tail)]))  # [2, G]
    row_end = jnp.minimum(cum[0], m)
    row_start = jnp.minimum(cum[0] - gs, m)
    zero_rows = m - (row_end[-1] if g else jnp.int32(0))  # the zero group after the last
    tile_end = jnp.concatenate([cum[1], (cum[1, -1:] if g else jnp.zeros((1,), jnp.int32))
                                + (zero_rows + block_m - 1) // block_m])  # [G + 1]
    tiles_x = jnp.concatenate([group_tiles(gs, block_m, tail),
                               ((zero_rows + block_m - 1) // block_m)[None]])
    starts_x = jnp.concatenate([row_start, (m - zero_rows)[None]])
    ends_x = jnp.concatenate([row_end, jnp.full((1,), m, jnp.int32)])
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # searchsorted, right
    gc = jnp.minimum(grp, g)
    first = tile_end[gc] - tiles_x[gc]
    start = starts_x[gc] + (t - first) * block_m
    end = jnp.minimum(start + block_m, ends_x[gc])
    if tail:  # a group's last tile runs to the group's end (<= block_m + tail rows)
        end = jnp.where(t == tile_end[gc] - 1, ends_x[gc], end)
    valid = (grp <= g) & (end > start)
    return jnp.stack([jnp.where(valid, gc, -1), jnp.where(valid, start, 0),
                      jnp.where(valid, end, 0)]).astype(jnp.int32)


def _nibble_bits(pb, bits: str):
    """packed bytes -> (low, high) nibbles as fp bit patterns, same shape: "f16" -> value * 2^-14
    in fp16 (the 0.5 an fp16 subnormal); "bf16" -> value * 2^-125 in bf16, all normal (exact)."""
    b = pb.astype(jnp.int32)
    if bits == "f16":
        lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
        hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
        return tuple(jax.lax.bitcast_convert_type(v.astype(jnp.uint16), jnp.float16)
                     for v in (lo, hi))
    out = []
    for mag, sign in ((b << 6) & 0x01C0, (b << 12) & 0x8000), ((b << 2) & 0x01C0, (b << 8) & 0x8000):
        # mag = magnitude bits at bf16 bits 6-8 (value * 2^-126, 0.5 subnormal); adding
        # min(mag, 0x80) gives value * 2^-125 in bf16 with the 0.5 normal: 0 -> 0, 0x40 -> 0x80,
        # mag >= 0x80 -> mag + 0x80 (exponent field + 1).
        out.append(jax.lax.bitcast_convert_type(
            (mag + jnp.minimum(mag, 0x80) + sign).astype(jnp.uint16), jnp.bfloat16))
    return tuple(out)


def _scale_factor(sb, enc: str):
    """E8M0 bytes -> the factor that takes the `enc` nibble numbers to value * 2^(s-127) * 2^-14.

    "f16" (nibble = value * 2^-14): 2^(s-127) in fp32, s = 0 -> 0. "bf16" (value * 2^-125): 2^(s-16)
    in bf16 (exponent field s + 111; s > 143 -> inf). "bf16_sub" (value * 2^-126): 2^(s-15) in bf16
    (field s + 112; s > 142 -> inf)."""
    s = sb.astype(jnp.int32)
    if enc == "f16":
        return jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    e = jnp.minimum(s + _BF16_SCALE_BIAS + (enc == "bf16_sub"), 255)
    return jax.lax.bitcast_convert_type((e << 7).astype(jnp.uint16), jnp.bfloat16)


# Inline PTX for the "split_asm*" variants: 4 packed bytes (one 32-bit register, $2) -> the 4 bf16
# of their low (or high) nibbles ($0, $1: two per register). prmt spreads bytes 0,1 (then 2,3) into
# the high byte of each 16-bit half, so each 32-bit op treats two nibbles. One asm per nibble: the
# Pallas lowering of jax 0.11.2 returns only one result of a multi-result inline asm.
# "normal": value * 2^-125, the bits of `_nibble_bits(.., "bf16")` (min.u16x2 lifts the magnitude
# 0x40 to 0x80 and adds 0x80 above it; sm_90+). "sub": value * 2^-126 (0.5 a bf16 subnormal, which
# the bf16 multiply by the scale takes exactly on NVIDIA GPUs).
def _asm_nibble(enc: str, half: str, out: str) -> str:
    """PTX: t (two bytes in the high bytes of its 16-bit halves) -> `out`, two bf16 of the low (or
    high) nibbles. s: sign at bit 15, m: magnitude at bits 6-8 (value * 2^-126)."""
    if enc == "sub" and half == "lo":  # ((t << 4) | (t >> 2)) keeps sign and magnitude apart
        return (f"shl.b32 s, t, 4;\nshr.b32 m, t, 2;\nor.b32 s, s, m;\n"
                f"and.b32 {out}, s, 0x81C081C0;\n")
    sign = "shl.b32 s, t, 4;\nand.b32 s, s, 0x80008000;\n" if half == "lo" else \
        "and.b32 s, t, 0x80008000;\n"
    body = sign + f"shr.b32 m, t, {2 if half == 'lo' else 6};\nand.b32 m, m, 0x01C001C0;\n"
    if enc == "sub":
        return body + f"or.b32 {out}, s, m;\n"
    return body + f"min.u16x2 n, m, c;\nadd.u32 m, m, n;\nadd.u32 {out}, m, s;\n"


def _nibble_asm(pb, sub: bool):
    """`_nibble_bits` for bf16 as inline PTX (CUDA only): (low, high) nibbles of packed bytes."""
    from jax.experimental.pallas import triton as plgpu

    enc = "sub" if sub else "normal"
    out = []
    for half in ("lo", "hi"):
        asm = ("{\n.reg .b32 t, s, m, n, c;\nmov.b32 c, 0x00800080;\n"
               "prmt.b32 t, $2, 0, 0x1404;\n" + _asm_nibble(enc, half, "$0")
               + "prmt.b32 t, $2, 0, 0x3424;\n" + _asm_nibble(enc, half, "$1") + "}")
        [v] = plgpu.elementwise_inline_asm(
            asm, args=[pb], constraints="=r,=r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(pb.shape, jnp.bfloat16)])
        out.append(v)
    return tuple(out)


def _scaled(v, sf, bits: str, dtype):
    """v [bn, w] nibble numbers times the factor sf [bn, w], in `dtype`."""
    if bits == "f16":
        return (v.astype(jnp.float32) * sf).astype(dtype)
    return (v * sf).astype(dtype)


def _expand_groups(sf, width: int):
    """[bn, g] -> [bn, g * width]: each group's factor repeated over its `width` columns (in Triton
    a broadcast + reshape that the layout absorbs: no data movement, see the module docstring)."""
    bn, g = sf.shape
    return jnp.broadcast_to(sf[:, :, None], (bn, g, width)).reshape(bn, g * width)


def _dequant_tile(pb, sb, dtype, bits: str = "f16"):
    """packed [bn, bk/2] uint8 + scales [bn, bk/32] uint8 -> [bn, bk] `dtype`, times 2^-14
    (columns interleaved: the "interleave" / "interleave_bf16" variants)."""
    bn, half = pb.shape
    lo, hi = _nibble_bits(pb, bits)
    if bits == "f16":
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
    v = jnp.stack([lo, hi], axis=-1).reshape(bn, 2 * half)  # column 2j, 2j+1
    sf = _expand_groups(_scale_factor(sb, bits), mxfp4.GROUP)
    return (v * sf).astype(dtype)


def _dequant_split(pb, sb, dtype, bits: str = "f16", use_asm: bool = False):
    """packed [bn, w] uint8 + scales [bn, w/16] -> (low, high) nibble weights [bn, w] in `dtype`,
    times 2^-14: weight columns 2j (low) and 2j+1 (high).

    bits "asm" / "asm_sub" use inline PTX when `use_asm` (the GPU), else the "bf16" code, whose
    result is the same bits (the interpreter cannot run PTX)."""
    enc = "f16" if bits == "f16" else "bf16"
    if bits.startswith("asm") and use_asm:
        sub = bits == "asm_sub"
        lo, hi = _nibble_asm(pb, sub)
        enc = "bf16_sub" if sub else "bf16"
    else:
        lo, hi = _nibble_bits(pb, "f16" if bits == "f16" else "bf16")
    sf = _expand_groups(_scale_factor(sb, enc), mxfp4.GROUP // 2)
    b = "f16" if enc == "f16" else "bf16"
    return _scaled(lo, sf, b, dtype), _scaled(hi, sf, b, dtype)


# "split_asm_t". Packed columns are taken in a fixed order per K block (`_perm_t`), x's even / odd
# columns in the same order (outside the kernel, or in the strided x indices), so the product is
# unchanged. Within a block of w = 16 S packed columns (S = block_k / 32 steps of 16 along the dot's
# K), logical column L = 16 s + 8 F + 2 t + E (s < S; F, E < 2; t < 4) holds physical column
# p(L) = 4 (S t + s) + 2 F + E: the four columns of a weight row that a thread of the transposed
# product (weights as the dot's first operand; Triton's wgmma / mma register layout, two consecutive
# K per register, thread t of a quad holding 2 t, 2 t + 1, 2 t + 8, 2 t + 9) needs for one 16-wide
# step are the four bytes of one 32-bit word, and its S words are contiguous (vector loads).
def _perm_t(v, s: int):
    """Last axis (a multiple of 16 s) from physical to `split_asm_t` logical order: v'[.., L] =
    v[.., p(L)] per block of 16 s (reshape + transpose: a relabeling of registers in Triton)."""
    *lead, w = v.shape
    n = len(lead)
    v = v.reshape(*lead, w // (16 * s), 4, s, 2, 2)  # block, t, s, F, E (the physical order)
    v = jnp.transpose(v, (*range(n), n, n + 2, n + 3, n + 1, n + 4))  # block, s, F, t, E
    return v.reshape(*lead, w)


def _perm_t_inverse(v, s: int):
    """The inverse of `_perm_t` (logical back to physical order)."""
    *lead, w = v.shape
    n = len(lead)
    v = v.reshape(*lead, w // (16 * s), s, 2, 4, 2)  # block, s, F, t, E (the logical order)
    v = jnp.transpose(v, (*range(n), n, n + 3, n + 1, n + 2, n + 4))  # block, t, s, F, E
    return v.reshape(*lead, w)


def _perm_t_index(j, s: int):
    """p(L) for logical indices j (int32 array) within blocks of 16 s (`_perm_t`, as arithmetic)."""
    blk, r = j // (16 * s), j % (16 * s)
    return blk * (16 * s) + 4 * (s * ((r >> 1) & 3) + (r >> 4)) + 2 * ((r >> 3) & 1) + (r & 1)


# PTX of "split_asm_t": 4 packed bytes ($2) -> bf16 of their low (or high) nibbles ($0, $1), the
# "split_asm_sub" bits (value * 2^-126: sign at bit 15, magnitude at bits 6-8). prmt places bytes
# 0, 1 (then 2, 3) in the low bytes of the two 16-bit halves; and keeps the two nibbles; one integer
# multiply by 2^6 + 2^12 (low nibbles, bits 0-3) or 2^2 + 2^8 (high, bits 4-7) writes each nibble
# twice in its half, at bits 6-9 and 12-15 (no overlap, so no carries); and keeps bits 6-8
# (magnitude) and 15 (sign) of each half. 3.5 instructions per two weights, as the "split_asm_sub"
# PTX, one of them an IMAD (FMA pipe) instead of an integer-ALU shift. Output slot i depends only on
# input byte i: elementwise exact whatever register order Triton packs into one asm instance.
def _asm_t(half: str) -> str:
    mask, mul = ("0x000F000F", "0x1040") if half == "lo" else ("0x00F000F0", "0x104")
    code = "{\n.reg .b32 t;\n"
    for r, sel in enumerate(("0x4140", "0x4342")):
        code += (f"prmt.b32 t, $2, 0, {sel};\nand.b32 t, t, {mask};\nmul.lo.u32 t, t, {mul};\n"
                 f"and.b32 ${r}, t, 0x81C081C0;\n")
    return code + "}"


def _nibble_asm_t(pb, layout: str = "k3"):
    """(low, high) nibbles of packed bytes as inline PTX (CUDA only), value * 2^-126 in bf16.
    layout "paired": the bytes are `paired.py` units (its 8-instruction PTX; not elementwise)."""
    from jax.experimental.pallas import triton as plgpu

    code = paired.ptx if layout == "paired" else _asm_t
    return tuple(plgpu.elementwise_inline_asm(
        code(half), args=[pb], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(pb.shape, jnp.bfloat16)])[0]
        for half in ("lo", "hi"))


def _dequant_split_t(pb, sb, dtype, use_asm: bool = False, layout: str = "k3"):
    """"split_asm_t": packed [bn, w] uint8 (w = 16 s, one K block) + scales [bn, w/16] -> (low,
    high) nibble weights [bn, w] in `dtype`, times 2^-14, columns in `_perm_t` order.

    On the GPU the PTX bits (value * 2^-126) times 2^(s-15); elsewhere the "bf16" bits (value *
    2^-125) times 2^(s-16): the same products (the CPU flushes the subnormal 0.5 of the former)."""
    w = pb.shape[-1]
    s = w // 16
    if use_asm and layout == "paired":
        pb = paired.units_in_place(pb)  # stored words -> unit bytes where the asm packs them
    pt = _perm_t(pb, s)
    if use_asm:
        (lo, hi), enc = _nibble_asm_t(pt, layout), "bf16_sub"
    else:
        (lo, hi), enc = _nibble_bits(pt, "bf16"), "bf16"
    sf = _perm_t(_expand_groups(_scale_factor(sb, enc), mxfp4.GROUP // 2), s)
    return _scaled(lo, sf, "bf16", dtype), _scaled(hi, sf, "bf16", dtype)


def _load(ref, mask):
    from jax.experimental.pallas import triton as plgpu

    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0)


def _gmm_kernel(meta_ref, x_ref, *refs, cfg: GmmConfig, k: int, n: int, g_count: int, quant: bool,
                n_w: int, epilogue, cdt, precision, use_asm: bool, layout: str = "k3"):
    from jax.experimental.pallas import triton as plgpu

    w_refs = refs[:-1]
    o_ref = refs[-1]
    bn, bk = cfg.block_n, cfg.block_k
    split, bits = dequant_variant(cfg.dequant) if quant else (False, "f16")
    half, hk, ng = bk // 2, k // 2, bk // mxfp4.GROUP  # per K block: packed columns, scale groups
    nb = pl.program_id(0)
    t = pl.program_id(1)
    grp = meta_ref[0, t]
    r0 = meta_ref[1, t]
    r1 = meta_ref[2, t]
    n_inner = cfg.n_per_program
    nb0 = nb * (bn * n_inner)  # this program's first column; column block j starts at nb0 + j bn
    n_k = pl.cdiv(k, bk)
    k_ragged = k % bk != 0
    n_ragged = n % (bn * n_inner) != 0
    edge = n_ragged or k_ragged  # weight loads need masks

    def col_ok(n0):
        return n0 + jnp.arange(bn, dtype=jnp.int32) < n

    def store(bm, val, n0, first=None):
        first = r0 if first is None else first  # the block's first row
        rows = first + jnp.arange(bm, dtype=jnp.int32)
        mask = (rows < r1)[:, None]
        if n_ragged:
            mask = mask & col_ok(n0)[None, :]
        plgpu.store(o_ref.at[pl.ds(first, bm), pl.ds(n0, bn)], val.astype(o_ref.dtype),
                    mask=mask)

    # "split_asm_t": the transposed product w [bn, kk] . x [bm, kk]^T -> [bn, bm] (weights as the
    # first operand: on Hopper a wgmma with the dequantised weights in registers and x read from
    # shared memory); columns in `_perm_t` order (x_ref holds them so, or `stride` indexes them).
    transposed = quant and bits == "asm_t"
    perm_s = half // 16  # `_perm_t` steps per K block

    def mm(xb, wb):
        """x [bm, kk] . w [bn, kk]^T -> [bm, bn] ([bn, bm] when transposed)."""
        if transposed:
            return plgpu.dot(wb, xb, trans_b=True, precision=precision)
        return plgpu.dot(xb, wb, trans_b=True, precision=precision)

    def compute(bm):
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        row_ok = rows < r1
        # the product transposed, w^T . x^T -> [bn, bm]: always in MXFP4 "split_asm_t", and for
        # dense weights on the short tiles when transpose_small
        tr_dense = not quant and cfg.transpose_small and bm < cfg.block_m
        tr = transposed or tr_dense

        def load_x(c0, width, part=None):
            """x columns [c0, c0 + width); part 0/1: of x's even/odd columns (c0 in half units)."""
            limit = k
            kcol = c0 + jnp.arange(width, dtype=jnp.int32)
            if part is None:
                ref = x_ref.at[pl.ds(r0, bm), pl.ds(c0, width)]
            elif cfg.x_split == "pre":  # x_ref is [2, M, K/2] ("split_asm_t": permuted, padded)
                ref = x_ref.at[jnp.int32(part), pl.ds(r0, bm), pl.ds(c0, width)]
                limit = x_ref.shape[-1]
            else:  # every other column of x (index arrays: the interpreter has no strided loads)
                if transposed:
                    kcol = _perm_t_index(kcol, perm_s)
                idx = 2 * kcol + part
                ref, limit = x_ref.at[rows[:, None], idx[None, :]], hk
            mask = row_ok[:, None]
            if k_ragged:
                mask = mask & (kcol < limit)[None, :]
            return plgpu.load(ref, mask=mask, other=0).astype(cdt)

        def fetch(kb, n0, xs=None):
            """K block kb's tiles: x (or its even / odd halves; `xs` if given: already loaded) and
            per weight its tile / packed bytes and scales (columns [n0, n0 + bn))."""

            def wmask(c0, width, limit):
                if not edge:
                    return None
                return col_ok(n0)[:, None] & (c0 + jnp.arange(width, dtype=jnp.int32)
                                              < limit)[None, :]

            k0, h0 = pl.multiple_of(kb * bk, bk), pl.multiple_of(kb * half, half)
            s0 = kb * ng
            if not quant:
                m_ = None
                if edge:
                    m_ = (k0 + jnp.arange(bk) < k)[:, None] & col_ok(n0)[None, :]
                return xs or (load_x(k0, bk),), [
                    _load(w_ref.at[grp, pl.ds(k0, bk), pl.ds(n0, bn)], m_).astype(cdt)
                    for w_ref in w_refs]
            if xs is None:
                xs = (load_x(h0, half, 0), load_x(h0, half, 1)) if split else (load_x(k0, bk),)
            ws = []
            for i in range(n_w):
                p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
                pb = _load(p_ref.at[grp, pl.ds(n0, bn), pl.ds(h0, half)], wmask(h0, half, hk))
                sb = _load(s_ref.at[grp, pl.ds(n0, bn), pl.ds(s0, ng)],
                           wmask(s0, ng, k // mxfp4.GROUP))
                ws.append((pb, sb))
            return xs, ws

        def step(tiles, accs):
            xs, ws = tiles
            if not quant:
                if tr_dense:  # w [bk, bn]^T . x [bm, bk]^T -> [bn, bm]
                    return tuple(acc + plgpu.dot(wb, xs[0], trans_a=True, trans_b=True,
                                                 precision=precision)
                                 for wb, acc in zip(ws, accs))
                return tuple(acc + plgpu.dot(xs[0], wb, precision=precision)
                             for wb, acc in zip(ws, accs))
            out = []
            for (pb, sb), acc in zip(ws, accs):
                if layout == "paired" and not (use_asm and transposed):
                    pb = paired.decode(pb, jnp)  # the interpreter: back to K3 bytes (rows 16-aligned)
                if transposed:
                    lo, hi = _dequant_split_t(pb, sb, cdt, use_asm, layout)
                    out.append(acc + mm(xs[0], lo) + mm(xs[1], hi))
                elif split:  # x's even/odd columns against the low/high nibbles, as loaded
                    lo, hi = _dequant_split(pb, sb, cdt, bits, use_asm)
                    out.append(acc + mm(xs[0], lo) + mm(xs[1], hi))
                else:
                    out.append(acc + mm(xs[0], _dequant_tile(pb, sb, cdt, bits)))
            return tuple(out)

        def finish(accs, n0):
            if quant:
                accs = tuple(a * _F16_SHIFT for a in accs)
            val = epilogue(*accs)
            store(bm, val.T if tr else val, n0)

        shape = (bn, bm) if tr else (bm, bn)
        accs = tuple(jnp.zeros(shape, jnp.float32) for _ in range(n_w))
        if n_inner > 1 and cfg.x_resident:  # x's K blocks once; a loop over column blocks
            xs_k = [fetch(jnp.int32(kb), nb0)[0] for kb in range(n_k)]

            def body_j(j, carry):
                n0 = pl.multiple_of(nb0 + j * bn, bn)
                acc_j = accs
                for kb in range(n_k):
                    acc_j = step(fetch(jnp.int32(kb), n0, xs_k[kb]), acc_j)
                finish(acc_j, n0)
                return carry
            jax.lax.fori_loop(0, n_inner, body_j, ())
        elif n_inner > 1:  # one loop over (column block j, K block kb), stored at each j's end
            def body(i, accs):
                j = i // n_k
                kb = i - j * n_k
                n0 = pl.multiple_of(nb0 + j * bn, bn)
                accs = step(fetch(kb, n0), accs)
                last = kb == n_k - 1

                @pl.when(last)
                def _():
                    finish(accs, n0)
                return tuple(jnp.where(last, jnp.zeros_like(a), a) for a in accs)
            jax.lax.fori_loop(0, n_inner * n_k, body, accs)
        else:
            finish(jax.lax.fori_loop(0, n_k, lambda kb, a: step(fetch(kb, nb0), a), accs), nb0)

    def compute_fused_tail():
        """A tile of block_m + up to block_m_small rows: each K step's weight tile (dense, or
        MXFP4 dequantised once in "split_asm_t") feeds the block_m rows' product and the tail's
        (transposed, w^T . x^T, when transpose_small; always for "split_asm_t")."""
        bm, bt = cfg.block_m, cfg.block_m_small
        rt0 = r0 + bm
        tail_tr = transposed or cfg.transpose_small

        def load_rows(first, rows_n, c0, width, part=None):
            rows = first + jnp.arange(rows_n, dtype=jnp.int32)
            mask = (rows < r1)[:, None]
            if part is None:
                ref, limit = x_ref.at[pl.ds(first, rows_n), pl.ds(c0, width)], k
            else:  # a SplitX: [2, M, K'/2]
                ref = x_ref.at[jnp.int32(part), pl.ds(first, rows_n), pl.ds(c0, width)]
                limit = x_ref.shape[-1]
            if k_ragged:
                mask = mask & (c0 + jnp.arange(width, dtype=jnp.int32) < limit)[None, :]
            return plgpu.load(ref, mask=mask, other=0).astype(cdt)

        def wmask(n0, c0, width, limit):
            if not edge:
                return None
            return col_ok(n0)[:, None] & (c0 + jnp.arange(width, dtype=jnp.int32) < limit)[None, :]

        def body(kb, accs):
            main, tail = list(accs[:n_w]), list(accs[n_w:])
            if quant:  # "split_asm_t": both products w . x^T on one dequantised tile
                h0 = pl.multiple_of(kb * half, half)
                xm = [load_rows(r0, bm, h0, half, p) for p in (0, 1)]
                xt = [load_rows(rt0, bt, h0, half, p) for p in (0, 1)]
                for i in range(n_w):
                    p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
                    pb = _load(p_ref.at[grp, pl.ds(nb0, bn), pl.ds(h0, half)],
                               wmask(nb0, h0, half, hk))
                    sb = _load(s_ref.at[grp, pl.ds(nb0, bn), pl.ds(kb * ng, ng)],
                               wmask(nb0, kb * ng, ng, k // mxfp4.GROUP))
                    if layout == "paired" and not use_asm:
                        pb = paired.decode(pb, jnp)  # the interpreter: back to K3 bytes
                    lo, hi = _dequant_split_t(pb, sb, cdt, use_asm, layout)
                    main[i] = main[i] + mm(xm[0], lo) + mm(xm[1], hi)
                    tail[i] = tail[i] + mm(xt[0], lo) + mm(xt[1], hi)
                return (*main, *tail)
            k0 = pl.multiple_of(kb * bk, bk)
            m_ = None
            if edge:
                m_ = (k0 + jnp.arange(bk) < k)[:, None] & col_ok(nb0)[None, :]
            xm, xt = load_rows(r0, bm, k0, bk), load_rows(rt0, bt, k0, bk)
            for i, w_ref in enumerate(w_refs):
                wb = _load(w_ref.at[grp, pl.ds(k0, bk), pl.ds(nb0, bn)], m_).astype(cdt)
                main[i] = main[i] + plgpu.dot(xm, wb, precision=precision)
                if cfg.transpose_small:
                    tail[i] = tail[i] + plgpu.dot(wb, xt, trans_a=True, trans_b=True,
                                                  precision=precision)
                else:
                    tail[i] = tail[i] + plgpu.dot(xt, wb, precision=precision)
            return (*main, *tail)

        main_shape = (bn, bm) if transposed else (bm, bn)
        tail_shape = (bn, bt) if tail_tr else (bt, bn)
        accs = tuple([jnp.zeros(main_shape, jnp.float32)] * n_w
                     + [jnp.zeros(tail_shape, jnp.float32)] * n_w)
        accs = jax.lax.fori_loop(0, n_k, body, accs)
        if quant:
            accs = tuple(a * _F16_SHIFT for a in accs)
        val = epilogue(*accs[:n_w])
        store(bm, val.T if transposed else val, nb0)
        val = epilogue(*accs[n_w:])
        store(bt, val.T if tail_tr else val, nb0, first=rt0)

    is_zero = grp == g_count
    is_work = (grp >= 0) & (grp < g_count) & (r1 > r0)
    if cfg.fuse_tail:  # tiles past block_m rows: the fused pair; the rest as below
        fused = (r1 - r0) > cfg.block_m
        pl.when(is_work & fused)(compute_fused_tail)
        is_work = is_work & jnp.logical_not(fused)

    @pl.when(is_zero & (r1 > r0))
    def _():
        for j in range(n_inner):
            store(cfg.block_m, jnp.zeros((cfg.block_m, bn), jnp.float32), nb0 + j * bn)

    bms = cfg.block_m_small
    if bms is not None and bms < cfg.block_m:
        small = (r1 - r0) <= bms

        @pl.when(is_work & small)
        def _():
            compute(bms)

        @pl.when(is_work & jnp.logical_not(small))
        def _():
            compute(cfg.block_m)
    else:
        @pl.when(is_work)
        def _():
            compute(cfg.block_m)


@jax.tree_util.register_pytree_node_class
class SplitX:
    """x [M, K] in the layout the MXFP4 "split*" kernels read with x_split="pre": data [2, M, K'/2]
    (x's even, then odd columns; "split_asm_t": in `_perm_t` order per K block, K' = K padded to
    whole blocks of `block_k`). `split_x` builds it; `moe_gmm` takes it in place of x when its
    config needs this layout (checked), so a caller can split once for several products (gate
    and up) or before a row gather (`take`: the MoE layer splits its N tokens, not the N * top-k
    gathered rows: splitting the gathered rows was a visible share of a TP8 rank's gate+up)."""

    def __init__(self, data, k: int, block_k: int, dequant: str):
        self.data, self.k, self.block_k, self.dequant = data, k, block_k, dequant

    def tree_flatten(self):
        return (self.data,), (self.k, self.block_k, self.dequant)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self):
        return (self.data.shape[1], self.k)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return 2

    def take(self, rows):
        """The split of x[rows] (a gather of rows; columns untouched)."""
        return SplitX(jnp.take(self.data, rows, axis=1), self.k, self.block_k, self.dequant)

    def dense(self):
        """x [M, K] back (the reference backend, configs that read x as it is)."""
        d = self.data
        if self.dequant == "split_asm_t":
            d = _perm_t_inverse(d, self.block_k // 32)
        m = d.shape[1]
        return jnp.moveaxis(d, 0, 2).reshape(m, -1)[:, : self.k]


def needs_split_x(cfg: GmmConfig) -> bool:
    """Whether the kernel of `cfg` (MXFP4 weights) reads x as a `SplitX`."""
    return dequant_variant(cfg.dequant)[0] and cfg.x_split == "pre"


def split_x(x, config: GmmConfig):
    """x [M, K] -> `SplitX` for MXFP4 products with `config` (see `needs_split_x`)."""
    if not needs_split_x(config):
        raise ValueError(f"config {config.name()} reads x as it is (dequant {config.dequant!r}, "
                         f"x_split {config.x_split!r}); split_x is for the 'split*' variants with "
                         f"x_split='pre'")
    m, k = x.shape
    xp = x
    if config.dequant == "split_asm_t" and k % config.block_k:  # whole K blocks for `_perm_t`
        xp = jnp.pad(x, ((0, 0), (0, -k % config.block_k)))
    d = jnp.moveaxis(xp.reshape(m, xp.shape[1] // 2, 2), 2, 0)  # [2, M, K/2]: even, odd
    if config.dequant == "split_asm_t":
        d = _perm_t(d, config.block_k // 32)
    return SplitX(d, k, config.block_k, config.dequant)


def gather_rows(x, rows, w, *, backend: str | None = None, fused_glu: bool = False):
    """x[rows] as moe_gmm(., w) (default config; `fused_glu`: moe_gmm_glu(fuse=True)) reads it:
    where that kernel reads a `SplitX`, x's own rows are split and then gathered, so the split
    touches x (the MoE layer's N tokens) instead of the N * top-k gathered rows."""
    backend = resolve_backend(backend)
    if backend == "reference" or not is_mxfp4(w):
        return x[rows]
    gathered = jax.ShapeDtypeStruct((rows.shape[0], x.shape[1]), x.dtype)  # what moe_gmm sees
    cfg = _resolve_config(gathered, (w, w) if fused_glu else (w,), None, backend == "interpret")
    return split_x(x, cfg).take(rows) if needs_split_x(cfg) else x[rows]


def _check(x, ws, group_sizes):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got {x.shape}")
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) != 1:
        raise ValueError(f"weights disagree in shape: {shapes}")
    g, k, n = ws[0].shape
    if k != x.shape[1]:
        raise ValueError(f"x has K={x.shape[1]}, weights have K={k}")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes.shape}")
    if any(is_mxfp4(w) for w in ws) and not all(is_mxfp4(w) for w in ws):
        raise ValueError("mixing MXFP4 and dense weights in one call is not supported")
    return g, k, n


def _resolve_config(x, ws, config, interpret):
    """The config a moe_gmm call runs: `config`, else default_config of the shapes."""
    if config is not None:
        return config
    g, k, n = ws[0].shape
    quant = is_mxfp4(ws[0])
    return default_config(x.shape[0], g, k, n, quant, len(ws) > 1,
                          platform="interpret" if interpret else None, x_dtype=x.dtype,
                          layout=ws[0].layout if quant else "k3")


def _gmm_pallas(x, ws, group_sizes, *, epilogue, out_dtype, config, interpret, precision):
    g, k, n = _check(x, ws, group_sizes)
    m = x.shape[0]
    quant = is_mxfp4(ws[0])
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    cdt = x.dtype if quant else jnp.promote_types(x.dtype, ws[0].dtype)
    if precision is None and jnp.dtype(cdt) == jnp.float32:
        precision = jax.lax.Precision.HIGHEST
    layout = ws[0].layout if quant else "k3"
    if quant and any(w.layout != layout for w in ws):  # (a jax.Array has its own .layout)
        raise ValueError("mixing MXFP4 layouts (k3 / paired) in one call is not supported")
    cfg = _resolve_config(x, ws, config, interpret)
    if layout == "paired":
        _check_paired(cfg, interpret)
    if quant and cfg.transpose_small:
        raise ValueError("transpose_small applies to dense weights; MXFP4 weights take the "
                         "transposed product through dequant='split_asm_t'")
    if quant and (cfg.block_k % mxfp4.GROUP or k % mxfp4.GROUP):
        raise ValueError(f"MXFP4 needs block_k and K multiples of {mxfp4.GROUP}")
    if quant and needs_split_x(cfg):
        if not isinstance(x, SplitX):
            x = split_x(x, cfg)
        elif (x.block_k, x.dequant) != (cfg.block_k, cfg.dequant):
            raise ValueError(f"x was split for block_k={x.block_k}, dequant={x.dequant!r}; the "
                             f"config is {cfg.name()}: split it with split_x(x, config) for the "
                             f"config moe_gmm runs (default_config of the same shapes)")
        x_in = x.data
    else:
        x_in = x.dense() if isinstance(x, SplitX) else x
    if cfg.fuse_tail and quant and (cfg.dequant != "split_asm_t" or cfg.x_split != "pre"):
        raise ValueError("fuse_tail with MXFP4 weights needs dequant='split_asm_t' with x_split="
                         f"'pre' (one dequantised tile for both products), got {cfg.name()}")
    meta = tile_plan(group_sizes, m, cfg.block_m, interpret=interpret,
                     tail=cfg.block_m_small if cfg.fuse_tail else 0)  # one launch
    n_tiles = meta.shape[1]
    flat_w = []
    for w in ws:
        flat_w += [w.packed, w.scales] if quant else [w]
    kernel = functools.partial(_gmm_kernel, cfg=cfg, k=k, n=n, g_count=g, quant=quant,
                               n_w=len(ws), epilogue=epilogue, cdt=cdt, precision=precision,
                               use_asm=not interpret, layout=layout)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(n, cfg.block_n * cfg.n_per_program), n_tiles),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="moe_gmm",
    )(meta, x_in, *flat_w)


def _check_paired(cfg: GmmConfig, interpret: bool):
    """The paired layout decodes with CUDA PTX in the "split_asm_t" product only (the interpreter
    decodes it back to K3 bytes in the kernel, any variant)."""
    if cfg.block_n % paired.ROWS:
        raise ValueError(f"paired MXFP4 weights need block_n a multiple of {paired.ROWS}, "
                         f"got {cfg.block_n}")
    if not interpret and cfg.dequant != "split_asm_t":
        raise ValueError(f"paired MXFP4 weights are decoded by the CUDA 'split_asm_t' kernel only "
                         f"(config dequant={cfg.dequant!r}); use dequant='split_asm_t' on an NVIDIA "
                         f"GPU, or load the weights in the K3 layout (mxfp4_layout='k3') elsewhere")


def moe_gmm(x, w, group_sizes, *, backend: str | None = None, preferred_element_type=None,
            config: GmmConfig | None = None, precision=None):
    """Grouped matmul, `jax.lax.ragged_dot` semantics: out[i] = x[i] @ w[group(i)].

    x [M, K]; w [G, K, N] dense or `MXFP4Weight(packed [G, N, K/2], scales [G, N, K/32])`;
    group_sizes [G] int32, sum <= M (rows past the sum are zero). fp32 accumulation; output in
    `preferred_element_type` or x.dtype. backend: "reference" | "pallas" | "interpret" | None.
    """
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if backend == "reference":
        x = x.dense() if isinstance(x, SplitX) else x
        return moe_gmm_reference(x, w, group_sizes, preferred_element_type=out_dtype)
    return _gmm_pallas(x, (w,), group_sizes, epilogue=lambda a: a, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision)


def moe_gmm_glu(x, w1, w3, group_sizes, *, activation: str = "swiglu", backend: str | None = None,
                preferred_element_type=None, config: GmmConfig | None = None, precision=None,
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0, fuse: bool = False):
    """Gate/up: act(x @ w1[g]) * (x @ w3[g]) (activation "swiglu" or "situ": SiTU(a) *
    25 tanh(b / 25)). w1, w3 as in `moe_gmm` (both dense or both MXFP4). `fuse`: one pass over
    x with both products and the activation in the kernel's epilogue; False: two `moe_gmm`
    launches with fp32 outputs, then the activation in XLA (same math, an [M, N] fp32 pair in
    memory). Unfused is the default: inside the K3 layer on the GPU it was faster at 64, 512
    and 8192 tokens, MXFP4 and bf16, even with the fused kernel's
    half-width blocks that no longer spill."""
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if not fuse and backend != "reference":
        cfg = _resolve_config(x, (w1,), config, backend == "interpret")
        if is_mxfp4(w1) and needs_split_x(cfg) and not isinstance(x, SplitX):
            x = split_x(x, cfg)  # once for both products
        a, b = (moe_gmm(x, w, group_sizes, backend=backend, preferred_element_type=jnp.float32,
                        config=config, precision=precision) for w in (w1, w3))
        return glu(a, b, activation, situ_beta=situ_beta,
                   situ_linear_beta=situ_linear_beta).astype(out_dtype)
    if isinstance(x, SplitX) and backend == "reference":
        x = x.dense()
    if backend == "reference":
        return moe_gmm_glu_reference(x, w1, w3, group_sizes, activation=activation,
                                     preferred_element_type=out_dtype, situ_beta=situ_beta,
                                     situ_linear_beta=situ_linear_beta)
    glu(jnp.zeros(()), jnp.zeros(()), activation)  # validate the name early
    epi = functools.partial(glu, activation=activation, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)
    return _gmm_pallas(x, (w1, w3), group_sizes, epilogue=epi, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision)
