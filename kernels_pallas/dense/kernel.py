"""Skinny matmul as one Pallas kernel (Triton lowering): x [M, K] times a group of weights
[K, N_i] that share the input, one launch for the group.

Grid (row blocks, column tiles of every weight in turn). Row blocks vary fastest, so the programs
that read the same weight tile run together and all but the first find it in L2. A program
streams its weight tile down the whole K in block_k steps (software-pipelined loads) with the x
rows beside it, accumulates in fp32 and writes its tile in its output's dtype (x's, or fp32 for
the router's logits); rows past M and columns past N_i are masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import triton_params

F32 = jnp.float32


def _load(ref, mask):
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _kernel(x_ref, *refs, m, ns, starts, block_m, block_n, block_k, precision):
    n_w = len(ns)
    w_refs, o_refs = refs[:n_w], refs[n_w:]
    r0 = pl.program_id(0) * block_m
    tile = pl.program_id(1)
    row_ok = (r0 + jnp.arange(block_m, dtype=jnp.int32)) < m
    x_mask = None if m % block_m == 0 else row_ok[:, None]
    k = x_ref.shape[1]

    def product(w_ref, o_ref, n, n0):
        col_ok = (n0 + jnp.arange(block_n, dtype=jnp.int32)) < n
        w_mask = None if n % block_n == 0 else col_ok[None, :]

        def step(t, acc):
            k0 = pl.multiple_of(t * block_k, block_k)
            xb = _load(x_ref.at[pl.ds(r0, block_m), pl.ds(k0, block_k)], x_mask)
            wb = _load(w_ref.at[pl.ds(k0, block_k), pl.ds(n0, block_n)], w_mask)
            return acc + plgpu.dot(xb, wb, precision=precision)

        acc = jax.lax.fori_loop(0, k // block_k, step, jnp.zeros((block_m, block_n), F32))
        plgpu.store(o_ref.at[pl.ds(r0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])

    for i in range(n_w):
        @pl.when((tile >= starts[i]) & (tile < starts[i + 1]))
        def _(i=i):
            product(w_refs[i], o_refs[i], ns[i], (tile - starts[i]) * block_n)


@functools.partial(jax.jit, static_argnames=("out_dtypes", "block_m", "block_n", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def skinny_matmul_pallas(x, weights, *, out_dtypes, block_m, block_n, block_k, num_warps, num_stages,
                         interpret=False):
    """x [M, K]; weights: tuple of [K, N_i] in x's dtype -> tuple of [M, N_i] in out_dtypes (a
    tuple of dtype names)."""
    m, _ = x.shape
    ns = tuple(w.shape[1] for w in weights)
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + pl.cdiv(n, block_n))
    outs = [jax.ShapeDtypeStruct((m, n), jnp.dtype(dt)) for n, dt in zip(ns, out_dtypes)]
    precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None  # fp32: no TF32 passes
    name = f"skinny_matmul_m{m}_k{x.shape[1]}_n{sum(ns)}"  # by shape: a profile tells groups apart
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, m=m, ns=ns, starts=tuple(starts), block_m=block_m,
                               block_n=block_n, block_k=block_k, precision=precision)
    return tuple(pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), starts[-1]),
        in_specs=[full(x.shape)] + [full(w.shape) for w in weights],
        out_specs=[full(o.shape) for o in outs], out_shape=outs,
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=name,
    )(x, *weights))
