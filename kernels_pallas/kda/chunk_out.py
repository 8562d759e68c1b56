"""Launch 5 of the chunked KDA prefill, `_out_kernel` (chunk, b, h, V-tile), parallel:
O = (scale Q exp G) S_n + Aqk V', zero on rows past `lengths`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params
from .chunk_common import C, dot, masked, valid_rows


def _out_kernel(len_ref, q_ref, G_ref, rq_ref, a_ref, h_ref, vn_ref, o_ref, *, scale, op_dtype,
                prec_mm, block_k):
    """The q h product as a device loop over key tiles of `block_k` (pipelined loads with
    num_stages >= 2)."""
    n = pl.program_id(0)
    valid = valid_rows(len_ref[...], n * C, C)
    rq = rq_ref[...]
    K = q_ref.shape[-1]
    o = dot(a_ref[...], vn_ref[...], prec_mm)

    def tile(t, o):
        cols = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
        q = masked(q_ref, slice(None), cols, valid, rq)
        qg = (q * jnp.exp2(G_ref[:, cols]) * scale).astype(op_dtype)   # scale Q exp(G)
        return o + dot(qg, h_ref[cols, :], prec_mm)
    o = jax.lax.fori_loop(0, K // block_k, tile, o)
    o_ref[...] = jnp.where(valid[:, None], o, 0.0).astype(o_ref.dtype)


def launch_out(lens, A, h, vn, q, G, rq, *, groups, scale, out_dtype, op_dtype, prec_mm, cfg,
               interpret):
    """h, vn come from the scan in its layout: [B * groups, H, chunks per group * (K | C), V]."""
    B, H, Tp, _ = A.shape
    K, V, N = q.shape[-1], vn.shape[-1], Tp // C
    per = N // groups
    hist = lambda n, b, h, j: (b * groups + n // per, h, n % per, j)
    bvo = cfg.block_v_out
    spec = lambda shape, idx: pl.BlockSpec(shape, idx)
    chunk = lambda X: spec((None, None, C, X), lambda n, b, h, j: (b, h, n, 0))
    tok = spec((None, C, None, K), lambda n, b, h, j: (b, n, h, 0))
    q_specs = [tok, tok, spec((None, None, C), lambda n, b, h, j: (b, h, n))]
    return pl.pallas_call(
        functools.partial(_out_kernel, scale=scale, op_dtype=op_dtype, prec_mm=prec_mm,
                          block_k=cfg.block_k_out),
        grid=(N, B, H, V // bvo),
        in_specs=[spec((None,), lambda n, b, h, j: (b,))] + q_specs + [
            chunk(C), spec((None, None, K, bvo), hist), spec((None, None, C, bvo), hist)],
        out_specs=spec((None, C, None, bvo), lambda n, b, h, j: (b, n, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype),
        compiler_params=triton_params(num_warps=cfg.num_warps_out, num_stages=cfg.num_stages_out),
        interpret=interpret, name="kda_chunk_out",
    )(lens, q, G, rq, A, h, vn)
