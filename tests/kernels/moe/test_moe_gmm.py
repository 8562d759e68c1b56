"""kernels_pallas.moe_gmm: the Pallas kernel (interpret mode) against the plain-JAX reference
(ragged_dot on dequantised weights), exact MXFP4 decoding from hand-built bytes for every dequant
variant, and (kernels_pallas.gpu_lowering) the lowering of every benchmarked kernel for an H200."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from tests.ptx_emulator import emulate_ptx, prmt  # noqa: E402
from kernels_pallas import GmmConfig, MXFP4Weight, moe_gmm, moe_gmm_glu, moe_gmm_tile_metadata
from kernels_pallas.moe import mxfp4, pair_mxfp4
from kernels_pallas.moe.gmm import (_BF16_MAX_SCALE, DEQUANT_VARIANTS, _asm_nibble, _asm_t,
                                    _dequant_split, _dequant_split_t, _dequant_tile, _perm_t,
                                    _perm_t_index, dequant_variant)


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
    if wtype == "mxfp4":
        p, s = mxfp4.quantize(w)
        return MXFP4Weight(jnp.asarray(p), jnp.asarray(s))
    dt = jnp.bfloat16 if wtype == "bf16" else jnp.float32
    return jnp.asarray(np.swapaxes(w, 1, 2), dt)  # ragged_dot layout [G, K, N]


CASES = [
    # (M, K, N, G, grouping, weights, x dtype, config)
    (45, 64, 48, 6, "empty_and_short", "bf16", jnp.bfloat16, GmmConfig(16, 32, 32, num_stages=1)),
    (77, 64, 32, 5, "random", "fp32", jnp.float32, GmmConfig(32, 32, 32, block_m_small=16)),
    (50, 96, 32, 4, "one_takes_all", "bf16", jnp.bfloat16, GmmConfig(32, 16, 32, block_m_small=16)),
    (61, 64, 64, 7, "empty_and_short", "mxfp4", jnp.bfloat16, GmmConfig(16, 32, 64)),
    (40, 128, 32, 3, "one_takes_all", "mxfp4", jnp.float32, GmmConfig(32, 32, 64, block_m_small=16)),
    (90, 64, 32, 9, "random", "mxfp4", jnp.bfloat16, None),
]
# every MXFP4 dequant variant: ragged K (96 = 64 + 32) and N (40 = 32 + 8) exercise the masks
for _i, _v in enumerate(DEQUANT_VARIANTS):
    CASES.append((61 + _i, 96, 40, 7, ("empty_and_short", "one_takes_all", "random")[_i % 3], "mxfp4",
                  jnp.bfloat16, GmmConfig(16, 32, 64, dequant=_v)))
CASES += [
    (45, 128, 32, 5, "empty_and_short", "mxfp4", jnp.bfloat16,
     GmmConfig(32, 32, 64, block_m_small=16, dequant="split_asm_sub", x_split="stride")),
    (40, 96, 32, 3, "one_takes_all", "mxfp4", jnp.float32,
     GmmConfig(16, 32, 64, dequant="split_asm")),
    (52, 128, 64, 4, "random", "mxfp4", jnp.float32,
     GmmConfig(32, 64, 128, block_m_small=16, dequant="interleave_bf16")),
    # several column blocks per program (n_per_program): N 40 in blocks of 16, 2 or 4 a program
    # (the last blocks partly / wholly past N), ragged K, bf16 and MXFP4, zero-group tiles
    (45, 96, 40, 6, "empty_and_short", "bf16", jnp.bfloat16, GmmConfig(16, 16, 64, n_per_program=2)),
    (61, 96, 40, 7, "empty_and_short", "mxfp4", jnp.bfloat16,
     GmmConfig(16, 16, 64, dequant="split_asm_t", n_per_program=4)),
    (52, 128, 64, 4, "random", "mxfp4", jnp.float32,
     GmmConfig(32, 16, 32, block_m_small=16, dequant="split", n_per_program=2)),
    # dense short tiles as the transposed product (transpose_small): ragged K and N
    (77, 96, 40, 5, "random", "bf16", jnp.bfloat16,
     GmmConfig(32, 16, 64, block_m_small=16, transpose_small=True)),
    (50, 64, 48, 4, "empty_and_short", "fp32", jnp.float32,
     GmmConfig(64, 32, 32, block_m_small=16, transpose_small=True, n_per_program=2)),
    # fused tails (dense): a group's last tile up to block_m + block_m_small rows, in one
    # program as two products on one weight tile (transposed tail or not), ragged K and N,
    # zero-group tiles, one group taking every row
    (150, 96, 40, 4, "random", "bf16", jnp.bfloat16,
     GmmConfig(32, 16, 64, block_m_small=16, transpose_small=True, fuse_tail=True)),
    (140, 64, 48, 3, "empty_and_short", "fp32", jnp.float32,
     GmmConfig(32, 32, 32, block_m_small=16, fuse_tail=True)),
    (45, 64, 32, 3, "one_takes_all", "bf16", jnp.bfloat16,
     GmmConfig(32, 32, 32, block_m_small=16, transpose_small=True, fuse_tail=True)),
    (150, 96, 40, 4, "random", "mxfp4", jnp.bfloat16,
     GmmConfig(32, 16, 64, block_m_small=16, dequant="split_asm_t", fuse_tail=True)),
    (140, 128, 32, 3, "empty_and_short", "mxfp4", jnp.float32,
     GmmConfig(32, 32, 64, block_m_small=16, dequant="split_asm_t", fuse_tail=True)),
    # x resident: x's K blocks loaded once a program, the K blocks unrolled in the column-block
    # loop (ragged K and N, zero-group tiles, the last program's blocks partly / wholly past N)
    (61, 96, 40, 7, "empty_and_short", "mxfp4", jnp.bfloat16,
     GmmConfig(16, 16, 64, dequant="split_asm_t", n_per_program=4, x_resident=True)),
    (45, 96, 40, 6, "empty_and_short", "bf16", jnp.bfloat16,
     GmmConfig(16, 16, 64, n_per_program=2, x_resident=True)),
    (52, 128, 64, 4, "random", "mxfp4", jnp.float32,
     GmmConfig(32, 16, 32, block_m_small=16, dequant="split", n_per_program=3, x_resident=True)),
]


def _case_id(c):
    cfg = c[7]
    tail = "" if cfg is None else f"-{cfg.dequant}"
    if cfg is not None and cfg.x_split != "pre":
        tail += f"-x{cfg.x_split}"
    if cfg is not None and cfg.n_per_program > 1:
        tail += f"-np{cfg.n_per_program}"
    if cfg is not None and cfg.transpose_small:
        tail += "-tsmall"
    if cfg is not None and cfg.x_resident:
        tail += "-xres"
    if cfg is not None and cfg.fuse_tail:
        tail += "-ftail"
    return f"M{c[0]}K{c[1]}N{c[2]}G{c[3]}-{c[4]}-{c[5]}-{jnp.dtype(c[6]).name}" + tail


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
    tol = 1e-2 if xdt == jnp.bfloat16 else 1e-5
    assert _rel(y, ref) < tol
    total = int(np.sum(np.asarray(gs)))
    assert np.all(np.asarray(y[total:], np.float32) == 0.0), "rows past sum(group_sizes) must be 0"
    # ragged_dot on the dequantised weights is the independent peer of the reference
    wd = w if wtype != "mxfp4" else jnp.swapaxes(mxfp4.dequantize(w.packed, w.scales, xdt), 1, 2)
    rd = jax.lax.ragged_dot(x, wd.astype(x.dtype), gs, preferred_element_type=jnp.float32)
    assert _rel(y, rd) < tol


@pytest.mark.parametrize("activation,wtype,dequant,n_per", [
    ("swiglu", "bf16", "interleave", 1), ("situ", "mxfp4", "interleave", 1),
    ("situ", "mxfp4", "split_asm_sub", 1), ("situ", "mxfp4", "split_asm_t", 1),
    ("situ", "mxfp4", "split_asm_t", 2), ("swiglu", "bf16", "interleave", 2)])
def test_moe_gmm_glu_matches_reference(activation, wtype, dequant, n_per):
    """Fused gate/up (two accumulators a program) == the reference; n_per 2: both stored at the
    end of each column block of the flattened loop (N 48 in blocks of 16: one program ragged)."""
    m, k, n, g = 53, 64, 32 if n_per == 1 else 48, 6
    rng = np.random.default_rng(7)
    gs = jnp.asarray(_groups(rng, m, g, "empty_and_short"))
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    w1, w3 = _weights(rng, g, k, n, wtype), _weights(rng, g, k, n, wtype)
    cfg = GmmConfig(32, 32 if n_per == 1 else 16, 64, block_m_small=16, dequant=dequant,
                    n_per_program=n_per)
    y = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="interpret", config=cfg,
                    fuse=True)
    ref = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="reference")
    assert _rel(y, ref) < 1e-2
    total = int(np.sum(np.asarray(gs)))
    assert np.all(np.asarray(y[total:], np.float32) == 0.0)
    # unfused: two products with fp32 outputs, the activation after; the same values
    yu = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="interpret", config=cfg,
                     fuse=False)
    assert _rel(yu, y) < 1e-2 and np.all(np.asarray(yu[total:], np.float32) == 0.0)


def test_moe_gmm_glu_fused_tail():
    """The fused gate/up with fused tails: four accumulators (two per row block) == reference."""
    m, k, n, g = 150, 64, 32, 4
    rng = np.random.default_rng(9)
    gs = jnp.asarray(_groups(rng, m, g, "empty_and_short"))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w1, w3 = _weights(rng, g, k, n, "bf16"), _weights(rng, g, k, n, "bf16")
    cfg = GmmConfig(32, 32, 32, block_m_small=16, transpose_small=True, fuse_tail=True)
    y = moe_gmm_glu(x, w1, w3, gs, activation="situ", backend="interpret", config=cfg, fuse=True)
    ref = moe_gmm_glu(x, w1, w3, gs, activation="situ", backend="reference")
    assert _rel(y, ref) < 1e-2
    with pytest.raises(ValueError, match="fuse_tail needs"):
        GmmConfig(32, 32, 32, fuse_tail=True)
    # MXFP4: the paired layout's fused tails (two accumulators per row block), and the variants
    # that cannot share one dequantised tile refused
    wq1, wq3 = (pair_mxfp4(_weights(rng, g, k, n, "mxfp4")) for _ in range(2))
    cfg = GmmConfig(32, 32, 32, block_m_small=16, dequant="split_asm_t", fuse_tail=True)
    y = moe_gmm_glu(x, wq1, wq3, gs, activation="situ", backend="interpret", config=cfg, fuse=True)
    assert _rel(y, moe_gmm_glu(x, wq1, wq3, gs, activation="situ", backend="reference")) < 1e-2
    with pytest.raises(ValueError, match="fuse_tail with MXFP4"):
        moe_gmm(x, _weights(rng, g, k, n, "mxfp4"), gs, backend="interpret",
                config=GmmConfig(32, 32, 32, block_m_small=16, dequant="split", fuse_tail=True))


@pytest.mark.parametrize("tail", [0, 8])
def test_tile_metadata_covers_rows_once(tail):
    """Every row in exactly one tile of its group; tiles within block_m rows (with `tail`: a
    group's last tile within block_m + tail, the zero group's within block_m), and a group of
    block_m + tail rows or fewer one tile."""
    rng = np.random.default_rng(3)
    for m, g, bm in [(100, 7, 16), (33, 4, 32), (16, 3, 16), (5, 9, 16), (90, 3, 16)]:
        gs = _groups(rng, m, g, "empty_and_short")
        meta = np.asarray(moe_gmm_tile_metadata(jnp.asarray(gs), m, bm, tail))
        assert meta.shape == (3, -(-m // bm) + g)
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


def test_tile_plan_kernel_equals_tile_metadata():
    """The one-launch Pallas tile plan (interpret) == the plain-JAX tile_metadata, on random
    groupings with empty experts, one expert taking every row, sum > M (clipped), G = 896."""
    from kernels_pallas.moe.tiles import tile_plan
    rng = np.random.default_rng(11)
    cases = [(100, 7, 16), (33, 4, 32), (5, 9, 16), (1024, 896, 16), (64, 1, 16), (40, 3, 128)]
    for m, g, bm in cases:
        for trial in range(3):
            gs = rng.multinomial(m + (9 if trial == 2 else 0), rng.dirichlet(np.full(g, 0.3)))
            if trial == 1:
                gs[:] = 0
                gs[rng.integers(g)] = m
            gs = jnp.asarray(gs, jnp.int32)
            for tail in (0, bm // 4):
                np.testing.assert_array_equal(
                    np.asarray(tile_plan(gs, m, bm, interpret=True, tail=tail)),
                    np.asarray(moe_gmm_tile_metadata(gs, m, bm, tail)))


def test_mxfp4_unpack_hand_built_bytes():
    # 0x21: low nibble 1 -> 0.5 (column 0), high nibble 2 -> 1.0 (column 1); 0xF8: -0, -6
    row = np.array([0x21, 0xF8] + [0x00] * 14, np.uint8)
    packed = np.stack([row, row])[None]                   # [1, 2, 16] -> K = 32
    scales = np.array([[[127], [128]]], np.uint8)        # row 1: scale byte 128 doubles
    want = np.zeros((2, 32), np.float32)
    want[0, :4] = [0.5, 1.0, -0.0, -6.0]
    want[1, :4] = [1.0, 2.0, -0.0, -12.0]
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(packed, scales, jnp.float32))[0], want)
    # in-kernel decoding (times 2^-14, undone on the accumulator) is exact for every byte and scale
    allb = np.arange(256, dtype=np.uint8).reshape(16, 16)
    # scale bytes 16..240 (the kernel flushes products below 2^-126 * 2^-14 to zero)
    sc = np.array([[100], [126], [127], [128], [150], [16], [17], [240]] * 2, np.uint8)
    got = np.asarray(_dequant_tile(jnp.asarray(allb), jnp.asarray(sc), jnp.float32)) * 2.0 ** 14
    np.testing.assert_array_equal(got, np.asarray(mxfp4.dequantize(allb, sc, jnp.float32)))
    # through the kernel: x = identity picks weight columns, out[i, n] = w[n, i]
    x = jnp.eye(32, dtype=jnp.float32)
    pk = np.zeros((1, 16, 16), np.uint8)
    sk = np.full((1, 16, 1), 127, np.uint8)
    pk[0, :2] = packed[0]
    sk[0, :2] = scales[0]
    y = moe_gmm(x, MXFP4Weight(jnp.asarray(pk), jnp.asarray(sk)), jnp.array([32], jnp.int32),
                backend="interpret", config=GmmConfig(16, 16, 32))
    np.testing.assert_array_equal(np.asarray(y)[:, :2].T, want)
    assert np.all(np.asarray(y)[:, 2:] == 0)


# Scale bytes each in-kernel encoding keeps exact (below 16 the products leave bf16's normal range;
# the "bf16" encodings end at 143, where the factor 2^(s-16) is bf16's largest power of two).
_SCALES_F16 = [16, 17, 100, 117, 122, 126, 127, 128, 150, 200, 240, 250]
_SCALES_BF16 = [16, 17, 60, 100, 117, 122, 126, 127, 128, 130, 142, _BF16_MAX_SCALE]


def test_dequant_encodings_exact_for_every_byte():
    """_dequant_tile / _dequant_split (times 2^-14, undone on the accumulator) equal the codec for
    every byte, both nibble orders, each encoding's scale range, and an all-zero group (s = 0)."""
    allb = np.arange(256, dtype=np.uint8).reshape(16, 16)  # [bn = 16, K/2 = 16]: K = 32, 1 group
    for bits, scales in (("f16", _SCALES_F16), ("bf16", _SCALES_BF16)):
        sc = np.resize(np.array(scales, np.uint8), 16)[:, None]
        want = np.asarray(mxfp4.dequantize(allb, sc, jnp.float32))  # [16, 32]
        got = np.asarray(_dequant_tile(jnp.asarray(allb), jnp.asarray(sc), jnp.float32, bits))
        np.testing.assert_array_equal(got * 2.0 ** 14, want)
        lo, hi = _dequant_split(jnp.asarray(allb), jnp.asarray(sc), jnp.float32, bits)
        np.testing.assert_array_equal(np.asarray(lo) * 2.0 ** 14, want[:, 0::2])
        np.testing.assert_array_equal(np.asarray(hi) * 2.0 ** 14, want[:, 1::2])
        zero = np.zeros((2, 16), np.uint8)
        lo, hi = _dequant_split(jnp.asarray(zero), jnp.zeros((2, 1), jnp.uint8), jnp.bfloat16, bits)
        assert np.all(np.asarray(lo, np.float32) == 0) and np.all(np.asarray(hi, np.float32) == 0)
    # bf16 encodings beyond their range are loud (inf / nan), not silently wrong
    lo, _ = _dequant_split(jnp.asarray(allb[:1]), jnp.full((1, 1), _BF16_MAX_SCALE + 1, jnp.uint8),
                           jnp.float32, "bf16")
    assert not np.any(np.isfinite(np.asarray(lo)))


@pytest.mark.parametrize("dequant", DEQUANT_VARIANTS)
def test_mxfp4_variant_exact_through_kernel(dequant):
    """One-hot x rows on one expert that holds every byte value and the variant's scale range:
    out[i, n] must be the exact dequantised w[n, c_i] (several row tiles, both nibbles, all
    groups)."""
    k, n, g, m = 128, 32, 3, 48
    rng = np.random.default_rng(21)
    packed = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    packed[1] = ((np.arange(n)[:, None] * 5 + np.arange(k // 2)[None, :]) % 256)
    _, bits = dequant_variant(dequant)
    sset = _SCALES_F16 if bits == "f16" else _SCALES_BF16
    scales = rng.choice(np.array(sset, np.uint8), (g, n, k // 32))
    packed[1, 2, 16:32] = 0  # an all-zero group with the quantiser's scale byte 0
    scales[1, 2, 1] = 0
    c = (np.arange(m) * 5 + 3) % k
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), c] = 1.0
    want = np.asarray(mxfp4.dequantize(packed[1], scales[1], jnp.float32))[:, c].T
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scales))
    gs = jnp.array([0, m, 0], jnp.int32)
    for x_split in ("pre", "stride") if dequant.startswith("split") else ("pre",):
        cfg = GmmConfig(16, 32, 64, dequant=dequant, x_split=x_split)
        y = moe_gmm(jnp.asarray(x, jnp.bfloat16), w, gs, backend="interpret", config=cfg,
                    preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), want)


# ---- "split_asm_t": column order, the jnp path for every byte, and its PTX emulated in numpy ----

def _perm_t_reference(w, s):
    """p(L) for L in [0, w) as documented: L = 16 s_ + 8 F + 2 t + E  <-  4 (s t + s_) + 2 F + E."""
    out = np.empty(w, np.int64)
    for L in range(w):
        blk, r = divmod(L, 16 * s)
        s_, F, t, E = r // 16, (r >> 3) & 1, (r >> 1) & 3, r & 1
        out[L] = blk * 16 * s + 4 * (s * t + s_) + 2 * F + E
    return out


@pytest.mark.parametrize("s", [1, 2, 4, 8, 16])
def test_split_asm_t_column_order(s):
    """`_perm_t` (reshape + transpose), `_perm_t_index` (arithmetic, the strided x path) and the
    documented formula agree, and are a permutation within each K block."""
    w = 3 * 16 * s
    ref = _perm_t_reference(w, s)
    assert sorted(ref) == list(range(w))
    got = np.asarray(_perm_t(jnp.arange(w, dtype=jnp.int32)[None, :], s))[0]
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.asarray(_perm_t_index(jnp.arange(w, dtype=jnp.int32), s)), ref)
    # a thread (t) of one 16-wide step (s_) takes the 4 bytes of one word, its words contiguous
    for t in range(4):
        words = {ref[16 * s_ + 8 * F + 2 * t + E] // 4
                 for s_ in range(s) for F in (0, 1) for E in (0, 1)}
        assert words == set(range(s * t, s * t + s))


_SCALES_T = [0, 16, 17, 60, 100, 117, 122, 126, 127, 128, 130, 142]  # 0: the all-zero group


def _tile_every_byte(s, scale_bytes):
    """packed [256 / (16 s), 16 s] with every byte value once; scales [rows, s] from scale_bytes."""
    w = 16 * s
    pb = np.arange(256, dtype=np.uint8).reshape(256 // w, w)
    sc = np.resize(np.asarray(scale_bytes, np.uint8), (256 // w) * s).reshape(256 // w, s)
    return pb, sc


@pytest.mark.parametrize("s", [2, 8])
def test_split_asm_t_jnp_exact_every_byte(s):
    """The interpreter path of "split_asm_t" (times 2^-14, undone on the accumulator) equals the
    codec for every byte value and scale bytes 16..142 (and 0 with zero bytes), `_perm_t` order."""
    perm = _perm_t_reference(16 * s, s)
    for scales in [[v] for v in _SCALES_T[1:]] + [_SCALES_T[1:]]:
        pb, sc = _tile_every_byte(s, scales)
        want = np.asarray(mxfp4.dequantize(pb, sc, jnp.float32))  # [rows, 32 s] natural order
        lo, hi = _dequant_split_t(jnp.asarray(pb), jnp.asarray(sc), jnp.float32)
        np.testing.assert_array_equal(np.asarray(lo) * 2.0 ** 14, want[:, 2 * perm])
        np.testing.assert_array_equal(np.asarray(hi) * 2.0 ** 14, want[:, 2 * perm + 1])
    zero = np.zeros((2, 16 * s), np.uint8)
    lo, hi = _dequant_split_t(jnp.asarray(zero), jnp.zeros((2, s), jnp.uint8), jnp.bfloat16)
    assert np.all(np.asarray(lo, np.float32) == 0) and np.all(np.asarray(hi, np.float32) == 0)


def _bf16_times(bits, factor_bits):
    """bf16 bits x bf16 bits, rounded to nearest as the GPU's bf16x2 multiply does (subnormals kept:
    exact here, every product is a power-of-two multiple of an E2M1 value) -> bf16 bits."""
    a = (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)
    b = (np.asarray(factor_bits, np.uint32) << 16).view(np.float32).astype(np.float64)
    p = (a * b).astype(np.float32)
    pb = p.view(np.uint32)
    assert np.all((pb & 0xFFFF) == 0) or not np.all(np.isfinite(p)), "product not exact in bf16"
    return (pb >> 16).astype(np.uint16)


def _emulate_split_asm_t_tile(pb, sc, rng):
    """The GPU computation of `_dequant_split_t` in numpy: `_perm_t` order, the PTX of `_asm_t`
    run on groups of 4 bytes packed in a RANDOM order (Triton chooses the register order; the PTX
    is elementwise, so any packing must give the same tile), then times 2^(s-15) (bf16_sub)."""
    rows, w = pb.shape
    s = w // 16
    perm = _perm_t_reference(w, s)
    pt = pb[:, perm].reshape(-1)
    order = rng.permutation(pt.size).reshape(-1, 4)  # 4 arbitrary elements per asm instance
    shifts = np.array([0, 8, 16, 24], np.uint32)
    words = (pt[order].astype(np.uint32) << shifts).sum(1, dtype=np.uint32)
    out = {}
    for half in ("lo", "hi"):
        r0, r1 = emulate_ptx(_asm_t(half), [words], 2)
        halves = np.stack([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], 1).astype(np.uint32)
        flat = np.zeros(pt.size, np.uint32)
        flat[order.reshape(-1)] = halves.reshape(-1)
        out[half] = flat.reshape(rows, w)
    f = (np.minimum(sc.astype(np.int64) + 112, 255) << 7).astype(np.uint32)  # 2^(s-15), bf16
    fac = np.repeat(f, 16, axis=1)[:, perm]
    return tuple(_bf16_times(out[h], fac) for h in ("lo", "hi"))


@pytest.mark.parametrize("s", [2, 8])
def test_split_asm_t_ptx_emulated_matches_jnp_path(s):
    """The PTX of "split_asm_t" (emulated: prmt per the PTX ISA, integer ops mod 2^32), times the
    GPU factor 2^(s-15) in bf16, gives the same bits as the interpreter's jnp path (whose own
    encoding and factor differ: value * 2^-125 times 2^(s-16)) for every byte and scale byte
    16..142, with the bytes packed 4 per instance in random order."""
    rng = np.random.default_rng(5)
    for scales in [[v] for v in _SCALES_T[1:]] + [_SCALES_T[1:]]:
        pb, sc = _tile_every_byte(s, scales)
        lo_e, hi_e = _emulate_split_asm_t_tile(pb, sc, rng)
        lo, hi = _dequant_split_t(jnp.asarray(pb), jnp.asarray(sc), jnp.bfloat16)
        np.testing.assert_array_equal(lo_e, np.asarray(lo).view(np.uint16))
        np.testing.assert_array_equal(hi_e, np.asarray(hi).view(np.uint16))
    # the raw PTX bits are the "split_asm_sub" encoding: sign << 15 | magnitude << 6
    b = np.arange(256, dtype=np.uint32)
    for half, nib in (("lo", b & 15), ("hi", b >> 4)):
        r0, _ = emulate_ptx(_asm_t(half), [b | (b << 8)], 2)
        want = ((nib & 8) << 12) | ((nib & 7) << 6)
        np.testing.assert_array_equal(r0 & 0xFFFF, want)
        np.testing.assert_array_equal(r0 >> 16, want)


def test_split_asm_sub_ptx_emulated():
    """The same emulator on the existing "split_asm" / "split_asm_sub" PTX (`_asm_nibble`): both
    give their documented bits for every byte (a check of the emulator as much as of the PTX)."""
    b = np.arange(256, dtype=np.uint32)
    t = prmt(b | (b << 8), 0, 0x1404)  # the spread their asm starts with
    for enc in ("sub", "normal"):
        for half, nib in (("lo", b & 15), ("hi", b >> 4)):
            code = "mov.b32 c, 0x00800080;\nmov.b32 t, $1;\n" + _asm_nibble(enc, half, "$0")
            [r] = emulate_ptx(code, [t], 1)
            mag = (nib & 7) << 6
            if enc == "normal":
                mag = mag + np.minimum(mag, 0x80)
            want = ((nib & 8) << 12) | mag
            np.testing.assert_array_equal(r & 0xFFFF, want)
            np.testing.assert_array_equal(r >> 16, want)


def test_config_validation():
    with pytest.raises(ValueError):
        GmmConfig(dequant="nibble")
    with pytest.raises(ValueError):
        GmmConfig(x_split="gather")
    with pytest.raises(ValueError, match="n_per_program"):
        GmmConfig(n_per_program=0)
    with pytest.raises(ValueError, match="n_per_program > 1"):
        GmmConfig(x_resident=True)
    assert GmmConfig(16, 128, 128, n_per_program=4, transpose_small=True).name() == \
        "bm16/None_bn128_bk128_w4_s3_np4_tsmall"
    assert dequant_variant("split_asm_sub") == (True, "asm_sub")
    assert dequant_variant("split_asm_t") == (True, "asm_t")
    assert dequant_variant("interleave") == (False, "f16")
    assert GmmConfig(16, 128, 256, dequant="split_asm", x_split="stride").name() == \
        "bm16/None_bn128_bk256_w4_s3_split_asm_xstride"


def test_default_config_by_platform():
    """MXFP4 decode: inline PTX ("split_asm_t", bk256; "split_asm_sub" for the fused gate/up)
    only on CUDA with bf16 activations, the portable "split" (bk128) on ROCm, CPU and the
    interpreter; bf16 prefill 4 stages."""
    from kernels_pallas.moe.gmm import default_config, kernel_platform

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
    assert default_config(16 * 8192, G, K, N, True).num_stages == 3        # MXFP4 prefill
    c = default_config(16 * 8192, G, K, N // 2, False, True)                     # fused GLU
    assert (c.block_m, c.block_n, c.num_warps, c.num_stages) == (128, 64, 8, 3)

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


def test_default_config_runs_in_interpret_mode():
    """config=None on the interpreter at decode shapes (the "split" default), MXFP4 and GLU."""
    rng = np.random.default_rng(31)
    m, k, n, g = 12, 256, 64, 16
    gs = jnp.asarray(_groups(rng, m, g, "random"))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w1, w3 = (_weights(rng, g, k, n, "mxfp4") for _ in range(2))
    y = moe_gmm(x, w1, gs, backend="interpret")
    assert _rel(y, moe_gmm(x, w1, gs, backend="reference")) < 1e-2
    ref = moe_gmm_glu(x, w1, w3, gs, backend="reference")
    for fuse in (True, False):  # the fused kernel's default config, and the unfused default
        y = moe_gmm_glu(x, w1, w3, gs, backend="interpret", fuse=fuse)
        assert _rel(y, ref) < 2e-2, fuse


def test_benchmark_kernels_lower_for_h200():
    """Every kernel the MoE benchmark times (each layer shape at its CUDA default config, MXFP4 in
    both layouts, bf16, the fused gate/up) and every dequantisation variant at the decode blocks
    lowers to Triton IR for an H200."""
    from benchmarks.moe import lower_check
    from kernels_pallas.gpu_lowering import lower_for_gpu as lower_cuda
    assert lower_check(lower_cuda, log=lambda s: None) == []
    sd = jax.ShapeDtypeStruct
    wq = MXFP4Weight(sd((896, 768, 1792), jnp.uint8), sd((896, 768, 112), jnp.uint8))
    for dequant in set(DEQUANT_VARIANTS) - {"interleave_bf16"}:
        cfg = GmmConfig(16, 128, 128 if dequant == "interleave" else 256, num_warps=4, num_stages=4,
                        dequant=dequant)
        lower_cuda(lambda a, b, c, cfg=cfg: moe_gmm(a, b, c, backend="pallas", config=cfg),
                   sd((1024, 3584), jnp.bfloat16), wq, sd((896,), jnp.int32))
    # the fused gate/up with a PTX variant too
    w = MXFP4Weight(sd((896, 384, 1792), jnp.uint8), sd((896, 384, 112), jnp.uint8))
    for dequant in ("split_asm_sub", "split_asm_t"):
        cfg = GmmConfig(16, 128, 256, num_stages=4, dequant=dequant)
        lower_cuda(lambda a, b, c, d, cfg=cfg: moe_gmm_glu(a, b, c, d, activation="situ",
                                                           backend="pallas", config=cfg,
                                                           fuse=True),
                   sd((1024, 3584), jnp.bfloat16), w, w, sd((896,), jnp.int32))


def test_moe_gmm_errors():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    w = jnp.zeros((2, 32, 16), jnp.bfloat16)
    with pytest.raises(ValueError):
        moe_gmm(x, w, jnp.array([2, 2], jnp.int32), backend="interpret")
    wq = MXFP4Weight(jnp.zeros((2, 16, 32), jnp.uint8), jnp.zeros((2, 16, 2), jnp.uint8))
    with pytest.raises(ValueError, match="transpose_small applies to dense weights"):
        moe_gmm(x, wq, jnp.array([2, 2], jnp.int32), backend="interpret",
                config=GmmConfig(16, 16, 64, transpose_small=True))


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


@pytest.mark.parametrize("dequant,k,n_per", [
    ("split", 128, 1), ("split_asm_t", 128, 1), ("interleave", 128, 1), ("split_asm_t", 96, 1),
    ("split", 96, 1), ("split_asm_t", 96, 2)])
def test_paired_weights_through_the_kernel(dequant, k, n_per):
    """Paired MXFP4 weights in the kernel (interpret: decoded to K3 bytes per tile) == the
    reference on the K3 weights, with an empty expert, rows past the sum and (K 96, blocks of
    64) a ragged last K block."""
    from kernels_pallas.moe import MXFP4PairedWeight, pair_mxfp4
    rng = np.random.default_rng(6 + k)
    g, n = 3, 48
    p = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    sc = rng.integers(118, 130, (g, n, k // 32), dtype=np.uint8)
    w = MXFP4Weight(jnp.asarray(p), jnp.asarray(sc))
    wp = pair_mxfp4(w)
    assert isinstance(wp, MXFP4PairedWeight) and wp.layout == "paired"
    x = jnp.asarray(rng.normal(size=(21, k)), jnp.bfloat16)
    gs = jnp.array([7, 0, 11], jnp.int32)
    ref = moe_gmm(x, w, gs, backend="reference", preferred_element_type=jnp.float32)
    cfg = GmmConfig(16, 16, 64, dequant=dequant, n_per_program=n_per) if n_per > 1 else \
        GmmConfig(16, 32, 64, dequant=dequant)
    y = moe_gmm(x, wp, gs, backend="interpret", config=cfg, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(np.asarray(y[18:]), 0)
    yr = moe_gmm(x, wp, gs, backend="reference", preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(yr), np.asarray(ref))


def test_paired_errors():
    from kernels_pallas.moe import gmm, pair_mxfp4
    w = MXFP4Weight(jnp.zeros((2, 32, 16), jnp.uint8), jnp.zeros((2, 32, 1), jnp.uint8))
    wp = pair_mxfp4(w)
    x = jnp.zeros((4, 32), jnp.bfloat16)
    gs = jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="block_n a multiple of 16"):
        moe_gmm(x, wp, gs, backend="interpret", config=GmmConfig(16, 24, 32))
    with pytest.raises(ValueError, match="mixing MXFP4 layouts"):
        moe_gmm_glu(x, w, wp, gs, backend="interpret", fuse=True)
    with pytest.raises(ValueError, match="split_asm_t"):  # on a GPU only that kernel decodes it
        gmm._check_paired(GmmConfig(16, 32, 32, dequant="split"), interpret=False)
    gmm._check_paired(GmmConfig(16, 32, 32, dequant="split_asm_t"), interpret=False)
    assert gmm.default_config(64, 896, 3584, 384, True, True, platform="cuda",
                              layout="paired").dequant == "split_asm_t"


def test_cuda_decode_takes_k_blocks_of_128_only_in_the_flattened_loop():
    """split_asm_t at K blocks of 128 raced on the H200 in the plain K loop (git history of
    benchmarks/results_moe.md): K blocks of 256 where 256 divides K; otherwise (384, a TP8 rank's down projection)
    128 in a loop over column blocks (paired: 7 a program with x resident for K <= 512; 4 in
    the flattened loop otherwise), which never raced. Both layouts."""
    from kernels_pallas.moe import gmm
    for layout in ("k3", "paired"):
        for k in (3072, 3584):
            cfg = gmm.default_config(64 * 16, 896, k, 3584, True, platform="cuda", layout=layout)
            assert cfg.dequant == "split_asm_t" and cfg.block_k == 256, (layout, k, cfg)
            assert cfg.n_per_program == 1
        cfg = gmm.default_config(512 * 16, 896, 384, 3584, True, platform="cuda", layout=layout)
        assert (cfg.dequant, cfg.block_k, cfg.n_per_program, cfg.num_stages, cfg.x_resident) \
            == (("split_asm_t", 128, 7, 3, True) if layout == "paired"
                else ("split_asm_t", 128, 4, 3, False)), (layout, cfg)
        cfg = gmm.default_config(512 * 16, 896, 640, 3584, True, platform="cuda", layout=layout)
        assert (cfg.block_k, cfg.n_per_program, cfg.x_resident) == (128, 4, False), (layout, cfg)


# ---- x split by the caller (SplitX) ----
@pytest.mark.parametrize("dequant,k,bk", [("split_asm_t", 96, 64), ("split_asm_t", 128, 128),
                                          ("split", 96, 32)])
def test_split_x_round_trip_take_and_kernel(dequant, k, bk):
    """split_x inverts (dense), take(rows) == split of x[rows], and moe_gmm on the SplitX == on x
    (interpret; ragged K for split_asm_t at K 96 / blocks of 64) == the reference."""
    from kernels_pallas.moe import split_x
    rng = np.random.default_rng(21)
    g, n, m = 3, 32, 40
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    cfg = GmmConfig(16, 16, bk, dequant=dequant)
    sx = split_x(x, cfg)
    np.testing.assert_array_equal(np.asarray(sx.dense()), np.asarray(x))
    rows = jnp.asarray(rng.integers(0, m, 24), jnp.int32)
    np.testing.assert_array_equal(np.asarray(sx.take(rows).data),
                                  np.asarray(split_x(x[rows], cfg).data))
    p, sc = mxfp4.quantize(rng.standard_normal((g, n, k)))
    wq = MXFP4Weight(jnp.asarray(p), jnp.asarray(sc))
    gs = jnp.asarray([15, 0, 20], jnp.int32)
    want = moe_gmm(x, wq, gs, backend="interpret", config=cfg)
    got = moe_gmm(sx, wq, gs, backend="interpret", config=cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    ref = moe_gmm(sx, wq, gs, backend="reference")
    assert _rel(got, ref) < 1e-2
    glu_ = moe_gmm_glu(sx, wq, wq, gs, backend="interpret", config=cfg)
    assert _rel(glu_, moe_gmm_glu(x, wq, wq, gs, backend="reference")) < 2e-2
    with pytest.raises(ValueError, match="split for block_k"):
        moe_gmm(sx, wq, gs, backend="interpret", config=GmmConfig(16, 16, 2 * bk, dequant=dequant))
    with pytest.raises(ValueError, match="reads x as it is"):
        split_x(x, GmmConfig(16, 16, bk, dequant="interleave"))
