"""The engine's jitted device steps: one mixed step (chunked prefill rows + decode rows) and a
multi-step decode loop that samples on device, so several tokens cost one host round trip, and
the speculative verify step, and `compile_idle`, which runs each once on idle rows (Engine.warmup)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.layers.kda import keep_positions
from kimik3.model import KimiLM, Model
from kimik3.sampling import MAX_TOP_LOGPROBS, sample_step


STOP_SLOTS = 8  # stop tokens the decode loop checks on device (past that, the host still stops)


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
                 temperature, top_k, top_p, stops, limit, steps: int, backend=None, dcp_axes=(),
                 logprobs=False):
    """`steps` decode steps on device: feed each row's last token, sample the next. Returns the
    sampled tokens [steps, B], the tokens each row fed [B], their log-probabilities (None, or
    (chosen [steps, B], top ids [steps, B, K], top logprobs [steps, B, K]) with `logprobs`), the
    next call's (tokens, start, active, gen_idx) so a following call can be chained on device
    before the host reads this one, and the layers. Rows with active = 0 are left untouched; a row stops feeding once it samples one
    of its `stops` [B, S] (pad -1) or its token count reaches `limit` [B], so its cache ends
    exactly at its last kept token (the prefix cache checkpoints that state); samples after that
    are ignored by the engine."""
    def body(i, carry):
        layers, tok, start, gen, out, live, lp_out = carry
        act = active * live
        logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tok[:, None], layers, start,
                                                 act, backend=backend, page_table=page_table,
                                                 dcp_axes=dcp_axes)
        nxt, lp = sample_step(logits[:, 0], seeds, gen, temperature, top_k, top_p, logprobs)
        if logprobs:
            lp_out = tuple(o.at[i].set(v) for o, v in zip(lp_out, lp))
        live = live * ((gen + 1 < limit) & ~(nxt[:, None] == stops).any(-1))
        return layers, nxt, start + act, gen + act, out.at[i].set(nxt), live, lp_out

    B = tokens.shape[0]
    out = jnp.zeros((steps, B), jnp.int32)
    lp_out = None
    if logprobs:  # (chosen, top ids, top logprobs) of every step
        K = min(MAX_TOP_LOGPROBS, model.cfg.vocab_size)
        lp_out = (jnp.zeros((steps, B), jnp.float32), jnp.zeros((steps, B, K), jnp.int32),
                  jnp.zeros((steps, B, K), jnp.float32))
    live = jnp.ones_like(active)
    layers, last, end, gen, out, live, lp_out = jax.lax.fori_loop(
        0, steps, body, (layers, tokens, start, gen_idx, out, live, lp_out))
    return out, end - start, lp_out, (last, end, active * live, gen), layers


@functools.partial(jax.jit, static_argnames=("backend", "dcp_axes", "logprobs"), donate_argnames=("layers",))
def verify_step(model: Model, layers, tokens, start, n_new, page_table, seeds, gen_idx,
                temperature, top_k, top_p, stops, backend=None, dcp_axes=(), logprobs: bool = False):
    """One verify pass (`verify`), jitted: the host's draft-verify-commit cycle."""
    return verify(model, layers, tokens, start, n_new, page_table, seeds, gen_idx, temperature, top_k, top_p,
                  stops, backend, dcp_axes, logprobs)


def verify(model: Model, layers, tokens, start, n_new, page_table, seeds, gen_idx,
           temperature, top_k, top_p, stops, backend=None, dcp_axes=(), logprobs: bool = False):
    """Speculative verify: tokens [B, 1 + k] are each row's last sampled token then k drafts (row b
    uses its first n_new[b]). The target samples a token after every position with the key it
    would use without speculation (index gen_idx + t), accepts drafts while they equal its own
    samples, and keeps the cache of the accepted prefix only. For a deterministic drafter this is
    exact rejection sampling (a draft d is kept with probability p(d); on a miss the target's
    sample is drawn from p restricted to the other tokens), and the committed tokens are the ones
    plain decoding with the same seed produces. A row whose samples reach one of its `stops`
    [B, S] (pad -1) keeps nothing past it, as decode_steps stops feeding there. Returns (samples
    [B, 1 + k], accepted drafts [B], logprobs of every position or None, layers): row b commits
    samples[b, :accepted[b] + 1]."""
    B, T = tokens.shape
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens, layers, start, n_new,
                                             backend=backend, page_table=page_table, dcp_axes=dcp_axes,
                                             all_positions=True)
    # every position of every row in one sampling call (rows are independent, each with its own
    # key), not one call a position: a verify pass's launches then do not grow with the depth
    per_row = lambda x: x if x is None else jnp.repeat(jnp.asarray(x), T)  # noqa: E731  [B] -> [B * T]
    flat, lp = sample_step(logits.reshape(B * T, -1), per_row(seeds),
                           (gen_idx[:, None] + jnp.arange(T, dtype=gen_idx.dtype)).reshape(-1),
                           per_row(temperature), per_row(top_k), per_row(top_p), logprobs)
    samples = flat.reshape(B, T)
    lp = lp and tuple(jnp.swapaxes(a.reshape((B, T) + a.shape[1:]), 0, 1) for a in lp)  # [T, B, ..]
    drafts_ok = (tokens[:, 1:] == samples[:, :-1]) & (jnp.arange(1, T) < n_new[:, None])
    accepted = jnp.sum(jnp.cumprod(drafts_ok.astype(jnp.int32), axis=1), axis=1)
    is_stop = (samples[:, :, None] == stops[:, None, :]).any(-1)  # [B, T]
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), T)
    accepted = jnp.minimum(accepted, first_stop)
    keep = jnp.where(n_new > 0, accepted + 1, 0)  # fed tokens whose cache entries stay
    layers = tuple(e if "latent" in e else keep_positions(e, keep) for e in layers)
    return samples, accepted, lp, layers


JITTED_STEPS = [mixed_step, decode_steps, verify_step]  # (spec_steps adds its loop)


def compiled_programs() -> int:
    """How many programs the jitted steps hold: a call that raises the count traced and compiled
    one (or loaded it from the compilation cache), so its wall time is not a step's. The count is
    the jit dispatch caches' (process-wide), so a fresh engine whose shapes ran before compiles
    nothing and is timed from its first call."""
    return sum(f._cache_size() for f in JITTED_STEPS)


def compile_idle(model: Model, layers, batch: int, widths, decode_lengths, depths, pages_per_seq: int,
                 backend=None, dcp_axes=(), logprobs: bool = False, sampled: bool = False):
    """Run every program steady serving uses once on idle rows (no row feeds a token), so each is
    compiled before a request needs it: the mixed step at each prefill width, the decode call at
    each length (the longest also chained from a call's device outputs, as the engine queues
    them: device arrays where the first call had host ones make another program), the verify
    pass at each speculative depth. Idle rows leave the KDA states as
    they were and write no MLA position a request reads before writing it (a slot's state is
    reset, or restored, when a request takes it). The arguments have the dtypes the engine
    passes, so its calls find these programs: `sampled` the programs of batches where a row
    samples, else the all-greedy ones (kimik3.sampling.step_sampling). Returns the layers."""
    B = batch
    z = np.zeros(B, np.int32)
    stops = np.full((B, STOP_SLOTS), -1, np.int32)
    # the keywords the engine passes: a call's jit cache key includes which arguments are keywords
    temp, top_k, top_p = (np.ones(B, np.float32), z, np.ones(B, np.float32)) if sampled else (None,) * 3
    common = dict(page_table=np.zeros((B, pages_per_seq), np.int32), seeds=np.zeros(B, np.uint32), gen_idx=z,
                  temperature=temp, top_k=top_k, top_p=top_p, backend=backend, dcp_axes=dcp_axes,
                  logprobs=logprobs)
    for T in widths:
        *_, layers = mixed_step(model, layers, np.zeros((B, T), np.int32), z, z, np.zeros(B, bool), **common)
    for steps in sorted(decode_lengths):
        *_, carry, layers = decode_steps(model, layers, z, z, z, stops=stops, limit=z, steps=steps, **common)
    if decode_lengths:
        tokens, start, active, gen = carry  # the longest's, chained (QueuedDecode._chain's call)
        *_, layers = decode_steps(model, layers, tokens, start, active, stops=stops, limit=z, steps=steps,
                                  **dict(common, gen_idx=gen))
    for k in depths:
        *_, layers = verify_step(model, layers, np.zeros((B, k + 1), np.int32), z, z, common["page_table"],
                                 common["seeds"], z, temp, top_k, top_p, stops,
                                 backend=backend, dcp_axes=dcp_axes, logprobs=logprobs)
    return layers
