"""Launch 4 of the chunked KDA prefill, the state scan: `_state_kernel` (b, h, V-tile),
sequential over chunks with the fp32 state in registers, stores the state entering each chunk,
V' = U - W S, and S <- exp(G_C) S + Kg^T V'.

Two-level form (`scan_groups` > 1, chosen by `tuning.auto_scan_groups` when few sequences x heads
would leave the GPU idle): the chunks split into equal groups; each group's affine map
S -> P S + Q runs in parallel (the same kernel: P with U = 0 from the identity, Q from 0),
`group_starts` (a short fp32 scan over the groups, plain JAX) gives each group's entering state,
and the groups replay in parallel, storing the per-chunk states.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params
from .chunk_common import C, F32, HIGHEST, dot


def _state_kernel(*refs, n_chunks, transition, store, op_dtype, prec_mm):
    """S <- exp(G_C) S + Kg^T (U - W S) over `n_chunks` chunks, fp32 S in registers; with `store`
    the state entering each chunk and V' = U - W S are written. `transition`: U = 0 and S starts
    as the identity's column tile, so the result is the chunks' product map (two-level scan)."""
    if transition:
        w_ref, kg_ref, ec_ref, *outs = refs
        u_ref = h0_ref = None
    else:
        w_ref, u_ref, kg_ref, ec_ref, h0_ref, *outs = refs
    h_ref, vn_ref, ht_ref = outs if store else (None, None, outs[0])
    K = w_ref.shape[-1]
    bv = ht_ref.shape[-1]

    def body(n, S):
        rows = pl.ds(pl.multiple_of(n * C, C), C)
        Sd = S.astype(op_dtype)
        if store:
            h_ref[pl.ds(pl.multiple_of(n * K, K), K), :] = Sd.astype(h_ref.dtype)
        vn = -dot(w_ref[rows, :], Sd, prec_mm)
        if u_ref is not None:
            vn = vn + u_ref[rows, :].astype(F32)
        vnd = vn.astype(op_dtype)
        if store:
            vn_ref[rows, :] = vnd.astype(vn_ref.dtype)
        return S * ec_ref[n, :][:, None] + dot(kg_ref[rows, :], vnd, prec_mm, trans_a=True)

    if transition:
        r = jax.lax.broadcasted_iota(jnp.int32, (K, bv), 0)
        c = jax.lax.broadcasted_iota(jnp.int32, (K, bv), 1) + pl.program_id(2) * bv
        S0 = (r == c).astype(F32)
    else:
        S0 = h0_ref[...].astype(F32)
    ht_ref[...] = jax.lax.fori_loop(0, n_chunks, body, S0)


def launch_state(w, u, kg, ec, h0, *, groups=1, transition=False, store=True, op_dtype,
                 prec_mm, cfg, interpret):
    """The scan over each of `groups` equal runs of chunks in parallel (program p = b * groups +
    group). Inputs [B, H, Tp, .] and ec [B, H, N, K]; h0 [B * groups, H, K, V] (absent with
    `transition`). Returns (h, vn, final states) or (final states,) without `store`."""
    B, H, Tp, K = w.shape
    N = Tp // C
    per = N // groups
    V = K if transition else u.shape[-1]
    bv = cfg.block_v_maps if transition else cfg.block_v_state
    run = lambda cols, X: pl.BlockSpec((None, None, cols, X),
                                       lambda p, h, j: (p // groups, h, p % groups, 0))
    run_tile = lambda rows: pl.BlockSpec((None, None, rows, bv),
                                         lambda p, h, j: (p // groups, h, p % groups, j))
    own = lambda rows: pl.BlockSpec((None, None, rows, bv), lambda p, h, j: (p, h, 0, j))
    sds = jax.ShapeDtypeStruct
    in_specs = [run(per * C, K)] + ([] if transition else [run_tile(per * C)]) + [
        run(per * C, K), run(per, K)] + ([] if transition else [own(K)])
    args = (w, kg, ec) if transition else (w, u, kg, ec, h0)
    out_specs = ([own(per * K), own(per * C)] if store else []) + [own(K)]
    out_shape = ([sds((B * groups, H, per * K, V), op_dtype),
                  sds((B * groups, H, per * C, V), op_dtype)] if store else []) + [
        sds((B * groups, H, K, V), F32)]
    return pl.pallas_call(
        functools.partial(_state_kernel, n_chunks=per, transition=transition, store=store,
                          op_dtype=op_dtype, prec_mm=prec_mm),
        grid=(B * groups, H, V // bv),
        in_specs=in_specs, out_specs=out_specs, out_shape=tuple(out_shape),
        compiler_params=triton_params(num_warps=cfg.num_warps_state,
                                      num_stages=cfg.num_stages_state),
        interpret=interpret, name="kda_chunk_state",
    )(*args)


def group_starts(P, Q, h0, groups):
    """Two-level scan, middle step: the state entering each group from the groups' maps
    S -> P_g S + Q_g (P [B*G, H, K, K], Q [B*G, H, K, V]), in fp32 plain JAX: a short
    sequential loop of batched matmuls. -> starts [B*G, H, K, V], final state [B, H, K, V]."""
    BG, H, K, V = Q.shape
    B = BG // groups
    P = P.reshape(B, groups, H, K, K).swapaxes(0, 1)
    Q = Q.reshape(B, groups, H, K, V).swapaxes(0, 1)

    def step(S, pq):
        Pg, Qg = pq
        return jnp.einsum("bhkl,bhlv->bhkv", Pg, S, precision=HIGHEST) + Qg, S
    # unrolled: straight-line batched matmuls instead of a device while loop, whose predicate
    # XLA copies back every step; capped so a large scan_groups does not unroll hundreds of steps
    final, starts = jax.lax.scan(step, h0, (P, Q), unroll=min(groups, 16))
    return starts.swapaxes(0, 1).reshape(BG, H, K, V), final
