"""MoE grouped matmul (ragged_dot) as a Pallas kernel with the Triton lowering.

x [M, K] rows sorted by group, w [G, K, N] dense (bf16 / fp32) or `MXFP4Weight` ([G, N, K/2] +
[G, N, K/32] uint8, dequantised tile by tile inside the kernel: the bf16 weights never exist in HBM),
group_sizes [G] int32 (sum <= M; rows past the sum are written as zeros).

Work decomposition. Plain JAX outside the kernel turns group_sizes into a static-length list of
row tiles (`tile_metadata`): tile t covers rows [start, end) of one group (end - start <= block_m);
there are at most cdiv(M, block_m) + G tiles, so the grid is static. Rows past sum(group_sizes)
form a "zero group" whose tiles only store zeros; unused tile slots do nothing. The grid is
(N / block_n, tiles) with the column block fastest, so the programs that share a tile's rows (and a
group's weights) run side by side and hit L2. Only non-empty groups have tiles, so an empty
expert's weights are never read: at decode, the cost is streaming the weights of the experts that
received tokens. A tile with few rows (the tail of a group) runs a smaller `block_m_small` row block
so prefill does not pay a full block_m of padding per expert.

MXFP4 in the kernel: each E2M1 nibble is placed into the bits of an fp16 (sign -> bit 15, the three
magnitude bits -> bits 9-11), which is exactly value * 2^-14 including the subnormal 0.5, then
multiplied by the E8M0 scale 2^(s-127) (built by shifting s into an fp32 exponent; s = 0 flushes to
zero) and rounded to the activation dtype (exact). The 2^14 is applied once to the fp32 accumulator.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import resolve_backend, triton_params
from . import mxfp4
from .reference import MXFP4Weight, glu, is_mxfp4, moe_gmm_glu_reference, moe_gmm_reference

_F16_SHIFT = 2.0 ** 14  # nibble-as-fp16 is value * 2^-14


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    block_m_small: int | None = None  # row block for tiles with <= this many rows (None: off)
    num_warps: int = 4
    num_stages: int = 3

    def smem_bytes(self, x_itemsize: int, quant: bool, glu_: bool = False) -> int:
        """Shared memory the software pipeline asks for (inputs of one stage x num_stages)."""
        w_tile = self.block_n * self.block_k // 2 + self.block_n * self.block_k // 32 if quant \
            else self.block_n * self.block_k * x_itemsize
        per_stage = self.block_m * self.block_k * x_itemsize + w_tile * (2 if glu_ else 1)
        return per_stage * max(self.num_stages - 1, 1)


def default_config(m: int, g: int, k: int, n: int, quant: bool, glu_: bool = False) -> GmmConfig:
    """Block sizes by regime: rows per group decides decode (weight streaming) vs prefill.

    Measured on one H200 (2026-11-29, benchmarks/results_moe.md) at K3's TP8 gate+up slice
    (896 experts, K 3584, N 768): the winners (or ties within noise) of the sweep there.
    """
    rows_per_group = m / max(g, 1)
    bn = 128 if n >= 128 else max(16, pl.next_power_of_2(n))
    if rows_per_group < 24:  # decode: few rows per expert; stream weights
        return GmmConfig(block_m=16, block_n=bn, block_k=_fit_k(128, k), num_warps=4, num_stages=4)
    if rows_per_group < 96:
        return GmmConfig(block_m=64, block_n=bn, block_k=_fit_k(64, k), block_m_small=16,
                         num_warps=4, num_stages=4)
    if quant or glu_ or n < 256:
        return GmmConfig(block_m=128, block_n=bn, block_k=_fit_k(64, k), block_m_small=32,
                         num_warps=4, num_stages=3)
    return GmmConfig(block_m=128, block_n=256, block_k=_fit_k(64, k), block_m_small=32,
                     num_warps=8, num_stages=3)


def _fit_k(bk: int, k: int) -> int:
    while bk > 32 and k % bk:
        bk //= 2
    return bk


def tile_metadata(group_sizes, m: int, block_m: int):
    """[3, T] int32: (group, row start, row end) of each row tile; T = cdiv(M, block_m) + G.

    group == G marks a tile of the rows past sum(group_sizes) (written as zeros); group == -1 marks
    an unused slot. Computed in plain JAX (outside the kernel), so the grid stays static.
    """
    g = group_sizes.shape[0]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    total = ends[-1] if g else jnp.int32(0)
    starts_x = jnp.concatenate([starts, total[None]])
    ends_x = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    sizes_x = ends_x - starts_x
    tiles_per = (sizes_x + block_m - 1) // block_m
    tile_cum = jnp.cumsum(tiles_per)
    n_tiles = pl.cdiv(m, block_m) + g
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    grp = jnp.searchsorted(tile_cum, t, side="right", method="compare_all").astype(jnp.int32)
    valid = grp <= g
    gc = jnp.minimum(grp, g)
    first = tile_cum[gc] - tiles_per[gc]
    start = starts_x[gc] + (t - first) * block_m
    end = jnp.minimum(start + block_m, ends_x[gc])
    return jnp.stack([jnp.where(valid, gc, -1), jnp.where(valid, start, 0),
                      jnp.where(valid, end, 0)]).astype(jnp.int32)


def _dequant_tile(pb, sb, dtype):
    """packed [bn, bk/2] uint8 + scales [bn, bk/32] uint8 -> [bn, bk] `dtype`, times 2^-14."""
    bn, half = pb.shape
    bk = half * 2
    b = pb.astype(jnp.int32)
    lo = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
    hi = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
    lo = jax.lax.bitcast_convert_type(lo.astype(jnp.uint16), jnp.float16)
    hi = jax.lax.bitcast_convert_type(hi.astype(jnp.uint16), jnp.float16)
    v = jnp.stack([lo, hi], axis=-1).reshape(bn, bk).astype(jnp.float32)  # column 2j, 2j+1
    s = sb.astype(jnp.int32)
    sf = jax.lax.bitcast_convert_type(s << 23, jnp.float32)  # 2^(s-127); s = 0 -> 0
    sf = jnp.broadcast_to(sf[:, :, None], (bn, bk // mxfp4.GROUP, mxfp4.GROUP)).reshape(bn, bk)
    return (v * sf).astype(dtype)


def _load(ref, mask):
    from jax.experimental.pallas import triton as plgpu

    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0)


def _gmm_kernel(meta_ref, x_ref, *refs, cfg: GmmConfig, k: int, n: int, g_count: int, quant: bool,
                n_w: int, epilogue, cdt, precision):
    from jax.experimental.pallas import triton as plgpu

    w_refs = refs[:-1]
    o_ref = refs[-1]
    bn, bk = cfg.block_n, cfg.block_k
    nb = pl.program_id(0)
    t = pl.program_id(1)
    grp = meta_ref[0, t]
    r0 = meta_ref[1, t]
    r1 = meta_ref[2, t]
    n0 = nb * bn
    cols = n0 + jnp.arange(bn, dtype=jnp.int32)
    col_ok = cols < n
    n_k = pl.cdiv(k, bk)
    k_ragged = k % bk != 0

    def store(bm, val):
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        mask = (rows < r1)[:, None]
        if n % bn:
            mask = mask & col_ok[None, :]
        plgpu.store(o_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], val.astype(o_ref.dtype), mask=mask)

    def compute(bm):
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        row_ok = rows < r1

        def body(kb, accs):
            k0 = pl.multiple_of(kb * bk, bk)
            xmask = row_ok[:, None]
            if k_ragged:
                kcols = k0 + jnp.arange(bk, dtype=jnp.int32)
                xmask = xmask & (kcols < k)[None, :]
            xb = plgpu.load(x_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=xmask, other=0)
            xb = xb.astype(cdt)
            out = []
            for i, acc in enumerate(accs):
                if quant:
                    p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
                    pmask = smask = None
                    if n % bn or k_ragged:
                        pmask = col_ok[:, None] & (k0 // 2 + jnp.arange(bk // 2) < k // 2)[None, :]
                        smask = col_ok[:, None] & (
                            k0 // 32 + jnp.arange(bk // 32) < k // 32)[None, :]
                    pb = _load(p_ref.at[grp, pl.ds(n0, bn), pl.ds(k0 // 2, bk // 2)], pmask)
                    sb = _load(s_ref.at[grp, pl.ds(n0, bn), pl.ds(k0 // 32, bk // 32)], smask)
                    wb = _dequant_tile(pb, sb, cdt)
                    acc = acc + plgpu.dot(xb, wb, trans_b=True, precision=precision)
                else:
                    w_ref = w_refs[i]
                    wmask = None
                    if n % bn or k_ragged:
                        wmask = (k0 + jnp.arange(bk) < k)[:, None] & col_ok[None, :]
                    wb = _load(w_ref.at[grp, pl.ds(k0, bk), pl.ds(n0, bn)], wmask).astype(cdt)
                    acc = acc + plgpu.dot(xb, wb, precision=precision)
                out.append(acc)
            return tuple(out)

        accs = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(n_w))
        accs = jax.lax.fori_loop(0, n_k, body, accs)
        if quant:
            accs = tuple(a * _F16_SHIFT for a in accs)
        store(bm, epilogue(*accs))

    is_zero = grp == g_count
    is_work = (grp >= 0) & (grp < g_count) & (r1 > r0)

    @pl.when(is_zero & (r1 > r0))
    def _():
        store(cfg.block_m, jnp.zeros((cfg.block_m, bn), jnp.float32))

    bms = cfg.block_m_small
    if bms is not None and bms < cfg.block_m:
        small = (r1 - r0) <= bms

        @pl.when(is_work & small)
        def _():
            compute(bms)

        @pl.when(is_work & jnp.logical_not(small))
        def _():
            compute(cfg.block_m)
    else:
        @pl.when(is_work)
        def _():
            compute(cfg.block_m)


def _check(x, ws, group_sizes):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got {x.shape}")
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) != 1:
        raise ValueError(f"weights disagree in shape: {shapes}")
    g, k, n = ws[0].shape
    if k != x.shape[1]:
        raise ValueError(f"x has K={x.shape[1]}, weights have K={k}")
    if group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes.shape}")
    if any(is_mxfp4(w) for w in ws) and not all(is_mxfp4(w) for w in ws):
        raise ValueError("mixing MXFP4 and dense weights in one call is not supported")
    return g, k, n


def _gmm_pallas(x, ws, group_sizes, *, epilogue, out_dtype, config, interpret, precision):
    g, k, n = _check(x, ws, group_sizes)
    m = x.shape[0]
    quant = is_mxfp4(ws[0])
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    cdt = x.dtype if quant else jnp.promote_types(x.dtype, ws[0].dtype)
    if precision is None and jnp.dtype(cdt) == jnp.float32:
        precision = jax.lax.Precision.HIGHEST
    cfg = config or default_config(m, g, k, n, quant, len(ws) > 1)
    if quant and (cfg.block_k % mxfp4.GROUP or k % mxfp4.GROUP):
        raise ValueError(f"MXFP4 needs block_k and K multiples of {mxfp4.GROUP}")
    meta = tile_metadata(group_sizes, m, cfg.block_m)
    n_tiles = meta.shape[1]
    flat_w = []
    for w in ws:
        flat_w += [w.packed, w.scales] if quant else [w]
    kernel = functools.partial(_gmm_kernel, cfg=cfg, k=k, n=n, g_count=g, quant=quant,
                               n_w=len(ws), epilogue=epilogue, cdt=cdt, precision=precision)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(pl.cdiv(n, cfg.block_n), n_tiles),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="moe_gmm",
    )(meta, x, *flat_w)


def moe_gmm(x, w, group_sizes, *, backend: str | None = None, preferred_element_type=None,
            config: GmmConfig | None = None, precision=None):
    """Grouped matmul, `jax.lax.ragged_dot` semantics: out[i] = x[i] @ w[group(i)].

    x [M, K]; w [G, K, N] dense or `MXFP4Weight(packed [G, N, K/2], scales [G, N, K/32])`;
    group_sizes [G] int32, sum <= M (rows past the sum are zero). fp32 accumulation; output in
    `preferred_element_type` or x.dtype. backend: "reference" | "pallas" | "interpret" | None.
    """
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if backend == "reference":
        return moe_gmm_reference(x, w, group_sizes, preferred_element_type=out_dtype)
    return _gmm_pallas(x, (w,), group_sizes, epilogue=lambda a: a, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision)


def moe_gmm_glu(x, w1, w3, group_sizes, *, activation: str = "swiglu", backend: str | None = None,
                preferred_element_type=None, config: GmmConfig | None = None, precision=None,
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0):
    """Fused gate/up: act(x @ w1[g]) * (x @ w3[g]) in one pass over x (activation "swiglu" or
    "situ": SiTU(a) * 25 tanh(b / 25)). w1, w3 as in `moe_gmm` (both dense or both MXFP4)."""
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if backend == "reference":
        return moe_gmm_glu_reference(x, w1, w3, group_sizes, activation=activation,
                                     preferred_element_type=out_dtype, situ_beta=situ_beta,
                                     situ_linear_beta=situ_linear_beta)
    glu(jnp.zeros(()), jnp.zeros(()), activation)  # validate the name early
    epi = functools.partial(glu, activation=activation, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)
    return _gmm_pallas(x, (w1, w3), group_sizes, epilogue=epi, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision)
