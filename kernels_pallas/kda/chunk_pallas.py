"""Chunked KDA prefill in Pallas (Triton lowering: CUDA and ROCm): the driver that chains the
five launches. Reference: reference.py.

Chunks of C = 64 tokens, sub-blocks of 16. Five launches, each small enough to stay in registers:
  1. diagonal 16x16 blocks, G and the l2 norms      chunk_intra.py  `launch_diag`
  2. off-diagonal blocks and T = (I + L)^-1         chunk_intra.py  `launch_inter`
  3. W, U, Kg, exp(G_C)                             chunk_wu.py     `launch_wu`
  4. the state scan (sequential or two-level)       chunk_state.py  `launch_state`
  5. the output                                     chunk_out.py    `launch_out`
Launch parameters: tuning.py (`ChunkConfig`, the tuned table and its rules). Rows past
`lengths[b]` are masked where they are loaded (they may hold garbage, even NaN); their outputs
are zero.

Triton-lowering limits respected: every loaded/stored array is a power of two, every dot has all
dims >= 16, no value slicing (rows come from refs or masked sums), static grids.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .chunk_common import C, F32, HIGHEST
from .chunk_intra import launch_diag, launch_inter
from .chunk_out import launch_out
from .chunk_state import group_starts, launch_state
from .chunk_wu import launch_wu
from .tuning import ChunkConfig, chunk_config

__all__ = ["ChunkConfig", "chunk_config", "chunk_stages", "kda_chunk_pallas"]


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def chunk_stages(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                 use_qk_l2norm=False, interpret=False, safe_gate=False,
                 config: ChunkConfig | None = None):
    """The forward as a list of (name, jitted stage, stage inputs), run in order.

    `kda_chunk_pallas` is exactly these stages composed; benchmarks time them one by one.
    config: fields that override the tuned configuration (`tuning.chunk_config`).
    Returns (stages, final (o, state))."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if not (_is_pow2(K) and _is_pow2(V) and K >= 16 and V >= 16):
        raise ValueError(f"K={K} and V={V} must be powers of two >= 16")
    op_dtype = F32 if q.dtype == F32 else jnp.bfloat16
    cfg = chunk_config(B, T, H, K, V, op_dtype, config)
    scale = float(K ** -0.5 if scale is None else scale)
    out_dtype = v.dtype
    common = dict(prec_mm=HIGHEST if op_dtype == F32 else None, cfg=cfg, interpret=interpret)
    h0 = jnp.zeros((B, H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    N = -(-T // C)
    if N == 0:
        return [], (jnp.zeros((B, 0, H, V), out_dtype), h0)
    groups = cfg.scan_groups
    N = -(-N // groups) * groups     # equal runs of chunks; padded chunks are masked (identity)
    Tp = N * C
    lens = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.minimum(
        jnp.asarray(lengths, jnp.int32), T)

    def prepare(q, k, v, g, beta):
        g = g.astype(F32)
        if Tp != T:  # keep every block in bounds; the padded rows are masked in-kernel
            pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
            q, k, v, g, beta = map(pad, (q, k, v, g, beta))
        return q, k, v, g, beta

    stages = []

    def run(name, fn, *args):
        stages.append((name, fn, args))
        return fn(*args)

    j = lambda f, **kw: jax.jit(functools.partial(f, **kw))
    q, k, v, g, beta = run("pad", jax.jit(prepare), q, k, v, g, beta)
    G, aqd, akd, rq, rk = run("diag", j(launch_diag, scale=scale, l2norm=use_qk_l2norm,
                                        safe_gate=safe_gate, **common),
                              lens, q, k, g, beta)
    A, Tinv = run("inter", j(launch_inter, scale=scale, op_dtype=op_dtype, **common),
                  lens, q, k, G, beta, rq, rk, aqd, akd)
    w, u, kg, ec = run("wu", j(launch_wu, op_dtype=op_dtype, **common),
                       lens, v, beta, Tinv, k, G, rk)
    state = lambda **kw: j(launch_state, op_dtype=op_dtype, groups=groups, **kw, **common)
    if groups == 1:
        h, vn, ht = run("state", state(), w, u, kg, ec, h0)
    else:  # two-level: each group's map in parallel, the short scan over groups, parallel replay
        (P,) = run("state_maps_P", state(transition=True, store=False), w, None, kg, ec, None)
        (Q,) = run("state_maps_Q", state(store=False), w, u, kg, ec,
                   jnp.zeros((B * groups, H, K, V), F32))
        starts, ht = run("group_scan", jax.jit(functools.partial(group_starts, groups=groups)),
                         P, Q, h0)
        h, vn, _ = run("state_replay", state(), w, u, kg, ec, starts)
    o = run("out", j(launch_out, groups=groups, scale=scale, out_dtype=out_dtype,
                     op_dtype=op_dtype, **common), lens, A, h, vn, q, G, rq)
    if Tp != T:
        o = o[:, :T]
    return stages, (o, ht)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "safe_gate",
                                             "config"))
def kda_chunk_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
                     use_qk_l2norm=False, interpret=False, safe_gate=False,
                     config: ChunkConfig | None = None):
    """Chunked KDA forward. q,k [B,T,H,K], v [B,T,H,V], g [B,T,H,K] (fp32 log-decay), beta
    [B,T,H], initial_state [B,H,K,V] fp32, lengths [B] (valid prefix per row) ->
    (o [B,T,H,V] in v's dtype, final_state [B,H,K,V] fp32). config: a ChunkConfig whose set
    fields override the tuned ones (tuning.py)."""
    return chunk_stages(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        lengths=lengths, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
                        safe_gate=safe_gate, config=config)[1]
