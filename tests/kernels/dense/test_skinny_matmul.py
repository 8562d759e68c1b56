"""The skinny-matmul kernel (interpret mode on CPU) against the plain product: ragged rows and
columns across tiles, a group of weights of different widths, leading dimensions, the shapes it
leaves to XLA, and bad weights."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.dense import MAX_ROWS, SkinnyConfig, skinny_matmul
from kernels_pallas.dense.ops import LONG_K, MIN_K, SHORT_ROWS, on_kernel
from kernels_pallas.dense.tuning import skinny_config

# bf16 outputs: both products accumulate in fp32 (in other orders) and round once, so they agree
# within one bf16 step of the element, or of the output's scale where an element cancels. fp32:
# summation-order noise over at most a few hundred terms.
TOL = {jnp.bfloat16: (2.0 ** -7, 2.0 ** -8), jnp.float32: (1e-5, 1e-5)}

# (rows, K, output widths, config): batch 1 against three widths (one narrower than a tile),
# rows ragged over three row blocks, K in 16 steps with ragged columns and rows, a [B, T, K]
# input, 16-row tiles over 40 rows with 32-column tiles
CASES = [
    ((1,), 256, (64, 48, 12), None),
    ((37,), 128, (64,), SkinnyConfig(block_m=16)),
    ((19,), 512, (100, 16), SkinnyConfig(block_m=16, block_k=32)),
    ((3, 2), 128, (96,), None),
    ((40,), 64, (80, 32), SkinnyConfig(block_m=16, block_n=32)),
]


def _inputs(seed, lead, k, ns, dtype):
    ks = jax.random.split(jax.random.key(seed), len(ns) + 1)
    x = jax.random.normal(ks[0], lead + (k,)).astype(dtype)
    return x, [(0.05 * jax.random.normal(kk, (k, n))).astype(dtype) for kk, n in zip(ks[1:], ns)]


def _close(y, ref, dtype):
    rtol, atol = TOL[dtype]
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    scale = float(np.sqrt(np.mean(ref * ref)))
    assert np.all(np.abs(y - ref) <= rtol * np.abs(ref) + atol * scale), np.abs(y - ref).max()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, dtype):
    lead, k, ns, config = CASES[case]
    x, ws = _inputs(case, lead, k, ns, dtype)
    ys = skinny_matmul(x, ws, backend="interpret", config=config)
    refs = skinny_matmul(x, ws, backend="reference")
    assert len(ys) == len(ws)
    for y, ref, n in zip(ys, refs, ns):
        assert y.shape == lead + (n,) and y.dtype == dtype
        _close(y, ref, dtype)


def test_weights_take_the_input_dtype():
    """fp32 master weights with bf16 activations compute in bf16, as the model's Dense does."""
    x, ws = _inputs(7, (4,), 128, (64,), jnp.bfloat16)
    w32 = [w.astype(jnp.float32) for w in ws]
    (y,) = skinny_matmul(x, w32, backend="interpret")
    assert y.dtype == jnp.bfloat16
    _close(y, skinny_matmul(x, ws, backend="reference")[0], jnp.bfloat16)


def test_an_fp32_output_keeps_the_accumulation():
    """bf16 x and weights, one output in fp32 (the router's logits) beside bf16 ones: the fp32
    one agrees with XLA's bf16 dot accumulated in fp32 to fp32 rounding, on the kernel and,
    bitwise, on the reference path; a wrong count of dtypes is a one-line error."""
    x, ws = _inputs(3, (5,), 256, (48, 96), jnp.bfloat16)
    want = jnp.dot(x, ws[0], preferred_element_type=jnp.float32)
    got, other = skinny_matmul(x, ws, out_dtypes=[jnp.float32, None], backend="interpret")
    assert got.dtype == jnp.float32 and other.dtype == jnp.bfloat16
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    ref, _ = skinny_matmul(x, ws, out_dtypes=[jnp.float32, None], backend="reference")
    np.testing.assert_array_equal(ref, want)
    with pytest.raises(ValueError, match="give one a weight"):
        skinny_matmul(x, ws, out_dtypes=[jnp.float32], backend="interpret")


def test_shapes_left_to_xla_equal_the_reference():
    """Past MAX_ROWS, with no rows or K not a multiple of 16 the product is XLA's, bitwise, on
    every backend."""
    for lead, k in (((MAX_ROWS + 1,), 64), ((0,), 64), ((3,), 40)):
        x, ws = _inputs(1, lead, k, (32,), jnp.float32)
        (y,) = skinny_matmul(x, ws, backend="interpret")
        np.testing.assert_array_equal(y, x @ ws[0])


def test_gpu_takes_the_kernel_where_it_was_measured_to_win():
    assert on_kernel(1, 7168, "pallas") and on_kernel(SHORT_ROWS, MIN_K, "pallas")
    assert not on_kernel(SHORT_ROWS + 1, 1536, "pallas")  # short K past 64 rows: XLA
    assert on_kernel(MAX_ROWS, LONG_K, "pallas") and not on_kernel(MAX_ROWS + 1, LONG_K, "pallas")
    assert not on_kernel(16, 128, "pallas")  # KDA's f_b: not measured, XLA
    assert on_kernel(16, 128, "interpret") and not on_kernel(16, 128, "reference")


def test_long_k_groups_take_wide_rows_in_wide_tiles():
    """Past SHORT_ROWS a long-K group still runs on the kernel (rows in blocks of 128, columns in
    tiles of 128: ragged here in both)."""
    x, ws = _inputs(3, (SHORT_ROWS + 9,), LONG_K, (130, 20), jnp.bfloat16)
    ys = skinny_matmul(x, ws, backend="interpret")
    for y, ref in zip(ys, skinny_matmul(x, ws, backend="reference")):
        _close(y, ref, jnp.bfloat16)
    with pytest.raises(ValueError, match="block_k=8192 must divide"):  # the kernel's path: checked
        skinny_matmul(x, ws, backend="interpret", config=SkinnyConfig(block_k=8192))
    cfg = skinny_config(256, 7168)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (128, 128, 8)


def test_bad_input_is_one_line_errors():
    x, ws = _inputs(2, (2,), 64, (32,), jnp.float32)
    with pytest.raises(ValueError, match="does not take inputs of width 64"):
        skinny_matmul(x, [ws[0].T], backend="interpret")
    with pytest.raises(ValueError, match="block_k=48 must be a power of two"):
        skinny_matmul(x, ws, backend="interpret", config=SkinnyConfig(block_k=48))
    with pytest.raises(ValueError, match="block_k=128 must divide K=64"):
        skinny_matmul(x, ws, backend="interpret", config=SkinnyConfig(block_k=128))


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_for_gpu_at_k3_shapes(platform):
    """Pallas' Triton lowering takes the kernel at a K3 rank's groups (no GPU needed): the KDA
    input group at one row (ragged 12-wide weight) and at 256 rows, an output projection at 64,
    the MoE input group with the router's fp32 logits at 16."""
    from kernels_pallas.gpu_lowering import lower_for_gpu

    sd = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    for m, k, ns, out in ((1, 7168, (1536, 1536, 1536, 1536, 128, 12), None), (256, 7168, (1536, 768), None),
                          (64, 1536, (7168,), None), (16, 7168, (896, 3584, 768, 768), [jnp.float32] + [None] * 3)):
        lower_for_gpu(lambda x, ws, out=out: skinny_matmul(x, ws, out_dtypes=out, backend="pallas"),
                      sd((m, k), bf16), [sd((k, n), bf16) for n in ns], platform=platform)
