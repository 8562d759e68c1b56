"""MLA kernels: the Pallas decode / prefill kernels (interpret mode on CPU) against the plain-JAX
references, and the exact log-sum-exp merge of partial results."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.mla import (merge_partials, mla_decode, mla_decode_reference, mla_prefill,
                                mla_prefill_reference)

SCALE = 1.0 / np.sqrt(192.0)


def _paged_cache(rng, lengths, page_size, max_pages, dtype, fill_unused=np.nan):
    """A page pool with each sequence's pages at random places; unused slots hold `fill_unused`."""
    B = len(lengths)
    num_pages = B * max_pages + 3
    perm = rng.permutation(num_pages)
    page_table = perm[: B * max_pages].reshape(B, max_pages).astype(np.int32)
    cache = np.full((num_pages, page_size, 576), fill_unused, np.float32)
    for b, L in enumerate(lengths):
        for pos in range(L):
            cache[page_table[b, pos // page_size], pos % page_size] = rng.standard_normal(576)
    return jnp.asarray(cache, dtype), jnp.asarray(page_table), jnp.asarray(lengths, jnp.int32)


def _q(rng, B, Tq, H, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal((B, Tq, H, 576)), jnp.float32).astype(dtype)


def _check(o, lse, ro, rlse, atol):
    o, lse, ro, rlse = (np.asarray(x, np.float32) for x in (o, lse, ro, rlse))
    assert np.all(np.isfinite(o)), "non-finite output"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(o, ro, atol=atol, rtol=0)
    assert np.all(o[~fin] == 0), "rows without keys must be 0"


@pytest.mark.parametrize("H,Tq", [(12, 1), (16, 1), (12, 4), (16, 4)])
def test_decode_bf16_edges(H, Tq):
    rng = np.random.default_rng(H * 10 + Tq)
    ps = 16
    # 0 (masked), 1, Tq-1 (fewer keys than queries), page boundaries, a longer one
    lengths = [0, 1, max(Tq - 1, 0), ps - 1, ps, ps + 1, 2 * ps, 150]
    cache, pt, ln = _paged_cache(rng, lengths, ps, 10, jnp.bfloat16)
    q = _q(rng, len(lengths), Tq, H)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, out_dtype=jnp.float32)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret", num_splits=3,
                        out_dtype=jnp.float32)
    assert o.shape == (len(lengths), Tq, H, 512) and lse.shape == (len(lengths), Tq, H)
    _check(o, lse, ro, rlse, atol=2e-2)


def test_decode_long_ragged_fp32_exact():
    rng = np.random.default_rng(1)
    ps, maxp = 32, 24
    lengths = [700, 33, 0, 511, 768]
    cache, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.float32)
    q = _q(rng, len(lengths), 2, 16, jnp.float32)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE)
    for splits, bk in ((1, 64), (7, 32)):
        o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret",
                            num_splits=splits, block_k=bk)
        _check(o, lse, ro, rlse, atol=2e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_decode_fp8(per_token):
    rng = np.random.default_rng(2 + per_token)
    ps = 16
    lengths = [0, 1, 17, 100]
    cache32, pt, ln = _paged_cache(rng, lengths, ps, 8, jnp.float32, fill_unused=0.0)
    if per_token:
        # c / scale must stay inside e4m3's range (448), else the cast gives NaN
        cs = jnp.asarray(rng.uniform(0.02, 0.05, cache32.shape[:2]), jnp.float32)
        cache8 = (cache32 / cs[..., None]).astype(jnp.float8_e4m3fn)
    else:
        cs = jnp.float32(0.02)
        cache8 = (cache32 / cs).astype(jnp.float8_e4m3fn)
    # NaN in unused slots must not leak: fp8 e4m3fn has a NaN encoding.
    used = np.zeros(cache8.shape[:2], bool)
    for b, L in enumerate(lengths):
        for pos in range(L):
            used[int(pt[b, pos // ps]), pos % ps] = True
    cache8 = jnp.where(jnp.asarray(used)[..., None], cache8,
                       jnp.asarray(np.nan, jnp.float8_e4m3fn))
    q = _q(rng, len(lengths), 4, 12)
    ro, rlse = mla_decode_reference(q, cache8, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    o, lse = mla_decode(q, cache8, pt, ln, scale=SCALE, backend="interpret", cache_scale=cs,
                        num_splits=2, out_dtype=jnp.float32)
    _check(o, lse, ro, rlse, atol=2e-2)
    # and the fp8 result is close to the unquantised one
    r32, _ = mla_decode_reference(q, cache32, pt, ln, scale=SCALE, out_dtype=jnp.float32)
    rel = float(jnp.linalg.norm(o - r32) / jnp.linalg.norm(r32))
    assert rel < 0.1, rel


def test_decode_default_config_and_reference_backend():
    rng = np.random.default_rng(4)
    lengths = [5, 64, 65]
    cache, pt, ln = _paged_cache(rng, lengths, 64, 2, jnp.bfloat16)
    q = _q(rng, 3, 1, 16)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret")
    ro, rlse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="reference")
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    _check(o, lse, ro, rlse, atol=3e-2)


def test_merge_partials_over_random_shards():
    """Decode over disjoint page ranges of the history, merged, equals the unsplit decode."""
    rng = np.random.default_rng(5)
    ps, maxp = 16, 12
    lengths = [150, 1, 0, 97]
    cache, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.float32)
    q = _q(rng, len(lengths), 1, 16, jnp.float32)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE)
    for trial in range(3):
        cuts = np.sort(rng.choice(np.arange(1, maxp), size=3, replace=False))
        bounds = [0, *cuts.tolist(), maxp]
        os_, ls_ = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sub_pt = jnp.zeros_like(pt).at[:, : b - a].set(pt[:, a:b])
            sub_len = jnp.clip(ln - a * ps, 0, (b - a) * ps)
            backend = "interpret" if trial == 0 else "reference"
            o_s, l_s = mla_decode(q, cache, sub_pt, sub_len, scale=SCALE, backend=backend,
                                  num_splits=2)
            os_.append(o_s)
            ls_.append(l_s)
        o, lse = merge_partials(os_, ls_)
        _check(o, lse, ro, rlse, atol=2e-5)
    # all-empty shards: lse -inf, o 0
    o, lse = merge_partials([jnp.ones((2, 3, 8))] * 2, [jnp.full((2, 3), -jnp.inf)] * 2)
    assert np.all(np.isneginf(np.asarray(lse))) and np.all(np.asarray(o) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill(dtype):
    rng = np.random.default_rng(6)
    B, T, H = 4, 80, 2
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, 192)), jnp.float32).astype(dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.float32).astype(dtype)
    ln = jnp.asarray([0, 1, 33, 80], jnp.int32)     # 0, 1, block+1, full (T not a block multiple)
    ro, rlse = mla_prefill_reference(q, k, v, ln, scale=SCALE, return_lse=True)
    atol = 2e-5 if dtype == jnp.float32 else 3e-2
    for backend in ("interpret", "reference"):
        o, lse = mla_prefill(q, k, v, ln, scale=SCALE, backend=backend, return_lse=True,
                             block_q=32, block_k=16, chunk=32)
        assert o.shape == (B, T, H, 128) and o.dtype == dtype
        _check(o, lse, ro, rlse, atol=atol)
