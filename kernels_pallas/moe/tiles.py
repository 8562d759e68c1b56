"""The row-tile plan of the grouped matmul: which rows of which group each program computes.

`tile_metadata` (plain JAX) is the definition: [3, T] int32 (group, row start, row end) per tile,
T = `tile_slots(M, G, block_m)` = cdiv(M, block_m) + min(G, M): at most min(G, M) groups hold
rows, so a decode step's 16 rows over 896 experts plan 17 slots, not 897 (the matmul's grid has
a program per slot and column block; empty slots still launch). XLA runs it as several small
kernels (reductions, a gather and a select); `tile_plan` computes the same table in one Pallas launch (Triton lowering), which the
kernel path runs. Each of its programs rebuilds the per-group sums on its own (G is at most ~1k:
two cumsums of G + 1 values) and fills `_CHUNK` tiles, so no program waits for another; Triton
has no register gather, so a tile's group values are masked sums over the groups.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params


def group_tiles(gs, block_m: int, tail: int = 0):
    """Row tiles of groups of gs rows: cdiv(gs, block_m), or with `tail` > 0 the group's last
    tile also takes up to `tail` rows past block_m (a group of block_m + tail rows or fewer is
    one tile), never more tiles than cdiv(gs, block_m)."""
    if not tail:
        return (gs + block_m - 1) // block_m
    return jnp.where(gs > 0, (jnp.maximum(gs - tail, 1) + block_m - 1) // block_m, 0)


def tile_slots(m: int, g: int, block_m: int) -> int:
    """Static bound on the row tiles of M rows in G groups: each non-empty group (at most
    min(G, M)) adds at most one partial tile to the cdiv(M, block_m) full ones."""
    return pl.cdiv(m, block_m) + min(g, m)


def _inclusive_cumsum(v):
    """Inclusive cumsum along the last axis as one masked reduction (O(n^2) work, n <= ~1k here):
    on the GPU one fused kernel, where jnp.cumsum becomes a chain of reduce-window kernels."""
    n = v.shape[-1]
    tri = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]  # [i, j]: j <= i
    return jnp.sum(jnp.where(tri, v[..., None, :], 0), axis=-1)


def tile_metadata(group_sizes, m: int, block_m: int, tail: int = 0):
    """[3, T] int32: (group, row start, row end) of each row tile; T = `tile_slots(M, G, block_m)`.
    tail > 0: a group's last tile holds up to block_m + tail rows (`group_tiles`; the zero
    group's tiles stay within block_m).

    group == G marks a tile of the rows past sum(group_sizes) (written as zeros); group == -1 marks
    an unused slot. Groups past row M (sum(group_sizes) > M breaks the contract) are clipped:
    their tiles past M are unused slots.
    """
    g = group_sizes.shape[0]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    n_tiles = tile_slots(m, g, block_m)
    cum = _inclusive_cumsum(jnp.stack([gs, group_tiles(gs, block_m, tail)]))  # [2, G]
    row_end = jnp.minimum(cum[0], m)
    row_start = jnp.minimum(cum[0] - gs, m)
    zero_rows = m - (row_end[-1] if g else jnp.int32(0))  # the zero group after the last
    tile_end = jnp.concatenate([cum[1], (cum[1, -1:] if g else jnp.zeros((1,), jnp.int32))
                                + (zero_rows + block_m - 1) // block_m])  # [G + 1]
    tiles_x = jnp.concatenate([group_tiles(gs, block_m, tail),
                               ((zero_rows + block_m - 1) // block_m)[None]])
    starts_x = jnp.concatenate([row_start, (m - zero_rows)[None]])
    ends_x = jnp.concatenate([row_end, jnp.full((1,), m, jnp.int32)])
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.sum(tile_end[None, :] <= t[:, None], axis=1, dtype=jnp.int32)  # searchsorted, right
    gc = jnp.minimum(grp, g)
    first = tile_end[gc] - tiles_x[gc]
    start = starts_x[gc] + (t - first) * block_m
    end = jnp.minimum(start + block_m, ends_x[gc])
    if tail:  # a group's last tile runs to the group's end (<= block_m + tail rows)
        end = jnp.where(t == tile_end[gc] - 1, ends_x[gc], end)
    valid = (grp <= g) & (end > start)
    return jnp.stack([jnp.where(valid, gc, -1), jnp.where(valid, start, 0),
                      jnp.where(valid, end, 0)]).astype(jnp.int32)


_CHUNK = 4  # tiles per program ([4, G] compares and masked sums)
_WARPS = 4


def _tiles_kernel(gs_ref, o_ref, *, g: int, m: int, block_m: int, gp: int, n_tiles: int,
                  chunk: int, tail: int):
    from jax.experimental.pallas import triton as plgpu

    i = jnp.arange(gp, dtype=jnp.int32)  # group index; index g is the zero group
    gs = jnp.maximum(plgpu.load(gs_ref.at[pl.ds(0, gp)], mask=i < g, other=0), 0)
    cum = jnp.cumsum(gs)
    zero_rows = m - jnp.minimum(jnp.sum(gs), m)  # the rows past sum(group_sizes)
    tiles = jnp.where(i < g, group_tiles(gs, block_m, tail),
                      jnp.where(i == g, (zero_rows + block_m - 1) // block_m, 0))
    tile_end = jnp.cumsum(tiles)
    starts = jnp.where(i == g, m - zero_rows, jnp.minimum(cum - gs, m))
    ends = jnp.where(i == g, m, jnp.minimum(cum, m))
    t = pl.program_id(0) * chunk + jnp.arange(chunk, dtype=jnp.int32)
    grp = jnp.sum(((tile_end[None, :] <= t[:, None]) & (i[None, :] <= g)).astype(jnp.int32),
                  axis=1)  # searchsorted, right
    gc = jnp.minimum(grp, g)
    sel = gc[:, None] == i[None, :]

    def pick(v):  # v[gc] per tile, as a masked sum (no register gather in Triton)
        return jnp.sum(jnp.where(sel, v[None, :], 0), axis=1)

    start = pick(starts) + (t - pick(tile_end - tiles)) * block_m
    end = jnp.minimum(start + block_m, pick(ends))
    if tail:  # a group's last tile runs to the group's end (group_tiles)
        end = jnp.where(t == pick(tile_end) - 1, pick(ends), end)
    valid = (grp <= g) & (end > start)
    in_range = t < n_tiles
    for row, val in enumerate((jnp.where(valid, gc, -1), jnp.where(valid, start, 0),
                               jnp.where(valid, end, 0))):
        plgpu.store(o_ref.at[jnp.int32(row), pl.ds(pl.program_id(0) * chunk, chunk)], val,
                    mask=in_range)


@functools.partial(jax.jit, static_argnames=("m", "block_m", "interpret", "chunk", "warps",
                                             "tail"))
def tile_plan(group_sizes, m: int, block_m: int, interpret: bool = False, chunk: int = 0,
              warps: int = 0, tail: int = 0):
    """`tile_metadata(group_sizes, m, block_m, tail)` in one Pallas launch (equal, tested).
    chunk / warps: tiles per program and warps (0: the defaults)."""
    chunk, warps = chunk or _CHUNK, warps or _WARPS
    g = group_sizes.shape[0]
    n_tiles = tile_slots(m, g, block_m)
    gp = max(16, pl.next_power_of_2(g + 1))
    kernel = functools.partial(_tiles_kernel, g=g, m=m, block_m=block_m, gp=gp, n_tiles=n_tiles,
                               chunk=chunk, tail=tail)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((3, n_tiles), jnp.int32),
        grid=(pl.cdiv(n_tiles, chunk),),
        compiler_params=triton_params(warps, 1),
        interpret=interpret,
        name="moe_gmm_tiles",
    )(group_sizes.astype(jnp.int32))
