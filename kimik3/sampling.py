"""Token sampling: greedy, temperature, top-k, top-p. Pure functions usable inside jit; every
parameter may be a scalar or a per-row [B] array (so one batch can mix requests)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits, keys, temperature=0.0, top_k=0, top_p=1.0):
    """logits [B, V] fp32, keys [B] PRNG keys -> tokens [B] int32.

    temperature <= 0 is greedy for that row; top_k <= 0 and top_p >= 1 disable those filters.
    """
    B, V = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    # top-k: keep logits >= the k-th largest
    kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k - 1, 0, V - 1)[:, None], axis=-1)
    scaled = jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
    sorted_logits = jnp.where((top_k[:, None] > 0) & (sorted_logits < kth), -jnp.inf, sorted_logits)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = mass_before < top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
