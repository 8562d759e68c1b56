"""The router's top-k kernel (interpret mode on CPU) against `jax.lax.top_k` + `take_along_axis`:
ids and scores bitwise, for K3's 896 experts, experts not a power of two, ties, a bias that
changes the choice but not the scores, and rows past the kernel's limit."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.moe.topk import top_k_scores


def _same(got, want):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint32), np.asarray(want[1]).view(np.uint32))


@pytest.mark.parametrize("n, e, k", [(1, 896, 16), (37, 896, 16), (5, 64, 8), (3, 100, 100), (65, 896, 16)])
def test_kernel_matches_top_k(n, e, k):
    scores = jax.nn.sigmoid(jax.random.normal(jax.random.key(n + e), (n, e)))
    bias = 0.01 * jax.random.normal(jax.random.key(k), (e,))
    got = top_k_scores(scores, bias, k, backend="interpret")
    assert got[0].dtype == jnp.int32 and got[0].shape == got[1].shape == (n, k)
    _same(got, top_k_scores(scores, bias, k, backend="reference"))


def test_ties_go_to_the_lower_id_and_the_bias_only_selects():
    scores = jnp.round(jax.nn.sigmoid(jax.random.normal(jax.random.key(3), (9, 50))) * 4) / 4
    _same(top_k_scores(scores, jnp.zeros(50), 7, backend="interpret"),
          top_k_scores(scores, jnp.zeros(50), 7, backend="reference"))
    bias = jnp.zeros(50).at[49].set(10.0)  # expert 49 is chosen first, with its own score
    ids, w = top_k_scores(scores, bias, 7, backend="interpret")
    assert (np.asarray(ids[:, 0]) == 49).all()
    np.testing.assert_array_equal(w[:, 0], scores[:, 49])


def test_no_rows_and_bad_shapes():
    ids, w = top_k_scores(jnp.zeros((0, 8)), jnp.zeros(8), 2, backend="interpret")
    assert ids.shape == w.shape == (0, 2)
    with pytest.raises(ValueError, match=r"0 < k <= E"):
        top_k_scores(jnp.zeros((2, 8)), jnp.zeros(8), 9, backend="interpret")
    with pytest.raises(ValueError, match=r"bias \[E\]"):
        top_k_scores(jnp.zeros((2, 8)), jnp.zeros(7), 2, backend="interpret")


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_lowers_for_gpu_at_k3_shapes(platform):
    """Pallas' Triton lowering takes the kernel at K3's 896 experts, k 16 (no GPU needed)."""
    from kernels_pallas.gpu_lowering import lower_for_gpu

    sd = jax.ShapeDtypeStruct
    for n in (1, 64):
        lower_for_gpu(lambda s, b: top_k_scores(s, b, 16, backend="pallas"),
                      sd((n, 896), jnp.float32), sd((896,), jnp.float32), platform=platform)
