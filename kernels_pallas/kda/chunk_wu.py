"""Launch 3 of the chunked KDA prefill, `_wu_kernel` (chunk, b, h): W = T diag(beta) (K exp G),
U = T diag(beta) V, Kg = K exp(G_C - G) and exp(G_C) (G_C: G at the chunk's end), 64-row
matmuls over column tiles."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params
from .chunk_common import C, F32, chunk_specs, dot, masked, tile_cols, valid_rows


def _wu_kernel(len_ref, k_ref, v_ref, G_ref, b_ref, rk_ref, t_ref, w_ref, u_ref, kg_ref, ec_ref, *,
               op_dtype, prec_mm, tile):
    """Column tiles of `tile` (narrowed to K and V) as device loops, whose loads Triton
    pipelines with num_stages >= 2."""
    n = pl.program_id(0)
    valid = valid_rows(len_ref[...], n * C, C)
    K, V = w_ref.shape[-1], v_ref.shape[-1]
    T = t_ref[...]
    beta = jnp.where(valid, b_ref[...].astype(F32), 0.0)
    rk = rk_ref[...]

    def k_tile(ct, _):
        cols = tile_cols(ct, tile_k)
        k = masked(k_ref, slice(None), cols, valid, rk)
        G = G_ref[:, cols]
        GC = G_ref[C - 1, cols]                       # decay to the chunk's end (g masked: flat)
        kw = beta[:, None] * k * jnp.exp2(G)          # beta K exp(G)
        w_ref[:, cols] = dot(T, kw.astype(op_dtype), prec_mm).astype(w_ref.dtype)
        kg_ref[:, cols] = (k * jnp.exp2(GC[None, :] - G)).astype(kg_ref.dtype)
        ec_ref[cols] = jnp.exp2(GC)
        return _

    def v_tile(ct, _):
        cols = tile_cols(ct, tile_v)
        v = masked(v_ref, slice(None), cols, valid)
        u_ref[:, cols] = dot(T, (beta[:, None] * v).astype(op_dtype), prec_mm).astype(u_ref.dtype)
        return _

    tile_k, tile_v = min(tile, K), min(tile, V)
    jax.lax.fori_loop(0, K // tile_k, k_tile, 0)
    jax.lax.fori_loop(0, V // tile_v, v_tile, 0)


def launch_wu(lens, v, beta, Tinv, k, G, rk, *, op_dtype, prec_mm, cfg, interpret):
    """-> w, u, kg [B, H, Tp, .] (operand dtype) and ec [B, H, N, K]."""
    B, Tp, H, V = v.shape
    K, N = k.shape[-1], Tp // C
    tok, per, vec, beta_spec, length = chunk_specs()
    sds = jax.ShapeDtypeStruct
    row_per_chunk = pl.BlockSpec((None, None, None, K), lambda n, b, h: (b, h, n, 0))
    return pl.pallas_call(
        functools.partial(_wu_kernel, op_dtype=op_dtype, prec_mm=prec_mm, tile=cfg.block_wu),
        grid=(N, B, H),
        in_specs=[length, tok(K), tok(V), tok(K), beta_spec, vec, per(C)],
        out_specs=[per(K), per(V), per(K), row_per_chunk],
        out_shape=(sds((B, H, Tp, K), op_dtype), sds((B, H, Tp, V), op_dtype),
                   sds((B, H, Tp, K), op_dtype), sds((B, H, N, K), F32)),
        compiler_params=triton_params(num_warps=cfg.num_warps_wu, num_stages=cfg.num_stages_wu),
        interpret=interpret, name="kda_chunk_wu",
    )(lens, k, v, G, beta, rk, Tinv)
