"""kernels_pallas.moe_gmm: the Pallas kernel (interpret mode) against the plain-JAX reference
(ragged_dot on dequantised weights), exact MXFP4 decoding from hand-built bytes for every dequant
variant (its PTX emulated), the tile plan, the default configurations, and
(kernels_pallas.gpu_lowering) the lowering of every benchmarked kernel for an H200.

Every interpreted kernel call costs about a second of compilation on CPU, so each case combines
the features it can: ragged groups, empty groups, rows past sum(group_sizes), K and N not
multiples of their blocks."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from tests.ptx_emulator import emulate_ptx
from kernels_pallas import GmmConfig, MXFP4Weight, moe_gmm, moe_gmm_glu, moe_gmm_tile_metadata
from kernels_pallas.moe import gather_rows, mxfp4, pair_mxfp4, split_x
from kernels_pallas.moe.dequant import (BF16_MAX_SCALE, DEQUANT_VARIANTS, asm_sub, asm_t,
                                        dequant_split, dequant_split_t, dequant_tile,
                                        dequant_variant, perm_t, perm_t_index)


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _groups(rng, m, g, kind):
    if kind == "one_takes_all":
        gs = np.zeros(g, np.int32)
        gs[rng.integers(g)] = m
        return gs
    if kind == "empty_and_short":  # several empty experts and a sum < M
        total = m - int(rng.integers(1, 9))
        cuts = np.sort(rng.integers(0, total + 1, g - 1))
        gs = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
        gs[rng.choice(g, size=g // 3, replace=False)] = 0
        return gs
    # random routing: each row picks an expert uniformly (binomial group sizes, empties likely)
    return np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32)


def _weights(rng, g, k, n, wtype):
    w = rng.standard_normal((g, n, k)).astype(np.float32) / np.sqrt(k)  # K3 layout [out, in]
    if wtype in ("mxfp4", "paired"):
        p, s = mxfp4.quantize(w)
        q = MXFP4Weight(jnp.asarray(p), jnp.asarray(s))
        return pair_mxfp4(q) if wtype == "paired" else q
    dt = jnp.bfloat16 if wtype == "bf16" else jnp.float32
    return jnp.asarray(np.swapaxes(w, 1, 2), dt)  # ragged_dot layout [G, K, N]


def _zero_past_sum(y, gs):
    return np.all(np.asarray(y[int(np.sum(np.asarray(gs))):], np.float32) == 0.0)


C = GmmConfig
CASES = [
    # (M, K, N, G, grouping, weights, x dtype, config); K 96 / N 40 or 48: ragged last blocks
    # dense: fused tails (a group's last tile up to block_m + block_m_small rows in one program),
    # transposed and not, with the short and full tiles of the other groups beside them
    (150, 96, 40, 4, "random", "bf16", jnp.bfloat16,
     C(32, 16, 64, block_m_small=16, transpose_small=True, fuse_tail=True)),
    (140, 64, 48, 3, "empty_and_short", "fp32", jnp.float32, C(32, 32, 32, block_m_small=16,
                                                               fuse_tail=True)),
    # dense: short tiles transposed in the flattened loop over 2 column blocks (one ragged)
    (50, 64, 48, 4, "empty_and_short", "fp32", jnp.float32,
     C(64, 32, 32, block_m_small=16, transpose_small=True, n_per_program=2)),
    # dense: x resident over column blocks (the last program's blocks partly / wholly past N)
    (45, 96, 40, 6, "empty_and_short", "bf16", jnp.bfloat16, C(16, 16, 64, n_per_program=2,
                                                               x_resident=True)),
    (50, 96, 32, 4, "one_takes_all", "bf16", jnp.bfloat16, C(32, 16, 32, block_m_small=16)),
    # MXFP4: the flattened loop (the CUDA TP8 down form), x resident, fused tails
    (61, 96, 40, 7, "random", "mxfp4", jnp.bfloat16, C(16, 16, 64, dequant="split_asm_t",
                                                       n_per_program=4)),
    (61, 96, 40, 7, "empty_and_short", "mxfp4", jnp.bfloat16,
     C(16, 16, 64, dequant="split_asm_t", n_per_program=4, x_resident=True)),
    (52, 128, 64, 4, "random", "mxfp4", jnp.float32,
     C(32, 16, 32, block_m_small=16, dequant="split", n_per_program=3, x_resident=True)),
    (150, 96, 40, 4, "random", "mxfp4", jnp.bfloat16,
     C(32, 16, 64, block_m_small=16, dequant="split_asm_t", fuse_tail=True)),
    # K split over programs (partial sums added after): 3 K blocks in 2 splits (2 + 1) with a
    # ragged N; in 4 splits, the last with no K block left (it stores zeros)
    (61, 96, 40, 7, "empty_and_short", "mxfp4", jnp.bfloat16,
     C(16, 16, 32, dequant="split_asm_t", split_k=2)),
    (50, 96, 32, 5, "random", "fp32", jnp.float32, C(16, 16, 32, split_k=4)),
]


def _case_id(c):
    return (f"M{c[0]}K{c[1]}N{c[2]}G{c[3]}-{c[4]}-{c[5]}-{jnp.dtype(c[6]).name}-"
            + c[7].name().replace("/", "-"))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_moe_gmm_matches_reference(case):
    m, k, n, g, kind, wtype, xdt, cfg = case
    rng = np.random.default_rng(abs(hash(case[:6])) % 2**32)
    gs = jnp.asarray(_groups(rng, m, g, kind))
    x = jnp.asarray(rng.standard_normal((m, k)), xdt)
    w = _weights(rng, g, k, n, wtype)
    y = moe_gmm(x, w, gs, backend="interpret", config=cfg)
    ref = moe_gmm(x, w, gs, backend="reference")
    assert y.shape == (m, n) and y.dtype == xdt
    assert not np.any(np.isnan(np.asarray(y, np.float32)))
    assert _rel(y, ref) < (1e-2 if xdt == jnp.bfloat16 else 1e-5)
    assert _zero_past_sum(y, gs), "rows past sum(group_sizes) must be 0"


# Scale bytes each in-kernel encoding keeps exact (below 16 the products leave bf16's normal range;
# the interpreter's bf16 bits end at 143, where the factor 2^(s-16) is bf16's largest power of two;
# the GPU's "sub" bits at 142).
_SCALES_F16 = [16, 17, 100, 117, 122, 126, 127, 128, 150, 200, 240, 250]
_SCALES_BF16 = [16, 17, 60, 100, 117, 122, 126, 127, 128, 130, 142]


@pytest.mark.parametrize("dequant,x_split,layout", [
    ("interleave", "pre", "k3"), ("split", "pre", "k3"), ("split", "stride", "k3"),
    ("split_asm_sub", "pre", "k3"), ("split_asm_t", "pre", "k3"), ("split_asm_t", "stride", "k3"),
    ("split_asm_t", "pre", "paired"), ("interleave", "pre", "paired")])
def test_mxfp4_exact_through_kernel(dequant, x_split, layout):
    """One-hot x rows: out[i, n] must be exactly the dequantised w[group(i)][n, c_i]. Expert 0
    holds every byte value, an all-zero scale group (byte 0) and the variant's scale range;
    expert 1 is empty; rows past the sum are zero; K 96 and N 48 end in partial blocks (the
    paired layout: decoded back to K3 bytes per tile by the interpreter)."""
    k, n, g, m = 96, 48, 3, 48
    gs = np.array([13, 0, 27], np.int32)
    rng = np.random.default_rng(21)
    packed = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    packed[0] = (np.arange(n)[:, None] * (k // 2) + np.arange(k // 2)[None, :]) % 256
    sset = _SCALES_F16 if dequant_variant(dequant)[1] == "f16" else _SCALES_BF16
    scales = rng.choice(np.array(sset, np.uint8), (g, n, k // 32))
    packed[0, 2, 16:32] = 0  # an all-zero group with the quantiser's scale byte 0
    scales[0, 2, 1] = 0
    c = (np.arange(m) * 5 + 3) % k
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), c] = 1.0
    dense = np.asarray(mxfp4.dequantize(packed, scales, jnp.float32))  # [G, N, K]
    grp = np.repeat(np.arange(g), gs)
    want = np.zeros((m, n), np.float32)
    want[:gs.sum()] = dense[grp, :, c[:gs.sum()]]
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scales))
    w = pair_mxfp4(w) if layout == "paired" else w
    cfg = C(32, 32, 64, block_m_small=16, dequant=dequant, x_split=x_split)
    y = moe_gmm(jnp.asarray(x, jnp.bfloat16), w, jnp.asarray(gs), backend="interpret", config=cfg,
                preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), want)


@pytest.mark.parametrize("activation,wtype,m,n,cfg,unfused", [
    ("swiglu", "bf16", 53, 48, C(32, 16, 64, block_m_small=16, n_per_program=2), True),
    ("situ", "mxfp4", 53, 32, C(32, 32, 64, block_m_small=16, dequant="split_asm_sub"), False),
    ("situ", "mxfp4", 53, 48, C(32, 16, 64, block_m_small=16, dequant="split_asm_t",
                                n_per_program=2), True),
    # fused tails: four accumulators (two per row block), dense and paired MXFP4
    ("situ", "bf16", 150, 32, C(32, 32, 32, block_m_small=16, transpose_small=True,
                                fuse_tail=True), False),
    ("situ", "paired", 150, 32, C(32, 32, 32, block_m_small=16, dequant="split_asm_t",
                                  fuse_tail=True), False)],
    ids=["dense-np2", "asm_sub", "asm_t-np2", "dense-ftail", "paired-ftail"])
def test_moe_gmm_glu_matches_reference(activation, wtype, m, n, cfg, unfused):
    """Fused gate/up (two accumulators a program, the activation in the epilogue) == the
    reference; n_per_program 2: both stored at the end of each column block of the flattened
    loop (N 48 in blocks of 16). unfused: two products with fp32 outputs (x split once), the
    activation after: the same values."""
    k, g = 64, 6 if m < 100 else 4
    rng = np.random.default_rng(7)
    gs = jnp.asarray(_groups(rng, m, g, "empty_and_short"))
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    w1, w3 = _weights(rng, g, k, n, wtype), _weights(rng, g, k, n, wtype)
    y = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="interpret", config=cfg,
                    fuse=True)
    ref = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="reference")
    assert _rel(y, ref) < 1e-2 and _zero_past_sum(y, gs)
    if unfused:
        yu = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="interpret", config=cfg,
                         fuse=False)
        assert _rel(yu, y) < 1e-2 and _zero_past_sum(yu, gs)


def test_fuse_tail_refusals():
    with pytest.raises(ValueError, match="fuse_tail needs"):
        C(32, 32, 32, fuse_tail=True)
    rng = np.random.default_rng(9)
    x = jnp.zeros((40, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="fuse_tail with MXFP4"):  # no shared dequantised tile
        moe_gmm(x, _weights(rng, 2, 64, 32, "mxfp4"), jnp.array([20, 20], jnp.int32),
                backend="interpret",
                config=C(32, 32, 32, block_m_small=16, dequant="split", fuse_tail=True))


def test_tile_plan_covers_rows_once_and_equals_tile_metadata():
    """tile_metadata: every row in exactly one tile of its group; tiles within block_m rows (with
    `tail`: a group's last tile within block_m + tail, the zero group's within block_m), and a
    group of block_m + tail rows or fewer one tile. The one-launch Pallas tile plan (interpret)
    gives the same table; groupings with empty experts, one expert taking every row, sum > M
    (clipped), M < G (fewer slots than groups), block_m > M and K3's G = 896."""
    rng = np.random.default_rng(11)
    meta_fn = jax.jit(moe_gmm_tile_metadata, static_argnums=(1, 2, 3))
    from kernels_pallas.moe.tiles import tile_plan
    for m, g, bm in [(100, 7, 16), (5, 9, 16), (16, 896, 16), (1024, 896, 16), (40, 3, 128)]:
        for tail in (0, bm // 4):
            for trial in range(3):  # sum < M (a zero group), one expert takes all, sum > M
                rows = (m - min(3, m - 1), m, m + 9)[trial]
                gs = rng.multinomial(rows, rng.dirichlet(np.full(g, 0.3)))
                if trial == 1:
                    gs[:] = 0
                    gs[rng.integers(g)] = m
                gs = gs.astype(np.int32)
                meta = np.asarray(meta_fn(jnp.asarray(gs), m, bm, tail))
                np.testing.assert_array_equal(
                    np.asarray(tile_plan(jnp.asarray(gs), m, bm, interpret=True, tail=tail)), meta)
                assert meta.shape == (3, -(-m // bm) + min(g, m))
                if trial == 2:  # sum > M breaks the contract: only the clipping is checked
                    continue
                cover = np.zeros(m, np.int32)
                owner = np.repeat(np.arange(g), gs)
                for grp, s, e in meta.T:
                    if grp < 0:
                        continue
                    assert 0 < e - s <= (bm + tail if grp < g else bm)
                    cover[s:e] += 1
                    if grp < g:
                        assert np.all(owner[s:e] == grp)
                    else:
                        assert s >= gs.sum()
                assert np.all(cover == 1)
                per_group = np.bincount(meta[0][(meta[0] >= 0) & (meta[0] < g)], minlength=g)
                assert np.all(per_group[(gs > 0) & (gs <= bm + tail)] == 1)


def test_dequant_encodings_exact_for_every_byte():
    """The codec on hand-built bytes; the in-kernel dequantisations (times 2^-14, undone on the
    accumulator) equal it for every byte, both nibble orders, each encoding's scale range and an
    all-zero group (s = 0); beyond the bf16 range they are loud (inf / nan)."""
    # 0x21: low nibble 1 -> 0.5 (column 0), high nibble 2 -> 1.0 (column 1); 0xF8: -0, -6
    row = np.array([0x21, 0xF8] + [0x00] * 14, np.uint8)
    hand = np.asarray(mxfp4.dequantize(np.stack([row, row]), np.array([[127], [128]], np.uint8),
                                       jnp.float32))
    np.testing.assert_array_equal(hand[:, :4], [[0.5, 1.0, -0.0, -6.0], [1.0, 2.0, -0.0, -12.0]])
    assert np.all(hand[:, 4:] == 0)
    allb = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(16, 16))  # [bn 16, K/2 16]: 1 group
    for bits, scales in (("f16", _SCALES_F16), ("asm_sub", _SCALES_BF16 + [BF16_MAX_SCALE])):
        sc = jnp.asarray(np.resize(np.array(scales, np.uint8), 16)[:, None])
        want = np.asarray(mxfp4.dequantize(allb, sc, jnp.float32))  # [16, 32]
        if bits == "f16":
            got = np.asarray(dequant_tile(allb, sc, jnp.float32))
            np.testing.assert_array_equal(got * 2.0 ** 14, want)
        lo, hi = dequant_split(allb, sc, jnp.float32, bits)  # asm_sub: the interpreter's bits
        np.testing.assert_array_equal(np.asarray(lo) * 2.0 ** 14, want[:, 0::2])
        np.testing.assert_array_equal(np.asarray(hi) * 2.0 ** 14, want[:, 1::2])
        lo, hi = dequant_split(jnp.zeros((2, 16), jnp.uint8), jnp.zeros((2, 1), jnp.uint8),
                               jnp.bfloat16, bits)
        assert np.all(np.asarray(lo, np.float32) == 0) and np.all(np.asarray(hi, np.float32) == 0)
    lo, _ = dequant_split(allb[:1], jnp.full((1, 1), BF16_MAX_SCALE + 1, jnp.uint8), jnp.float32,
                          "asm_sub")
    assert not np.any(np.isfinite(np.asarray(lo)))


# ---- "split_asm_t" column order; the PTX of both CUDA variants emulated in numpy ----

def _perm_t_reference(w, s):
    """p(L) for L in [0, w) as documented: L = 16 s_ + 8 F + 2 t + E  <-  4 (s t + s_) + 2 F + E."""
    out = np.empty(w, np.int64)
    for L in range(w):
        blk, r = divmod(L, 16 * s)
        s_, F, t, E = r // 16, (r >> 3) & 1, (r >> 1) & 3, r & 1
        out[L] = blk * 16 * s + 4 * (s * t + s_) + 2 * F + E
    return out


def test_split_asm_t_column_order():
    """`perm_t` (reshape + transpose), `perm_t_index` (arithmetic, the strided x path) and the
    documented formula agree, and are a permutation within each K block; a thread (t) of one
    16-wide step takes the 4 bytes of one word, its words contiguous."""
    for s in (1, 2, 4, 8, 16):
        w = 3 * 16 * s
        ref = _perm_t_reference(w, s)
        assert sorted(ref) == list(range(w))
        j = jnp.arange(w, dtype=jnp.int32)
        np.testing.assert_array_equal(np.asarray(perm_t(j[None], s))[0], ref)
        np.testing.assert_array_equal(np.asarray(perm_t_index(j, s)), ref)
        for t in range(4):
            words = {ref[16 * s_ + 8 * F + 2 * t + E] // 4
                     for s_ in range(s) for F in (0, 1) for E in (0, 1)}
            assert words == set(range(s * t, s * t + s))


def _bf16_times(bits, factor_bits):
    """bf16 bits x bf16 bits, rounded to nearest as the GPU's bf16x2 multiply does (subnormals kept:
    exact here, every product is a power-of-two multiple of an E2M1 value) -> bf16 bits."""
    a = (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)
    b = (np.asarray(factor_bits, np.uint32) << 16).view(np.float32).astype(np.float64)
    p = (a * b).astype(np.float32)
    pb = p.view(np.uint32)
    assert np.all((pb & 0xFFFF) == 0) or not np.all(np.isfinite(p)), "product not exact in bf16"
    return (pb >> 16).astype(np.uint16)


def _emulate_ptx_tile(code, pt, rng):
    """The PTX `code(half)` run on the bytes pt [rows, w] (in the order the weights come out),
    packed 4 per asm instance in a RANDOM order (Triton chooses the register order; the PTX is
    elementwise, so any packing must give the same tile) -> (lo, hi) bf16 bits [rows, w]."""
    flat = pt.reshape(-1)
    order = rng.permutation(flat.size).reshape(-1, 4)
    words = (flat[order].astype(np.uint32) << np.array([0, 8, 16, 24], np.uint32)).sum(
        1, dtype=np.uint32)
    out = []
    for half in ("lo", "hi"):
        r0, r1 = emulate_ptx(code(half), [words], 2)
        halves = np.stack([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], 1).astype(np.uint32)
        res = np.zeros(flat.size, np.uint32)
        res[order.reshape(-1)] = halves.reshape(-1)
        out.append(res.reshape(pt.shape))
    return out


@pytest.mark.parametrize("dequant", ["split_asm_sub", "split_asm_t"])
def test_ptx_emulated_matches_interpreter(dequant):
    """The CUDA variants' PTX (emulated from its text: prmt per the PTX ISA, integer ops mod 2^32)
    gives the "sub" bits (sign << 15 | magnitude << 6) of every nibble, and times the GPU factor
    2^(s-15) in bf16 the same weights as the interpreter's path (value * 2^-125 times 2^(s-16)),
    for every byte, every scale byte 16..142 and the all-zero group, and equal to the codec; K
    blocks of 2 and 8 steps for "split_asm_t"'s column order."""
    rng = np.random.default_rng(5)
    code = asm_t if dequant == "split_asm_t" else asm_sub
    b = np.arange(256, dtype=np.uint32)
    for half, nib in (("lo", b & 15), ("hi", b >> 4)):
        r0, r1 = emulate_ptx(code(half), [b * 0x01010101], 2)  # every slot holds byte b
        want = ((nib & 8) << 12) | ((nib & 7) << 6)
        for r in (r0, r1):
            np.testing.assert_array_equal(r & 0xFFFF, want)
            np.testing.assert_array_equal(r >> 16, want)
    for s in ((2, 8) if dequant == "split_asm_t" else (1,)):
        w = 16 * s
        every = np.arange(256, dtype=np.uint8).reshape(256 // w, w)  # every byte once
        # every byte at each scale byte, then at scale bytes mixed over the groups, then zeros
        pb = np.concatenate([every] * (len(_SCALES_BF16) + 1) + [np.zeros((2, w), np.uint8)])
        sc = np.concatenate([np.full((256 // w, s), v, np.uint8) for v in _SCALES_BF16]
                            + [np.resize(np.array(_SCALES_BF16[::-1], np.uint8), (256 // w, s)),
                               np.zeros((2, s), np.uint8)])
        perm = _perm_t_reference(w, s) if dequant == "split_asm_t" else np.arange(w)
        fn = (dequant_split_t if dequant == "split_asm_t"
              else lambda p, q, dt: dequant_split(p, q, dt, "asm_sub"))
        lo, hi = fn(jnp.asarray(pb), jnp.asarray(sc), jnp.bfloat16)
        f = (np.minimum(sc.astype(np.int64) + 112, 255) << 7).astype(np.uint32)  # 2^(s-15), bf16
        fac = np.repeat(f, 16, axis=1)[:, perm]
        codec = np.asarray(mxfp4.dequantize(pb, sc, jnp.float32))  # [rows, 32 s] natural order
        for got, bits, nib in zip((lo, hi), _emulate_ptx_tile(code, pb[:, perm], rng), (0, 1)):
            np.testing.assert_array_equal(_bf16_times(bits, fac), np.asarray(got).view(np.uint16))
            np.testing.assert_array_equal(np.asarray(got, np.float32) * 2.0 ** 14,
                                          codec[:, 2 * perm + nib])


def test_config_validation():
    with pytest.raises(ValueError):
        C(dequant="nibble")
    for gone in ("interleave_bf16", "split_bf16", "split_asm"):
        with pytest.raises(ValueError, match="not one of"):
            C(dequant=gone)
    assert set(DEQUANT_VARIANTS) == {"interleave", "split", "split_asm_sub", "split_asm_t"}
    with pytest.raises(ValueError):
        C(x_split="gather")
    with pytest.raises(ValueError, match="n_per_program"):
        C(n_per_program=0)
    with pytest.raises(ValueError, match="n_per_program > 1"):
        C(x_resident=True)
    with pytest.raises(ValueError, match="split_k must be"):
        C(split_k=0)
    with pytest.raises(ValueError, match="split_k splits the plain K loop"):
        C(split_k=2, n_per_program=2)
    with pytest.raises(ValueError, match="cannot take it: use fuse=False"):
        x, gs = jnp.zeros((8, 64), jnp.float32), jnp.array([8], jnp.int32)
        w = jnp.zeros((1, 64, 32), jnp.float32)
        moe_gmm_glu(x, w, w, gs, backend="interpret", config=C(16, 16, 32, split_k=2), fuse=True)
    assert C(16, 128, 128, n_per_program=4, transpose_small=True).name() == \
        "bm16/None_bn128_bk128_w4_s3_np4_tsmall"
    assert dequant_variant("split_asm_sub") == (True, "asm_sub")
    assert dequant_variant("split_asm_t") == (True, "asm_t")
    assert dequant_variant("interleave") == (False, "f16")
    assert C(16, 128, 256, dequant="split_asm_t", x_split="stride").name() == \
        "bm16/None_bn128_bk256_w4_s3_split_asm_t_xstride"


def test_default_config_by_platform():
    """MXFP4 decode: inline PTX ("split_asm_t", bk256; "split_asm_sub" for the fused gate/up)
    only on CUDA with bf16 activations, the portable "split" (bk128) on ROCm, CPU and the
    interpreter; bf16 prefill 4 stages; the regime rules beyond the table."""
    from kernels_pallas._backend import kernel_platform
    from kernels_pallas.moe import default_config
    from kernels_pallas.moe.tuning import lookup, shape_class

    G, K, N = 896, 3584, 768
    for tokens in (64, 512):
        c = default_config(16 * tokens, G, K, N, True, platform="cuda")
        assert (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.dequant) == \
            (16, 128, 256, 4, 4, "split_asm_t")
        c = default_config(16 * tokens, G, K, N // 2, True, True, platform="cuda")
        assert (c.dequant, c.block_n) == ("split_asm_sub", 64)  # fused gate/up: half the columns
        for plat in ("rocm", "cpu", "interpret", "gpu"):
            c = default_config(16 * tokens, G, K, N, True, platform=plat)
            assert (c.dequant, c.block_k) == ("split", 128), plat
        c = default_config(16 * tokens, G, K, N, True, platform="cuda", x_dtype=jnp.float32)
        assert (c.dequant, c.block_k) == ("split", 256)
    assert kernel_platform() == jax.devices()[0].platform == "cpu"   # the tests run on CPU
    assert not default_config(1024, G, K, N, True).dequant.startswith("split_asm")
    c = default_config(16 * 8192, G, K, N, False)
    assert (c.block_m, c.block_m_small, c.block_n, c.block_k, c.num_warps, c.num_stages,
            c.transpose_small, c.fuse_tail) == (128, 32, 256, 64, 8, 4, True, True)
    # no table row: the regime rules (MXFP4 prefill, fused GLU prefill, the middle regime)
    for cls in (shape_class(16 * 8192, G, K, N, True), shape_class(16 * 8192, G, K, N // 2, False,
                                                                   True),
                shape_class(50 * G, G, K, N, True)):
        assert lookup("cuda", cls)[0] is None, cls
    c = default_config(16 * 8192, G, K, N, True)
    assert (c.num_stages, c.dequant) == (3, "interleave")                  # MXFP4 prefill
    c = default_config(16 * 8192, G, K, N // 2, False, True)                     # fused GLU
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == (128, 64, 8, 3)
    c = default_config(50 * G, G, 3000, 40, False)  # middle; K 3000 (no multiple of 64), N 40
    assert (c.block_m, c.block_m_small, c.block_n, c.block_k) == (64, 16, 64, 32)
    assert default_config(16, 8, 256, 40, False, True).block_n == 32      # narrow N, fused GLU
    # small experts (the tiny models' K 96 / N 128): the decode blocks up to the prefill regime,
    # so a verify pass runs its decode step's config; K3's shapes keep the middle rule
    for plat in ("cuda", "rocm"):
        for k, n in ((96, 128), (128, 96)):
            want = default_config(16 * 16, 16, k, n, True, platform=plat)
            assert shape_class(50 * 16, 16, k, n, True).regime == "decode"
            assert default_config(50 * 16, 16, k, n, True, platform=plat) == want
            assert default_config(100 * 16, 16, k, n, True, platform=plat).block_m == 128
    for k, n in ((384, 3584), (3584, 384)):
        assert shape_class(50 * G, G, k, n, True).regime == "middle"
    # sparse decode (under half a row an expert), CUDA, paired: a TP8 rank's gate / up at half
    # width, K split where the programs are few (1 token: 16 rows x 6 column blocks = 96), and
    # its down at two column blocks a program
    for layout in ("paired", "k3"):
        for tokens, split in ((1, 4), (2, 2), (16, 1)):
            c = default_config(16 * tokens, G, K, 384, True, platform="cuda", layout=layout)
            assert (c.block_n, c.block_k, c.split_k, c.dequant) == (64, 256, split, "split_asm_t"), c
            c = default_config(16 * tokens, G, 384, 3584, True, platform="cuda", layout=layout)
            assert (c.block_n, c.block_k, c.n_per_program, c.x_resident, c.split_k) == \
                (128, 128, 2, layout == "paired", 1), c
    assert default_config(16, G, K, 384, True, platform="rocm").split_k == 1  # measured on CUDA only
    assert default_config(16, G, K, 384, True, platform="cuda", x_dtype=jnp.float32).split_k == 1
    assert default_config(16, G, K, 384 // 2, True, True, platform="cuda").split_k == 1  # fused GLU

    class _Client:
        def __init__(self, version):
            self.platform_version = version

    class _Dev:
        def __init__(self, version, kind):
            self.platform, self.client, self.device_kind = "gpu", _Client(version), kind

    assert kernel_platform(_Dev("cuda 13000", "NVIDIA H200")) == "cuda"
    assert kernel_platform(_Dev("rocm 7.0", "AMD Instinct MI300X")) == "rocm"
    assert kernel_platform(_Dev("<unknown>", "NVIDIA H200")) == "cuda"
    assert kernel_platform(_Dev("<unknown>", "AMD Instinct MI300X")) == "gpu"


def test_cuda_decode_takes_k_blocks_of_128_only_in_the_flattened_loop():
    """split_asm_t at K blocks of 128 raced on the H200 in the plain K loop: K blocks of 256 where
    256 divides K; otherwise (384, a TP8 rank's down projection) 128 in a loop over column blocks
    (paired: 7 a program with x resident for K <= 512; 4 in the flattened loop otherwise). Both
    layouts; the paired layout takes split_asm_t in every regime on CUDA."""
    from kernels_pallas.moe import default_config
    for layout in ("k3", "paired"):
        for k in (3072, 3584):
            cfg = default_config(64 * 16, 896, k, 3584, True, platform="cuda", layout=layout)
            assert cfg.dequant == "split_asm_t" and cfg.block_k == 256, (layout, k, cfg)
            assert cfg.n_per_program == 1
        cfg = default_config(512 * 16, 896, 384, 3584, True, platform="cuda", layout=layout)
        assert (cfg.dequant, cfg.block_k, cfg.n_per_program, cfg.num_stages, cfg.x_resident) \
            == (("split_asm_t", 128, 7, 3, True) if layout == "paired"
                else ("split_asm_t", 128, 4, 3, False)), (layout, cfg)
        for k in (640, 96):  # K blocks of 128 as they are (96: one partial block)
            cfg = default_config(512 * 16, 896, k, 3584, True, platform="cuda", layout=layout)
            assert (cfg.block_k, cfg.n_per_program, cfg.x_resident) == \
                ((128, 7, True) if layout == "paired" and k == 96 else (128, 4, False)), (k, cfg)
    for m in (50 * 896, 8192 * 16):  # middle, prefill
        cfg = default_config(m, 896, 3584, 768, True, platform="cuda", layout="paired")
        assert cfg.dequant == "split_asm_t" and cfg.block_m > 16
        assert default_config(m, 896, 3584, 768, True, platform="rocm",
                              layout="paired").dequant == "interleave"


def test_default_config_and_gather_rows_in_interpret_mode():
    """config=None on the interpreter at decode shapes (the "split" default): moe_gmm, and the
    MoE layer's path: gather_rows (x split before the gather) then the gate/up fused or not."""
    rng = np.random.default_rng(31)
    m, k, n, g = 12, 256, 64, 16
    gs = jnp.asarray(_groups(rng, m, g, "random"))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rows = jnp.asarray(rng.permutation(m), jnp.int32)
    w1, w3 = (_weights(rng, g, k, n, "mxfp4") for _ in range(2))
    y = moe_gmm(x[rows], w1, gs, backend="interpret")
    assert _rel(y, moe_gmm(x[rows], w1, gs, backend="reference")) < 1e-2
    xs = gather_rows(x, rows, w1, backend="interpret")
    np.testing.assert_array_equal(np.asarray(xs.dense()), np.asarray(x[rows]))
    np.testing.assert_array_equal(np.asarray(moe_gmm(xs, w1, gs, backend="interpret")),
                                  np.asarray(y))
    ref = moe_gmm_glu(x[rows], w1, w3, gs, backend="reference")
    for fuse in (True, False):  # the fused kernel's default config, and the unfused default
        xg = gather_rows(x, rows, w1, backend="interpret", fused_glu=fuse)
        assert _rel(moe_gmm_glu(xg, w1, w3, gs, backend="interpret", fuse=fuse), ref) < 2e-2, fuse
    np.testing.assert_array_equal(np.asarray(gather_rows(x, rows, w1, backend="reference")),
                                  np.asarray(x[rows]))


def test_row_groups_a_tile_per_row_in_any_order():
    """moe_gmm(row_groups=): rows unsorted, a group repeated, group G rows zero. Equal to the
    reference and, row for row, bitwise to the grouped path's kernel on the rows sorted (one row
    a group there too, so each row's tile is the same); the gate/up pair on the same rows."""
    rng = np.random.default_rng(37)
    m, k, n, g = 10, 256, 64, 16
    groups = jnp.asarray([5, 2, 9, 16, 0, 2, 15, 7, 16, 11], jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w1, w3 = (_weights(rng, g, k, n, "mxfp4") for _ in range(2))
    y = moe_gmm(x, w1, row_groups=groups, backend="interpret")
    ref = moe_gmm(x, w1, row_groups=groups, backend="reference")
    assert _rel(y, ref) < 1e-2
    zero = np.asarray(groups) == g
    assert np.all(np.asarray(y, np.float32)[zero] == 0) and np.all(np.asarray(ref, np.float32)[zero] == 0)
    distinct = np.array([0, 2, 4, 6, 7, 9])  # rows of six distinct groups
    order = distinct[np.argsort(np.asarray(groups)[distinct])]
    sizes = jnp.zeros((g,), jnp.int32).at[groups[order]].set(1)
    grouped = moe_gmm(x[order], w1, sizes, backend="interpret")
    np.testing.assert_array_equal(np.asarray(grouped), np.asarray(y)[order])
    dense = [_weights(rng, g, k, n, "bf16") for _ in range(2)]  # and dense weights, fused or not
    want = moe_gmm_glu(x, *dense, row_groups=groups, activation="situ", backend="reference")
    for fuse in (False, True):
        got = moe_gmm_glu(x, *dense, row_groups=groups, activation="situ", backend="interpret",
                          fuse=fuse)
        assert _rel(got, want) < 1e-2, fuse
    with pytest.raises(ValueError, match="either group_sizes"):
        moe_gmm(x, w1, sizes, row_groups=groups, backend="interpret")
    with pytest.raises(ValueError, match="row_groups must be"):
        moe_gmm(x, w1, row_groups=groups[:4], backend="interpret")
    from kernels_pallas.gpu_lowering import lower_for_gpu  # K3's TP8 gate and down, 16 pairs
    sd = jax.ShapeDtypeStruct
    for kk, nn in ((3584, 384), (384, 3584)):
        wq = MXFP4Weight(sd((896, nn, kk // 2), jnp.uint8), sd((896, nn, kk // 32), jnp.uint8))
        for platform in ("cuda", "rocm"):
            lower_for_gpu(lambda a, b, c: moe_gmm(a, b, row_groups=c, backend="pallas"),
                          sd((16, kk), jnp.bfloat16), wq, sd((16,), jnp.int32), platform=platform)


def test_benchmark_kernels_lower_for_h200():
    """Every kernel the MoE benchmark times (each layer shape at its CUDA default config, MXFP4 in
    both layouts, bf16, the fused gate/up) lowers to Triton IR for an H200, and so do the
    portable "split" decode and the fused gate/up in "split_asm_t", which no benchmark row runs
    on CUDA."""
    from benchmarks.moe import lower_check
    from kernels_pallas.gpu_lowering import lower_for_gpu as lower_cuda
    assert lower_check(lower_cuda, log=lambda s: None) == []
    sd = jax.ShapeDtypeStruct
    wq = MXFP4Weight(sd((896, 768, 1792), jnp.uint8), sd((896, 768, 112), jnp.uint8))
    lower_cuda(lambda a, b, c: moe_gmm(a, b, c, backend="pallas",
                                       config=C(16, 128, 128, num_stages=4, dequant="split")),
               sd((1024, 3584), jnp.bfloat16), wq, sd((896,), jnp.int32))
    w = MXFP4Weight(sd((896, 384, 1792), jnp.uint8), sd((896, 384, 112), jnp.uint8))
    cfg = C(16, 128, 256, num_stages=4, dequant="split_asm_t")
    lower_cuda(lambda a, b, c, d: moe_gmm_glu(a, b, c, d, activation="situ", backend="pallas",
                                              config=cfg, fuse=True),
               sd((1024, 3584), jnp.bfloat16), w, w, sd((896,), jnp.int32))


def test_moe_gmm_errors():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    w = jnp.zeros((2, 32, 16), jnp.bfloat16)
    with pytest.raises(ValueError):
        moe_gmm(x, w, jnp.array([2, 2], jnp.int32), backend="interpret")
    wq = MXFP4Weight(jnp.zeros((2, 16, 32), jnp.uint8), jnp.zeros((2, 16, 2), jnp.uint8))
    with pytest.raises(ValueError, match="transpose_small applies to dense weights"):
        moe_gmm(x, wq, jnp.array([2, 2], jnp.int32), backend="interpret",
                config=C(16, 16, 64, transpose_small=True))


# ---- the paired MXFP4 layout (kernels_pallas/moe/paired.py) ----
def _sub_bits_np(nib):
    return ((nib & 8) << 12) | ((nib & 7) << 6)


def test_paired_codec_round_trip_and_zero():
    from kernels_pallas.moe import paired
    rng = np.random.default_rng(3)
    p = rng.integers(0, 256, (3, 48, 40), dtype=np.uint8)
    q = paired.encode(p)
    assert q.shape == p.shape and q.dtype == np.uint8 and np.mean(q != p) > 0.9
    np.testing.assert_array_equal(paired.decode(q), p)
    np.testing.assert_array_equal(np.asarray(paired.decode(jnp.asarray(q), jnp)), p)
    np.testing.assert_array_equal(np.asarray(paired.encode(jnp.asarray(p), jnp)), q)
    np.testing.assert_array_equal(paired.encode(np.zeros_like(p)), 0)  # masked loads stay zero
    with pytest.raises(ValueError, match="multiple of 16|groups of 16"):
        paired.encode(np.zeros((24, 8), np.uint8))
    with pytest.raises(ValueError, match="multiple of 4"):
        paired.encode(np.zeros((16, 6), np.uint8))


def test_paired_units_are_stored_as_aligned_words():
    """Each unit (bytes c, c + 1 of rows r and r + 8) is one aligned little-endian 32-bit word of
    the stored bytes, so the kernel's loaded word is its asm operand; `units_in_place` (the
    kernel's relabeling of a loaded tile) puts every unit's bytes back at its K3 positions."""
    from kernels_pallas.moe import paired
    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, (2, 32, 24), dtype=np.uint8)
    q = paired.encode(p)
    units = paired.stored_units(q)  # [2, 2, 8, 12]: group, row j, column pair
    words = q.view("<u4").reshape(2, 2, 2, 8, 6)  # expert, group, F, row j, word
    np.testing.assert_array_equal(
        words, units.reshape(2, 2, 8, 6, 2).transpose(0, 1, 4, 2, 3))
    tile = jnp.asarray(q[0, 16:32, 8:16])  # a tile: one 16-row group, 8 packed columns
    np.testing.assert_array_equal(paired._to_units(np.asarray(paired.units_in_place(tile)), np)[0],
                                  units[0, 1][:, 4:8])


def test_paired_ptx_emulated_gives_the_sub_bits_of_the_original_bytes():
    """The paired PTX (emulated from its text) on units of encoded bytes, packed as Triton packs
    them for the wgmma operand (bytes c, c + 1 of rows r and r + 8; bit-exact on the H200 by the
    benchmark's one-hot check), yields the "split_asm_sub" bits of the K3 bytes' nibbles."""
    from kernels_pallas.moe import paired
    rng = np.random.default_rng(4)
    every = (np.arange(16)[:, None] * 37 + np.arange(512)[None, :]) % 256  # every byte, each slot
    p = np.concatenate([every, rng.integers(0, 256, (16, 512))]).astype(np.uint8)
    q = paired.encode(p)
    units = paired.stored_units(q)
    orig = paired._to_units(p, np)
    for half in ("lo", "hi"):
        r0, r1 = emulate_ptx(paired.ptx(half), [units.reshape(-1)], 2)
        for slot, r in ((0, r0), (1, r1)):
            b0 = (orig.reshape(-1) >> (16 * slot)) & 0xFF
            b1 = (orig.reshape(-1) >> (16 * slot + 8)) & 0xFF
            n0, n1 = (b0 & 15, b1 & 15) if half == "lo" else (b0 >> 4, b1 >> 4)
            np.testing.assert_array_equal(r & 0xFFFF, _sub_bits_np(n0))
            np.testing.assert_array_equal(r >> 16, _sub_bits_np(n1))
    # every 32-bit unit decodes: the map is a bijection (spot-check with random units)
    u = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    regs = paired.decode_registers(u)
    assert len({tuple(int(regs[k][i]) for k in regs) for i in range(u.size)}) == u.size


def test_paired_weights_api_and_errors():
    """pair_mxfp4 gives an MXFP4PairedWeight whose reference product equals the K3 weights';
    block_n must cover whole 16-row groups; no mixing of layouts; on a GPU only "split_asm_t"
    decodes paired bytes."""
    from kernels_pallas.moe import MXFP4PairedWeight, default_config, ops
    rng = np.random.default_rng(6)
    w = MXFP4Weight(jnp.asarray(rng.integers(0, 256, (2, 32, 16), dtype=np.uint8)),
                    jnp.asarray(rng.integers(118, 130, (2, 32, 1), dtype=np.uint8)))
    wp = pair_mxfp4(w)
    assert isinstance(wp, MXFP4PairedWeight) and wp.layout == "paired" and pair_mxfp4(wp) is wp
    x = jnp.asarray(rng.normal(size=(4, 32)), jnp.bfloat16)
    gs = jnp.array([2, 1], jnp.int32)
    np.testing.assert_array_equal(np.asarray(moe_gmm(x, wp, gs, backend="reference")),
                                  np.asarray(moe_gmm(x, w, gs, backend="reference")))
    with pytest.raises(ValueError, match="block_n a multiple of 16"):
        moe_gmm(x, wp, gs, backend="interpret", config=C(16, 24, 32))
    with pytest.raises(ValueError, match="mixing MXFP4 layouts"):
        moe_gmm_glu(x, w, wp, gs, backend="interpret", fuse=True)
    with pytest.raises(ValueError, match="split_asm_t"):  # on a GPU only that kernel decodes it
        ops._check_paired(C(16, 32, 32, dequant="split"), interpret=False)
    ops._check_paired(C(16, 32, 32, dequant="split_asm_t"), interpret=False)
    assert default_config(64, 896, 3584, 384, True, True, platform="cuda",
                          layout="paired").dequant == "split_asm_t"


# ---- x split by the caller (SplitX) ----
def test_split_x_round_trip_take_and_kernel():
    """split_x inverts (dense), take(rows) == split of x[rows] ("split" and "split_asm_t" with K
    96 padded to blocks of 64), and moe_gmm on the SplitX == on x (interpret) == the reference;
    a SplitX of other blocks, or for a config that reads x as it is, is refused."""
    rng = np.random.default_rng(21)
    g, n, m, k = 3, 32, 40, 96
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rows = jnp.asarray(rng.integers(0, m, 24), jnp.int32)
    for cfg in (C(16, 16, 32, dequant="split"), C(16, 16, 64, dequant="split_asm_t")):
        sx = split_x(x, cfg)
        np.testing.assert_array_equal(np.asarray(sx.dense()), np.asarray(x))
        np.testing.assert_array_equal(np.asarray(sx.take(rows).data),
                                      np.asarray(split_x(x[rows], cfg).data))
    p, sc = mxfp4.quantize(rng.standard_normal((g, n, k)))
    wq = MXFP4Weight(jnp.asarray(p), jnp.asarray(sc))
    gs = jnp.asarray([15, 0, 20], jnp.int32)
    got = moe_gmm(sx, wq, gs, backend="interpret", config=cfg)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.asarray(moe_gmm(x, wq, gs, backend="interpret", config=cfg)))
    assert _rel(got, moe_gmm(sx, wq, gs, backend="reference")) < 1e-2
    assert _rel(moe_gmm_glu(sx, wq, wq, gs, backend="reference"),
                moe_gmm_glu(x, wq, wq, gs, backend="reference")) == 0
    with pytest.raises(ValueError, match="split for block_k"):
        moe_gmm(sx, wq, gs, backend="interpret", config=C(16, 16, 128, dequant="split_asm_t"))
    with pytest.raises(ValueError, match="reads x as it is"):
        split_x(x, C(16, 16, 64, dequant="interleave"))
