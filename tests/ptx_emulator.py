"""A numpy emulator of the integer PTX subset in our inline asm (the MoE MXFP4 decode, the MLA
fp8 words conversion), so CPU tests check the asm text itself, not a re-implementation of it."""
import ml_dtypes
import numpy as np


def prmt(a, b, c):
    """PTX prmt.b32 (default mode), uint32 arrays: output byte i = byte (c >> 4i) & 7 of the 8 bytes
    {b, a} (a: 0-3, b: 4-7); selector bit 3 set: that byte's sign bit replicated (0x00 / 0xFF)."""
    a, b, c = (np.asarray(v, np.uint64) & 0xFFFFFFFF for v in (a, b, c))
    src = a | (b << np.uint64(32))
    out = np.zeros(np.broadcast(a, b, c).shape, np.uint64)
    for i in range(4):
        sel = (c >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (src >> ((sel & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(sel & np.uint64(8), np.where(byte & np.uint64(0x80), 0xFF, 0), byte)
        out |= byte.astype(np.uint64) << np.uint64(8 * i)
    return out.astype(np.uint32)


def emulate_ptx(asm, inputs, n_out):
    """Run the integer PTX subset of our inline asm on uint32 numpy arrays ($0.. outputs, then the
    inputs): mov (also {lo, hi} unpacking), and, or, xor, shl, shr, shf.r.wrap, add.u32, sub.u32, mul.lo.u32, min.u16x2,
    prmt, cvt.u16.u32 (keeps the low 16 bits) and cvt.rn.f16x2.e4m3x2 (the two e4m3 bytes of a
    16-bit value -> two fp16 bit patterns, byte 0 in the low half). Returns the outputs."""
    regs = {f"${n_out + i}": np.asarray(v, np.uint32) for i, v in enumerate(inputs)}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.uint32(int(tok, 0))

    def m32(v):
        return (np.asarray(v, np.uint64) & 0xFFFFFFFF).astype(np.uint32)

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        if op == "mov.b32" and len(src) == 2:      # mov.b32 {lo, hi}, x: unpack two halves
            v = val(src[1])
            regs[d], regs[src[0]] = v & np.uint32(0xFFFF), v >> np.uint32(16)
            continue
        x = [val(t) for t in src]
        u = [np.asarray(v, np.uint64) for v in x]
        if op == "mov.b32":
            r = x[0]
        elif op == "and.b32":
            r = x[0] & x[1]
        elif op == "or.b32":
            r = x[0] | x[1]
        elif op == "xor.b32":
            r = x[0] ^ x[1]
        elif op == "shf.r.wrap.b32":  # funnel shift right of (x1:x0) by x2 mod 32
            r = m32(((u[1] << np.uint64(32)) | u[0]) >> (u[2] & np.uint64(31)))
        elif op == "shl.b32":
            r = m32(u[0] << u[1])
        elif op == "shr.b32":
            r = m32(u[0] >> u[1])
        elif op == "add.u32":
            r = m32(u[0] + u[1])
        elif op == "sub.u32":
            r = m32(u[0] + (np.uint64(1) << np.uint64(32)) - u[1])
        elif op == "cvt.u16.u32":
            r = x[0] & np.uint32(0xFFFF)
        elif op == "cvt.rn.f16x2.e4m3x2":
            pair = (x[0] & np.uint32(0xFFFF)).astype("<u2")
            f16 = pair.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
            h = f16.view(np.uint16).reshape(*pair.shape, 2).astype(np.uint32)
            r = h[..., 0] | (h[..., 1] << np.uint32(16))
        elif op == "mul.lo.u32":
            r = m32(u[0] * u[1])
        elif op == "min.u16x2":
            lo = np.minimum(u[0] & 0xFFFF, u[1] & 0xFFFF)
            hi = np.minimum(u[0] >> np.uint64(16), u[1] >> np.uint64(16))
            r = m32(lo | (hi << np.uint64(16)))
        elif op == "prmt.b32":
            r = prmt(*x)
        else:   # the emulator knows exactly the opcodes our PTX uses; a new one must be added
            raise ValueError(f"PTX opcode {op!r} is not emulated: add its semantics above")
        regs[d] = np.asarray(r, np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]
