"""The "paired" MXFP4 layout: K3's packed bytes re-encoded once, at load time, so that the CUDA
decode kernel ("split_asm_t") turns 8 weights into bf16 with 8 integer instructions instead of 14.

Why a re-encoding. In the transposed product the dequantised weights are wgmma's register operand
A: a thread's 32-bit registers hold two consecutive K of one weight row, and Triton hands the
nibble PTX (pack=4) the four bytes [(r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)]: physical packed
columns c, c + 1 (an aligned byte pair) of rows r and r + 8 of one 16-row group. In K3's layout each
byte decodes alone, and placing its nibble's sign at bf16 bit 15 and its magnitude at bits 6-8 costs
prmt, and, mul, and per two weights. Here those 32 bits are stored as a GF(2)-linear mix `u` of the
same bits, chosen so that each of the four output registers is one rotation of `u` (optionally
xor'ed with `u`) and one mask (`DECODE`): shf + and, or shf + lop3. No rotation-and-mask scheme
without the xor exists, and none with shared rotations at 6 instructions (exhaustive search over
rotations and byte permutes). The decode is no longer elementwise: it is exact only if
Triton packs the four bytes above into one asm operand, in that order; the benchmark's one-hot check
verifies that bit for bit on the device.

Unit: u = b0 | b1 << 8 | b2 << 16 | b3 << 24 with b0, b1 = row r's bytes c, c + 1 and b2, b3 = row
r + 8's (r % 16 < 8, c even). Every unit is re-encoded the same way, so the layout is independent
of block sizes; it needs the row count (N) to be a multiple of 16, and any slice of rows (TP shards,
owned rows) must start at a multiple of 16. Zero bytes encode to zero bytes (linear), so masked
loads still read zero weights.

Stored order: each unit is stored as the 4 contiguous bytes of one 32-bit word, so that the word
the kernel loads is the asm operand (without it, Triton builds every operand from two loaded words
with a prmt: 32 of the 621 SASS instructions a warp a K block of 256 in the TP8 gate+up kernel,
offline). Within a 16-row group and a 4-byte column group, stored row 8 F + j, bytes 2 h + e hold
the unit of rows j, j + 8 and columns 2 F, 2 F + 1, i.e. the byte of row 8 h + j, column 2 F + e:
the row-half bit and column bit 1 trade places. The kernel undoes it with a reshape and a transpose
of the loaded tile (`units_in_place`), which Triton absorbs into its shared-memory load (no
instruction, offline SASS). Needs the packed columns (K / 2) to be a multiple of 4.
"""
from __future__ import annotations

import functools

import numpy as np

ROWS = 16  # rows r and r + 8 of each 16-row group share units
MASK = 0x81C081C0  # sign (bit 15) and magnitude (bits 6-8) of each bf16 half
# Output registers: (nibble half, unit slot 0 = bytes b0, b1 / 1 = b2, b3, right rotation of u,
# xor with u). Register (half, slot) holds the "split_asm_sub" bf16 bits (value * 2^-126) of that
# nibble of byte 2 slot (low 16 bits) and byte 2 slot + 1 (high 16 bits).
DECODE = (("lo", 0, 10, False), ("lo", 1, 22, False), ("hi", 0, 12, True), ("hi", 1, 18, True))


def _rotr(v, s: int, xp):
    return ((v >> s) | (v << (32 - s))) & xp.uint32(0xFFFFFFFF)


def _sub_bits(nib, xp):
    """E2M1 nibble -> its "split_asm_sub" bf16 bit pattern (magnitude at bits 6-8, sign at 15)."""
    return ((nib & 7) << 6) | ((nib >> 3) << 15)


def decode_registers(u, xp=np):
    """u (uint32 units) -> {(half, slot): uint32 register}: the PTX of `ptx`, as array code."""
    u = xp.asarray(u, xp.uint32)
    out = {}
    for half, slot, rot, with_xor in DECODE:
        v = _rotr(u, rot, xp)
        if with_xor:
            v = v ^ u
        out[(half, slot)] = v & xp.uint32(MASK)
    return out


def target_registers(o, xp=np):
    """K3 units o (bytes of the original layout) -> the registers the decode must produce."""
    o = xp.asarray(o, xp.uint32)
    out = {}
    for half, slot, _, _ in DECODE:
        b0 = (o >> (16 * slot)) & 0xFF
        b1 = (o >> (16 * slot + 8)) & 0xFF
        n0, n1 = (b0 & 0xF, b1 & 0xF) if half == "lo" else (b0 >> 4, b1 >> 4)
        out[(half, slot)] = _sub_bits(n0, xp) | (_sub_bits(n1, xp) << 16)
    return out


def _bits_of(regs):
    """The 32 data bits of the four registers, in DECODE order, as one uint32 (MASK's 8 bits each)."""
    pos = [b for b in range(32) if MASK >> b & 1]
    word = 0
    for i, (half, slot, _, _) in enumerate(DECODE):
        r = int(regs[(half, slot)])
        for j, b in enumerate(pos):
            word |= ((r >> b) & 1) << (8 * i + j)
    return word


def _linear_matrix(fn) -> np.ndarray:
    """[32, 32] GF(2) matrix of a linear map uint32 -> uint32 (column j = fn(1 << j))."""
    cols = [fn(1 << j) for j in range(32)]
    return np.array([[(c >> i) & 1 for c in cols] for i in range(32)], np.uint8)


def _gf2_inverse(a: np.ndarray) -> np.ndarray:
    n = a.shape[0]
    m = np.concatenate([a.copy(), np.eye(n, dtype=np.uint8)], axis=1)
    for c in range(n):
        piv = next((r for r in range(c, n) if m[r, c]), None)
        if piv is None:
            raise AssertionError("the paired decode is not invertible")  # DECODE is fixed
        m[[c, piv]] = m[[piv, c]]
        for r in range(n):
            if r != c and m[r, c]:
                m[r] ^= m[c]
    return m[:, n:]


def _byte_tables(mat: np.ndarray) -> np.ndarray:
    """[4, 256] uint32: the linear map as a xor of one table lookup per input byte."""
    col = np.array([int(sum(int(mat[i, j]) << i for i in range(32))) for j in range(32)], np.uint64)
    t = np.zeros((4, 256), np.uint64)
    for byte in range(4):
        for v in range(256):
            acc = 0
            for bit in range(8):
                if v >> bit & 1:
                    acc ^= int(col[8 * byte + bit])
            t[byte, v] = acc
    return t.astype(np.uint32)


@functools.lru_cache(maxsize=None)
def _encode_tables():
    """Byte tables of the encoder, K3 unit o -> paired unit u (the inverse of the decode)."""
    dec = _linear_matrix(lambda u: _bits_of(decode_registers(np.uint32(u))))   # u -> data bits
    tgt = _linear_matrix(lambda o: _bits_of(target_registers(np.uint32(o))))  # o -> data bits
    return _byte_tables((_gf2_inverse(dec).astype(np.int64) @ tgt % 2).astype(np.uint8))


def _apply(tables, units, xp):
    t = xp.asarray(tables)
    out = xp.zeros(units.shape, xp.uint32)
    for byte in range(4):
        out = out ^ t[byte][((units >> (8 * byte)) & 0xFF).astype(xp.int32)]
    return out


def _check(shape):
    *_, n, c = shape
    if n % ROWS or c % 4:
        raise ValueError(f"the paired MXFP4 layout needs rows (N = {n}) in whole groups of {ROWS} "
                         f"and packed columns (K / 2 = {c}) a multiple of 4; keep the K3 layout "
                         f"(layout='k3') for this weight")


def _swap(v, xp):
    """[..., N, C] bytes: the row-half bit (row r vs r + 8 of each 16-row group) and bit 1 of the
    column trade places (its own inverse): between the stored order and units in K3 positions."""
    *lead, n, c = v.shape
    v = v.reshape(*lead, n // ROWS, 2, ROWS // 2, c // 4, 2, 2)
    k = len(lead)
    return xp.transpose(v, (*range(k), k, k + 4, k + 2, k + 3, k + 1, k + 5)).reshape(*lead, n, c)


def units_in_place(tile):
    """A loaded tile of stored bytes [bn, w] (bn a multiple of 16, w of 4) -> the same bytes with
    each unit's four bytes at their K3 positions (rows r, r + 8, columns c, c + 1), where the
    kernel's register layout packs them into one asm operand. In a kernel, a relabeling."""
    import jax.numpy as jnp
    return _swap(tile, jnp)


def _to_units(packed, xp):
    """K3-position bytes [..., N, C] -> units [..., N / 16, 8, C / 2]."""
    *lead, n, c = packed.shape
    b = packed.astype(xp.uint32).reshape(*lead, n // ROWS, 2, ROWS // 2, c // 2, 2)
    return (b[..., 0, :, :, 0] | (b[..., 0, :, :, 1] << 8) | (b[..., 1, :, :, 0] << 16)
            | (b[..., 1, :, :, 1] << 24))


def _from_units(u, shape, xp):
    parts = [((u >> (8 * i)) & 0xFF).astype(xp.uint8) for i in range(4)]
    row_r = xp.stack(parts[:2], axis=-1)   # [..., n/16, 8, c/2, 2]
    row_r8 = xp.stack(parts[2:], axis=-1)
    return xp.stack([row_r, row_r8], axis=-4).reshape(shape)


def stored_units(paired, xp=np):
    """The paired layout's stored bytes -> its units [..., N / 16, 8, C / 2] (uint32)."""
    _check(paired.shape)
    return _to_units(_swap(xp.asarray(paired), xp), xp)


def encode(packed, xp=np):
    """K3 packed bytes [..., N, K/2] -> the paired layout (same shape and dtype). Load time."""
    _check(packed.shape)
    units = _apply(_encode_tables(), _to_units(xp.asarray(packed), xp), xp)
    return _swap(_from_units(units, packed.shape, xp), xp)


def decode(paired, xp=np):
    """The paired layout -> K3 packed bytes (the reference, the interpreter, exports): the PTX's
    registers (`decode_registers`, shifts and masks only, so it also runs inside a kernel), their
    nibbles put back in bytes."""
    regs = decode_registers(stored_units(paired, xp), xp)
    o = xp.zeros(regs[DECODE[0][:2]].shape, xp.uint32)
    for half, slot, _, _ in DECODE:
        r = regs[(half, slot)]
        for j in range(2):  # the two bf16 halves: bytes 2 slot + j
            h = r >> (16 * j)
            nib = ((h >> 6) & 7) | (((h >> 15) & 1) << 3)
            o = o | (nib << (8 * (2 * slot + j) + (4 if half == "hi" else 0)))
    return _from_units(o, paired.shape, xp)


def ptx(half: str) -> str:
    """Inline PTX for one nibble half: $2 = a unit, $0 / $1 = the registers of slots 0 / 1."""
    code = "{\n.reg .b32 t;\n"
    for h, slot, rot, with_xor in DECODE:
        if h != half:
            continue
        code += f"shf.r.wrap.b32 t, $2, $2, {rot};\n"
        if with_xor:
            code += "xor.b32 t, t, $2;\n"
        code += f"and.b32 ${slot}, t, {MASK:#010x};\n"
    return code + "}"
