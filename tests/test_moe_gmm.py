"""kernels_pallas.moe_gmm: the Pallas kernel (interpret mode) against the plain-JAX reference
(ragged_dot on dequantised weights), exact MXFP4 decoding from hand-built bytes for every dequant
variant, and (kernels_pallas.gpu_lowering) the lowering of every benchmarked kernel for an H200."""
import importlib.util
import pathlib

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import GmmConfig, MXFP4Weight, moe_gmm, moe_gmm_glu, moe_gmm_tile_metadata
from kernels_pallas.moe import mxfp4
from kernels_pallas.moe.gmm import (_BF16_MAX_SCALE, DEQUANT_VARIANTS, _dequant_split, _dequant_tile,
                                    dequant_variant)


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
]


def _case_id(c):
    cfg = c[7]
    tail = "" if cfg is None else f"-{cfg.dequant}"
    if cfg is not None and cfg.x_split != "pre":
        tail += f"-x{cfg.x_split}"
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


@pytest.mark.parametrize("activation,wtype,dequant", [("swiglu", "bf16", "interleave"),
                                                     ("situ", "mxfp4", "interleave"),
                                                     ("situ", "mxfp4", "split_asm_sub")])
def test_moe_gmm_glu_matches_reference(activation, wtype, dequant):
    m, k, n, g = 53, 64, 32, 6
    rng = np.random.default_rng(7)
    gs = jnp.asarray(_groups(rng, m, g, "empty_and_short"))
    x = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    w1, w3 = _weights(rng, g, k, n, wtype), _weights(rng, g, k, n, wtype)
    cfg = GmmConfig(32, 32, 64, block_m_small=16, dequant=dequant)
    y = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="interpret", config=cfg)
    ref = moe_gmm_glu(x, w1, w3, gs, activation=activation, backend="reference")
    assert _rel(y, ref) < 1e-2
    total = int(np.sum(np.asarray(gs)))
    assert np.all(np.asarray(y[total:], np.float32) == 0.0)


def test_tile_metadata_covers_rows_once():
    rng = np.random.default_rng(3)
    for m, g, bm in [(100, 7, 16), (33, 4, 32), (16, 3, 16), (5, 9, 16)]:
        gs = _groups(rng, m, g, "empty_and_short")
        meta = np.asarray(moe_gmm_tile_metadata(jnp.asarray(gs), m, bm))
        assert meta.shape == (3, -(-m // bm) + g)
        cover = np.zeros(m, np.int32)
        owner = np.repeat(np.arange(g), gs)
        for grp, s, e in meta.T:
            if grp < 0:
                continue
            assert 0 < e - s <= bm
            cover[s:e] += 1
            if grp < g:
                assert np.all(owner[s:e] == grp)
            else:
                assert s >= gs.sum()
        assert np.all(cover == 1)


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


def test_config_validation():
    with pytest.raises(ValueError):
        GmmConfig(dequant="nibble")
    with pytest.raises(ValueError):
        GmmConfig(x_split="gather")
    assert dequant_variant("split_asm_sub") == (True, "asm_sub")
    assert dequant_variant("interleave") == (False, "f16")
    assert GmmConfig(16, 128, 256, dequant="split_asm", x_split="stride").name() == \
        "bm16/None_bn128_bk256_w4_s3_split_asm_xstride"


def test_default_config_by_platform():
    """MXFP4 decode: inline PTX ("split_asm_sub", bk256) only on CUDA with bf16 activations, the
    portable "split" (bk128) on ROCm, CPU and the interpreter; bf16 prefill 4 stages."""
    from kernels_pallas.moe.gmm import default_config, kernel_platform

    G, K, N = 896, 3584, 768
    for tokens in (64, 512):
        c = default_config(16 * tokens, G, K, N, True, platform="cuda")
        assert (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.dequant) == \
            (16, 128, 256, 4, 4, "split_asm_sub")
        assert default_config(16 * tokens, G, K, N // 2, True, True, platform="cuda").dequant == \
            "split_asm_sub"
        for plat in ("rocm", "cpu", "interpret", "gpu"):
            c = default_config(16 * tokens, G, K, N, True, platform=plat)
            assert (c.dequant, c.block_k) == ("split", 128), plat
        c = default_config(16 * tokens, G, K, N, True, platform="cuda", x_dtype=jnp.float32)
        assert (c.dequant, c.block_k) == ("split", 256)
    assert kernel_platform() == jax.devices()[0].platform == "cpu"   # the tests run on CPU
    assert not default_config(1024, G, K, N, True).dequant.startswith("split_asm")
    c = default_config(16 * 8192, G, K, N, False)
    assert (c.block_m, c.block_m_small, c.block_n, c.block_k, c.num_warps, c.num_stages) == \
        (128, 32, 256, 64, 8, 4)
    assert default_config(16 * 8192, G, K, N, True).num_stages == 3        # MXFP4 prefill
    assert default_config(16 * 8192, G, K, N // 2, False, True).num_stages == 3   # fused GLU

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
    y = moe_gmm_glu(x, w1, w3, gs, backend="interpret")
    assert _rel(y, moe_gmm_glu(x, w1, w3, gs, backend="reference")) < 2e-2


def test_benchmark_sweep_lowers_for_h200():
    """Every kernel the benchmark sweeps (each dequant variant and block config, MXFP4 decode at 64
    and 512 tokens, bf16 decode and prefill at K3 shapes) lowers to Triton IR for an H200."""
    from kernels_pallas.gpu_lowering import lower_for_gpu as lower_cuda
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_moe_gmm.py"
    spec = importlib.util.spec_from_file_location("_bench_moe_gmm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert {c.dequant for c in bench.DECODE_SWEEP} == set(DEQUANT_VARIANTS) - {"interleave_bf16"}
    assert bench.lower_check(lower_cuda, log=lambda s: None) == []
    # the fused gate/up with a PTX variant too
    sd = jax.ShapeDtypeStruct
    w = MXFP4Weight(sd((896, 384, 1792), jnp.uint8), sd((896, 384, 112), jnp.uint8))
    cfg = GmmConfig(16, 128, 256, num_stages=4, dequant="split_asm_sub")
    lower_cuda(lambda a, b, c, d: moe_gmm_glu(a, b, c, d, activation="situ", backend="pallas",
                                              config=cfg),
               sd((1024, 3584), jnp.bfloat16), w, w, sd((896,), jnp.int32))


def test_moe_gmm_errors():
    x = jnp.zeros((4, 64), jnp.bfloat16)
    w = jnp.zeros((2, 32, 16), jnp.bfloat16)
    with pytest.raises(ValueError):
        moe_gmm(x, w, jnp.array([2, 2], jnp.int32), backend="interpret")
