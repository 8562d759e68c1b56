"""The engine's jitted device steps: one mixed step (chunked prefill rows + decode rows) and a
multi-step decode loop that samples on device, so several tokens cost one host round trip."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimik3.model import KimiLM, Model
from kimik3.sampling import MAX_TOP_LOGPROBS, sample_step


def _reset_rows(entry, reset):
    """Zero the KDA state / conv state of rows that start a new sequence (MLA pages need no
    reset: positions past a row's length are never read)."""
    if "latent" in entry:
        return entry
    return {k: jnp.where(reset.reshape((-1,) + (1,) * (v.ndim - 1)), jnp.zeros_like(v), v)
            for k, v in entry.items()}


@functools.partial(jax.jit, static_argnames=("backend", "dcp_axes", "logprobs"), donate_argnames=("layers",))
def mixed_step(model: Model, layers, tokens, start, n_new, reset, page_table, seeds, gen_idx,
               temperature, top_k, top_p, backend=None, dcp_axes=(), logprobs=False):
    """tokens [B, T]: row b appends its first n_new[b] tokens after start[b]; returns the token
    sampled after each row's last new token [B], its log-probabilities (None, or kimik3.sampling's
    (chosen [B], top ids [B, K], top logprobs [B, K]) with `logprobs`), and the updated layers."""
    layers = tuple(_reset_rows(e, reset) for e in layers)
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens, layers, start, n_new,
                                             backend=backend, page_table=page_table, dcp_axes=dcp_axes)
    last = logits[jnp.arange(tokens.shape[0]), jnp.maximum(n_new - 1, 0)]
    sampled, lp = sample_step(last, seeds, gen_idx, temperature, top_k, top_p, logprobs)
    return sampled, lp, layers


@functools.partial(jax.jit, static_argnames=("steps", "backend", "dcp_axes", "logprobs"),
                   donate_argnames=("layers",))
def decode_steps(model: Model, layers, tokens, start, active, page_table, seeds, gen_idx,
                 temperature, top_k, top_p, steps: int, backend=None, dcp_axes=(), logprobs=False):
    """`steps` decode steps on device: feed each row's last token, sample the next. Returns the
    sampled tokens [steps, B], their log-probabilities (None, or (chosen [steps, B], top ids
    [steps, B, K], top logprobs [steps, B, K]) with `logprobs`) and the layers. Rows with
    active = 0 are left untouched."""
    def body(i, carry):
        layers, tok, start, gen, out, lp_out = carry
        logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tok[:, None], layers, start,
                                                 active, backend=backend, page_table=page_table,
                                                 dcp_axes=dcp_axes)
        nxt, lp = sample_step(logits[:, 0], seeds, gen, temperature, top_k, top_p, logprobs)
        if logprobs:
            lp_out = tuple(o.at[i].set(v) for o, v in zip(lp_out, lp))
        return layers, nxt, start + active, gen + active, out.at[i].set(nxt), lp_out

    B = tokens.shape[0]
    out = jnp.zeros((steps, B), jnp.int32)
    lp_out = None
    if logprobs:  # (chosen, top ids, top logprobs) of every step
        K = min(MAX_TOP_LOGPROBS, model.cfg.vocab_size)
        lp_out = (jnp.zeros((steps, B), jnp.float32), jnp.zeros((steps, B, K), jnp.int32),
                  jnp.zeros((steps, B, K), jnp.float32))
    layers, _, _, _, out, lp_out = jax.lax.fori_loop(0, steps, body,
                                                     (layers, tokens, start, gen_idx, out, lp_out))
    return out, lp_out, layers
