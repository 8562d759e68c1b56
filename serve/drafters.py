"""Drafters for speculative decoding: each proposes up to k next tokens for a running request.

`NgramDrafter` needs no weights: it finds the longest recent n-gram of the request's own tokens
(prompt + output) that occurred before and proposes what followed it. Agentic coding turns re-send
the whole conversation and their answers copy spans of it (file contents, tool output), which is
what such lookups catch. `ModelDrafter` runs any kimik3 model (sharing the target's tokenizer)
greedily, on its own cache that the engine keeps in step with the committed tokens.

Drafts are deterministic (a point mass), which is what makes the engine's verify exact
rejection sampling with the target's own per-position keys (serve/steps.py verify_step).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.model import KimiLM, Model, init_cache

from .steps import _reset_rows


class NgramDrafter:
    """Suffix lookup over a request's tokens: the last `n` tokens (n from max_n down to min_n) are
    looked up among earlier positions; the tokens after their latest earlier occurrence are the
    draft. An index per request (n-gram -> latest end position) is extended as tokens arrive, so
    a lookup costs O(max_n) however long the context is."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict = {}  # request key -> (tokens indexed so far, {n-gram: end position})

    def propose(self, key, tokens, k: int) -> list[int]:
        """tokens: the request's sequence (a list or a view that slices to lists)."""
        L = len(tokens)
        if k <= 0 or L < self.min_n + 1:
            return []
        seen, table = self._index.get(key, (0, {}))
        if seen > L:  # the request restarted (preempted and recomputed): rebuild
            seen, table = 0, {}
        # index every n-gram followed by a token (the suffix itself is the query): those ending
        # (exclusive) at e in [max(seen, n), L - 1], from one copy of the new tail, with the
        # n-gram tuples built by zip in C (not a slice of the sequence view per n-gram)
        base = max(0, max(seen, self.min_n) - self.max_n)
        tail = tokens[base:L]
        for n in range(self.min_n, self.max_n + 1):
            first, last = max(seen, n) - n - base, L - 1 - n - base  # window starts, relative to base
            if first <= last:
                grams = zip(*(tail[first + i:last + 1 + i] for i in range(n)))
                table.update(zip(grams, range(first + base + n, L)))  # later ends overwrite earlier ones
        self._index[key] = (L, table)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            end = table.get(tuple(tokens[L - n:L]))
            if end is not None:
                return list(tokens[end:end + k])
        return []

    def forget(self, key):
        self._index.pop(key, None)


def ngram_drafts(hist, length, k: int, min_n: int = 2, max_n: int = 4):
    """NgramDrafter.propose for every row at once, on device: hist [B, H] holds each row's tokens
    (the first length[b] real). The longest suffix n-gram (max_n down to min_n) that also ends at
    an earlier position, its latest such occurrence, and up to k tokens that followed it.
    Returns (drafts [B, k], how many of them are real [B])."""
    B, H = hist.shape
    pos = jnp.arange(H, dtype=jnp.int32)[None, :]
    length = length[:, None]
    suffix = jnp.take_along_axis(hist, jnp.clip(length - 1 - jnp.arange(max_n), 0, H - 1), axis=1)  # [B, max_n]
    padded = jnp.pad(hist, ((0, 0), (max_n, 0)), constant_values=-1)  # -1: before the sequence, no token
    # matched[e]: how many tokens before position e equal the sequence's last ones (up to max_n)
    matched = 0
    for i in range(max_n, 0, -1):  # farthest first: a match extends the count, a nearer miss resets it
        same = (padded[:, max_n - i:max_n - i + H] == suffix[:, i - 1:i]) & (length > i)
        matched = jnp.where(same, matched + 1, 0)
    matched = matched * (pos <= length - 1)  # occurrences that end before the sequence does
    score = jnp.where(matched >= min_n, matched * (H + 1) + pos, -1)  # longest n-gram, then latest
    best = jnp.max(score, axis=1)
    end = jnp.where(best >= 0, best % (H + 1), -1)
    count = jnp.where(end >= 0, jnp.minimum(k, length[:, 0] - end), 0)
    drafts = jnp.take_along_axis(hist, jnp.clip(end[:, None] + jnp.arange(k), 0, H - 1), axis=1)
    return drafts, count


@functools.partial(jax.jit, static_argnames=("k", "backend"), donate_argnames=("layers",))
def _sync_and_draft(model: Model, layers, lengths, tokens, n_new, reset, first, k: int, backend=None):
    """Feed each row its committed tokens not yet seen (tokens [B, T], the first n_new[b] real) and
    keep that cache; then, from each row's newest token `first` [B], draft k tokens greedily on a
    copy that is dropped, so rejected drafts never enter the drafter's state."""
    layers = tuple(_reset_rows(e, reset) for e in layers)
    lengths = jnp.where(reset, 0, lengths)
    net = KimiLM(model.cfg)
    _, layers = net.apply({"params": model.params}, tokens, layers, lengths, n_new, backend=backend)
    lengths = lengths + n_new

    def body(carry, _):
        lay, tok, pos = carry
        lg, lay = net.apply({"params": model.params}, tok[:, None], lay, pos, jnp.ones_like(pos), backend=backend)
        nxt = jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)
        return (lay, nxt, pos + 1), nxt

    drafts = jnp.zeros((tokens.shape[0], 0), jnp.int32)
    if k:
        _, drafts = jax.lax.scan(body, (layers, first, lengths), None, length=k)
        drafts = drafts.T
    return drafts, layers, lengths


class ModelDrafter:
    """A kimik3 model as the drafter. It holds a contiguous cache of `max_batch` rows, one per
    engine slot; `propose_batch` first feeds each slot the tokens committed since its last call
    (the whole prompt for a new request, `sync_chunk` tokens a call), then drafts greedily."""

    def __init__(self, model: Model, sync_chunk: int = 32, backend=None):
        self.model, self.sync_chunk, self.backend = model, sync_chunk, backend
        self.layers = self.lengths = None
        self.owner: list = []

    def check_target(self, cfg):
        if self.model.cfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model.cfg.vocab_size}) differs from the "
                             f"target's ({cfg.vocab_size}); a drafter must share the tokenizer")

    def propose_batch(self, rows: dict, k: int, max_batch: int, max_seq_len: int) -> dict:
        """rows: slot -> (request key, its tokens so far; the newest is the one to draft after)
        -> slot -> k draft tokens."""
        if self.layers is None:
            self.layers = init_cache(self.model.cfg, max_batch, max_seq_len).layers
            self.lengths, self.owner = np.zeros(max_batch, np.int32), [None] * max_batch
        reset = np.zeros(max_batch, bool)
        for s, (key, seq) in rows.items():
            if self.owner[s] != key or self.lengths[s] > len(seq) - 1:  # new request, or restarted
                self.owner[s], self.lengths[s], reset[s] = key, 0, True
        first = np.zeros(max_batch, np.int32)
        for s, (_, seq) in rows.items():
            first[s] = seq[-1]
        while True:
            tokens = np.zeros((max_batch, self.sync_chunk), np.int32)
            n_new = np.zeros(max_batch, np.int32)
            for s, (_, seq) in rows.items():
                todo = seq[self.lengths[s]:len(seq) - 1][:self.sync_chunk]
                tokens[s, :len(todo)], n_new[s] = todo, len(todo)
            done = all(self.lengths[s] + n_new[s] == len(seq) - 1 for s, (_, seq) in rows.items())
            drafts, self.layers, lengths = _sync_and_draft(
                self.model, self.layers, jnp.asarray(self.lengths), jnp.asarray(tokens), jnp.asarray(n_new),
                jnp.asarray(reset), jnp.asarray(first), k=k if done else 0, backend=self.backend)
            reset[:] = False
            self.lengths = np.array(lengths)
            if done:
                break
        drafts = np.asarray(drafts)
        return {s: [int(t) for t in drafts[s]] for s in rows}
