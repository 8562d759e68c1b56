"""Jitted copies between the engine's cache layers and the prefix cache: a slot's KDA state (a
checkpoint) out and back in, MLA pages out and back in, one page onto another (copy-on-write).
Page id arrays are padded to powers of two (pad ids point past the pool: dropped on write), so
each op compiles for a handful of shapes only."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def is_mla(entry) -> bool:
    return "latent" in entry


def padded_ids(ids, fill: int) -> jnp.ndarray:
    n = max(1, 1 << max(0, len(ids) - 1).bit_length())
    out = np.full(n, fill, np.int32)
    out[:len(ids)] = ids
    return jnp.asarray(out)


@jax.jit
def read_state(layers, slot):
    """The KDA recurrent + conv state of every KDA layer for one slot (a checkpoint); one device
    call (indexing each layer's arrays eagerly cost a dispatch per array, every checkpoint)."""
    return tuple({k: v[slot] for k, v in e.items()} for e in layers if not is_mla(e))


@functools.partial(jax.jit, donate_argnames=("layers",))
def write_state(layers, slot, ckpt):
    it = iter(ckpt)
    return tuple(e if is_mla(e) else {k: v.at[slot].set(c[k]) for c in [next(it)] for k, v in e.items()}
                 for e in layers)


@jax.jit
def read_pages(layers, ids):
    """Every MLA layer's latents at page ids [n] -> one array [mla layers, n, page, width] (one
    array, so a host copy moves in one transfer: each array a transfer costs its own overhead)."""
    return jnp.stack([e["latent"][ids] for e in layers if is_mla(e)])


@functools.partial(jax.jit, donate_argnames=("layers",))
def write_pages(layers, ids, data):
    """data: one read_pages result per group of ids (ids [groups * n]); ids past the pool are dropped."""
    merged = iter(jnp.concatenate(data, axis=1))
    return tuple({"latent": e["latent"].at[ids].set(next(merged), mode="drop")} if is_mla(e) else e
                 for e in layers)


@functools.partial(jax.jit, donate_argnames=("layers",))
def copy_page(layers, src, dst):
    return tuple({"latent": e["latent"].at[dst].set(e["latent"][src])} if is_mla(e) else e for e in layers)
