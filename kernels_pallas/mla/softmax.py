"""The online-softmax update both MLA kernels (flash decode, flash prefill) run per key block,
in base 2 (scores arrive pre-multiplied by scale * log2 e)."""
import jax.numpy as jnp


def online_softmax_step(s, m_i, l_i):
    """s [..., rows, keys] masked scores (-inf = masked); running max m_i and sum l_i [..., rows].
    Returns (p, alpha, m_new, l_new): the block's weights, the rescale for the old accumulator."""
    m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a fully masked row stays all-zero
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - m_safe[..., None])
    return p, alpha, m_new, l_i * alpha + jnp.sum(p, axis=-1)
