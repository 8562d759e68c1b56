"""The model as jitted pure functions: forward (no cache), extend (prefill / chunked prefill /
decode / verify into a cache), and the checks that turn bad input into clear errors before jit."""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .model import Cache, KimiLM, Model, init_cache

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """Padded length for n tokens: powers of two from MIN_BUCKET (one compilation per bucket)."""
    return max(MIN_BUCKET, 1 << max(0, int(n) - 1).bit_length())


def check_tokens(cfg, tokens, what="tokens"):
    """Raise a ValueError naming the first out-of-vocabulary id and where it is."""
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integer token ids, got dtype {arr.dtype}")
    bad = np.argwhere((arr < 0) | (arr >= cfg.vocab_size))
    if bad.size:
        pos = tuple(int(i) for i in bad[0])
        raise ValueError(f"{what}: token id {int(arr[pos])} at position {pos} is outside the vocabulary "
                         f"[0, {cfg.vocab_size}) of model {cfg.name!r}")
    return arr


@functools.partial(jax.jit, static_argnames=("backend",))
def _forward(model: Model, tokens, backend=None):
    return KimiLM(model.cfg).apply({"params": model.params}, tokens, backend=backend)[0]


def forward(model: Model, tokens, backend=None):
    """int32 [B, T] -> float32 logits [B, T, vocab]; a causal pass with no cache."""
    arr = check_tokens(model.cfg, tokens)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"forward needs tokens of shape [batch, length>0], got {arr.shape}")
    with mesh_context(run_mesh(model)):
        return _forward(model, jnp.asarray(arr, jnp.int32), backend=backend)


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("cache",))
def _extend(model: Model, cache: Cache, tokens, n_new, backend=None):
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens, cache.layers,
                                             cache.lengths, n_new, backend=backend,
                                             page_table=cache.page_table, dcp_axes=cache.dcp_axes)
    return logits, cache.replace(lengths=cache.lengths + n_new, layers=layers)


def extend(model: Model, cache: Cache, tokens, n_new=None, backend=None):
    """Append tokens [B, T] to each row of the cache (row b takes its first n_new[b]).

    Returns (logits [B, T, V], cache). The passed cache is donated (reuse the returned one).
    Prefill is extend on an empty cache, chunked prefill is repeated extends, decode is T = 1.
    """
    arr = check_tokens(model.cfg, tokens)
    B, T = arr.shape
    if B != cache.batch:
        raise ValueError(f"tokens have batch {B} but the cache holds {cache.batch} rows")
    n = np.full((B,), T, np.int32) if n_new is None else np.asarray(n_new, np.int32)
    if n.shape != (B,) or (n < 0).any() or (n > T).any():
        raise ValueError(f"n_new must be [B] ints in [0, {T}], got {n}")
    lengths = np.asarray(cache.lengths)
    over = np.nonzero(lengths + n > cache.max_seq_len)[0]
    if over.size:
        b = int(over[0])
        raise ValueError(f"row {b}: {int(lengths[b])} cached + {int(n[b])} new tokens exceed the cache's "
                         f"max_seq_len {cache.max_seq_len}; allocate a larger cache")
    with mesh_context(run_mesh(model, cache)):
        return _extend(model, cache, jnp.asarray(arr, jnp.int32), jnp.asarray(n), backend=backend)


def mesh_context(mesh):
    """The ambient mesh the sharded cache's attention and the MoE's shard_map run under (a no-op
    without one)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def run_mesh(model: Model, cache: Cache | None = None):
    """The mesh a call runs under: the cache's, else the one the weights are placed on (None: the
    weights are on one device)."""
    if cache is not None and cache.mesh is not None:
        return cache.mesh
    leaves = jax.tree.leaves(model.params)
    sharding = getattr(leaves[0], "sharding", None) if leaves else None
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


def prefill(model: Model, prompts, max_seq_len: int, backend=None, mesh=None, dcp_axes=()):
    """Prefill a batch of prompts (lists of ids, different lengths) into a fresh cache.

    Pads to a length bucket so each bucket compiles once. Returns (last-token logits [B, V], cache).
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    if len(prompts) == 0:
        raise ValueError("prefill needs at least one prompt")
    if (lens == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lens))} is empty; every prompt needs at least one token")
    if lens.max() > max_seq_len:
        b = int(np.argmax(lens))
        raise ValueError(f"prompt {b} has {int(lens[b])} tokens, more than max_seq_len={max_seq_len}")
    T = min(bucket(lens.max()), max_seq_len) if max_seq_len >= lens.max() else lens.max()
    pad = model.cfg.pad_token_id or 0
    tokens = np.full((len(prompts), T), pad, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = check_tokens(model.cfg, p, f"prompt {b}")
    cache = init_cache(model.cfg, len(prompts), max_seq_len, mesh=mesh, dcp_axes=dcp_axes)
    logits, cache = extend(model, cache, tokens, lens, backend=backend)
    last = jnp.take_along_axis(logits, jnp.asarray(lens - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


def decode_step(model: Model, cache: Cache, tokens, active=None, backend=None):
    """One new token per row: tokens [B] -> (logits [B, V], cache). Inactive rows stay unchanged."""
    B = cache.batch
    n = np.ones((B,), np.int32) if active is None else np.asarray(active, np.int32)
    logits, cache = extend(model, cache, np.asarray(tokens, np.int32).reshape(B, 1), n, backend=backend)
    return logits[:, 0], cache
