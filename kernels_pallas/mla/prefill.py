"""Causal variable-length MLA prefill attention in expanded form, without T x T scores.

q, k [B, T, H, 192] (nope 128 | rope 64), v [B, T, H, 128], lengths [B] int32: query i of
sequence b sees keys j <= i, j < lengths[b]; rows i >= lengths[b] come out 0 (lse -inf).
Returns o [B, T, H, 128] in q.dtype (and lse [B, T, H] fp32 with return_lse=True).

Entry point: ops.mla_prefill; blocks: tuning.PrefillConfig. Backends:
* "pallas" / "interpret": a flash-attention kernel (Triton lowering). Grid (query blocks, heads,
  batch); each program keeps o [block_q, 128] and the fp32 softmax state in registers and walks
  the key blocks up to min(its last query, length). 192 is not a power of two: the score is two
  dots (128 + 64). Shared memory per stage: block_k * (192 + 128) * 2 B (bf16) = 40 KiB at
  block_k 64; fits MI300X's 64 KiB with num_stages 1.
* "reference": a chunked plain-JAX online softmax (lax.scan over key chunks; memory O(T * chunk)).
`mla_prefill_reference` (reference.py) is the dense oracle used by the tests.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .softmax import online_softmax_step
from .._backend import triton_params

NOPE = 128
QK_ROPE = 64
QK_DIM = NOPE + QK_ROPE
V_DIM = 128
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _prefill_kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_q, block_k,
                    score_mult):
    qi = pl.program_id(0)
    b = pl.program_id(2)
    length = len_ref[b]
    q_start = qi * block_q
    q_a = q_ref[:, pl.ds(0, NOPE)]
    q_b = q_ref[:, pl.ds(NOPE, QK_ROPE)]
    qpos = q_start + jnp.arange(block_q, dtype=jnp.int32)
    kend = jnp.minimum(q_start + block_q, length)
    n_iter = jnp.maximum(lax.div(kend + (block_k - 1), block_k), 0)
    koffs = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry):
        acc, m_i, l_i = carry
        ks = pl.multiple_of(j * block_k, block_k)
        k_a = k_ref[pl.ds(ks, block_k), pl.ds(0, NOPE)]
        k_b = k_ref[pl.ds(ks, block_k), pl.ds(NOPE, QK_ROPE)]
        v = v_ref[pl.ds(ks, block_k), :]
        s = plgpu.dot(q_a, k_a, trans_b=True) + plgpu.dot(q_b, k_b, trans_b=True)
        s = s * score_mult
        kpos = ks + koffs
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < length)
        s = jnp.where(ok, s, -jnp.inf)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    acc0 = jnp.zeros((block_q, V_DIM), jnp.float32)
    m0 = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(0, n_iter, body, (acc0, m0, l0))
    has = (l_i > 0) & (qpos < length)
    l_safe = jnp.where(has, l_i, 1.0)
    o = jnp.where(has[:, None], acc / l_safe[:, None], 0.0)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret"))
def prefill_pallas(q, k, v, lengths, *, scale, block_q, block_k, num_warps, num_stages,
                        interpret):
    B, T, H, _ = q.shape
    blk = max(block_q, block_k)
    t_pad = -(-T // blk) * blk
    if t_pad != T:
        pad = ((0, 0), (0, t_pad - T), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    grid = (t_pad // block_q, H, B)
    kernel = functools.partial(_prefill_kernel, block_q=block_q, block_k=block_k,
                               score_mult=float(scale) * _LOG2E)
    o, lse = pl.pallas_call(
        kernel, grid=grid,
        in_specs=[
            pl.BlockSpec((B,), lambda i, h, b: (0,)),
            pl.BlockSpec((None, block_q, None, QK_DIM), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, t_pad, None, QK_DIM), lambda i, h, b: (b, 0, h, 0)),
            pl.BlockSpec((None, t_pad, None, V_DIM), lambda i, h, b: (b, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, V_DIM), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, h, b: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, t_pad, H, V_DIM), q.dtype),
                   jax.ShapeDtypeStruct((B, H, t_pad), jnp.float32)],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="mla_prefill",
    )(lengths.astype(jnp.int32), q, k, v)
    return o[:, :T], jnp.swapaxes(lse[:, :, :T], 1, 2)


@functools.partial(jax.jit, static_argnames=("scale", "chunk"))
def mla_prefill_chunked(q, k, v, lengths, *, scale, chunk: int = 512):
    """Plain-JAX causal attention with an online softmax over key chunks (no T x T scores)."""
    B, T, H, _ = q.shape
    chunk = min(chunk, T)
    t_pad = -(-T // chunk) * chunk
    pad = ((0, 0), (0, t_pad - T), (0, 0), (0, 0))
    kp, vp = jnp.pad(k, pad), jnp.pad(v, pad)
    nc = t_pad // chunk
    kc = jnp.moveaxis(kp.reshape(B, nc, chunk, H, -1), 1, 0)
    vc = jnp.moveaxis(vp.reshape(B, nc, chunk, H, -1), 1, 0)
    qf = q.astype(jnp.float32)
    qpos = jnp.arange(T)
    L = lengths.astype(jnp.int32)

    def step(carry, xs):
        acc, m_i, l_i = carry
        kb, vb, c = xs
        s = jnp.einsum("bihd,bjhd->bhij", qf, kb.astype(jnp.float32),
                       precision=lax.Precision.HIGHEST) * scale
        kpos = c * chunk + jnp.arange(chunk)
        ok = (kpos[None, :] <= qpos[:, None])[None, None] & (kpos < L[:, None])[:, None, None, :]
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m_i - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l_new = l_i * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bhij,bjhd->bhid", p, vb.astype(jnp.float32),
                                                   precision=lax.Precision.HIGHEST)
        return (acc, m_new, l_new), None

    init = (jnp.zeros((B, H, T, v.shape[-1]), jnp.float32),
            jnp.full((B, H, T), -jnp.inf, jnp.float32), jnp.zeros((B, H, T), jnp.float32))
    (acc, m_i, l_i), _ = lax.scan(step, init, (kc, vc, jnp.arange(nc)))
    has = (l_i > 0) & (qpos[None, None, :] < L[:, None, None])
    l_safe = jnp.where(has, l_i, 1.0)
    o = jnp.where(has[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(has, m_i + jnp.log(l_safe), -jnp.inf)
    return jnp.swapaxes(o, 1, 2).astype(q.dtype), jnp.swapaxes(lse, 1, 2)
