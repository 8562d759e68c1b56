"""Absorbed MLA decode against a paged latent cache: flash-decoding in Pallas (Triton lowering).

Math and shapes: see reference.py. Kernel layout:

* Rows. The Tq query tokens and Hq heads of a sequence are flattened into Tq*Hq rows (row
  r = t*Hq + h) and padded to a multiple of the row block `block_h` (a power of two >= 16: Triton
  dots need >= 16 rows), e.g. 12 heads x 1 token -> 16 rows. Padded rows are computed and then
  discarded. Each row carries its causal offset t - Tq + 1, so row r sees positions
  < length + offset.
* Grid (head_blocks, num_splits, batch), head blocks fastest so the programs that read the same
  stretch of cache run side by side (the second read hits L2). Program (h, s, b) walks split s of
  sequence b: the history [0, length) is cut into num_splits equal spans (rounded up to block_k),
  computed from the runtime length, so a short sequence in a large page table does not leave
  most programs idle and a long one is spread over all of them.
* Each step reads block_k tokens, the latent part [block_k, 512] and the rope part [block_k, 64]
  as two power-of-two operands of one load each (576 is not a power of two), and runs
  s = q_lat c^T + q_rope k_rot^T and o += p c with the same latent tile (it is read from memory
  once; V is not re-loaded), with an fp32 online softmax in base 2. Two ways to find the tokens
  (`load`):
  - "page" (default where page_size % block_k == 0): a step never crosses a page, so it needs
    one page id and reads block_k consecutive rows of that page. The page ids of a chunk of
    steps are read into a vector before the inner loop, so no tile address inside that loop
    depends on a load of the same loop and Triton pipelines num_stages - 1 tiles ahead.
  - "token": a page-table lookup per token inside the loop (any page_size, block_k > page_size
    too). Triton treats the tile load as indirect: one tile in flight, issued after the step's
    compute, whatever num_stages says.
  Masked loads (other = 0) keep garbage in unused slots out of the result.
* fp8 cache (float8_e4m3fn). A per-tensor scale is folded into the score multiplier and the
  output; a per-token scale multiplies the score columns and the probabilities (p * s_t) before
  the PV dot, never the [block_k, 576] tile. The tile's e4m3 -> bf16 conversion (`fp8_upcast`)
  decides whether the tile load is pipelined at all:
  - "operand" (the first kernel): `astype(bf16)` right before the dots. Triton moves the
    conversion into each dot's operand layout, and an 8-bit transposed operand (the QK^T side)
    has no shared-memory path, so the fp8 tile is loaded synchronously into registers (not
    pipelined), staged twice and converted twice (it spills): slower than bf16 while reading
    half the bytes.
  - "tile": convert once through fp32 and an opaque 1.0 factor (a runtime scalar), which Triton
    leaves in place: the fp8 tile is pipelined with cp.async and both dots read bf16 copies
    (Triton makes two, one per operand layout: more shared memory).
  - "mixed": QK^T reads the "tile" bf16 copy, PV converts the fp8 operand in registers; one
    fp8 buffer per stage plus one bf16 copy, the load pipelined.
  `fp8_dot` chooses the dtype the dots run in: "bf16", or "fp16" (the default, with
  "operand"): e4m3 -> fp16 is exact and one hardware conversion, and q rows are divided by
  their max |q| (the score multiplied back) so that no bf16 q overflows fp16.
  All three stage 8-bit data through registers and shared memory every step (an 8-bit
  transposed operand has no ldmatrix path): far below copy bandwidth, slower in time than a
  bf16 cache of twice the bytes.
* fp8 cache in the words form (uint16 [num_pages, page_size, 288], `fp8_to_words`; the same
  bytes, two e4m3 values a word): the "words" upcasts. The tile is 16-bit, so Triton treats it
  like a bf16 tile (cp.async pipelined, ldmatrix with .trans for PV and without for QK^T, no
  staging) and the e4m3 -> fp16 conversion is an elementwise op on the dot operands in
  registers: each word's low byte is latent column 2d, its high byte column 2d + 1, so
  s = q_even . lo(W)^T + q_odd . hi(W)^T (+ the rope part likewise) and the PV product fills
  two accumulators, the even and odd output columns, interleaved once at the end. "words":
  PTX, one prmt (the two low or high bytes of a register's two words) and one
  cvt.rn.f16x2.e4m3x2 per two values, exact; "words_int": integer ops (value * 2^-8, PTX on
  NVIDIA, jnp elsewhere: the portable one). "words" is several times faster than "operand" and
  faster than bf16 in time; "words_int" a little slower than "words".
  "words_pairs" (the CUDA default): PV as "words"; QK^T converts each word
  whole, one cvt and no prmt, since a 16-bit dot operand's register holds two k-adjacent words
  of one token and their four bytes are latent columns 4i..4i+3: one dot takes the first word's
  two values (columns 4i, 4i + 1), the other the second's, with q's columns permuted to match
  (`word_q_columns`). Not an elementwise op: it relies on Triton packing k-adjacent words
  (checked on the GPU by `python -m benchmarks mla`; "words" does not). Fewer instructions a
  warp a step than "words" (offline SASS), and faster with `lat_chunks` 1 (each QK^T dot its
  own accumulator: Triton had folded the four into one HMMA chain).
* q rows for fp16 dots are scaled (and, for the words form, split into even / odd columns by
  strided loads) inside the kernel at 16-row blocks, before it for larger blocks.
* Each program writes its normalised partial o (`partials`: bf16 when the output is 16-bit,
  else fp32) and lse (fp32, -inf when it saw no key); the splits are merged exactly by one more
  Pallas kernel (merge.py; `merge="xla"`: the plain-JAX `merge_stacked`, about six XLA
  kernels, slower); the split policy counts that traffic at fp32 size, 2 x 4 B x 513 per row and
  split (with bf16 partials it is about half; a sweep still found the policy's split count best
  at B1). One split needs no merge.

Splits (`num_splits`, an int or a policy): the grid has B * head_blocks * num_splits programs;
with equal lengths each takes the same time, so a program count just above a multiple of the
resident programs (SMs x programs per SM) costs a whole extra wave. "waves" (default) picks the
split count from a small cost model (see `choose_num_splits`); "fill" is the earlier rule
(about 2 x SMs programs, >= 256 tokens each), which gave 272 programs for 264 slots at B16.

Shared memory (`smem_bytes`): per buffered stage block_k * 576 * itemsize, x max(1,
num_stages - 1), + the fp8 bf16 copies + q. For ROCm MI300X (64 KiB LDS) use block_k 32,
num_stages 1-2, load "token" or "page".

Speed (GPU time of the whole op against the copy bandwidth measured in the same run, by batch,
context, heads and cache form): BENCHMARKS.md, MLA decode. Batch 1 carries a fixed cost a call
in this kernel plus the merge. See default_config for what was not measured.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .softmax import online_softmax_step
from .._backend import kernel_platform, num_sms as device_sms, resolve_backend, triton_params
from .merge import MERGE_CHUNK, merge_splits_pallas
from .reference import (CACHE_DIM, LATENT, ROPE, WORDS, WORDS_DTYPE, is_words, merge_stacked,
                        mla_decode_reference)

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

SPLIT_POLICIES = ("waves", "fill")
LOADS = ("page", "token")
# The "words" upcasts and the conversion each runs on both dots' operands (_e4m3_word_halves).
# Mixed forms (one dot "cvt", the other "int", to spread the work over two pipes) were timed and
# lost to "words" at most shapes; not kept.
WORD_CONVERSIONS = {"words": "cvt", "words_int": "int", "words_pairs": "cvt"}
# "words_pairs": PV as "words"; QK^T converts each word whole (its two bytes are latent columns
# 2d, 2d + 1, a natural k pair of the dot) with no byte gather, q's columns permuted to match
PAIR_UPCASTS = ("words_pairs",)
WORD_UPCASTS = tuple(WORD_CONVERSIONS)
FP8_UPCASTS = ("mixed", "tile", "operand") + WORD_UPCASTS
FP8_DOTS = ("bf16", "fp16")
MERGES = ("pallas", "xla")
LAT_CHUNKS = (0, 1, 2, 4)
PARTIALS = ("float32", "bfloat16")

# Hopper (sm_90) per-SM limits used by the occupancy estimate.
_SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED_PER_CTA = 1024
_REGS_PER_SM = 65536
_MAX_WARPS_PER_SM = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def smem_bytes(block_h: int, block_k: int, num_stages: int, itemsize: int = 2,
               fp8_upcast: str = "mixed") -> int:
    """Estimated shared memory of one program (within ~4% of what Triton 3.9 allocates for
    sm_90): the pipelined cache tiles (num_stages - 1 buffers, at least one), for fp8 the bf16
    copies the dots read ("tile": two, "mixed": one), q staged for the dots, p, scratch."""
    tile = block_k * CACHE_DIM
    total = max(1, num_stages - 1) * tile * itemsize
    if itemsize == 1:
        total += {"tile": 2, "mixed": 1}.get(fp8_upcast, 0) * tile * 2
    return total + block_h * CACHE_DIM * 2 + block_h * block_k * 2 + 2048


def programs_per_sm(block_h: int, block_k: int, num_warps: int, num_stages: int,
                    itemsize: int = 2, fp8_upcast: str = "mixed") -> int:
    """Estimated resident programs per SM (shared memory, registers, warps). Registers: the fp32
    accumulator [block_h, 512] and scores per thread plus 64 (bf16; what ptxas reports for these
    kernels, within ~10%), or the 255 maximum for fp8 (ptxas uses all of them there)."""
    smem = smem_bytes(block_h, block_k, num_stages, itemsize, fp8_upcast) + _SMEM_RESERVED_PER_CTA
    by_smem = _SMEM_PER_SM // smem
    threads = 32 * num_warps
    regs = block_h * (LATENT + block_k) // threads + 64
    regs = 255 if itemsize == 1 else min(255, regs)
    regs = -(-regs // 8) * 8
    by_regs = _REGS_PER_SM // (regs * threads)
    return max(1, min(by_smem, by_regs, _MAX_WARPS_PER_SM // num_warps))


def choose_num_splits(batch: int, n_hblk: int, capacity: int, block_k: int, *, rows_p: int,
                      slots: int, itemsize: int = 2, policy: str = "waves",
                      num_sms: int | None = None) -> int:
    """Number of history splits per sequence, for B sequences of up to `capacity` tokens.

    "waves": minimise  waves * (steps per program + C0)  +  partials' traffic,  with
    waves = ceil(B * n_hblk * splits / slots) (slots = SMs x resident programs per SM),
    steps = ceil(key blocks / splits), C0 = 2 steps (launch, q load, pipeline fill, the
    partial's store), and the partials (fp32 o, written by the kernel and read by the merge)
    counted in steps of all slots. Ties go to fewer splits. A program count just past a
    multiple of the slots costs a whole extra wave: the rule before (below) gave 272 programs
    for 264 slots at B16 and 320 at B64.
    "fill": about 2 x SMs programs, each with >= 256 tokens (the rule before the sweep).
    "waves" takes at most MERGE_CHUNK (128) splits: the merge reads that many in one load, and
    a second chunk cost it more than the kernel gained (measured at B1 32K, 256 against 128
    splits).
    """
    nblk = max(1, -(-capacity // block_k))
    base = max(1, batch * n_hblk)
    if policy == "fill":
        target = 2 * (num_sms or device_sms())
        splits = max(1, -(-target // base))
        return max(1, min(splits, max(1, capacity // 256), nblk))
    if policy != "waves":
        raise ValueError(f"split policy {policy!r} is not one of {SPLIT_POLICIES}")
    c0 = 2.0
    step_bytes = slots * block_k * CACHE_DIM * itemsize
    best, best_t = 1, None
    for s in range(1, min(nblk, 4 * slots, MERGE_CHUNK) + 1):
        waves = -(-base * s // slots)
        steps = -(-nblk // s)
        partials = batch * s * rows_p * (LATENT + 1) * 4 * 2 / step_bytes
        t = waves * (steps + c0) + partials
        if best_t is None or t < best_t - 1e-9:
            best, best_t = s, t
    return best


def default_config(batch: int, rows: int, capacity: int, dtype, page_size: int | None = None,
                   *, num_sms: int | None = None, platform: str | None = None) -> dict:
    """Block configuration for B sequences of `rows` = Tq * Hq query rows and a page table of
    `capacity` tokens: row block, key block, warps, stages, load mode, fp8 upcast, splits.

    Each choice below is the fastest of a GPU sweep against the other candidates in the same
    run (`python -m benchmarks mla`; figures in BENCHMARKS.md), unless it says otherwise.
    bf16 cache, rows <= 16 (Tq * Hq <= 16: e.g. 16 or 12 heads at Tq 1): 64-key blocks, 4 warps,
    3 stages, "page" load, "waves" splits: faster at every shape than the 32-key / 8-warp blocks
    before. When page_size is not a multiple of 64 (the engine's default 16-token pages) the
    64-key blocks use the "token" load, whose tile load is not pipelined, with 2 stages.
    bf16, 64-row blocks (many heads: 96 or 128 heads on one GPU, as under DCP, or Tq * Hq > 32):
    64-key blocks, 8 warps, 2 stages (wgmma; most of sm_90's shared memory and registers):
    faster than 32-key blocks at 2 or 3 stages and than 32-row blocks. Compute-bound there: each
    step waits for its load, then runs QK^T, the softmax and PV one after the other.
    Not measured, so still chosen from sm_90 compiles (Triton on CPU: shared memory, registers,
    which loads are pipelined): bf16 rows 17-32 and fp32 caches: 32-key blocks, 8 warps, 3 stages
    (64-key blocks at 3 stages would not fit an fp32 tile pair in 227 KiB); fp8 64-row blocks:
    32-key blocks, 8 warps, 2 stages.
    fp8 words form (uint16 cache): "words_pairs" with lat_chunks 1 (one accumulator per QK^T
    dot), fp16 dots, 64-key blocks, 4 warps, 3 stages at 16-row blocks: ahead of "words" and of
    lat_chunks 0, 2 and 4 at every 16-head shape from B16 32K up, in repeated calls; the blocks
    beat 8 warps, 2 or 4 stages and 32-key blocks, and "words_int" is slower. 64-row blocks
    (96-128 heads, as under DCP): "words", 64-key blocks, 8 warps, 2 stages, lat_chunks 0
    (faster than "words_pairs" at 32-key blocks or 1 stage, and than 16-key blocks, which spill
    least offline); still slower than bf16 there: the conversion is one more serial phase of a
    step in a kernel bound by its step's latency (1 program an SM). "words_int" on ROCm (no PTX
    there; not run on AMD).
    fp8 (float8 cache): 64-key blocks, 8 warps, 3 stages, "operand" upcast with fp16 dots: the
    fastest float8 configuration at every 16-head shape (faster than the "mixed" bf16
    configuration that was the default), but still slower in time than bf16 (Triton stages the
    converted tile through shared memory or registers: see the module docstring).
    """
    words = dtype is not None and jnp.dtype(dtype) == WORDS_DTYPE
    itemsize = 1 if words else (jnp.dtype(dtype).itemsize if dtype is not None else 2)
    block_h = min(max(16, _next_pow2(rows)), 64)
    n_hblk = -(-rows // block_h)
    fp8_upcast, fp8_dot = ("operand", "fp16") if itemsize == 1 else ("mixed", "bf16")
    rocm = (platform or kernel_platform()) == "rocm"
    lat_chunks = 0
    if words:
        # 64-row blocks (wgmma): "words" converts each tile once for both dots ("pairs" twice)
        fp8_upcast = "words_int" if rocm else ("words_pairs" if block_h == 16 else "words")
        block_k, num_warps, num_stages = (64, 4, 3) if block_h == 16 else (64, 8, 2)
        lat_chunks = 1 if (block_h == 16 and not rocm) else 0     # measured: see the docstring
    elif block_h == 64 and itemsize == 2:         # measured (see above)
        block_k, num_warps, num_stages = 64, 8, 2
    elif block_h == 64:
        block_k, num_warps, num_stages = 32, 8, 2
    elif itemsize == 1:
        block_k, num_warps, num_stages = (64 if block_h == 16 else 32), 8, 3
    elif itemsize == 2 and block_h == 16:       # measured (see above)
        paged = page_size is None or page_size % 64 == 0
        block_k, num_warps, num_stages = 64, 4, (3 if paged else 2)
    else:
        block_k, num_warps, num_stages = 32, 8, 3
    if rocm:
        # The CUDA choices do not fit AMD: bk64 w4 st3 compiles (upstream Triton, offline)
        # to more LDS than MI300X's 64 KiB and spills on gfx942. 32-key blocks, 4 warps
        # (wave64), one stage fit the LDS without spills on gfx942 / gfx950, bf16 and fp8
        # (16 rows; `python -m benchmarks resources`). Not run on AMD.
        block_k, num_warps, num_stages = min(block_k, 32), 4, 1
    sms = num_sms or device_sms()
    slots = sms * programs_per_sm(block_h, block_k, num_warps, num_stages, itemsize, fp8_upcast)
    splits = choose_num_splits(batch, n_hblk, capacity, block_k, rows_p=n_hblk * block_h,
                               slots=slots, itemsize=itemsize, num_sms=sms)
    load = "page" if page_size is None or page_size % block_k == 0 else "token"
    return dict(block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                num_splits=splits, load=load, fp8_upcast=fp8_upcast, fp8_dot=fp8_dot,
                lat_chunks=lat_chunks)


# the "int" conversion gives e4m3 values * 2^-8 (folded back into the score / output multiplier)
_CONV_SCALE = {"cvt": 1.0, "int": 256.0}


def _cvt_asm(sel: str) -> str:
    # prmt gathers two bytes (one from each word of the register) into the low 16 bits
    return ("{ .reg .b32 t; .reg .b16 h;\n"
            f"  prmt.b32 t, $1, 0, {sel};\n"
            "  cvt.u16.u32 h, t;\n"
            "  cvt.rn.f16x2.e4m3x2 $0, h; }")


# (low bytes, high bytes) of a 32-bit register of two words -> f16x2, per conversion
WORD_ASM = {
    "cvt": (_cvt_asm("0x20"), _cvt_asm("0x31")),
    "int": ("{ .reg .b32 y, t;\n  prmt.b32 y, $1, 0, 0x2404;\n  shr.b32 t, y, 1;\n"
            "  and.b32 t, t, 0x3f803f80;\n  sub.u32 $0, y, t; }",
            "{ .reg .b32 t, u;\n  shr.b32 t, $1, 1;\n  and.b32 t, t, 0x3f803f80;\n"
            "  and.b32 u, $1, 0x80008000;\n  or.b32 $0, u, t; }"),
}


# one register of two words (w0 low, w1 high) -> f16x2 of w0's two bytes / of w1's (two asm
# ops: Pallas' Triton lowering takes one result an op)
PAIR_ASM = tuple("{ .reg .b16 l, h;\n  mov.b32 {l, h}, $1;\n"
                 f"  cvt.rn.f16x2.e4m3x2 $0, {r}; }}" for r in ("l", "h"))


def _e4m3_word_pairs(w, ptx: bool):
    """uint16 words [..., n] (n even) of two e4m3 bytes -> (a, b) fp16 [..., n]: for each pair of
    adjacent words (w[2i], w[2i + 1]) a[2i], a[2i + 1] = w[2i]'s low, high byte and b[2i],
    b[2i + 1] = w[2i + 1]'s: one cvt per word and no byte gather. Not elementwise: on the GPU
    (PTX, pack=2) it relies on Triton packing the two words adjacent in the last axis into one
    register, as it does for the QK^T operand (16-bit dot operands pair k-adjacent elements);
    the GPU check of `python -m benchmarks mla` holds it to the reference."""
    if ptx:
        sd = jax.ShapeDtypeStruct(w.shape, jnp.float16)
        return tuple(plgpu.elementwise_inline_asm(
            asm, args=[w], constraints="=r,r", pack=2, result_shape_dtypes=[sd])[0]
            for asm in PAIR_ASM)
    b = lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint8)
    f = lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float16)  # [..., n/2, 2, 2]
    return tuple(f[..., i, :].reshape(w.shape) for i in (0, 1))


def word_q_columns(n_words: int, half: int, pairs: bool):
    """The latent / rope columns (offsets within the part) that meet a words tile of n_words
    words in the QK^T dot: `half` 0 / 1 = the first / second dot. Halves: the words' low / high
    bytes, columns 2k + half. Pairs (_e4m3_word_pairs): 4 (k // 2) + k % 2 + 2 half."""
    k = jnp.arange(n_words, dtype=jnp.int32)
    if pairs:
        return 4 * (k // 2) + k % 2 + 2 * half
    return 2 * k + half


def _e4m3_word_halves(w, conv: str, ptx: bool):
    """uint16 words of two e4m3 bytes -> (fp16 of each low byte, fp16 of each high byte).

    Elementwise on 16-bit data, so Triton keeps the tile 16-bit through shared memory (cp.async,
    then ldmatrix with and without .trans, as for a bf16 tile) and converts the dot operands in
    registers. conv "cvt": the exact values; on the GPU PTX's e4m3x2 -> f16x2 conversion (sm_89+),
    one prmt gathering the two low (high) bytes of a register's two words and one cvt per two
    values. "int": value * 2^-8 from integer ops (sign to bit 15, the 7 exponent / mantissa
    bits to bits 7..13: exact, subnormals included, an e4m3 NaN becomes a finite value): on
    NVIDIA GPUs as PTX on a register's two words (prmt, shift, and, sub for the low bytes; shift,
    and, and-or for the high), elsewhere (ROCm, the interpreter) the same bits with jnp."""
    if ptx:
        asms = WORD_ASM[conv]
        return tuple(plgpu.elementwise_inline_asm(
            asm, args=[w], constraints="=r,r", pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(w.shape, jnp.float16)])[0]
            for asm in asms)
    if conv == "cvt":
        b = lax.bitcast_convert_type(w, jnp.uint8)                          # [..., 2]
        f = lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float16)
        return f[..., 0], f[..., 1]
    lo = ((w << 8) & 0x8000) | ((w << 7) & 0x3F80)
    hi = (w & 0x8000) | ((w >> 1) & 0x3F80)
    return (lax.bitcast_convert_type(lo.astype(jnp.uint16), jnp.float16),
            lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.float16))


def _decode_kernel(len_ref, scal_ref, roff_ref, q_ref, pt_ref, cache_ref, *rest,
                   block_k: int, page_size: int, max_pages: int, num_splits: int,
                   has_token_scale: bool, row_scale: str | None, compute_dtype, load: str,
                   fp8_upcast: str | None, word_ptx: bool = False, lat_chunks: int = 0):
    rest = list(rest)
    tscale_ref = rest.pop(0) if has_token_scale else None
    qmul_ref = rest.pop(0) if row_scale == "input" else None
    o_ref, lse_ref = rest
    s_idx = pl.program_id(1)
    b = pl.program_id(2)
    length = len_ref[b]
    score_mult = scal_ref[0]        # softmax scale * log2(e) (* per-tensor cache scale)
    out_mult = scal_ref[1]          # per-tensor cache scale (1 otherwise)
    one = scal_ref[2]               # 1.0 that the compiler cannot see through (fp8 upcast)

    # This split's span of the history, from the runtime length.
    nblk_total = lax.div(length + (block_k - 1), block_k)
    blk_per_split = lax.div(nblk_total + (num_splits - 1), num_splits)
    start = s_idx * blk_per_split * block_k
    end = jnp.minimum(start + blk_per_split * block_k, length)
    n_iter = jnp.maximum(lax.div(end - start + (block_k - 1), block_k), 0)

    block_h = q_ref.shape[0]
    # fp16 dots (row_scale): fp16 holds e4m3 exactly and p in [0, 1] better than bf16, but not
    # every bf16 q, so each q row is divided by its max |q| (in [-1, 1] then) and the score
    # multiplied back. "kernel": done here on the program's rows; "input": q arrives divided,
    # cast and (words) with its columns in the kernel's order, qmul beside it
    if row_scale == "input":
        score_mult = score_mult * qmul_ref[...][:, None]
    elif row_scale == "kernel":
        amax = jnp.maximum(  # two power-of-two loads (Triton's blocks), not one of 576
            jnp.max(jnp.abs(q_ref[:, pl.ds(0, LATENT)].astype(jnp.float32)), axis=1),
            jnp.max(jnp.abs(q_ref[:, pl.ds(LATENT, ROPE)].astype(jnp.float32)), axis=1))
        qmul = jnp.where(amax > 0, amax, 1.0)
        score_mult = score_mult * qmul[:, None]

    def scaled(v):
        if row_scale == "kernel":
            v = v.astype(jnp.float32) / qmul[:, None]
        return v.astype(compute_dtype)

    words = fp8_upcast in WORD_UPCASTS
    pairs = fp8_upcast in PAIR_UPCASTS
    lat_w, rope_w = (LATENT // 2, ROPE // 2) if words else (LATENT, ROPE)

    # The latent in `nch` column chunks (a load, QK^T dots and PV accumulators each): with
    # lat_chunks > 0 every QK^T dot has an accumulator of its own, so their HMMA chains run side
    # by side; with 0 Triton folds "dot + x" into the dot's accumulator, one chain through all
    nch = max(1, lat_chunks)
    cw = lat_w // nch

    def q_word_cols(part, half, i=0):
        """q's columns that meet chunk i of a words tile in the QK^T dot (word_q_columns)."""
        base, n = (0, cw) if part == "lat" else (LATENT, rope_w)
        whole = lat_w if part == "lat" else rope_w
        if row_scale == "input":    # q arrives in the kernel's column order: a plain slice
            return scaled(q_ref[:, pl.ds(base + half * whole + i * n, n)])
        if not pairs:
            return scaled(q_ref[:, pl.ds(base + 2 * i * n + half, n, stride=2)])
        rows = jnp.arange(block_h, dtype=jnp.int32)
        cols = base + 2 * i * n + word_q_columns(n, half, True)
        return scaled(plgpu.load(q_ref.at[rows[:, None], cols[None, :]]))

    # per chunk the q columns of each dot (words: two, the low / high bytes or word pairs)
    if words:
        q_lat = [(q_word_cols("lat", 0, i), q_word_cols("lat", 1, i)) for i in range(nch)]
        q_rope = (q_word_cols("rope", 0), q_word_cols("rope", 1))
    else:
        q_lat = [(scaled(q_ref[:, pl.ds(i * cw, cw)]),) for i in range(nch)]
        q_rope = (scaled(q_ref[:, pl.ds(LATENT, ROPE)]),)
    lim = length + roff_ref[...]                       # [block_h]: row r sees pos < lim[r]
    offs = jnp.arange(block_k, dtype=jnp.int32)
    zero = jnp.zeros((), cache_ref.dtype)     # typed, so an fp8 cache gets an fp8 fill value

    def tile_upcast(x):
        # Through an opaque 1.0: Triton keeps this conversion where it is (one copy of the
        # tile in shared memory) instead of moving it into the dot operands. bf16 goes through
        # fp32 (Triton has no bf16 multiply); e4m3 -> fp16 is one hardware conversion and the
        # multiply stays in fp16 (half the registers of the fp32 route).
        if compute_dtype == jnp.float16:
            return x.astype(jnp.float16) * one.astype(jnp.float16)
        return (x.astype(jnp.float32) * one).astype(compute_dtype)

    def step(carry, base, page):
        """One key block at positions base + [0, block_k); page = its page id ("page" loads)."""
        acc, m_i, l_i = carry
        pos = base + offs                               # [block_k]
        valid = pos < end
        vmask = valid[:, None]

        def ld(ref, mask, fill=zero):
            return plgpu.load(ref, mask=mask, other=fill)

        if load == "page":
            rows = pl.ds(lax.rem(base, page_size), block_k)
            c = [ld(cache_ref.at[page, rows, pl.ds(i * cw, cw)], vmask) for i in range(nch)]
            kr = ld(cache_ref.at[page, rows, pl.ds(lat_w, rope_w)], vmask)
            ts = ld(tscale_ref.at[page, rows], valid, 0.0) if has_token_scale else None
        else:
            slot = jnp.minimum(lax.div(pos, page_size), max_pages - 1)
            tok = pt_ref[slot] * page_size + lax.rem(pos, page_size)
            cols_rope = lat_w + jnp.arange(rope_w, dtype=jnp.int32)
            # Gathers with two integer indexers (the interpreter has no int-array + slice mix).
            c = [ld(cache_ref.at[tok[:, None], (i * cw + jnp.arange(cw, dtype=jnp.int32))[None, :]],
                    vmask) for i in range(nch)]
            kr = ld(cache_ref.at[tok[:, None], cols_rope[None, :]], vmask)
            ts = ld(tscale_ref.at[tok], valid, 0.0) if has_token_scale else None
        mult = ts[None, :] * score_mult if has_token_scale else score_mult   # [bh, bk] or [bh, 1]
        # per chunk the operands of each dot: c_qk / r_qk for QK^T, c_pv for PV
        if words:
            # each 16-bit word holds dims 2d (low byte) and 2d + 1 (high byte) of one token;
            # both become fp16 in registers after the 16-bit tile's shared-memory load
            conv = WORD_CONVERSIONS[fp8_upcast]
            c_pv = [_e4m3_word_halves(ci, conv, word_ptx) for ci in c]
            if pairs:   # QK^T's: whole words, no byte gather (q's columns to match)
                c_qk = [_e4m3_word_pairs(ci, word_ptx) for ci in c]
                r_qk = _e4m3_word_pairs(kr, word_ptx)
            else:
                c_qk = c_pv
                r_qk = _e4m3_word_halves(kr, conv, word_ptx)
        elif fp8_upcast is None or fp8_upcast == "operand":
            c_qk = c_pv = [(ci.astype(compute_dtype),) for ci in c]
            r_qk = (kr.astype(compute_dtype),)
        elif fp8_upcast == "tile":
            c_qk = c_pv = [(tile_upcast(ci),) for ci in c]
            r_qk = (tile_upcast(kr),)
        else:   # "mixed": QK^T reads a bf16 copy, PV converts the fp8 operand in registers
            c_qk = [(tile_upcast(ci),) for ci in c]
            c_pv = [(ci.astype(compute_dtype),) for ci in c]
            r_qk = (tile_upcast(kr),)
        operands = [(qq, kk) for qc, kc in zip(q_lat, c_qk) for qq, kk in zip(qc, kc)]
        dots = [plgpu.dot(qq, kk, trans_b=True) for qq, kk in operands + list(zip(q_rope, r_qk))]
        if lat_chunks:  # each dot scaled before the sum: Triton cannot fold the sum into one
            s = sum(d * mult for d in dots)     # accumulator chain
        else:
            s = sum(dots[1:], dots[0]) * mult
        s = jnp.where(pos[None, :] < lim[:, None], s, -jnp.inf)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)
        if has_token_scale:
            p = p * ts[None, :]
        pc = p.astype(compute_dtype)
        # an accumulator per PV operand: words (chunk 0 low bytes, chunk 0 high bytes, chunk 1
        # low, ...), else one per chunk
        acc = tuple(a * alpha[:, None] + plgpu.dot(pc, cc)
                    for a, cc in zip(acc, [h for halves in c_pv for h in halves]))
        return acc, m_new, l_new

    acc0 = (jnp.zeros((block_h, cw), jnp.float32),) * ((2 if words else 1) * nch)
    m0 = jnp.full((block_h,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_h,), jnp.float32)
    carry = (acc0, m0, l0)
    if load == "page":
        # The page ids of `chunk` steps are read up front into a vector and each step takes its
        # own from it (a masked sum), so inside the inner loop no tile address depends on a load
        # of that loop: Triton's pipeliner then keeps num_stages - 1 tiles in flight. (With the
        # page-table load in the loop it kept one tile, issued only after the step's compute,
        # whatever num_stages was.) The pipeline refills once per chunk of 32 steps (a 64-step
        # chunk cost ~30 more registers at block_k 32).
        chunk = 32
        steps = jnp.arange(chunk, dtype=jnp.int32)

        def outer(ci, carry):
            t0 = ci * chunk
            slots = lax.div(start + (t0 + steps) * block_k, page_size)
            pages = pt_ref[jnp.minimum(slots, max_pages - 1)]            # [chunk]

            def inner(j, carry):
                page = jnp.sum(jnp.where(steps == j, pages, 0))
                return step(carry, start + (t0 + j) * block_k, page)

            return lax.fori_loop(0, jnp.minimum(chunk, n_iter - t0), inner, carry)

        carry = lax.fori_loop(0, lax.div(n_iter + (chunk - 1), chunk), outer, carry)
    else:
        carry = lax.fori_loop(0, n_iter, lambda i, cr: step(cr, start + i * block_k, None),
                              carry)
    acc, m_i, l_i = carry
    has = l_i > 0
    l_safe = jnp.where(has, l_i, 1.0)
    omul = (out_mult / l_safe)[:, None]
    for i in range(nch):
        if words:   # back to the latent's column order: column 2d of a chunk from its low bytes
            o = jnp.stack(acc[2 * i:2 * i + 2], axis=-1).reshape(block_h, 2 * cw)
            o_ref[:, pl.ds(2 * i * cw, 2 * cw)] = (o * omul).astype(o_ref.dtype)
        elif nch == 1:
            o_ref[...] = (acc[0] * omul).astype(o_ref.dtype)
        else:
            o_ref[:, pl.ds(i * cw, cw)] = (acc[i] * omul).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("num_splits", "block_h", "block_k", "num_warps",
                                             "num_stages", "load", "fp8_upcast", "fp8_dot",
                                             "interpret", "out_dtype", "return_partials",
                                             "merge", "partial_dtype", "lat_chunks"))
def _mla_decode_pallas(q, cache, page_table, lengths, scale, cache_scale, *, num_splits, block_h,
                       block_k, num_warps, num_stages, load, fp8_upcast, interpret, out_dtype,
                       fp8_dot="bf16", return_partials=False, merge="pallas",
                       partial_dtype=jnp.float32, lat_chunks=0):
    if merge not in MERGES:
        raise ValueError(f"merge={merge!r} is not one of {MERGES}")
    B, Tq, Hq, _ = q.shape
    num_pages, page_size, _ = cache.shape
    max_pages = page_table.shape[1]
    rows = Tq * Hq
    n_hblk = -(-rows // block_h)
    rows_p = n_hblk * block_h
    is_fp8 = jnp.dtype(cache.dtype).itemsize == 1
    words = is_words(cache)
    is_fp8 = is_fp8 or words
    if words and fp8_dot != "fp16":
        raise ValueError(f'fp8_upcast="{fp8_upcast}" runs fp16 dots: pass fp8_dot="fp16" '
                         '(or None)')
    fp16_dots = is_fp8 and fp8_dot == "fp16"
    compute_dtype = (jnp.float16 if fp16_dots else jnp.bfloat16) if is_fp8 else cache.dtype
    # Where q rows are scaled for fp16 dots: in the kernel at 16-row blocks (saves a few small
    # XLA kernels a call, which matter at batch 1), outside for larger blocks (inside, the
    # 64-row fp8 "operand" kernel was much slower)
    row_scale = None if not fp16_dots else ("kernel" if block_h == 16 else "input")

    qf = q.reshape(B, rows, CACHE_DIM)
    qmul = None
    if row_scale == "input":
        q32 = qf.astype(jnp.float32)
        amax = jnp.max(jnp.abs(q32), axis=-1)
        qmul = jnp.where(amax > 0, amax, 1.0)
        qf = q32 / qmul[..., None]
        qmul = jnp.pad(qmul, ((0, 0), (0, rows_p - rows)), constant_values=1.0)
        if words:   # [lat half 0 | lat half 1 | rope half 0 | rope half 1] (word_q_columns)
            pairs = fp8_upcast in PAIR_UPCASTS
            qf = jnp.concatenate([qf[..., base + word_q_columns(n, half, pairs)]
                                  for base, n in ((0, LATENT // 2), (LATENT, ROPE // 2))
                                  for half in (0, 1)], axis=-1)
    if row_scale != "kernel":   # the kernel scales and casts its rows itself
        qf = qf.astype(compute_dtype)
    if rows_p != rows:
        qf = jnp.pad(qf, ((0, 0), (0, rows_p - rows), (0, 0)))
    t_of_row = jnp.arange(rows_p, dtype=jnp.int32) // Hq
    row_off = jnp.where(t_of_row < Tq, t_of_row - Tq + 1, -Tq).astype(jnp.int32)

    score_mult = jnp.asarray(scale, jnp.float32) * _LOG2E
    out_mult = jnp.float32(1.0)
    token_scale = None
    if cache_scale is not None:
        cs = jnp.asarray(cache_scale, jnp.float32)
        if cs.size == 1:
            score_mult = score_mult * cs.reshape(())
            out_mult = cs.reshape(())
        else:
            if cs.shape != (num_pages, page_size):
                raise ValueError(f"cache_scale shape {cs.shape}: expected () / (1,) or "
                                 f"{(num_pages, page_size)}")
            token_scale = cs
    if words:
        conv_scale = _CONV_SCALE[WORD_CONVERSIONS[fp8_upcast]]
        score_mult, out_mult = score_mult * conv_scale, out_mult * conv_scale
    scal = jnp.stack([score_mult, out_mult, jnp.float32(1.0)]).astype(jnp.float32)
    ntok = num_pages * page_size
    width = cache.shape[-1]

    grid = (n_hblk, num_splits, B)
    if load == "page":
        cache_arg = cache
        cache_spec = pl.BlockSpec((num_pages, page_size, width), lambda h, s, b: (0, 0, 0))
        ts_arg = token_scale
        ts_spec = pl.BlockSpec((num_pages, page_size), lambda h, s, b: (0, 0))
    else:
        cache_arg = cache.reshape(ntok, width)
        cache_spec = pl.BlockSpec((ntok, width), lambda h, s, b: (0, 0))
        ts_arg = None if token_scale is None else token_scale.reshape(ntok)
        ts_spec = pl.BlockSpec((ntok,), lambda h, s, b: (0,))
    in_specs = [
        pl.BlockSpec((B,), lambda h, s, b: (0,)),                                 # lengths
        pl.BlockSpec((3,), lambda h, s, b: (0,)),                                 # scalars
        pl.BlockSpec((block_h,), lambda h, s, b: (h,)),                           # row offsets
        pl.BlockSpec((None, block_h, CACHE_DIM), lambda h, s, b: (b, h, 0)),      # q
        pl.BlockSpec((None, max_pages), lambda h, s, b: (b, 0)),                  # page table
        cache_spec,
    ]
    args = [lengths.astype(jnp.int32), scal, row_off, qf, page_table.astype(jnp.int32),
            cache_arg]
    if token_scale is not None:
        in_specs.append(ts_spec)
        args.append(ts_arg)
    if qmul is not None:
        in_specs.append(pl.BlockSpec((None, block_h), lambda h, s, b: (b, h)))
        args.append(qmul)
    out_specs = [
        pl.BlockSpec((None, None, block_h, LATENT), lambda h, s, b: (b, s, h, 0)),
        pl.BlockSpec((None, None, block_h), lambda h, s, b: (b, s, h)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, num_splits, rows_p, LATENT), partial_dtype),
                 jax.ShapeDtypeStruct((B, num_splits, rows_p), jnp.float32)]
    kernel = functools.partial(
        _decode_kernel, block_k=block_k, page_size=page_size, max_pages=max_pages,
        num_splits=num_splits, has_token_scale=token_scale is not None,
        row_scale=row_scale, compute_dtype=compute_dtype, load=load,
        fp8_upcast=fp8_upcast if is_fp8 else None, lat_chunks=lat_chunks,
        word_ptx=words and not interpret and kernel_platform() != "rocm")
    o_part, lse_part = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"mla_decode_bh{block_h}_bk{block_k}_{load}",
    )(*args)
    if return_partials:
        return o_part[:, :, :rows], lse_part[:, :, :rows]
    if num_splits == 1:             # nothing to merge
        o, lse = o_part[:, 0, :rows].astype(out_dtype), lse_part[:, 0, :rows]
    elif merge == "pallas":
        o, lse = merge_splits_pallas(o_part, lse_part, rows=rows, out_dtype=out_dtype,
                                     interpret=interpret)
    else:
        o, lse = merge_stacked(o_part[:, :, :rows], lse_part[:, :, :rows], axis=1,
                               out_dtype=out_dtype)
    return o.reshape(B, Tq, Hq, LATENT), lse.reshape(B, Tq, Hq)


def resolve_config(q_shape, cache_shape, cache_dtype, page_table_shape, *, num_splits=None,
                   block_h=None, block_k=None, num_warps=None, num_stages=None, load=None,
                   fp8_upcast=None, fp8_dot=None, lat_chunks=None, num_sms=None,
                   platform=None) -> dict:
    """The full static configuration mla_decode runs with: `default_config` for the shapes (and
    platform: "cuda" | "rocm" | ...; None: where the kernel runs, `kernel_platform()`),
    overridden by the given values. num_splits: an int, or a policy in SPLIT_POLICIES applied
    to the (possibly overridden) block config."""
    B, Tq, Hq, _ = q_shape
    page_size = cache_shape[1]
    capacity = page_table_shape[1] * page_size
    words = jnp.dtype(cache_dtype) == WORDS_DTYPE
    itemsize = 1 if words else jnp.dtype(cache_dtype).itemsize
    cfg = default_config(B, Tq * Hq, capacity, cache_dtype, page_size, num_sms=num_sms,
                         platform=platform)
    for k, v in dict(block_h=block_h, block_k=block_k, num_warps=num_warps,
                     num_stages=num_stages).items():
        if v is not None:
            cfg[k] = int(v)
    for name in ("block_h", "block_k"):
        if cfg[name] < 16 or cfg[name] & (cfg[name] - 1):
            raise ValueError(f"{name}={cfg[name]} must be a power of two >= 16")
    if load is None:
        load = "page" if page_size % cfg["block_k"] == 0 else "token"
    if load not in LOADS:
        raise ValueError(f"load={load!r} is not one of {LOADS}")
    if load == "page" and page_size % cfg["block_k"]:
        raise ValueError(f"load='page' needs page_size ({page_size}) to be a multiple of "
                         f"block_k ({cfg['block_k']})")
    cfg["load"] = load
    fp8_upcast = fp8_upcast or cfg["fp8_upcast"]
    if fp8_upcast not in FP8_UPCASTS:
        raise ValueError(f"fp8_upcast={fp8_upcast!r} is not one of {FP8_UPCASTS}")
    if (fp8_upcast in ("words",) + PAIR_UPCASTS
            and (platform or kernel_platform()) == "rocm"):
        raise ValueError(f'fp8_upcast="{fp8_upcast}" converts with NVIDIA PTX; on ROCm use '
                         '"words_int" (the default there)')
    if itemsize == 1 and words != (fp8_upcast in WORD_UPCASTS):
        raise ValueError(
            f"fp8_upcast={fp8_upcast!r} with a {'words' if words else 'float8'} cache: the "
            f"upcasts {WORD_UPCASTS} read an fp8 cache in the words form (uint16 [..., {WORDS}], "
            "kernels_pallas.mla.fp8_to_words), the others a float8_e4m3fn [..., 576] cache")
    cfg["fp8_upcast"] = fp8_upcast
    fp8_dot = fp8_dot or cfg["fp8_dot"]
    if fp8_dot not in FP8_DOTS:
        raise ValueError(f"fp8_dot={fp8_dot!r} is not one of {FP8_DOTS}")
    cfg["fp8_dot"] = fp8_dot
    if lat_chunks is not None:
        cfg["lat_chunks"] = int(lat_chunks)
    if cfg["lat_chunks"] not in LAT_CHUNKS:
        raise ValueError(f"lat_chunks={cfg['lat_chunks']} is not one of {LAT_CHUNKS}")
    if num_splits is None or isinstance(num_splits, str):
        policy = num_splits or "waves"
        if policy not in SPLIT_POLICIES:
            raise ValueError(f"num_splits={policy!r}: an int or one of {SPLIT_POLICIES}")
        rows = Tq * Hq
        n_hblk = -(-rows // cfg["block_h"])
        sms = num_sms or device_sms()
        slots = sms * programs_per_sm(cfg["block_h"], cfg["block_k"], cfg["num_warps"],
                                      cfg["num_stages"], itemsize, fp8_upcast)
        cfg["num_splits"] = choose_num_splits(
            B, n_hblk, capacity, cfg["block_k"], rows_p=n_hblk * cfg["block_h"], slots=slots,
            itemsize=itemsize, policy=policy, num_sms=sms)
    else:
        cfg["num_splits"] = max(1, int(num_splits))
    return cfg


def mla_decode(q, cache, page_table, lengths, *, scale, backend: str | None = None,
               num_splits: int | str | None = None, cache_scale=None, out_dtype=None,
               block_h: int | None = None, block_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None,
               load: str | None = None, fp8_upcast: str | None = None,
               fp8_dot: str | None = None, merge: str = "pallas",
               partials: str | None = None, lat_chunks: int | None = None):
    """Absorbed MLA decode / multi-token verify over a paged latent cache.

    q [B, Tq, Hq, 576] (q_lat 512 | q_rope 64), cache [num_pages, page_size, 576] (bf16, fp32, or
    float8_e4m3fn with `cache_scale` () / (1,) / [num_pages, page_size] fp32) or an fp8 cache in
    the words form, uint16 [num_pages, page_size, 288] (`fp8_to_words`; the fast fp8 path, with
    `cache_scale` likewise), page_table
    [B, max_pages] int32, lengths [B] int32 (history incl. the Tq new tokens), scale: softmax
    scale. Returns (o [B, Tq, Hq, 512] in out_dtype (default q.dtype), lse [B, Tq, Hq] fp32,
    -inf where a query sees no key; o is 0 there).

    Variants (None = `default_config` for the shapes): num_splits (an int, or the policy
    "waves" / "fill"), block_h, block_k, num_warps, num_stages, load ("page" / "token") and,
    for an fp8 cache, fp8_upcast ("mixed" / "tile" / "operand" for a float8 cache, "words" /
    "words_int" for the words form) and fp8_dot ("bf16" / "fp16": the dtype the dots run in;
    the words form runs fp16); merge: how the splits are combined ("pallas": merge.py, one
    launch; "xla": reference.merge_stacked); partials: the dtype of the per-split outputs
    written by the kernel and read by the merge: "float32", or "bfloat16" (half that traffic,
    one more bf16 rounding of each normalised partial; the merge weighs and sums in fp32). None:
    "bfloat16" when out_dtype is a 16-bit type (the result is rounded to 16 bits anyway, and
    half the partials' bytes made B1 decode faster), else "float32".
    `resolve_config` gives the configuration a call runs with. See the module docstring.
    """
    backend = resolve_backend(backend)
    if q.ndim != 4 or q.shape[-1] != CACHE_DIM:
        raise ValueError(f"q must be [B, Tq, Hq, {CACHE_DIM}], got {q.shape}")
    if cache.ndim != 3 or cache.shape[-1] != (WORDS if is_words(cache) else CACHE_DIM):
        raise ValueError(f"cache must be [num_pages, page_size, {CACHE_DIM}] (bf16, fp32, "
                         f"float8_e4m3fn) or fp8 words [num_pages, page_size, {WORDS}] uint16, "
                         f"got {cache.dtype} {cache.shape}")
    if (jnp.dtype(cache.dtype).itemsize == 1 or is_words(cache)) and cache_scale is None:
        raise ValueError("an fp8 cache needs cache_scale")
    out_dtype = jnp.dtype(out_dtype or q.dtype)
    if partials is None:
        partials = "bfloat16" if out_dtype.itemsize == 2 else "float32"
    if partials not in PARTIALS:
        raise ValueError(f"partials={partials!r} is not one of {PARTIALS}")
    if backend == "reference":
        return mla_decode_reference(q, cache, page_table, lengths, scale=scale,
                                    cache_scale=cache_scale, out_dtype=out_dtype)
    cfg = resolve_config(q.shape, cache.shape, cache.dtype, page_table.shape,
                         num_splits=num_splits, block_h=block_h, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages, load=load,
                         fp8_upcast=fp8_upcast, fp8_dot=fp8_dot, lat_chunks=lat_chunks)
    return _mla_decode_pallas(q, cache, page_table, lengths, scale, cache_scale,
                              interpret=backend == "interpret", out_dtype=out_dtype,
                              merge=merge, partial_dtype=jnp.dtype(partials), **cfg)
