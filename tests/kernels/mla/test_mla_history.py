"""The chunked prefill over a cached MLA history (kimik3.layers.mla.history_attention in plain JAX,
history_flash on the flash prefill kernel): equal to attention over the whole history at once
(the T x S scores they replace) for ragged starts, rows with nothing new, several key chunks,
page boundaries, and an fp8 cache."""
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.mla.reference import dequant_cache, quantize_words
from kimik3.layers.mla import history_attention

B, T, H, DN, DR, DV, R, P = 5, 12, 3, 16, 8, 16, 32, 4


def dense_oracle(q_nope, q_rope, keys, start, n_new, w_uk, w_uv, scale):
    """All S positions at once, fp32: scores [B, H, T, S], masked to s <= start + t, s < end."""
    R, T = w_uk.shape[0], q_nope.shape[1]
    k_nope = jnp.einsum("bsc,chn->bshn", keys[..., :R], w_uk)
    v = jnp.einsum("bsc,chv->bshv", keys[..., :R], w_uv)
    s = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope)
         + jnp.einsum("bthr,bsr->bhts", q_rope, keys[..., R:])) * scale
    S = keys.shape[1]
    pos = jnp.arange(S)
    qpos = start[:, None] + jnp.arange(T)[None, :]
    ok = (pos[None, None, :] <= qpos[..., None]) & (pos[None, None, :] < (start + n_new)[:, None, None])
    s = jnp.where(ok[:, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhts,bshv->bhtv", p, v) / jnp.where(den > 0, den, 1.0)
    return jnp.swapaxes(o, 1, 2)


@pytest.mark.parametrize("fp8,chunk", [(False, 8), (False, 1024), (True, 4)])
def test_history_attention_matches_whole_history(fp8, chunk):
    rng = np.random.default_rng(7 + chunk)
    pages_per_row, num_pages = 9, 48
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q_nope, q_rope = f(B, T, H, DN), f(B, T, H, DR)
    w_uk, w_uv = f(R, H, DN) * 0.2, f(R, H, DV) * 0.2
    values = f(num_pages, P, R + DR)
    scale_c = 0.05
    latent = quantize_words(values, scale_c) if fp8 else values
    table = jnp.asarray(rng.permutation(num_pages)[:B * pages_per_row].reshape(B, pages_per_row),
                        jnp.int32)
    # ragged: a fresh prompt, one across page boundaries, rows with nothing new (with and
    # without a history), a near-full one
    start = jnp.asarray([0, 5, 13, 0, 36 - T], jnp.int32)
    n_new = jnp.asarray([T, 7, 0, 0, T], jnp.int32)
    o = history_attention(q_nope, q_rope, latent, table, start, n_new, w_uk, w_uv, 0.3,
                          scale_c if fp8 else None, jnp.float32, chunk=chunk)
    keys = (dequant_cache(latent, scale_c) if fp8 else latent)[table].reshape(B, -1, R + DR)
    want = dense_oracle(q_nope, q_rope, keys.astype(jnp.float32), start, n_new, w_uk, w_uv, 0.3)
    valid = np.asarray(jnp.arange(T)[None, :] < n_new[:, None])
    np.testing.assert_allclose(np.asarray(o)[valid], np.asarray(want)[valid], atol=2e-5, rtol=2e-5)
    assert np.all(np.isfinite(np.asarray(o))), "padding queries stay finite"
    assert np.all(np.asarray(o)[3] == 0), "a row with no key attends nothing"


@pytest.mark.parametrize("fp8,key_rows", [(False, 40), (False, 10_000), (True, 24)])
def test_history_flash_matches_whole_history(fp8, key_rows):
    """The chunked prefill on the flash kernel (interpret mode) at its head dimensions (192 / 128):
    the same attention as the dense oracle for ragged starts, rows with nothing new, several key
    chunks (key_rows 40 and 24: 2-3 pages a step) or one, and an fp8 cache."""
    from kimik3.layers.mla import Heads, history_flash

    dn, dr, dv, r, h, t, b = 128, 64, 128, 32, 2, 10, 4
    rng = np.random.default_rng(11 + key_rows)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q_nope, q_rope = f(b, t, h, dn), f(b, t, h, dr)
    w_uk, w_uv = f(r, h, dn) * 0.1, f(r, h, dv) * 0.2
    pages_per_row, num_pages, scale_c = 8, 40, 0.05
    values = f(num_pages, P, r + dr)
    latent = quantize_words(values, scale_c) if fp8 else values
    table = jnp.asarray(rng.permutation(num_pages)[:b * pages_per_row].reshape(b, pages_per_row), jnp.int32)
    start = jnp.asarray([0, 6, 13, 32 - t], jnp.int32)
    n_new = jnp.asarray([t, 5, 0, t], jnp.int32)
    heads = Heads(q_nope, q_rope, w_uk, w_uv, 0.1, jnp.float32, scale_c if fp8 else None, "interpret")
    o = history_flash(heads, latent, table, start, n_new, key_rows=key_rows, min_keys=P)
    keys = (dequant_cache(latent, scale_c) if fp8 else latent)[table].reshape(b, -1, r + dr)
    want = dense_oracle(q_nope, q_rope, keys.astype(jnp.float32), start, n_new, w_uk, w_uv, 0.1)
    valid = np.asarray(jnp.arange(t)[None, :] < n_new[:, None])
    np.testing.assert_allclose(np.asarray(o)[valid], np.asarray(want)[valid], atol=3e-5, rtol=3e-5)
    assert np.all(np.asarray(o)[~valid] == 0), "rows past the new tokens come out 0"
