"""The model as jitted pure functions: forward (no cache), extend (prefill / chunked prefill /
decode / verify into a cache), and the checks that turn bad input into clear errors before jit.

`forward`, `extend`, `prefill` (given a token array) and `decode_step` are traceable: they can be
called inside `jax.jit` (and `forward` inside `jax.vmap` over tokens, and `jax.grad` with respect
to float weights). Values (token ids inside the
vocabulary, lengths within the cache) are checked on the host when the inputs are concrete; under
tracing only shapes and dtypes are checked, and the values are the caller's responsibility.
"""
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


def is_traced(x) -> bool:
    """True for an abstract value inside jit / vmap / grad (its values are not known)."""
    return isinstance(x, jax.core.Tracer)


def check_tokens(cfg, tokens, what="tokens"):
    """Raise a ValueError naming the first out-of-vocabulary id and where it is; a traced array
    is returned as it is once its dtype is an integer one."""
    if is_traced(tokens):
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{what} must be integer token ids, got dtype {tokens.dtype}")
        return tokens
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


@functools.cache
def _forward_rows(backend):
    """_forward for one backend, vmappable over tokens: rows of a cache-free pass are independent,
    so a vmapped batch axis is folded into the rows (the MoE's ragged_dot has no batching rule).
    custom_vmap alone cannot be differentiated, so a custom_vjp around it takes the gradient of
    the plain pass."""

    @jax.custom_batching.custom_vmap
    def rows(model, tokens):
        return _forward(model, tokens, backend=backend)

    @rows.def_vmap
    def _fold(axis_size, in_batched, model, tokens):
        if any(jax.tree.leaves(in_batched[0])):
            raise ValueError("jax.vmap over kimik3.forward maps over tokens only: use in_axes=(None, 0)")
        if not in_batched[1]:
            tokens = jnp.broadcast_to(tokens, (axis_size,) + tokens.shape)
        N, B, T = tokens.shape
        return rows(model, tokens.reshape(N * B, T)).reshape(N, B, T, -1), True

    @jax.custom_vjp
    def forward_rows(model, tokens):
        return rows(model, tokens)

    def fwd(model, tokens):
        return rows(model, tokens), (model, tokens)

    def bwd(res, ct):
        model, tokens = res
        _, vjp = jax.vjp(lambda m: _forward(m, tokens, backend=backend), model)
        return vjp(ct)[0], np.zeros(tokens.shape, jax.dtypes.float0)

    forward_rows.defvjp(fwd, bwd)
    return forward_rows


def forward(model: Model, tokens, backend=None):
    """int32 [B, T] -> float32 logits [B, T, vocab]; a causal pass with no cache.

    Traceable: `jax.jit(kimik3.forward)(model, tokens)`, `jax.vmap(kimik3.forward, in_axes=(None, 0))`
    over tokens [N, B, T], and `jax.grad` with respect to float weights."""
    arr = check_tokens(model.cfg, tokens)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"forward needs tokens of shape [batch, length>0], got {arr.shape}")
    with mesh_context(run_mesh(model)):
        return _forward_rows(backend)(model, jnp.asarray(arr, jnp.int32))


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
    Traceable (under jit the lengths are not checked against the cache size).
    """
    arr = check_tokens(model.cfg, tokens)
    if arr.ndim != 2:
        raise ValueError(f"extend needs tokens of shape [batch, length], got {arr.shape}")
    B, T = arr.shape
    if B != cache.batch:
        raise ValueError(f"tokens have batch {B} but the cache holds {cache.batch} rows")
    if n_new is None:
        n = np.full((B,), T, np.int32)
    elif is_traced(n_new):
        n = n_new.astype(jnp.int32)
    else:
        n = np.asarray(n_new, np.int32)
    if n.shape != (B,) or not (is_traced(n) or ((n >= 0).all() and (n <= T).all())):
        raise ValueError(f"n_new must be [B] ints in [0, {T}], got {n}")
    if not (is_traced(n) or is_traced(cache.lengths)):
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


def prefill(model: Model, prompts, max_seq_len: int, backend=None, mesh=None, dcp_axes=(), lengths=None):
    """Prefill prompts into a fresh cache; returns (last-token logits [B, V], cache).

    `prompts`: a list of prompts (lists of ids, different lengths), padded to a length bucket so
    each bucket compiles once; or an int array [B, T] of right-padded prompts with `lengths` [B]
    (default: T each), the traceable form (`jax.jit(prefill, static_argnames="max_seq_len")`).
    """
    if hasattr(prompts, "ndim"):
        tokens = check_tokens(model.cfg, prompts, "prompts")
        if tokens.ndim != 2 or 0 in tokens.shape:
            raise ValueError(f"prefill needs prompts of shape [batch>0, length>0], got {tokens.shape}")
        B, T = tokens.shape
        if T > max_seq_len:
            raise ValueError(f"prompts have {T} positions, more than max_seq_len={max_seq_len}")
        lens = np.full((B,), T, np.int32) if lengths is None else lengths
        if not is_traced(lens):
            lens = np.asarray(lens, np.int32)
            if lens.shape != (B,) or (lens < 1).any() or (lens > T).any():
                raise ValueError(f"lengths must be [{B}] ints in [1, {T}], got {lens}")
    else:
        tokens, lens = _pad_prompts(model.cfg, prompts, max_seq_len)
    cache = init_cache(model.cfg, tokens.shape[0], max_seq_len, mesh=mesh, dcp_axes=dcp_axes)
    logits, cache = extend(model, cache, tokens, lens, backend=backend)
    last = jnp.take_along_axis(logits, (jnp.asarray(lens) - 1)[:, None, None], axis=1)[:, 0]
    return last, cache


def _pad_prompts(cfg, prompts, max_seq_len):
    """Ragged prompts -> (tokens [B, bucket] right-padded with the pad id, lengths [B])."""
    lens = np.array([len(p) for p in prompts], np.int32)
    if len(prompts) == 0:
        raise ValueError("prefill needs at least one prompt")
    if (lens == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lens))} is empty; every prompt needs at least one token")
    if lens.max() > max_seq_len:
        b = int(np.argmax(lens))
        raise ValueError(f"prompt {b} has {int(lens[b])} tokens, more than max_seq_len={max_seq_len}")
    T = min(bucket(lens.max()), max_seq_len)
    tokens = np.full((len(prompts), T), cfg.pad_token_id or 0, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = check_tokens(cfg, p, f"prompt {b}")
    return tokens, lens


def decode_step(model: Model, cache: Cache, tokens, active=None, backend=None):
    """One new token per row: tokens [B] -> (logits [B, V], cache). Inactive rows stay unchanged.
    Traceable."""
    B = cache.batch
    n = np.ones((B,), np.int32) if active is None else active
    tokens = jnp.reshape(tokens, (B, 1)) if is_traced(tokens) else np.asarray(tokens, np.int32).reshape(B, 1)
    logits, cache = extend(model, cache, tokens, n, backend=backend)
    return logits[:, 0], cache
