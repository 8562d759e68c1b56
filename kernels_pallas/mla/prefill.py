"""Causal variable-length MLA prefill attention in expanded form, without T x T scores.

q [B, T, H, 192] (nope 128 | rope 64), k [B, S, H, 192], v [B, S, H, 128], lengths [B] int32:
query i of sequence b sees keys j <= i, j < lengths[b]; rows i >= lengths[b] come out 0 (lse
-inf). Returns o [B, T, H, 128] in q.dtype (and lse [B, T, H] fp32 with return_lse=True).
A chunk of a longer sequence: `starts` [B] puts query i at position starts[b] + i and
`key_start` (a traced scalar) key j at key_start + j; query i then sees the keys at positions
<= its own and < starts[b] + lengths[b] (a prefill chunk over its cached history, one key chunk
at a time, the chunks' (o, lse) merged by the caller). Without them S = T and both start at 0.

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


def _prefill_kernel(len_ref, qstart_ref, kstart_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    block_q, block_k, score_mult, n_keys):
    qi = pl.program_id(0)
    b = pl.program_id(2)
    length = len_ref[b]                   # queries of the row; keys at positions < end exist
    q0, k0 = qstart_ref[b], kstart_ref[0]  # positions of query 0 and key 0
    end = q0 + length
    q_start = qi * block_q
    q_a = q_ref[:, pl.ds(0, NOPE)]
    q_b = q_ref[:, pl.ds(NOPE, QK_ROPE)]
    rows = q_start + jnp.arange(block_q, dtype=jnp.int32)
    qpos = q0 + rows
    kend = jnp.clip(jnp.minimum(q0 + q_start + block_q, end) - k0, 0, n_keys)  # keys to visit
    n_iter = lax.div(kend + (block_k - 1), block_k)
    koffs = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry):
        acc, m_i, l_i = carry
        ks = pl.multiple_of(j * block_k, block_k)
        k_a = k_ref[pl.ds(ks, block_k), pl.ds(0, NOPE)]
        k_b = k_ref[pl.ds(ks, block_k), pl.ds(NOPE, QK_ROPE)]
        v = v_ref[pl.ds(ks, block_k), :]
        s = plgpu.dot(q_a, k_a, trans_b=True) + plgpu.dot(q_b, k_b, trans_b=True)
        s = s * score_mult
        kpos = k0 + ks + koffs
        ok = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < end) & (ks + koffs < n_keys)[None, :]
        s = jnp.where(ok, s, -jnp.inf)
        p, alpha, m_new, l_new = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    acc0 = jnp.zeros((block_q, V_DIM), jnp.float32)
    m0 = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(0, n_iter, body, (acc0, m0, l0))
    has = (l_i > 0) & (rows < length)
    l_safe = jnp.where(has, l_i, 1.0)
    o = jnp.where(has[:, None], acc / l_safe[:, None], 0.0)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * _LN2, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps",
                                             "num_stages", "interpret", "out_dtype"))
def prefill_pallas(q, k, v, lengths, starts=None, key_start=None, *, scale, block_q, block_k,
                   num_warps, num_stages, interpret, out_dtype=None):
    B, T, H, _ = q.shape
    S = k.shape[1]
    blk = max(block_q, block_k)
    t_pad, s_pad = -(-T // blk) * blk, -(-S // blk) * blk
    if t_pad != T:
        q = jnp.pad(q, ((0, 0), (0, t_pad - T), (0, 0), (0, 0)))
    if s_pad != S:
        pad = ((0, 0), (0, s_pad - S), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    starts = jnp.zeros((B,), jnp.int32) if starts is None else starts.astype(jnp.int32)
    key_start = jnp.zeros((1,), jnp.int32) if key_start is None else jnp.reshape(key_start, (1,)).astype(jnp.int32)
    grid = (t_pad // block_q, H, B)
    kernel = functools.partial(_prefill_kernel, block_q=block_q, block_k=block_k,
                               score_mult=float(scale) * _LOG2E, n_keys=S)
    o, lse = pl.pallas_call(
        kernel, grid=grid,
        in_specs=[
            pl.BlockSpec((B,), lambda i, h, b: (0,)),
            pl.BlockSpec((B,), lambda i, h, b: (0,)),
            pl.BlockSpec((1,), lambda i, h, b: (0,)),
            pl.BlockSpec((None, block_q, None, QK_DIM), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, s_pad, None, QK_DIM), lambda i, h, b: (b, 0, h, 0)),
            pl.BlockSpec((None, s_pad, None, V_DIM), lambda i, h, b: (b, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, V_DIM), lambda i, h, b: (b, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, h, b: (b, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, t_pad, H, V_DIM), out_dtype or q.dtype),
                   jax.ShapeDtypeStruct((B, H, t_pad), jnp.float32)],
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="mla_prefill",
    )(lengths.astype(jnp.int32), starts, key_start, q, k, v)
    return o[:, :T], jnp.swapaxes(lse[:, :, :T], 1, 2)


@functools.partial(jax.jit, static_argnames=("scale", "chunk", "out_dtype"))
def mla_prefill_chunked(q, k, v, lengths, starts=None, key_start=None, *, scale, chunk: int = 512,
                        out_dtype=None):
    """Plain-JAX causal attention with an online softmax over key chunks (no T x S scores);
    positions as in the kernel (`starts`, `key_start`)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    chunk = min(chunk, S)
    s_pad = -(-S // chunk) * chunk
    pad = ((0, 0), (0, s_pad - S), (0, 0), (0, 0))
    kp, vp = jnp.pad(k, pad), jnp.pad(v, pad)
    nc = s_pad // chunk
    kc = jnp.moveaxis(kp.reshape(B, nc, chunk, H, -1), 1, 0)
    vc = jnp.moveaxis(vp.reshape(B, nc, chunk, H, -1), 1, 0)
    qf = q.astype(jnp.float32)
    rows = jnp.arange(T)
    L = lengths.astype(jnp.int32)
    q0 = jnp.zeros((B,), jnp.int32) if starts is None else starts.astype(jnp.int32)
    k0 = 0 if key_start is None else jnp.reshape(key_start, ()).astype(jnp.int32)
    qpos, end = q0[:, None] + rows[None, :], q0 + L                  # [B, T], [B]

    def step(carry, xs):
        acc, m_i, l_i = carry
        kb, vb, c = xs
        s = jnp.einsum("bihd,bjhd->bhij", qf, kb.astype(jnp.float32),
                       precision=lax.Precision.HIGHEST) * scale
        idx = c * chunk + jnp.arange(chunk)
        kpos = k0 + idx
        ok = ((kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < end[:, None, None])
              & (idx < S)[None, None, :])[:, None]
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
    has = (l_i > 0) & (rows[None, None, :] < L[:, None, None])
    l_safe = jnp.where(has, l_i, 1.0)
    o = jnp.where(has[..., None], acc / l_safe[..., None], 0.0)
    lse = jnp.where(has, m_i + jnp.log(l_safe), -jnp.inf)
    return jnp.swapaxes(o, 1, 2).astype(out_dtype or q.dtype), jnp.swapaxes(lse, 1, 2)
