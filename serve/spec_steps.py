"""Speculative decoding with n-gram drafts as one device call of several cycles: each cycle drafts
on device (drafters.ngram_drafts over each row's recent tokens), verifies (steps.verify) and
commits, and the next cycle starts from what the last one committed, so the host's launch and
its read of the results are paid once a call, not once a cycle; as with decode calls, the next
call can be queued on device from this one's outputs before the host reads them. A host cycle
(spec_cycle.py) waits for each verify pass's result before it can draft the next: its launch
and transfers were longer than the pass itself on a small model."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.model import Model

from .drafters import ngram_drafts
from .steps import JITTED_STEPS, STOP_SLOTS, verify

SPEC_WINDOW = 4096  # recent tokens a row's n-gram lookup searches


@functools.partial(jax.jit, static_argnames=("cycles", "depth", "min_n", "max_n", "backend", "dcp_axes"),
                   donate_argnames=("layers",))
def spec_decode_steps(model: Model, layers, hist, hist_len, start, active, page_table, seeds, gen_idx,
                      temperature, top_k, top_p, stops, limit, cap, cycles: int, depth: int, min_n: int = 2,
                      max_n: int = 4, backend=None, dcp_axes=()):
    """`cycles` draft-verify-commit cycles at `depth` for the rows with active = 1. hist [B, H]:
    each row's recent tokens (the first hist_len[b] real; its last is the token fed next), start:
    tokens cached, gen_idx: tokens sampled so far (the sampling key's index), limit: max new tokens,
    cap: tokens the row's pages hold. A row drafts at most what it can still commit and what fits
    its pages; it stops after a stop token or at its limit, as decode_steps does. Returns
    (samples [cycles, B, depth + 1], committed [cycles, B] (row b commits samples[c, b, :n]),
    drafted [cycles, B], offered [cycles, B] (positions it could have drafted), the next call's
    (hist, hist_len, start, active, gen_idx) so it can be chained on device before the host reads
    this one, layers)."""
    B, H = hist.shape
    T = depth + 1
    rows = jnp.arange(B)[:, None]
    # a chained call starts from the last one's window: drop its oldest tokens so this call's fit
    shift = jnp.maximum(hist_len - (H - cycles * T), 0)
    hist = jnp.take_along_axis(hist, jnp.minimum(jnp.arange(H)[None, :] + shift[:, None], H - 1), axis=1)
    hist_len = hist_len - shift

    def body(c, carry):
        layers, hist, hist_len, start, gen, live, done, outs = carry
        act = active * live
        room = jnp.clip(jnp.minimum(jnp.minimum(depth, limit - gen - 1), cap - start - 1), 0, depth) * act
        drafts, found = ngram_drafts(hist, hist_len, depth, min_n, max_n)
        drafted = jnp.minimum(found, room)
        last = jnp.take_along_axis(hist, jnp.maximum(hist_len - 1, 0)[:, None], axis=1)
        tokens = jnp.concatenate([last, drafts], axis=1)
        n_new = act * (1 + drafted)
        samples, accepted, _, layers = verify(model, layers, tokens, start, n_new, page_table, seeds, gen,
                                              temperature, top_k, top_p, stops, backend, dcp_axes)
        n = jnp.where(n_new > 0, accepted + 1, 0)
        j = jnp.arange(T)[None, :]
        at = jnp.where(j < n[:, None], hist_len[:, None] + j, H)  # H: past the end, dropped
        hist = hist.at[rows, at].set(samples, mode="drop")
        kept = j < n[:, None]
        stopped = (kept & (samples[:, :, None] == stops[:, None, :]).any(-1)).any(1)
        gen = gen + n
        done = done | stopped | (gen >= limit)  # the request ended: it stays ended in a chained call
        live = live * (~done & (start + n < cap))  # (a row out of pages only pauses: the next call has more)
        outs = tuple(o.at[c].set(v) for o, v in zip(outs, (samples, n, drafted, room)))
        return layers, hist, hist_len + n, start + n, gen, live, done, outs

    outs = (jnp.zeros((cycles, B, T), jnp.int32),) + tuple(jnp.zeros((cycles, B), jnp.int32) for _ in range(3))
    carry = (layers, hist, hist_len, start, gen_idx, (start < cap).astype(active.dtype),  # room to feed
             jnp.zeros(B, bool), outs)
    layers, hist, hist_len, start, gen, live, done, outs = jax.lax.fori_loop(0, cycles, body, carry)
    return (*outs, (hist, hist_len, start, active * ~done, gen), layers)


JITTED_STEPS.append(spec_decode_steps)


def spec_inputs(batch: int, depth: int, cycles: int, max_seq_len: int) -> dict:
    """Zeroed host inputs of a spec_decode_steps call (idle rows), in the dtypes the engine passes."""
    H = min(max_seq_len, SPEC_WINDOW) + cycles * (depth + 1)
    z = np.zeros(batch, np.int32)
    return dict(hist=np.zeros((batch, H), np.int32), hist_len=z.copy(), start=z.copy(), active=z.copy(),
                gen_idx=z.copy(), seeds=np.zeros(batch, np.uint32), temperature=np.zeros(batch, np.float32),
                top_k=z.copy(), top_p=np.ones(batch, np.float32), stops=np.full((batch, STOP_SLOTS), -1, np.int32),
                limit=z.copy(), cap=z.copy())


def compile_spec_idle(model: Model, layers, batch: int, depths, cycles: int, max_seq_len: int,
                      pages_per_seq: int, min_n: int, max_n: int, backend=None, dcp_axes=(),
                      sampled: bool = False):
    """Run spec_decode_steps at each depth on idle rows (Engine.warmup), then once more chained
    from its device outputs as the engine queues calls (another program: device arrays where the
    first call had host ones); `sampled`: the programs of batches where a row samples, else the
    all-greedy ones. Returns the layers."""
    table = np.zeros((batch, pages_per_seq), np.int32)
    for k in depths:
        x = spec_inputs(batch, k, cycles, max_seq_len)
        if not sampled:
            x.update(temperature=None, top_k=None, top_p=None)
        for _ in range(2):
            *_, carry, layers = spec_decode_steps(model, layers, page_table=table, cycles=cycles, depth=k,
                                                  min_n=min_n, max_n=max_n, backend=backend, dcp_axes=dcp_axes, **x)
            hist, hist_len, start, active, gen = carry  # (SpeculativeCycle._spec_chain's call)
            x = dict(x, hist=hist, hist_len=hist_len, start=start, active=active, gen_idx=gen)
    return layers
