"""The fused AttnRes mix + RMSNorm kernel (interpret mode on CPU) against its plain-JAX reference:
the persisted residual stream bitwise, the normalised rows within the rounding the reference
itself does (its mixture and its normalised value are rounded to the model dtype)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.attnres import NormConfig, attn_res_norm

EPS = 1e-5
# bf16: the kernel's fp32 mixture differs from the reference's in the last fp32 bits (online
# softmax, another summation order), which can move the rounded mixture by one bf16 step, and the
# normalised value by one more: two steps of 2^-7 relative each at most. fp32: summation-order
# noise over at most a few hundred terms. ATOL: that fp32 noise is relative to the row's scale,
# not to an element that cancels to near zero; y is normalised (RMS 1 times a gain near 1).
RTOL = {jnp.bfloat16: 2 * 2.0 ** -7, jnp.float32: 1e-5}
ATOL = 1e-5


def _inputs(seed, n_bank, shape, dtype, residual=True, delta=True, query_scale=1.0):
    ks = jax.random.split(jax.random.key(seed), n_bank + 6)
    H = shape[-1]
    # rows of different scales, as block sums grow with depth
    bank = [(jax.random.normal(ks[i], shape) * (1 + i)).astype(dtype) for i in range(n_bank)]
    r = jax.random.normal(ks[-1], shape).astype(dtype) if residual else None
    d = (0.5 * jax.random.normal(ks[-2], shape)).astype(dtype) if delta else None
    g = 1 + 0.1 * jax.random.normal(ks[-3], (H,))
    w = query_scale * jax.random.normal(ks[-4], (H,))
    gain = (1 + 0.1 * jax.random.normal(ks[-5], (H,))).astype(dtype)
    return bank, r, d, g, w, gain


def _check(args, dtype, config=None):
    ref_y, ref_s = attn_res_norm(*args, eps=EPS, backend="reference")
    y, s = attn_res_norm(*args, eps=EPS, backend="interpret", config=config)
    assert y.dtype == ref_y.dtype == dtype and y.shape == ref_y.shape
    assert s.dtype == ref_s.dtype and s.shape == ref_s.shape
    np.testing.assert_array_equal(np.asarray(s).view(np.uint8), np.asarray(ref_s).view(np.uint8))
    y32, r32 = np.asarray(y, np.float32), np.asarray(ref_y, np.float32)
    np.testing.assert_allclose(y32, r32, rtol=RTOL[dtype], atol=ATOL)
    return y32, r32


# (bank rows, shape, residual given, delta given, tile): the first layer (embedding only, no
# bank), the plain add + norm, a block end's MLP side (new partial = the delta alone), a full
# bank at batch 1, ragged token counts across tiles, [B, T, H] input, a hidden size of 3 x 32.
CASES = [
    (0, (5, 64), True, False, None),
    (0, (7, 64), True, True, NormConfig(block_t=4)),
    (1, (6, 64), False, True, None),
    (8, (1, 128), True, True, None),
    (3, (37, 64), True, True, NormConfig(block_t=8)),
    (2, (13, 64), True, True, None),
    (4, (2, 5, 64), True, True, NormConfig(block_t=2, block_h=16)),
    (5, (9, 96), True, True, None),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case, dtype):
    n_bank, shape, residual, delta, config = CASES[case]
    args = _inputs(case, n_bank, shape, dtype, residual, delta)
    y, ref = _check(args, dtype, config)
    if dtype == jnp.bfloat16:  # the rounding differences are rare, not everywhere
        assert np.mean(y != ref) < 0.05


def test_peaked_softmax_and_bf16_sum():
    """Large pseudo-queries make the softmax over depth nearly one-hot (the online softmax must
    rescale without overflow); bf16 + fp32 inputs promote the stream to fp32, as in JAX."""
    args = _inputs(11, 6, (9, 64), jnp.bfloat16, query_scale=30.0)
    _check(args, jnp.bfloat16, NormConfig(block_t=4))
    bank, r, d, g, w, gain = _inputs(12, 2, (4, 64), jnp.float32)
    _check((bank, r.astype(jnp.bfloat16), d, g, w, gain), jnp.float32)


def test_no_tokens():
    args = _inputs(3, 2, (0, 64), jnp.bfloat16)
    y, s = attn_res_norm(*args, eps=EPS, backend="interpret")
    assert y.shape == s.shape == (0, 64)


def test_default_tiles():
    from kernels_pallas.attnres.tuning import norm_config

    k3 = norm_config(8192, 7168)  # one token a program, seven 1024-wide slices, no padded lanes
    assert (k3.block_t, k3.block_h, k3.num_warps) == (1, 1024, 8)
    assert norm_config(37, 64).block_t == 32 and norm_config(3, 64).block_t == 2
    with pytest.raises(ValueError):
        norm_config(4, 96, NormConfig(block_h=64))


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_for_gpu_at_k3_shapes(platform):
    """Pallas' Triton lowering takes the kernel at K3's hidden size: a full bank at decode and a
    prefill tile (no GPU needed)."""
    from kernels_pallas.gpu_lowering import lower_for_gpu

    sd = jax.ShapeDtypeStruct
    vec = sd((7168,), jnp.bfloat16)
    for n_bank, T in ((8, 64), (3, 8192)):
        rows = sd((T, 7168), jnp.bfloat16)
        lower_for_gpu(lambda b, r, d, g, w, gain: attn_res_norm(b, r, d, g, w, gain, eps=EPS,
                                                                backend="pallas"),
                      [rows] * n_bank, rows, rows, vec, vec, vec, platform=platform)
