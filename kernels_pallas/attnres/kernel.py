"""AttnRes mix + RMSNorm as one Pallas kernel (Triton lowering).

Grid: token tiles. Program i reads its tokens' rows once each, in hidden slices of block_h (a
power of two; K3's 7168 = 7 x 1024, so no padded lanes): the bank rows, then the residual stream
s = residual + delta (added in fp32 and rounded to s's dtype, which equals the model's rounded
add: fp32 carries more than twice bf16's precision, so no double rounding). Each row's score
(its dot with c = g * w over its rms) feeds an online softmax, so the fp32 mixture accumulates in
registers and no row is read twice. The mixture is rounded to the model dtype (the reference's
rounding point), RMS-normalised, rounded again and multiplied by the gain, as the Kimi RMSNorm
does. Writes the normalised rows and, when an add happened, s: the persisted residual, which the
caller also freezes as a bank row at a block end. Rows past the token count are masked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._backend import triton_params

F32 = jnp.float32


def _kernel(*refs, n_bank, add, tokens, hidden, block_t, block_h, eps):
    bank = refs[:n_bank]
    stream = refs[n_bank:n_bank + 1 + add]  # the residual, then the pending delta if any
    c_ref, gain_ref, y_ref = refs[n_bank + 1 + add:n_bank + 4 + add]
    t0 = pl.program_id(0) * block_t
    mask = ((t0 + jnp.arange(block_t)) < tokens)[:, None]
    slices = [pl.ds(k * block_h, block_h) for k in range(hidden // block_h)]

    def load(ref):
        return [plgpu.load(ref.at[pl.ds(t0, block_t), h], mask=mask, other=0.0).astype(F32)
                for h in slices]

    def store(ref, chunks):
        for h, x in zip(slices, chunks):
            plgpu.store(ref.at[pl.ds(t0, block_t), h], x.astype(ref.dtype), mask=mask)

    s = load(stream[0])
    if add:
        s = [(a + b).astype(y_ref.dtype).astype(F32) for a, b in zip(s, load(stream[1]))]
        store(refs[-1], s)
    if n_bank:
        c = [c_ref[h].astype(F32)[None, :] for h in slices]

        def score(x):
            sumsq = sum(jnp.sum(v * v, axis=1) for v in x)
            dot = sum(jnp.sum(v * w, axis=1) for v, w in zip(x, c))
            return dot * jax.lax.rsqrt(sumsq / hidden + eps)

        acc = load(bank[0])  # online softmax over the rows: running max m, denominator den
        m = score(acc)
        den = jnp.ones_like(m)
        for j in range(1, n_bank + 1):
            x = load(bank[j]) if j < n_bank else s
            sj = score(x)
            m_new = jnp.maximum(m, sj)
            a, b = jnp.exp(m - m_new), jnp.exp(sj - m_new)
            den = den * a + b
            acc = [u * a[:, None] + b[:, None] * v for u, v in zip(acc, x)]
            m = m_new
        h = [(u / den[:, None]).astype(y_ref.dtype).astype(F32) for u in acc]
    else:
        h = s
    inv = jax.lax.rsqrt(sum(jnp.sum(v * v, axis=1) for v in h) / hidden + eps)[:, None]
    gain = [gain_ref[sl].astype(y_ref.dtype).astype(F32)[None, :] for sl in slices]
    store(y_ref, [g * (v * inv).astype(y_ref.dtype).astype(F32) for g, v in zip(gain, h)])


@functools.partial(jax.jit, static_argnames=("eps", "block_t", "block_h", "num_warps",
                                             "interpret"))
def attn_res_norm_pallas(bank, residual, delta, c, gain, *, eps, block_t, block_h, num_warps,
                         interpret=False):
    """bank: tuple of [T, H] rows; residual [T, H]; delta [T, H] or None; c [H] fp32; gain [H].
    Returns (y [T, H], s [T, H] or None when delta is None) in residual's dtype (promoted with
    delta's)."""
    T, H = residual.shape
    dtype = residual.dtype if delta is None else jnp.result_type(residual, delta)
    ins = list(bank) + [residual] + ([] if delta is None else [delta]) + [c, gain]
    outs = [jax.ShapeDtypeStruct((T, H), dtype)] * (1 if delta is None else 2)
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(_kernel, n_bank=len(bank), add=delta is not None, tokens=T,
                               hidden=H, block_t=block_t, block_h=block_h, eps=eps)
    res = pl.pallas_call(
        kernel, grid=(pl.cdiv(T, block_t),),
        in_specs=[full(x.shape) for x in ins], out_specs=[full(o.shape) for o in outs],
        out_shape=outs, compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interpret, name="attn_res_norm",
    )(*ins)
    return res[0], (res[1] if delta is not None else None)
