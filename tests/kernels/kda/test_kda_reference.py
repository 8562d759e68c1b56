"""The chunked plain-JAX KDA equals the naive per-token recurrence (both gate forms)."""
import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import kda_chunk, kda_chunk_reference, kda_gate, kda_recurrent


def _inputs(T, seed, B=2, H=2, K=16, V=8, lower_bound=-5.0):
    ks = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = kda_gate(jax.random.normal(ks[3], (B, T, H, K)), jax.random.normal(ks[4], (H,)),
                 jax.random.normal(ks[5], (H * K,)), lower_bound=lower_bound)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H)))
    S0 = jax.random.normal(jax.random.fold_in(ks[0], 1), (B, H, K, V))
    return q, k, v, g, beta, S0


# sequences shorter than a chunk, exactly one, and several with a partial last one; the rows'
# lengths 0, 1, chunk-1, chunk, chunk+1 (each cut to T)
@pytest.mark.parametrize("T", [1, 64, 200])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_chunked_equals_recurrence(T, lower_bound):
    lengths = jnp.minimum(jnp.array([T, 0, 1, 63, 64, 65]), T)
    q, k, v, g, beta, S0 = _inputs(T, T, B=len(lengths), lower_bound=lower_bound)
    for init in (None, S0):
        o1, s1 = kda_recurrent(q, k, v, g, beta, initial_state=init, lengths=lengths, use_qk_l2norm=True)
        o2, s2 = kda_chunk_reference(q, k, v, g, beta, initial_state=init, lengths=lengths,
                                     use_qk_l2norm=True)
        valid = (jnp.arange(T)[None, :] < lengths[:, None])[..., None, None]
        assert jnp.max(jnp.abs(jnp.where(valid, o1 - o2, 0))) < 2e-5
        assert jnp.max(jnp.abs(s1 - s2)) < 2e-5


def test_lengths_stop_the_state_and_ignore_padding():
    q, k, v, g, beta, S0 = _inputs(70, 1)
    _, s_short = kda_recurrent(q[:, :30], k[:, :30], v[:, :30], g[:, :30], beta[:, :30], initial_state=S0)
    v_poisoned = v.at[:, 30:].set(jnp.nan)
    _, s = kda_chunk_reference(q, k, v_poisoned, g, beta, initial_state=S0, lengths=jnp.array([30, 30]))
    assert jnp.max(jnp.abs(s - s_short)) < 1e-5


def test_dispatcher_reference_backend_and_bad_names():
    q, k, v, g, beta, _ = _inputs(10, 2)
    o, _ = kda_chunk(q, k, v, g, beta, backend="reference")
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    assert jnp.max(jnp.abs(o - o_ref)) < 1e-5
    with pytest.raises(ValueError, match="backend='cuda'"):
        kda_chunk(q, k, v, g, beta, backend="cuda")
