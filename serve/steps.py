"""The engine's jitted device steps: one mixed step (chunked prefill rows + decode rows) and a
multi-step decode loop that samples on device, so several tokens cost one host round trip."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kimik3.model import KimiLM, Model
from kimik3.sampling import sample


def _reset_rows(entry, reset):
    """Zero the KDA state / conv state of rows that start a new sequence (MLA pages need no
    reset: positions past a row's length are never read)."""
    if "latent" in entry:
        return entry
    return {k: jnp.where(reset.reshape((-1,) + (1,) * (v.ndim - 1)), jnp.zeros_like(v), v)
            for k, v in entry.items()}


def _keys(seeds, gen_idx):
    """One key per row from the request's seed and the index of the token being sampled: samples
    depend on neither the batch, the slot, nor preemption."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, gen_idx)


@functools.partial(jax.jit, static_argnames=("backend", "dcp_axes"), donate_argnames=("layers",))
def mixed_step(model: Model, layers, tokens, start, n_new, reset, page_table, seeds, gen_idx,
               temperature, top_k, top_p, backend=None, dcp_axes=()):
    """tokens [B, T]: row b appends its first n_new[b] tokens after start[b]; returns the token
    sampled after each row's last new token, and the updated cache layers."""
    layers = tuple(_reset_rows(e, reset) for e in layers)
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens, layers, start, n_new,
                                             backend=backend, page_table=page_table, dcp_axes=dcp_axes)
    last = logits[jnp.arange(tokens.shape[0]), jnp.maximum(n_new - 1, 0)]
    return sample(last, _keys(seeds, gen_idx), temperature, top_k, top_p), layers


@functools.partial(jax.jit, static_argnames=("steps", "backend", "dcp_axes"), donate_argnames=("layers",))
def decode_steps(model: Model, layers, tokens, start, active, page_table, seeds, gen_idx,
                 temperature, top_k, top_p, stops, limit, steps: int, backend=None, dcp_axes=()):
    """`steps` decode steps on device: feed each row's last token, sample the next. Returns the
    sampled tokens [steps, B], the tokens each row fed [B], and the layers. Rows with active = 0
    are left untouched; a row stops feeding once it samples one of its `stops` [B, S] (pad -1) or
    its token count reaches `limit` [B], so its cache ends exactly at its last kept token (the
    prefix cache checkpoints that state); samples after that are ignored by the engine."""
    def body(i, carry):
        layers, tok, start, gen, out, live = carry
        act = active * live
        logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tok[:, None], layers, start,
                                                 act, backend=backend, page_table=page_table,
                                                 dcp_axes=dcp_axes)
        nxt = sample(logits[:, 0], _keys(seeds, gen), temperature, top_k, top_p)
        live = live * ((gen + 1 < limit) & ~(nxt[:, None] == stops).any(-1))
        return layers, nxt, start + act, gen + act, out.at[i].set(nxt), live

    out = jnp.zeros((steps, tokens.shape[0]), jnp.int32)
    live = jnp.ones_like(active)
    layers, _, end, _, out, _ = jax.lax.fori_loop(0, steps, body, (layers, tokens, start, gen_idx, out, live))
    return out, end - start, layers
