"""Launch parameters of the MLA kernels: `DecodeConfig` and `PrefillConfig`, the tuned
configurations as tables keyed by platform and shape class, and the rules for what a row cannot
fix (the split count, the load mode).

A decode call's configuration (`decode_config`):
  1. its row block: Tq * Hq query rows in blocks of 16, 32 or 64 (the next power of two, at
     least 16: Triton's smallest dot; at most 64);
  2. the first `TUNED` row for (platform, `DecodeClass`), else `_FALLBACK`;
  3. every field the caller's DecodeConfig sets, over that row;
  4. the rules: the load mode ("page" where page_size is a multiple of block_k, else "token"),
     the history splits (`choose_num_splits`, a cost model over the GPU's resident programs),
     and the checks (powers of two >= 16, upcast against cache form and platform).
Rows were chosen on an H200 against the other candidates in the same run (`python -m benchmarks
mla`; figures in BENCHMARKS.md) unless their comment says they were not measured. The ROCm rows
fit MI300X's 64 KiB of LDS without spills (offline compiles for gfx942 / gfx950, `python -m
benchmarks resources`); not run on AMD.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from .._backend import kernel_platform, num_sms as device_sms
from .merge import MERGE_CHUNK
from .reference import CACHE_DIM, LATENT, WORDS_DTYPE

LOADS = ("page", "token")
# "operand": a float8 cache, converted where the dots read it. The words form (uint16 cache,
# fp8_words.py): "words_pairs" / "words" convert with NVIDIA PTX, "words_int" with integer ops
# (the portable one, ROCm).
FP8_UPCASTS = ("operand", "words", "words_pairs", "words_int")
WORD_UPCASTS = ("words", "words_pairs", "words_int")
PTX_UPCASTS = ("words", "words_pairs")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel (decode.py). None: from the tuning table or its
    rules (`decode_config`); a set field overrides it."""
    block_h: int | None = None      # query rows a program (power of two >= 16)
    block_k: int | None = None      # keys a step (power of two >= 16)
    num_warps: int | None = None
    num_stages: int | None = None
    num_splits: int | None = None   # history splits a sequence (None: `choose_num_splits`)
    load: str | None = None         # "page": one page id a step; "token": a lookup per token
    fp8_upcast: str | None = None   # FP8_UPCASTS; None for a 16/32-bit cache
    # the QK^T dots each scaled before their sum, so Triton gives each its own accumulator
    # instead of folding them into one chain
    split_qk_acc: bool | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DecodeClass(NamedTuple):
    """The class of one decode call (`decode_class`), or a pattern in `TUNED`: a field "*"
    matches any value."""
    cache: str = "*"      # "words" (fp8 in uint16 words) | "8bit" (float8) | "16bit" | "32bit"
    block_h: object = "*"  # 16 | 32 | 64
    pages: str = "*"      # "p64": page_size a multiple of 64 | "other"


_C = DecodeConfig
# (platform, class) -> the row. Platform "rocm", or "*" (any: CUDA, the CPU, the interpreter).
TUNED: tuple[tuple[str, DecodeClass, DecodeConfig], ...] = (
    # ROCm: the CUDA rows compile to more LDS than MI300X's 64 KiB and spill on gfx942. The
    # words form converts without PTX there.
    ("rocm", DecodeClass("words"),
     _C(block_k=32, num_warps=4, num_stages=1, fp8_upcast="words_int", split_qk_acc=False)),
    ("rocm", DecodeClass(), _C(block_k=32, num_warps=4, num_stages=1)),
    # fp8 words, 16 rows: one accumulator per QK^T dot, whole-word QK^T conversion
    ("*", DecodeClass("words", 16),
     _C(block_k=64, num_warps=4, num_stages=3, fp8_upcast="words_pairs", split_qk_acc=True)),
    # fp8 words, 32-64 rows (96-128 heads, as under DCP): each tile converted once for both dots
    ("*", DecodeClass("words"),
     _C(block_k=64, num_warps=8, num_stages=2, fp8_upcast="words", split_qk_acc=False)),
    # bf16, 64 rows: wgmma, most of sm_90's shared memory and registers
    ("*", DecodeClass("16bit", 64), _C(block_k=64, num_warps=8, num_stages=2)),
    # bf16, 16 rows; the "token" load (pages not a multiple of 64 keys) pipelines no tile: 2 stages
    ("*", DecodeClass("16bit", 16, "p64"), _C(block_k=64, num_warps=4, num_stages=3)),
    ("*", DecodeClass("16bit", 16), _C(block_k=64, num_warps=4, num_stages=2)),
    # float8 cache, 16 rows: "operand" with fp16 dots
    ("*", DecodeClass("8bit", 16), _C(block_k=64, num_warps=8, num_stages=3)),
    # not measured (sm_90 compiles: shared memory, registers, pipelined loads)
    ("*", DecodeClass("8bit", 32), _C(block_k=32, num_warps=8, num_stages=3)),
    ("*", DecodeClass(block_h=64), _C(block_k=32, num_warps=8, num_stages=2)),
)
# bf16 at 32 rows, fp32 at 16 or 32 rows; not measured (64-key blocks at 3 stages would not fit
# an fp32 tile pair in 227 KiB)
_FALLBACK = _C(block_k=32, num_warps=8, num_stages=3)

# Hopper (sm_90) per-SM limits used by the occupancy estimate.
_SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED_PER_CTA = 1024
_REGS_PER_SM = 65536
_MAX_WARPS_PER_SM = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_words_dtype(dtype) -> bool:
    return jnp.dtype(dtype) == WORDS_DTYPE


def cache_itemsize(dtype) -> int:
    """Bytes a cache value: 1 for the words form (two fp8 values a word)."""
    return 1 if is_words_dtype(dtype) else jnp.dtype(dtype).itemsize


def row_block(rows: int) -> int:
    return min(max(16, _next_pow2(rows)), 64)


def decode_class(rows: int, dtype, page_size: int) -> DecodeClass:
    """The class of a decode call of `rows` = Tq * Hq query rows over a cache of `dtype`."""
    cache = ("words" if is_words_dtype(dtype) else
             {1: "8bit", 2: "16bit"}.get(jnp.dtype(dtype).itemsize, "32bit"))
    return DecodeClass(cache, row_block(rows), "p64" if page_size % 64 == 0 else "other")


def lookup(platform: str, cls: DecodeClass) -> DecodeConfig:
    """The first `TUNED` row for (platform, cls), else `_FALLBACK`."""
    for plat, pattern, cfg in TUNED:
        if plat in ("*", platform) and all(p == "*" or p == c for p, c in zip(pattern, cls)):
            return cfg
    return _FALLBACK


def smem_bytes(block_h: int, block_k: int, num_stages: int, itemsize: int = 2) -> int:
    """Estimated shared memory of one program (within ~4% of what Triton 3.9 allocates for
    sm_90): the pipelined cache tiles (num_stages - 1 buffers, at least one), q staged for the
    dots, p, scratch."""
    tile = block_k * CACHE_DIM
    total = max(1, num_stages - 1) * tile * itemsize
    return total + block_h * CACHE_DIM * 2 + block_h * block_k * 2 + 2048


def programs_per_sm(block_h: int, block_k: int, num_warps: int, num_stages: int,
                    itemsize: int = 2) -> int:
    """Estimated resident programs per SM (shared memory, registers, warps). Registers: the fp32
    accumulator [block_h, 512] and scores per thread plus 64 (bf16; what ptxas reports for these
    kernels, within ~10%), or the 255 maximum for fp8 (ptxas uses all of them there)."""
    smem = smem_bytes(block_h, block_k, num_stages, itemsize) + _SMEM_RESERVED_PER_CTA
    by_smem = _SMEM_PER_SM // smem
    threads = 32 * num_warps
    regs = block_h * (LATENT + block_k) // threads + 64
    regs = 255 if itemsize == 1 else min(255, regs)
    regs = -(-regs // 8) * 8
    by_regs = _REGS_PER_SM // (regs * threads)
    return max(1, min(by_smem, by_regs, _MAX_WARPS_PER_SM // num_warps))


def choose_num_splits(batch: int, n_hblk: int, capacity: int, block_k: int, *, rows_p: int,
                      slots: int, itemsize: int = 2) -> int:
    """History splits per sequence, for B sequences of up to `capacity` tokens: minimise
    waves * (steps per program + C0) + the partials' traffic, with
    waves = ceil(B * n_hblk * splits / slots) (slots = SMs x resident programs per SM),
    steps = ceil(key blocks / splits), C0 = 2 steps (launch, q load, pipeline fill, the
    partial's store), and the partials (fp32 o, written by the kernel and read by the merge)
    counted in steps of all slots. Ties go to fewer splits. A program count just past a
    multiple of the slots costs a whole extra wave. At most MERGE_CHUNK splits: the merge reads
    that many in one load, and a second chunk costs it more than the kernel gains."""
    nblk = max(1, -(-capacity // block_k))
    base = max(1, batch * n_hblk)
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


def decode_config(q_shape, cache_shape, cache_dtype, page_table_shape,
                  config: DecodeConfig | None = None, *, num_sms: int | None = None,
                  platform: str | None = None) -> DecodeConfig:
    """The configuration mla_decode runs with for q [B, Tq, Hq, 576], a cache of `cache_shape`
    and `cache_dtype` and a page table [B, max_pages], every field set (see the module
    docstring). platform: "cuda" | "rocm" | ...; None: where the kernel runs
    (`kernel_platform()`). num_sms: default the first device's."""
    B, Tq, Hq, _ = q_shape
    page_size = cache_shape[1]
    capacity = page_table_shape[1] * page_size
    platform = platform or kernel_platform()
    words = is_words_dtype(cache_dtype)
    itemsize = cache_itemsize(cache_dtype)
    rows = Tq * Hq
    cls = decode_class(rows, cache_dtype, page_size)
    row = dataclasses.replace(lookup(platform, cls), block_h=cls.block_h)
    if itemsize == 1 and not words:
        row = dataclasses.replace(row, fp8_upcast="operand")
    user = {} if config is None else {f.name: getattr(config, f.name)
                                      for f in dataclasses.fields(config)
                                      if getattr(config, f.name) is not None}
    cfg = dataclasses.replace(row, **user)
    for name in ("block_h", "block_k"):
        n = getattr(cfg, name)
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two >= 16")
    load = cfg.load or ("page" if page_size % cfg.block_k == 0 else "token")
    if load not in LOADS:
        raise ValueError(f"load={load!r} is not one of {LOADS}")
    if load == "page" and page_size % cfg.block_k:
        raise ValueError(f"load='page' needs page_size ({page_size}) to be a multiple of "
                         f"block_k ({cfg.block_k})")
    if itemsize == 1:
        if cfg.fp8_upcast not in FP8_UPCASTS:
            raise ValueError(f"fp8_upcast={cfg.fp8_upcast!r} is not one of {FP8_UPCASTS}")
        if cfg.fp8_upcast in PTX_UPCASTS and platform == "rocm":
            raise ValueError(f'fp8_upcast="{cfg.fp8_upcast}" converts with NVIDIA PTX; on ROCm '
                             'use "words_int" (the default there)')
        if words != (cfg.fp8_upcast in WORD_UPCASTS):
            raise ValueError(
                f"fp8_upcast={cfg.fp8_upcast!r} with a {'words' if words else 'float8'} cache: "
                f"the upcasts {WORD_UPCASTS} read an fp8 cache in the words form (uint16 "
                "[..., 288], kernels_pallas.mla.fp8_to_words), \"operand\" a float8_e4m3fn "
                "[..., 576] cache")
    elif cfg.fp8_upcast is not None:
        raise ValueError(f"fp8_upcast={cfg.fp8_upcast!r} with a {jnp.dtype(cache_dtype).name} "
                         "cache: only an fp8 cache is upcast")
    num_splits = cfg.num_splits
    if num_splits is None:
        n_hblk = -(-rows // cfg.block_h)
        slots = (num_sms or device_sms()) * programs_per_sm(
            cfg.block_h, cfg.block_k, cfg.num_warps, cfg.num_stages, itemsize)
        num_splits = choose_num_splits(B, n_hblk, capacity, cfg.block_k,
                                       rows_p=n_hblk * cfg.block_h, slots=slots,
                                       itemsize=itemsize)
    return dataclasses.replace(cfg, load=load, num_splits=max(1, int(num_splits)),
                               split_qk_acc=bool(cfg.split_qk_acc))


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (prefill.py). None: from `PREFILL_TUNED`."""
    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None


# platform -> blocks. CUDA: the fastest of a GPU sweep at every shape but one (where it tied).
PREFILL_TUNED = {"cuda": PrefillConfig(block_q=128, block_k=64, num_warps=8, num_stages=4)}
# elsewhere (ROCm, the interpreter): ~40 KiB a stage, inside MI300X's 64 KiB LDS (not measured
# on AMD)
PREFILL_FALLBACK = PrefillConfig(block_q=64, block_k=64, num_warps=4, num_stages=2)


def prefill_config(platform: str, config: PrefillConfig | None = None) -> PrefillConfig:
    """The table's row for `platform` with every field `config` sets over it, checked."""
    row = PREFILL_TUNED.get(platform, PREFILL_FALLBACK)
    if config is not None:
        row = dataclasses.replace(row, **{f.name: getattr(config, f.name)
                                          for f in dataclasses.fields(config)
                                          if getattr(config, f.name) is not None})
    for n in (row.block_q, row.block_k):
        if n < 16 or n & (n - 1):
            raise ValueError(f"block sizes must be powers of two >= 16, got {n}")
    return row
