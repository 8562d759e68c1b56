"""Token sampling: greedy, temperature, top-k, top-p, and the pieces `kimik3.generate` and the
serving engine share so that they agree: the checks on sampling settings, the per-row PRNG keys,
and per-token log-probabilities. Pure functions usable inside jit; every parameter of `sample`
may be a scalar or a per-row [B] array (so one batch can mix requests)."""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20  # alternatives per token a caller may ask for (OpenAI's limit)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_sampling(max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_tokens=None,
                   stop_strings=(), top_logprobs=0, vocab_size=None):
    """Raise a one-line ValueError for the first bad setting (what was wrong and what is allowed).

    The one set of rules for `kimik3.generate`, `Engine.generate` and `SamplingParams`."""
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not _is_real(temperature) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be a number in (0, 1] (1 keeps every token), got {top_p!r}")
    if not _is_int(seed) or not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    if not _is_int(top_logprobs) or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    if stop_tokens is not None:
        if isinstance(stop_tokens, (str, bytes)) or not all(_is_int(t) for t in stop_tokens):
            raise ValueError(f"stop_tokens must be a list of token ids, got {stop_tokens!r}")
        bad = [t for t in stop_tokens if vocab_size is not None and not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if isinstance(stop_strings, (str, bytes)) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"stop_strings must be a list of non-empty strings, got {stop_strings!r}")


def row_keys(seeds, gen_idx):
    """One PRNG key per row from the row's seed and the index of the token being sampled (0 for the
    first new token): samples depend on neither the batch, the slot, nor preemption, and
    `kimik3.generate` and the engine draw the same ones."""
    seeds = jnp.asarray(seeds, jnp.uint32)
    gen_idx = jnp.asarray(gen_idx, jnp.int32)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, gen_idx)


def token_logprobs(logits, tokens, num_top: int):
    """The model's log-probabilities (log-softmax of the raw logits: before temperature, top-k and
    top-p) of the chosen tokens [B], and the num_top most likely tokens per row: (chosen [B],
    top ids [B, num_top] int32, top logprobs [B, num_top]); num_top is static."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, num_top)
    return chosen, top_ids.astype(jnp.int32), top_lp


def sample(logits, keys, temperature=0.0, top_k=0, top_p=1.0):
    """logits [B, V] fp32, keys [B] PRNG keys -> tokens [B] int32.

    temperature <= 0 is greedy for that row; top_k <= 0 and top_p >= 1 disable those filters.
    temperature None (top_k, top_p ignored), or a Python number <= 0, makes every row greedy:
    the argmax alone, without sorting the vocabulary. Jitted steps get None from
    `step_sampling` when no row of the batch samples, so the choice is made on the host: a
    device-side branch (lax.cond) can have XLA:GPU read its predicate back to the host in the
    middle of the call, and the host then waits for the GPU instead of queueing ahead of it.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if temperature is None or (isinstance(temperature, numbers.Real) and temperature <= 0):
        return greedy
    B = logits.shape[0]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,))
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (B,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (B,))
    return _draw(logits, keys, temperature, top_k, top_p, greedy)


def step_sampling(temperature, top_k, top_p):
    """A batch's (temperature, top_k, top_p) as the jitted steps take them: (None, None, None)
    where no row samples (every temperature <= 0), so the batch runs the argmax-only program
    (`sample`); else as given. Host values (numpy arrays or numbers)."""
    if not np.any(np.asarray(temperature) > 0):
        return None, None, None
    return temperature, top_k, top_p


def _draw(logits, keys, temperature, top_k, top_p, greedy):
    """`sample` where some row has temperature > 0 (the greedy rows keep `greedy`)."""
    V = logits.shape[-1]
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


def sample_step(logits, seeds, gen_idx, temperature, top_k, top_p, logprobs: bool = False):
    """Sample one token per row with the rows' own keys (`row_keys`); with logprobs (static) also
    each token's log-probability and the MAX_TOP_LOGPROBS most likely alternatives:
    (tokens, None) or (tokens, (chosen, top ids, top logprobs))."""
    tokens = sample(logits, row_keys(seeds, gen_idx), temperature, top_k, top_p)
    if not logprobs:
        return tokens, None
    return tokens, token_logprobs(logits, tokens, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
