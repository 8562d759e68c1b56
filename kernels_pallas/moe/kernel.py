"""The grouped-matmul kernel (ragged_dot) of `ops.moe_gmm`: Pallas with the Triton lowering.

x [M, K] rows sorted by group, w [G, K, N] dense (bf16 / fp32) or MXFP4 ([G, N, K/2] + [G, N, K/32]
uint8, dequantised tile by tile in the kernel: `dequant.py`), group_sizes [G] int32 (sum <= M;
rows past the sum are written as zeros).

Work decomposition. The tile plan (`tiles.tile_plan`, one launch before the matmul) turns
group_sizes into a static-length list of row tiles: tile t covers rows [start, end) of one group
(end - start <= block_m); there are at most cdiv(M, block_m) + G tiles, so the grid is static.
Rows past sum(group_sizes) form a "zero group" whose tiles only store zeros; unused tile slots do
nothing. The grid is (N / block_n, tiles) with the column block fastest, so the programs that
share a tile's rows (and a group's weights) run side by side and hit L2. Only non-empty groups
have tiles, so an empty expert's weights are never read: at decode the cost is streaming the
weights of the experts that received tokens. A tile with few rows (the tail of a group) runs a
smaller `block_m_small` row block, so prefill does not pay a full block_m of padding per expert.
With `n_per_program` > 1 a program takes that many column blocks in one flattened (column block,
K block) loop: one pipeline fill per program instead of per block, which is what a short K needs.
With `x_resident` as well, the row tile's x is loaded once (all K blocks, before the loop) and the
loop walks the column blocks with the K blocks unrolled inside: a column block no longer reloads
x, and the loop's bookkeeping is paid once per column block.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .._backend import triton_params
from . import mxfp4, paired
from .dequant import (F16_SHIFT, dequant_split, dequant_split_t, dequant_tile, dequant_variant,
                      perm_t_index)

X_SPLITS = ("pre", "stride")


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    """Static configuration of one moe_gmm kernel: row / column / K blocks, the smaller row block
    for short tiles, warps, software-pipeline stages, and for MXFP4 weights the dequantisation
    variant (`dequant.DEQUANT_VARIANTS`) and how x's even / odd columns are separated.

    The PTX variants ("split_asm_sub", "split_asm_t") exist only on NVIDIA GPUs (inline PTX; there
    is no ROCm equivalent, and Pallas' Triton lowering is also used on AMD). A config that names
    one is taken as given: compiling it for ROCm fails. `tuning.default_config` picks one only
    when the kernel runs on a CUDA device.
    """
    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    block_m_small: int | None = None  # row block for tiles with <= this many rows (None: off)
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "interleave"  # MXFP4 only: one of dequant.DEQUANT_VARIANTS
    x_split: str = "pre"  # split variants: x's even/odd columns gathered "pre" kernel or "stride"
    # Column blocks per program, walked in one flattened (column block, K block) loop that the
    # software pipeline streams through without a break; each block's result is stored when its
    # last K block is done. For short K (a TP8 rank's down projection: 3 K blocks of 128), where
    # a program per column block is mostly pipeline fill and drain.
    n_per_program: int = 1
    # Dense weights: the short tiles (block_m_small rows) as the transposed product
    # w^T [block_n, K] . x^T -> [block_n, rows], so that the weights fill the MMA's M side (a
    # 32-row tile is below the 64 rows of one Hopper wgmma) and the rows are its N side.
    transpose_small: bool = False
    # With n_per_program > 1: x's K blocks loaded once a program (before the loop), which then
    # walks the column blocks with the K blocks unrolled inside (short K only: n_k x-tiles live
    # in shared memory / registers for the whole program).
    x_resident: bool = False
    # A group's last row tile also takes up to block_m_small rows past block_m
    # (`tiles.group_tiles`), computed in one program as a block_m product and a block_m_small
    # one (transposed when transpose_small) on the same weight tile of each K step: the group's
    # weights are streamed (and MXFP4 ones dequantised, "split_asm_t" only) once instead of
    # once more for its short tail tile.
    fuse_tail: bool = False
    # K split over this many programs per (column block, row tile), each storing its fp32
    # partial sum ([M, split_k * N], summed by `ops`): at decode a few experts' tiles make too
    # few programs to keep every SM streaming weights (16 rows, one per expert: 48 programs
    # for N 384 at block_n 128 on 132 SMs).
    split_k: int = 1

    def __post_init__(self):
        dequant_variant(self.dequant)
        if self.x_split not in X_SPLITS:
            raise ValueError(f"x_split={self.x_split!r} is not one of {X_SPLITS}")
        if self.n_per_program < 1:
            raise ValueError(f"n_per_program must be >= 1, got {self.n_per_program}")
        if self.fuse_tail and not (self.block_m_small and self.block_m_small < self.block_m
                                   and self.n_per_program == 1):
            raise ValueError("fuse_tail needs block_m_small < block_m (the tail's row block) and "
                             f"n_per_program 1 (got {self})")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")
        if self.split_k > 1 and (self.n_per_program > 1 or self.fuse_tail):
            raise ValueError("split_k splits the plain K loop: set n_per_program 1 and fuse_tail "
                             f"False with it (got {self})")
        if self.x_resident and self.n_per_program == 1:
            raise ValueError("x_resident keeps x over several column blocks a program: set "
                             "n_per_program > 1 with it")

    def name(self) -> str:
        """Short label: bm/small, bn, bk, warps, stages (+ MXFP4 dequant options when not default)."""
        s = (f"bm{self.block_m}/{self.block_m_small}_bn{self.block_n}_bk{self.block_k}"
             f"_w{self.num_warps}_s{self.num_stages}"
             + (f"_np{self.n_per_program}" if self.n_per_program > 1 else "")
             + ("_tsmall" if self.transpose_small else "")
             + ("_xres" if self.x_resident else "")
             + ("_ftail" if self.fuse_tail else "")
             + (f"_sk{self.split_k}" if self.split_k > 1 else ""))
        if self.dequant != "interleave":
            s += f"_{self.dequant}"
            if self.x_split != "pre" and self.dequant.startswith("split"):
                s += f"_x{self.x_split}"
        return s

    def smem_bytes(self, x_itemsize: int, quant: bool, glu_: bool = False) -> int:
        """Shared memory the software pipeline asks for (inputs of one stage x num_stages)."""
        w_tile = self.block_n * self.block_k // 2 + self.block_n * self.block_k // 32 if quant \
            else self.block_n * self.block_k * x_itemsize
        per_stage = self.block_m * self.block_k * x_itemsize + w_tile * (2 if glu_ else 1)
        return per_stage * max(self.num_stages - 1, 1)


def _load(ref, mask):
    from jax.experimental.pallas import triton as plgpu

    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0)


def _gmm_kernel(meta_ref, x_ref, *refs, cfg: GmmConfig, k: int, n: int, g_count: int, quant: bool,
                n_w: int, epilogue, cdt, precision, use_asm: bool, layout: str = "k3"):
    from jax.experimental.pallas import triton as plgpu

    w_refs = refs[:-1]
    o_ref = refs[-1]
    bn, bk = cfg.block_n, cfg.block_k
    split, bits = dequant_variant(cfg.dequant) if quant else (False, "f16")
    half, hk, ng = bk // 2, k // 2, bk // mxfp4.GROUP  # per K block: packed columns, scale groups
    sk = cfg.split_k
    nb, ks = pl.program_id(0), 0  # column block, K split
    if sk > 1:
        nb, ks = nb // sk, nb % sk
    t = pl.program_id(1)
    if len(meta_ref.shape) == 1:  # each row its group's (`moe_gmm(row_groups=)`): tile t is row t
        grp, r0 = meta_ref[t], t
        r1 = t + 1
    else:
        grp, r0, r1 = meta_ref[0, t], meta_ref[1, t], meta_ref[2, t]
    n_inner = cfg.n_per_program
    nb0 = nb * (bn * n_inner)  # this program's first column; column block j starts at nb0 + j bn
    n_k = pl.cdiv(k, bk)
    k_ragged = k % bk != 0
    n_ragged = n % (bn * n_inner) != 0
    edge = n_ragged or k_ragged  # weight loads need masks

    def col_ok(n0):
        return n0 + jnp.arange(bn, dtype=jnp.int32) < n

    def store(bm, val, n0, first=None):
        first = r0 if first is None else first  # the block's first row
        rows = first + jnp.arange(bm, dtype=jnp.int32)
        mask = (rows < r1)[:, None]
        if n_ragged:
            mask = mask & col_ok(n0)[None, :]
        col = n0 + ks * n if sk > 1 else n0  # split k's partial sums: columns [k N, (k+1) N)
        plgpu.store(o_ref.at[pl.ds(first, bm), pl.ds(col, bn)], val.astype(o_ref.dtype),
                    mask=mask)

    # "split_asm_t": the transposed product w [bn, kk] . x [bm, kk]^T -> [bn, bm] (weights as the
    # first operand: on Hopper a wgmma with the dequantised weights in registers and x read from
    # shared memory); columns in `dequant.perm_t` order (x_ref holds them so, or `stride` indexes them).
    transposed = quant and bits == "asm_t"
    perm_s = half // 16  # `dequant.perm_t` steps per K block

    def mm(xb, wb):
        """x [bm, kk] . w [bn, kk]^T -> [bm, bn] ([bn, bm] when transposed)."""
        if transposed:
            return plgpu.dot(wb, xb, trans_b=True, precision=precision)
        return plgpu.dot(xb, wb, trans_b=True, precision=precision)

    def compute(bm):
        rows = r0 + jnp.arange(bm, dtype=jnp.int32)
        row_ok = rows < r1
        # the product transposed, w^T . x^T -> [bn, bm]: always in MXFP4 "split_asm_t", and for
        # dense weights on the short tiles when transpose_small
        tr_dense = not quant and cfg.transpose_small and bm < cfg.block_m
        tr = transposed or tr_dense

        def load_x(c0, width, part=None):
            """x columns [c0, c0 + width); part 0/1: of x's even/odd columns (c0 in half units)."""
            limit = k
            kcol = c0 + jnp.arange(width, dtype=jnp.int32)
            if part is None:
                ref = x_ref.at[pl.ds(r0, bm), pl.ds(c0, width)]
            elif cfg.x_split == "pre":  # x_ref is [2, M, K/2] ("split_asm_t": permuted, padded)
                ref = x_ref.at[jnp.int32(part), pl.ds(r0, bm), pl.ds(c0, width)]
                limit = x_ref.shape[-1]
            else:  # every other column of x (index arrays: the interpreter has no strided loads)
                if transposed:
                    kcol = perm_t_index(kcol, perm_s)
                idx = 2 * kcol + part
                ref, limit = x_ref.at[rows[:, None], idx[None, :]], hk
            mask = row_ok[:, None]
            if k_ragged:
                mask = mask & (kcol < limit)[None, :]
            return plgpu.load(ref, mask=mask, other=0).astype(cdt)

        def fetch(kb, n0, xs=None):
            """K block kb's tiles: x (or its even / odd halves; `xs` if given: already loaded) and
            per weight its tile / packed bytes and scales (columns [n0, n0 + bn))."""

            def wmask(c0, width, limit):
                if not edge:
                    return None
                return col_ok(n0)[:, None] & (c0 + jnp.arange(width, dtype=jnp.int32)
                                              < limit)[None, :]

            k0, h0 = pl.multiple_of(kb * bk, bk), pl.multiple_of(kb * half, half)
            s0 = kb * ng
            if not quant:
                m_ = None
                if edge:
                    m_ = (k0 + jnp.arange(bk) < k)[:, None] & col_ok(n0)[None, :]
                return xs or (load_x(k0, bk),), [
                    _load(w_ref.at[grp, pl.ds(k0, bk), pl.ds(n0, bn)], m_).astype(cdt)
                    for w_ref in w_refs]
            if xs is None:
                xs = (load_x(h0, half, 0), load_x(h0, half, 1)) if split else (load_x(k0, bk),)
            ws = []
            for i in range(n_w):
                p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
                pb = _load(p_ref.at[grp, pl.ds(n0, bn), pl.ds(h0, half)], wmask(h0, half, hk))
                sb = _load(s_ref.at[grp, pl.ds(n0, bn), pl.ds(s0, ng)],
                           wmask(s0, ng, k // mxfp4.GROUP))
                ws.append((pb, sb))
            return xs, ws

        def step(tiles, accs):
            xs, ws = tiles
            if not quant:
                if tr_dense:  # w [bk, bn]^T . x [bm, bk]^T -> [bn, bm]
                    return tuple(acc + plgpu.dot(wb, xs[0], trans_a=True, trans_b=True,
                                                 precision=precision)
                                 for wb, acc in zip(ws, accs))
                return tuple(acc + plgpu.dot(xs[0], wb, precision=precision)
                             for wb, acc in zip(ws, accs))
            out = []
            for (pb, sb), acc in zip(ws, accs):
                if layout == "paired" and not (use_asm and transposed):
                    pb = paired.decode(pb, jnp)  # the interpreter: back to K3 bytes (rows 16-aligned)
                if transposed:
                    lo, hi = dequant_split_t(pb, sb, cdt, use_asm, layout)
                    out.append(acc + mm(xs[0], lo) + mm(xs[1], hi))
                elif split:  # x's even/odd columns against the low/high nibbles, as loaded
                    lo, hi = dequant_split(pb, sb, cdt, bits, use_asm)
                    out.append(acc + mm(xs[0], lo) + mm(xs[1], hi))
                else:
                    out.append(acc + mm(xs[0], dequant_tile(pb, sb, cdt)))
            return tuple(out)

        def finish(accs, n0):
            if quant:
                accs = tuple(a * F16_SHIFT for a in accs)
            val = epilogue(*accs)
            store(bm, val.T if tr else val, n0)

        shape = (bn, bm) if tr else (bm, bn)
        accs = tuple(jnp.zeros(shape, jnp.float32) for _ in range(n_w))
        if n_inner > 1 and cfg.x_resident:  # x's K blocks once; a loop over column blocks
            xs_k = [fetch(jnp.int32(kb), nb0)[0] for kb in range(n_k)]

            def body_j(j, carry):
                n0 = pl.multiple_of(nb0 + j * bn, bn)
                acc_j = accs
                for kb in range(n_k):
                    acc_j = step(fetch(jnp.int32(kb), n0, xs_k[kb]), acc_j)
                finish(acc_j, n0)
                return carry
            jax.lax.fori_loop(0, n_inner, body_j, ())
        elif n_inner > 1:  # one loop over (column block j, K block kb), stored at each j's end
            def body(i, accs):
                j = i // n_k
                kb = i - j * n_k
                n0 = pl.multiple_of(nb0 + j * bn, bn)
                accs = step(fetch(kb, n0), accs)
                last = kb == n_k - 1

                @pl.when(last)
                def _():
                    finish(accs, n0)
                return tuple(jnp.where(last, jnp.zeros_like(a), a) for a in accs)
            jax.lax.fori_loop(0, n_inner * n_k, body, accs)
        else:
            lo, hi = 0, n_k
            if sk > 1:  # this program's share of the K blocks
                per = pl.cdiv(n_k, sk)
                lo = ks * per
                hi = jnp.minimum(lo + per, n_k)
            finish(jax.lax.fori_loop(lo, hi, lambda kb, a: step(fetch(kb, nb0), a), accs), nb0)

    def compute_fused_tail():
        """A tile of block_m + up to block_m_small rows: each K step's weight tile (dense, or
        MXFP4 dequantised once in "split_asm_t") feeds the block_m rows' product and the tail's
        (transposed, w^T . x^T, when transpose_small; always for "split_asm_t")."""
        bm, bt = cfg.block_m, cfg.block_m_small
        rt0 = r0 + bm
        tail_tr = transposed or cfg.transpose_small

        def load_rows(first, rows_n, c0, width, part=None):
            rows = first + jnp.arange(rows_n, dtype=jnp.int32)
            mask = (rows < r1)[:, None]
            if part is None:
                ref, limit = x_ref.at[pl.ds(first, rows_n), pl.ds(c0, width)], k
            else:  # a SplitX: [2, M, K'/2]
                ref = x_ref.at[jnp.int32(part), pl.ds(first, rows_n), pl.ds(c0, width)]
                limit = x_ref.shape[-1]
            if k_ragged:
                mask = mask & (c0 + jnp.arange(width, dtype=jnp.int32) < limit)[None, :]
            return plgpu.load(ref, mask=mask, other=0).astype(cdt)

        def wmask(n0, c0, width, limit):
            if not edge:
                return None
            return col_ok(n0)[:, None] & (c0 + jnp.arange(width, dtype=jnp.int32) < limit)[None, :]

        def body(kb, accs):
            main, tail = list(accs[:n_w]), list(accs[n_w:])
            if quant:  # "split_asm_t": both products w . x^T on one dequantised tile
                h0 = pl.multiple_of(kb * half, half)
                xm = [load_rows(r0, bm, h0, half, p) for p in (0, 1)]
                xt = [load_rows(rt0, bt, h0, half, p) for p in (0, 1)]
                for i in range(n_w):
                    p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
                    pb = _load(p_ref.at[grp, pl.ds(nb0, bn), pl.ds(h0, half)],
                               wmask(nb0, h0, half, hk))
                    sb = _load(s_ref.at[grp, pl.ds(nb0, bn), pl.ds(kb * ng, ng)],
                               wmask(nb0, kb * ng, ng, k // mxfp4.GROUP))
                    if layout == "paired" and not use_asm:
                        pb = paired.decode(pb, jnp)  # the interpreter: back to K3 bytes
                    lo, hi = dequant_split_t(pb, sb, cdt, use_asm, layout)
                    main[i] = main[i] + mm(xm[0], lo) + mm(xm[1], hi)
                    tail[i] = tail[i] + mm(xt[0], lo) + mm(xt[1], hi)
                return (*main, *tail)
            k0 = pl.multiple_of(kb * bk, bk)
            m_ = None
            if edge:
                m_ = (k0 + jnp.arange(bk) < k)[:, None] & col_ok(nb0)[None, :]
            xm, xt = load_rows(r0, bm, k0, bk), load_rows(rt0, bt, k0, bk)
            for i, w_ref in enumerate(w_refs):
                wb = _load(w_ref.at[grp, pl.ds(k0, bk), pl.ds(nb0, bn)], m_).astype(cdt)
                main[i] = main[i] + plgpu.dot(xm, wb, precision=precision)
                if cfg.transpose_small:
                    tail[i] = tail[i] + plgpu.dot(wb, xt, trans_a=True, trans_b=True,
                                                  precision=precision)
                else:
                    tail[i] = tail[i] + plgpu.dot(xt, wb, precision=precision)
            return (*main, *tail)

        main_shape = (bn, bm) if transposed else (bm, bn)
        tail_shape = (bn, bt) if tail_tr else (bt, bn)
        accs = tuple([jnp.zeros(main_shape, jnp.float32)] * n_w
                     + [jnp.zeros(tail_shape, jnp.float32)] * n_w)
        accs = jax.lax.fori_loop(0, n_k, body, accs)
        if quant:
            accs = tuple(a * F16_SHIFT for a in accs)
        val = epilogue(*accs[:n_w])
        store(bm, val.T if transposed else val, nb0)
        val = epilogue(*accs[n_w:])
        store(bt, val.T if tail_tr else val, nb0, first=rt0)

    is_zero = grp == g_count
    is_work = (grp >= 0) & (grp < g_count) & (r1 > r0)
    if cfg.fuse_tail:  # tiles past block_m rows: the fused pair; the rest as below
        fused = (r1 - r0) > cfg.block_m
        pl.when(is_work & fused)(compute_fused_tail)
        is_work = is_work & jnp.logical_not(fused)

    @pl.when(is_zero & (r1 > r0))
    def _():
        for j in range(n_inner):
            store(cfg.block_m, jnp.zeros((cfg.block_m, bn), jnp.float32), nb0 + j * bn)

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



def gmm_call(meta, x_in, flat_w, *, cfg: GmmConfig, k: int, n: int, g: int, quant: bool, n_w: int,
             epilogue, cdt, precision, out_dtype, interpret: bool, layout: str):
    """The kernel's pallas_call: meta the tile plan [3, T] (or each row's group [M]: a tile a
    row), x_in x [M, K] (or a `SplitX`'s data),
    flat_w the n_w weights (MXFP4: packed, scales each) -> [M, N] `out_dtype` (split_k > 1:
    [M, split_k * N], the K splits' partial sums side by side)."""
    m = x_in.shape[-2]
    kernel = functools.partial(_gmm_kernel, cfg=cfg, k=k, n=n, g_count=g, quant=quant, n_w=n_w,
                               epilogue=epilogue, cdt=cdt, precision=precision,
                               use_asm=not interpret, layout=layout)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n * cfg.split_k), out_dtype),
        grid=(pl.cdiv(n, cfg.block_n * cfg.n_per_program) * cfg.split_k, meta.shape[-1]),
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="moe_gmm",
    )(meta, x_in, *flat_w)
