"""The router's expert choice as one Pallas kernel (Triton lowering): per token, the k experts of
highest choice = score + bias and their unbiased scores.

XLA runs `jax.lax.top_k` over a decode step's few rows of 896 experts as a segmented radix sort,
several launches costing more than the router matmul. Here a program takes one row whole (the
experts padded to a power of two with -inf) and picks k times: the row's largest choice, then its
lowest index among equals (`jax.lax.top_k`'s order for ties), which it masks out: two reductions
a pick; the scores are read at the k ids after the loop, one gather. Ids and scores are those of
`top_k` plus `take_along_axis` exactly: no arithmetic touches a score, and the only sum is the
fp32 add of the bias that the reference does too.

One row a program: a block of 16 rows (16 x 1024 fp32 choices and scores in 128 threads'
registers) spilled, and made a 16-row decode step's routing many times slower than XLA's sort.
Past MAX_ROWS (decode batches) XLA's sort takes over, for prefill's thousands of rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import resolve_backend, triton_params

F32 = jnp.float32
MAX_ROWS = 64
NUM_WARPS = 4  # the fastest of 1-8 on the GPU (`python -m benchmarks moe --sections router`)


def top_k_scores_reference(scores, bias, k: int):
    """(ids [N, k] int32 of the k largest scores + bias, in top_k's order; scores [N, k] at them)."""
    _, idx = jax.lax.top_k(scores + bias, k)
    return idx, jnp.take_along_axis(scores, idx, axis=-1)


def _kernel(s_ref, b_ref, idx_ref, w_ref, *, e, e_pad, k, k_pad):
    r0 = pl.program_id(0)
    col = jnp.arange(e_pad, dtype=jnp.int32)
    col_ok = col < e
    scores = plgpu.load(s_ref.at[r0, pl.ds(0, e_pad)], mask=col_ok, other=0.0)
    bias = plgpu.load(b_ref.at[pl.ds(0, e_pad)], mask=col_ok, other=0.0)
    choice = jnp.where(col_ok, scores + bias, -jnp.inf)
    slot = jnp.arange(k_pad, dtype=jnp.int32)
    ids = jnp.zeros((k_pad,), jnp.int32)
    for j in range(k):
        pick = jnp.min(jnp.where(choice == jnp.max(choice), col, e_pad))
        ids = jnp.where(slot == j, pick, ids)
        choice = jnp.where(col == pick, -jnp.inf, choice)
    # slots past k hold id 0, a valid column; their values are not stored
    plgpu.store(idx_ref.at[r0, pl.ds(0, k_pad)], ids, mask=slot < k)
    plgpu.store(w_ref.at[r0, pl.ds(0, k_pad)], s_ref[r0, ids], mask=slot < k)


@functools.partial(jax.jit, static_argnames=("k", "num_warps", "interpret"))
def _top_k_scores_pallas(scores, bias, *, k, num_warps, interpret=False):
    n, e = scores.shape
    e_pad, k_pad = pl.next_power_of_2(e), pl.next_power_of_2(k)
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, e=e, e_pad=e_pad, k=k, k_pad=k_pad)
    outs = [jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), F32)]
    return tuple(pl.pallas_call(
        kernel, grid=(n,), in_specs=[full(scores.shape), full(bias.shape)],
        out_specs=[full(o.shape) for o in outs], out_shape=outs,
        compiler_params=triton_params(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="route_top_k",
    )(scores, bias))


def top_k_scores(scores, bias, k: int, *, backend: str | None = None, num_warps: int = NUM_WARPS):
    """The router's choice: scores [N, E] fp32 (the unbiased expert scores), bias [E] fp32 (the
    correction bias, which only selects) -> (ids [N, k] int32 of the k largest scores + bias, in
    `jax.lax.top_k`'s order, ties to the lower id; the scores at them [N, k]). Bitwise the same on
    every backend. The kernel takes up to MAX_ROWS rows; more go to XLA's top_k."""
    backend = resolve_backend(backend)
    if scores.ndim != 2 or bias.shape != scores.shape[-1:] or not 0 < k <= scores.shape[-1]:
        raise ValueError(f"top_k_scores takes scores [N, E], bias [E] and 0 < k <= E; got "
                         f"{scores.shape}, {bias.shape}, k={k}")
    if backend == "reference" or not 0 < scores.shape[0] <= MAX_ROWS:
        return top_k_scores_reference(scores, bias, k)
    return _top_k_scores_pallas(scores.astype(F32), bias.astype(F32), k=k, num_warps=num_warps,
                                interpret=backend == "interpret")
