"""Exact merge of the flash-decoding splits as one Pallas kernel (Triton lowering).

`merge_stacked` (reference.py, the plain-JAX definition) does the same math; XLA runs it as
several small kernels (maximum, exponentials, two reductions, divisions, selects), a visible
share of a batch-1 decode next to the attention kernel; here it is one launch (BENCHMARKS.md,
MLA decode).

Grid (column blocks, rows, batch): program (c, r, b) reads the S split lses of row r (masked to
a power of two), forms the weights w_s = exp(lse_s - max) / sum, then sums w_s * o_s[:, cols]
over S in chunks of `s_chunk` splits (re-reading the chunk's lses: Triton cannot slice a
register vector at a runtime offset). Empty splits (lse = -inf) weigh 0; a row with no keys at
all gets o = 0 and lse = -inf, as in merge_stacked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import triton_params


# Splits the merge reads in one load; each further chunk is another dependent load, so the split
# policy (tuning.choose_num_splits) stays within one chunk.
MERGE_CHUNK = 128


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _merge_kernel(lse_ref, o_ref, out_ref, lse_out_ref, *, n_splits: int, s_pad: int,
                  s_chunk: int, block_d: int):
    c = pl.program_id(0)
    r = pl.program_id(1)
    b = pl.program_id(2)
    sidx = jnp.arange(s_pad, dtype=jnp.int32)
    cols = pl.ds(c * block_d, block_d)
    lse = plgpu.load(lse_ref.at[b, pl.ds(0, s_pad), r], mask=sidx < n_splits, other=-jnp.inf)
    if s_pad <= s_chunk:
        # All splits in one tile: o is requested next to the lses, before any arithmetic waits
        # for them, so the program pays one memory latency instead of two.
        o_all = plgpu.load(o_ref.at[b, pl.ds(0, s_pad), r, cols],
                           mask=(sidx < n_splits)[:, None], other=0.0)
    m = jnp.max(lse)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w_all = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - m_safe))
    wsum = jnp.sum(w_all)
    inv = jnp.where(wsum > 0, 1.0 / jnp.where(wsum > 0, wsum, 1.0), 0.0)
    coff = jnp.arange(s_chunk, dtype=jnp.int32)

    def body(i, acc):
        s0 = i * s_chunk
        ok = (s0 + coff) < n_splits
        lc = plgpu.load(lse_ref.at[b, pl.ds(s0, s_chunk), r], mask=ok, other=-jnp.inf)
        w = jnp.where(lc == -jnp.inf, 0.0, jnp.exp(lc - m_safe))
        oc = plgpu.load(o_ref.at[b, pl.ds(s0, s_chunk), r, cols], mask=ok[:, None], other=0.0)
        return acc + jnp.sum(w[:, None] * oc.astype(jnp.float32), axis=0)

    if s_pad <= s_chunk:
        acc = jnp.sum(w_all[:, None] * o_all.astype(jnp.float32), axis=0)
    else:
        acc = lax.fori_loop(0, -(-n_splits // s_chunk), body,
                            jnp.zeros((block_d,), jnp.float32))
    out_ref[b, r, cols] = (acc * inv).astype(out_ref.dtype)

    @pl.when(c == 0)
    def _():
        lse_out_ref[b, r] = jnp.where(wsum > 0, m_safe + jnp.log(jnp.where(wsum > 0, wsum, 1.0)),
                                      -jnp.inf)


@functools.partial(jax.jit, static_argnames=("rows", "out_dtype", "interpret", "block_d",
                                             "s_chunk", "num_warps"))
def merge_splits_pallas(o_part, lse_part, *, rows: int, out_dtype, interpret: bool = False,
                        block_d: int | None = None, s_chunk: int = MERGE_CHUNK,
                        num_warps: int = 4):
    """o_part [B, S, R, D] (fp32, or bf16: read as it is, summed in fp32) and lse_part [B, S, R]
    fp32 (natural log) -> (o [B, rows, D] in out_dtype, lse [B, rows] fp32), merging over S; only
    the first `rows` of R are merged (the rest is the decode kernel's row padding).

    Narrow column blocks and whole split ranges per load (up to 128 splits at once: a [128, 32]
    fp32 tile, 32 registers a thread at 4 warps): at batch 1 the merge is a few hundred programs
    of one or two dependent loads each. block_d None: as wide as keeps a program's tile at 4096
    values (min(S, s_chunk) rounded up to a power of two, times block_d), between 32 and D, so
    that few splits (2-16) do not make B x rows x 16 programs of a few values each."""
    B, S, R, D = o_part.shape
    if block_d is None:
        block_d = max(32, min(D, 4096 // min(_next_pow2(S), s_chunk)))
    if D % block_d:
        raise ValueError(f"feature dim {D} is not a multiple of block_d={block_d}")
    s_pad = _next_pow2(S)
    s_chunk = min(s_chunk, s_pad)
    kernel = functools.partial(_merge_kernel, n_splits=S, s_pad=s_pad, s_chunk=s_chunk,
                               block_d=block_d)
    full = lambda shape: pl.BlockSpec(shape, lambda c, r, b: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        kernel, grid=(D // block_d, rows, B),
        in_specs=[full((B, S, R)), full((B, S, R, D))],
        out_specs=[full((B, rows, D)), full((B, rows))],
        out_shape=[jax.ShapeDtypeStruct((B, rows, D), out_dtype),
                   jax.ShapeDtypeStruct((B, rows), jnp.float32)],
        compiler_params=triton_params(num_warps=num_warps, num_stages=2),
        interpret=interpret, name="mla_merge_splits",
    )(lse_part.astype(jnp.float32), o_part)
