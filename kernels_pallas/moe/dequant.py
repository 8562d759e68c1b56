"""MXFP4 dequantisation inside the grouped-matmul kernel: packed E2M1 nibbles and E8M0 scale
bytes of one weight tile -> weights in the activation dtype, without the bf16 weights ever
existing in HBM.

Every variant (`GmmConfig.dequant`) yields the exact weight times 2^-14; the kernel applies the
2^14 once, to its fp32 accumulator.
  "interleave" (portable): each nibble placed into the bits of an fp16 (sign -> bit 15, the three
    magnitude bits -> bits 9-11: exactly value * 2^-14, the subnormal 0.5 included), widened to
    fp32, times the scale 2^(s-127) (s shifted into an fp32 exponent; s = 0 flushes to zero),
    rounded to the activation dtype (exact), and the low / high nibbles interleaved back into
    columns 2j, 2j+1. Exact for scale bytes >= 16.
  "split" (portable): the same numbers without the interleave. x's even and odd columns are
    separated instead (outside the kernel, `ops.split_x`, or by strided loads: x_split="stride"),
    so out = x_even @ W_lo^T + x_odd @ W_hi^T: two dots of K = block_k / 2 on the low and high
    nibbles in the packed tile's own layout.
  "split_asm_sub" (CUDA): "split" with the nibble decode as inline PTX that treats two nibbles
    per 32-bit op: magnitude to bf16 bits 6-8, sign to bit 15 (value * 2^-126, the 0.5 a bf16
    subnormal, which the bf16 multiply by the factor 2^(s-15) takes exactly on NVIDIA GPUs).
    Exact for scale bytes 16..142; larger ones give inf (loud, not silently wrong).
  "split_asm_t" (CUDA): the "split_asm_sub" bits in the transposed product out^T = W_lo . x_even^T
    + W_hi . x_odd^T, so that the dequantised weights are the dot's register operand (wgmma on
    Hopper) and x is read from shared memory. The packed columns of each K block are taken in a
    fixed order (`perm_t`), x's even / odd columns in the same order, so that a thread's registers
    for one 16-wide step of a weight row come from the four bytes of one 32-bit word (vector
    loads, 2 scale groups a row per thread). Its PTX is elementwise (output i depends on input
    byte i only), so the weights do not depend on Triton's register order; the paired layout
    (`paired.py`) has its own, shorter PTX that is not. The fp32 sums run in another order than
    in the other variants (permuted K), so outputs agree with theirs to rounding, the weights
    bit for bit.
The interpreter cannot run PTX: there the PTX variants compute the same weights from the bf16
bits value * 2^-125 (every value normal, so the CPU's flushed subnormals do not matter) times
2^(s-16) in bf16; exact for scale bytes 16..143.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from . import mxfp4, paired

F16_SHIFT = 2.0 ** 14  # every variant yields value * 2^(s-127) * 2^-14
_BF16_SCALE_BIAS = 125 - 14  # scale byte s -> bf16 exponent field of 2^(s-16)
BF16_MAX_SCALE = 254 - _BF16_SCALE_BIAS  # 143: the largest scale byte the bf16 bits keep exact

# GmmConfig.dequant -> (x split into even / odd columns, nibble bits: "f16" | "asm_sub" | "asm_t")
_VARIANTS = {"interleave": (False, "f16"), "split": (True, "f16"),
             "split_asm_sub": (True, "asm_sub"), "split_asm_t": (True, "asm_t")}
DEQUANT_VARIANTS = tuple(_VARIANTS)


def dequant_variant(name: str):
    """(split, bits) of a `GmmConfig.dequant` name (see the module docstring)."""
    if name not in _VARIANTS:
        raise ValueError(f"dequant={name!r} is not one of {DEQUANT_VARIANTS}")
    return _VARIANTS[name]


def nibble_bits(pb, bits: str):
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


def scale_factor(sb, enc: str):
    """E8M0 bytes -> the factor that takes the `enc` nibble numbers to value * 2^(s-127) * 2^-14.

    "f16" (nibble = value * 2^-14): 2^(s-127) in fp32, s = 0 -> 0. "bf16" (value * 2^-125): 2^(s-16)
    in bf16 (exponent field s + 111; s > 143 -> inf). "bf16_sub" (value * 2^-126): 2^(s-15) in bf16
    (field s + 112; s > 142 -> inf)."""
    s = sb.astype(jnp.int32)
    if enc == "f16":
        return jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    e = jnp.minimum(s + _BF16_SCALE_BIAS + (enc == "bf16_sub"), 255)
    return jax.lax.bitcast_convert_type((e << 7).astype(jnp.uint16), jnp.bfloat16)


def _scaled(v, sf, enc: str, dtype):
    """v [bn, w] nibble numbers times the factor sf [bn, w], in `dtype`."""
    if enc == "f16":
        return (v.astype(jnp.float32) * sf).astype(dtype)
    return (v * sf).astype(dtype)


def _expand_groups(sf, width: int):
    """[bn, g] -> [bn, g * width]: each group's factor repeated over its `width` columns (in Triton
    a broadcast + reshape that its linear layouts absorb: no data movement)."""
    bn, g = sf.shape
    return jnp.broadcast_to(sf[:, :, None], (bn, g, width)).reshape(bn, g * width)


def dequant_tile(pb, sb, dtype):
    """"interleave": packed [bn, bk/2] uint8 + scales [bn, bk/32] uint8 -> [bn, bk] `dtype`, times
    2^-14, columns in their natural order."""
    bn, half = pb.shape
    lo, hi = (v.astype(jnp.float32) for v in nibble_bits(pb, "f16"))
    v = jnp.stack([lo, hi], axis=-1).reshape(bn, 2 * half)  # column 2j, 2j+1
    sf = _expand_groups(scale_factor(sb, "f16"), mxfp4.GROUP)
    return (v * sf).astype(dtype)


# "split_asm_sub" PTX: 4 packed bytes (one 32-bit register, $2) -> the 4 bf16 of their low (or high)
# nibbles ($0, $1: two per register). prmt spreads bytes 0,1 (then 2,3) into the high byte of each
# 16-bit half, so each 32-bit op treats two nibbles. One asm per nibble half: the Pallas lowering
# returns only one result of a multi-result inline asm.
def _asm_sub_nibble(half: str, out: str) -> str:
    """PTX: t (two bytes in the high bytes of its 16-bit halves) -> `out`, two bf16 of the low (or
    high) nibbles: sign at bit 15, magnitude at bits 6-8 (value * 2^-126)."""
    if half == "lo":  # ((t << 4) | (t >> 2)) keeps sign and magnitude apart
        return (f"shl.b32 s, t, 4;\nshr.b32 m, t, 2;\nor.b32 s, s, m;\n"
                f"and.b32 {out}, s, 0x81C081C0;\n")
    return (f"and.b32 s, t, 0x80008000;\nshr.b32 m, t, 6;\nand.b32 m, m, 0x01C001C0;\n"
            f"or.b32 {out}, s, m;\n")


def asm_sub(half: str) -> str:
    """The whole "split_asm_sub" asm of one nibble half ($2 -> $0, $1)."""
    return ("{\n.reg .b32 t, s, m;\n"
            "prmt.b32 t, $2, 0, 0x1404;\n" + _asm_sub_nibble(half, "$0")
            + "prmt.b32 t, $2, 0, 0x3424;\n" + _asm_sub_nibble(half, "$1") + "}")


# "split_asm_t" PTX: 4 packed bytes ($2) -> bf16 of their low (or high) nibbles ($0, $1), the
# "split_asm_sub" bits. prmt places bytes 0, 1 (then 2, 3) in the low bytes of the two 16-bit
# halves; and keeps the two nibbles; one integer multiply by 2^6 + 2^12 (low nibbles, bits 0-3)
# or 2^2 + 2^8 (high, bits 4-7) writes each nibble twice in its half, at bits 6-9 and 12-15 (no
# overlap, so no carries); and keeps bits 6-8 (magnitude) and 15 (sign) of each half. Output slot
# i depends only on input byte i: exact whatever register order Triton packs into one asm instance.
def asm_t(half: str) -> str:
    mask, mul = ("0x000F000F", "0x1040") if half == "lo" else ("0x00F000F0", "0x104")
    code = "{\n.reg .b32 t;\n"
    for r, sel in enumerate(("0x4140", "0x4342")):
        code += (f"prmt.b32 t, $2, 0, {sel};\nand.b32 t, t, {mask};\nmul.lo.u32 t, t, {mul};\n"
                 f"and.b32 ${r}, t, 0x81C081C0;\n")
    return code + "}"


def _inline_asm(code, pb):
    """(low, high) nibbles of packed bytes pb from the PTX `code(half)`, bf16 (CUDA only)."""
    from jax.experimental.pallas import triton as plgpu

    return tuple(plgpu.elementwise_inline_asm(
        code(half), args=[pb], constraints="=r,=r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(pb.shape, jnp.bfloat16)])[0]
        for half in ("lo", "hi"))


def dequant_split(pb, sb, dtype, bits: str = "f16", use_asm: bool = False):
    """"split" / "split_asm_sub": packed [bn, w] uint8 + scales [bn, w/16] -> (low, high) nibble
    weights [bn, w] in `dtype`, times 2^-14: weight columns 2j (low) and 2j+1 (high).

    bits "asm_sub" runs the PTX when `use_asm` (the GPU), else the "bf16" bits, whose products
    are the same (the interpreter cannot run PTX)."""
    if bits == "f16":
        (lo, hi), enc = nibble_bits(pb, "f16"), "f16"
    elif use_asm:
        (lo, hi), enc = _inline_asm(asm_sub, pb), "bf16_sub"
    else:
        (lo, hi), enc = nibble_bits(pb, "bf16"), "bf16"
    sf = _expand_groups(scale_factor(sb, enc), mxfp4.GROUP // 2)
    enc = "f16" if enc == "f16" else "bf16"
    return _scaled(lo, sf, enc, dtype), _scaled(hi, sf, enc, dtype)


# "split_asm_t"'s column order. Within a block of w = 16 S packed columns (S = block_k / 32 steps of
# 16 along the dot's K), logical column L = 16 s + 8 F + 2 t + E (s < S; F, E < 2; t < 4) holds
# physical column p(L) = 4 (S t + s) + 2 F + E: the four columns of a weight row that a thread of
# the transposed product (Triton's wgmma / mma register layout, two consecutive K per register,
# thread t of a quad holding 2 t, 2 t + 1, 2 t + 8, 2 t + 9) needs for one 16-wide step are the four
# bytes of one 32-bit word, and its S words are contiguous.
def perm_t(v, s: int):
    """Last axis (a multiple of 16 s) from physical to `split_asm_t` logical order: v'[.., L] =
    v[.., p(L)] per block of 16 s (reshape + transpose: a relabeling of registers in Triton)."""
    *lead, w = v.shape
    n = len(lead)
    v = v.reshape(*lead, w // (16 * s), 4, s, 2, 2)  # block, t, s, F, E (the physical order)
    v = jnp.transpose(v, (*range(n), n, n + 2, n + 3, n + 1, n + 4))  # block, s, F, t, E
    return v.reshape(*lead, w)


def perm_t_inverse(v, s: int):
    """The inverse of `perm_t` (logical back to physical order)."""
    *lead, w = v.shape
    n = len(lead)
    v = v.reshape(*lead, w // (16 * s), s, 2, 4, 2)  # block, s, F, t, E (the logical order)
    v = jnp.transpose(v, (*range(n), n, n + 3, n + 1, n + 2, n + 4))  # block, t, s, F, E
    return v.reshape(*lead, w)


def perm_t_index(j, s: int):
    """p(L) for logical indices j (int32 array) within blocks of 16 s (`perm_t`, as arithmetic)."""
    blk, r = j // (16 * s), j % (16 * s)
    return blk * (16 * s) + 4 * (s * ((r >> 1) & 3) + (r >> 4)) + 2 * ((r >> 3) & 1) + (r & 1)


def dequant_split_t(pb, sb, dtype, use_asm: bool = False, layout: str = "k3"):
    """"split_asm_t": packed [bn, w] uint8 (w = 16 s, one K block) + scales [bn, w/16] -> (low,
    high) nibble weights [bn, w] in `dtype`, times 2^-14, columns in `perm_t` order.

    On the GPU the PTX bits (value * 2^-126) times 2^(s-15), the paired layout's bytes decoded by
    its own PTX; elsewhere (K3 bytes) the "bf16" bits (value * 2^-125) times 2^(s-16): the same
    products."""
    w = pb.shape[-1]
    s = w // 16
    if use_asm and layout == "paired":
        pb = paired.units_in_place(pb)  # stored words -> unit bytes where the asm packs them
    pt = perm_t(pb, s)
    if use_asm:
        (lo, hi), enc = _inline_asm(paired.ptx if layout == "paired" else asm_t, pt), "bf16_sub"
    else:
        (lo, hi), enc = nibble_bits(pt, "bf16"), "bf16"
    sf = perm_t(_expand_groups(scale_factor(sb, enc), mxfp4.GROUP // 2), s)
    return _scaled(lo, sf, "bf16", dtype), _scaled(hi, sf, "bf16", dtype)
