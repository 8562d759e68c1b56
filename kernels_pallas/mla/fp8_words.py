"""The fp8 cache in the words form inside the decode kernel (decode.py): uint16
[num_pages, page_size, 288] (`fp8_to_words`), the same bytes as the float8 cache, two e4m3 values
a word.

The tile is 16-bit, so Triton treats it like a bf16 tile (cp.async pipelined, ldmatrix with
.trans for PV and without for QK^T, no staging through registers), and the e4m3 -> fp16
conversion is an op on the dot operands in registers. Each word's low byte is latent column 2d,
its high byte column 2d + 1, so

    s = q_even . lo(W)^T + q_odd . hi(W)^T   (+ the rope part likewise)

and PV fills two accumulators, the even and odd output columns, interleaved once at the end.
The upcasts (`fp8_upcast`):
* "words": PTX, one prmt (the two low or high bytes of a register's two words) and one
  cvt.rn.f16x2.e4m3x2 per two values, exact. Each tile is converted once for both dots.
* "words_pairs": PV as "words"; QK^T converts each word whole, one cvt and no prmt: a 16-bit
  dot operand's register holds two k-adjacent words of one token, whose four bytes are latent
  columns 4i..4i+3, so one dot takes the first word's two values (columns 4i, 4i + 1), the other
  the second's, with q's columns permuted to match (`word_q_columns`). Not elementwise: it
  relies on Triton packing k-adjacent words into one register (checked on the GPU by `python -m
  benchmarks mla`).
* "words_int": integer ops giving value * 2^-8 (folded back into the score / output
  multipliers; `CONV_SCALE`), PTX on NVIDIA, jnp elsewhere: the portable one (ROCm).
q's columns: at 16-row blocks the kernel loads them strided (or gathered, for pairs); for larger
blocks they arrive in the kernel's order ([lat half 0 | lat half 1 | rope half 0 | rope half 1],
`q_in_word_order`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .reference import LATENT, ROPE

# the conversion each upcast runs on both dots' operands (`e4m3_word_halves`)
WORD_CONVERSIONS = {"words": "cvt", "words_int": "int", "words_pairs": "cvt"}
# the "int" conversion gives e4m3 values * 2^-8 (folded back into the score / output multiplier)
CONV_SCALE = {"cvt": 1.0, "int": 256.0}


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


def e4m3_word_pairs(w, ptx: bool):
    """uint16 words [..., n] (n even) of two e4m3 bytes -> (a, b) fp16 [..., n]: for each pair of
    adjacent words (w[2i], w[2i + 1]) a[2i], a[2i + 1] = w[2i]'s low, high byte and b[2i],
    b[2i + 1] = w[2i + 1]'s: one cvt per word and no byte gather. On the GPU (PTX, pack=2) it
    relies on Triton packing the two words adjacent in the last axis into one register."""
    if ptx:
        sd = jax.ShapeDtypeStruct(w.shape, jnp.float16)
        return tuple(plgpu.elementwise_inline_asm(
            asm, args=[w], constraints="=r,r", pack=2, result_shape_dtypes=[sd])[0]
            for asm in PAIR_ASM)
    b = lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint8)
    f = lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float16)  # [..., n/2, 2, 2]
    return tuple(f[..., i, :].reshape(w.shape) for i in (0, 1))


def e4m3_word_halves(w, conv: str, ptx: bool):
    """uint16 words of two e4m3 bytes -> (fp16 of each low byte, fp16 of each high byte).

    conv "cvt": the exact values; on the GPU PTX's e4m3x2 -> f16x2 conversion (sm_89+).
    "int": value * 2^-8 from integer ops (sign to bit 15, the 7 exponent / mantissa bits to bits
    7..13: exact, subnormals included, an e4m3 NaN becomes a finite value): on NVIDIA GPUs as
    PTX on a register's two words, elsewhere (ROCm, the interpreter) the same bits with jnp."""
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


def word_q_columns(n_words: int, half: int, pairs: bool):
    """The latent / rope columns (offsets within the part) that meet a words tile of n_words
    words in the QK^T dot: `half` 0 / 1 = the first / second dot. Halves: the words' low / high
    bytes, columns 2k + half. Pairs (`e4m3_word_pairs`): 4 (k // 2) + k % 2 + 2 half."""
    k = jnp.arange(n_words, dtype=jnp.int32)
    if pairs:
        return 4 * (k // 2) + k % 2 + 2 * half
    return 2 * k + half


def q_in_word_order(qf, fp8_upcast: str):
    """q [..., 576] -> its columns in the order the kernel's dots read them:
    [lat half 0 | lat half 1 | rope half 0 | rope half 1] (`word_q_columns`)."""
    pairs = fp8_upcast == "words_pairs"
    return jnp.concatenate([qf[..., base + word_q_columns(n, half, pairs)]
                            for base, n in ((0, LATENT // 2), (LATENT, ROPE // 2))
                            for half in (0, 1)], axis=-1)


def q_word_operands(q_ref, fp8_upcast: str, in_order: bool, scaled):
    """q's operands of the QK^T dots against a words tile: ((lat for the first dot, lat for the
    second), (rope likewise)), each through `scaled` (the row scale and cast). in_order: q
    arrives in the kernel's column order (`q_in_word_order`): plain slices."""
    pairs = fp8_upcast == "words_pairs"
    block_h = q_ref.shape[0]

    def cols(part, half):
        base, n = (0, LATENT // 2) if part == "lat" else (LATENT, ROPE // 2)
        if in_order:
            return scaled(q_ref[:, pl.ds(base + half * n, n)])
        if not pairs:
            return scaled(q_ref[:, pl.ds(base + half, n, stride=2)])
        rows = jnp.arange(block_h, dtype=jnp.int32)
        c = base + word_q_columns(n, half, True)
        return scaled(plgpu.load(q_ref.at[rows[:, None], c[None, :]]))

    return ((cols("lat", 0), cols("lat", 1)), (cols("rope", 0), cols("rope", 1)))


def word_tile_operands(c, kr, fp8_upcast: str, ptx: bool):
    """A words tile (latent words c [block_k, 256], rope words kr [block_k, 32]) -> the fp16
    operands (latent for QK^T, latent for PV, rope for QK^T), each a pair: (low bytes, high
    bytes), or for "words_pairs"' QK^T (first words, second words)."""
    conv = WORD_CONVERSIONS[fp8_upcast]
    c_pv = e4m3_word_halves(c, conv, ptx)
    if fp8_upcast == "words_pairs":
        return e4m3_word_pairs(c, ptx), c_pv, e4m3_word_pairs(kr, ptx)
    return c_pv, c_pv, e4m3_word_halves(kr, conv, ptx)


def interleave_columns(acc_even, acc_odd):
    """The PV accumulators of the low / high bytes [rows, 256] -> [rows, 512] in the latent's
    column order."""
    rows, n = acc_even.shape
    return jnp.stack([acc_even, acc_odd], axis=-1).reshape(rows, 2 * n)
