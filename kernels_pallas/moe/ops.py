"""MoE grouped matmul entry points: `moe_gmm` (`jax.lax.ragged_dot` semantics over dense or
MXFP4 expert weights), `moe_gmm_glu` (the gate/up pair with its activation), `gather_rows`, and
`split_x` (x in the even / odd column layout the "split*" MXFP4 kernels read).

Each takes `backend=` ("reference" | "pallas" | "interpret"; None = pallas on GPU, reference
elsewhere: `_backend.resolve_backend`). The Pallas path checks the operands, takes the config
(`tuning.default_config` unless given), lays x out for it, plans the row tiles (`tiles.py`) and
runs the kernel (`kernel.py`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._backend import resolve_backend
from . import mxfp4, paired
from .dequant import dequant_variant, perm_t, perm_t_inverse
from .kernel import GmmConfig, gmm_call
from .reference import glu, is_mxfp4, moe_gmm_glu_reference, moe_gmm_reference
from .tiles import tile_plan
from .tuning import default_config


@jax.tree_util.register_pytree_node_class
class SplitX:
    """x [M, K] in the layout the MXFP4 "split*" kernels read with x_split="pre": data [2, M, K'/2]
    (x's even, then odd columns; "split_asm_t": in `dequant.perm_t` order per K block, K' = K
    padded to whole blocks of `block_k`). `split_x` builds it; `moe_gmm` takes it in place of x
    when its config needs this layout (checked), so a caller can split once for several products
    (gate and up) or before a row gather (`take`: the MoE layer splits its N tokens, not the
    N * top-k gathered rows)."""

    def __init__(self, data, k: int, block_k: int, dequant: str):
        self.data, self.k, self.block_k, self.dequant = data, k, block_k, dequant

    def tree_flatten(self):
        return (self.data,), (self.k, self.block_k, self.dequant)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def shape(self):
        return (self.data.shape[1], self.k)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def ndim(self):
        return 2

    def take(self, rows):
        """The split of x[rows] (a gather of rows; columns untouched)."""
        return SplitX(jnp.take(self.data, rows, axis=1), self.k, self.block_k, self.dequant)

    def dense(self):
        """x [M, K] back (the reference backend, configs that read x as it is)."""
        d = self.data
        if self.dequant == "split_asm_t":
            d = perm_t_inverse(d, self.block_k // 32)
        m = d.shape[1]
        return jnp.moveaxis(d, 0, 2).reshape(m, -1)[:, : self.k]


def needs_split_x(cfg: GmmConfig) -> bool:
    """Whether the kernel of `cfg` (MXFP4 weights) reads x as a `SplitX`."""
    return dequant_variant(cfg.dequant)[0] and cfg.x_split == "pre"


def split_x(x, config: GmmConfig):
    """x [M, K] -> `SplitX` for MXFP4 products with `config` (see `needs_split_x`)."""
    if not needs_split_x(config):
        raise ValueError(f"config {config.name()} reads x as it is (dequant {config.dequant!r}, "
                         f"x_split {config.x_split!r}); split_x is for the 'split*' variants with "
                         f"x_split='pre'")
    m, k = x.shape
    xp = x
    if config.dequant == "split_asm_t" and k % config.block_k:  # whole K blocks for `perm_t`
        xp = jnp.pad(x, ((0, 0), (0, -k % config.block_k)))
    d = jnp.moveaxis(xp.reshape(m, xp.shape[1] // 2, 2), 2, 0)  # [2, M, K/2]: even, odd
    if config.dequant == "split_asm_t":
        d = perm_t(d, config.block_k // 32)
    return SplitX(d, k, config.block_k, config.dequant)


def gather_rows(x, rows, w, *, backend: str | None = None, fused_glu: bool = False):
    """x[rows] as moe_gmm(., w) (default config; `fused_glu`: moe_gmm_glu(fuse=True)) reads it:
    where that kernel reads a `SplitX`, x's own rows are split and then gathered, so the split
    touches x (the MoE layer's N tokens) instead of the N * top-k gathered rows."""
    backend = resolve_backend(backend)
    if backend == "reference" or not is_mxfp4(w):
        return x[rows]
    gathered = jax.ShapeDtypeStruct((rows.shape[0], x.shape[1]), x.dtype)  # what moe_gmm sees
    cfg = _resolve_config(gathered, (w, w) if fused_glu else (w,), None, backend == "interpret")
    return split_x(x, cfg).take(rows) if needs_split_x(cfg) else x[rows]


def _check(x, ws, group_sizes, row_groups=None):
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K], got {x.shape}")
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) != 1:
        raise ValueError(f"weights disagree in shape: {shapes}")
    g, k, n = ws[0].shape
    if k != x.shape[1]:
        raise ValueError(f"x has K={x.shape[1]}, weights have K={k}")
    if (group_sizes is None) == (row_groups is None):
        raise ValueError("pass either group_sizes (rows sorted by group) or row_groups (each "
                         "row's group), not both or neither")
    if group_sizes is not None and group_sizes.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes.shape}")
    if row_groups is not None and row_groups.shape != (x.shape[0],):
        raise ValueError(f"row_groups must be [M] = [{x.shape[0]}] (a group per row of x), got "
                         f"{row_groups.shape}")
    if any(is_mxfp4(w) for w in ws) and not all(is_mxfp4(w) for w in ws):
        raise ValueError("mixing MXFP4 and dense weights in one call is not supported")
    return g, k, n


def _resolve_config(x, ws, config, interpret):
    """The config a moe_gmm call runs: `config`, else default_config of the shapes."""
    if config is not None:
        return config
    g, k, n = ws[0].shape
    quant = is_mxfp4(ws[0])
    return default_config(x.shape[0], g, k, n, quant, len(ws) > 1,
                          platform="interpret" if interpret else None, x_dtype=x.dtype,
                          layout=ws[0].layout if quant else "k3")


def _gmm_pallas(x, ws, group_sizes, *, epilogue, out_dtype, config, interpret, precision,
                row_groups=None):
    g, k, n = _check(x, ws, group_sizes, row_groups)
    m = x.shape[0]
    quant = is_mxfp4(ws[0])
    if m == 0:
        return jnp.zeros((0, n), out_dtype)
    cdt = x.dtype if quant else jnp.promote_types(x.dtype, ws[0].dtype)
    if precision is None and jnp.dtype(cdt) == jnp.float32:
        precision = jax.lax.Precision.HIGHEST
    layout = ws[0].layout if quant else "k3"
    if quant and any(w.layout != layout for w in ws):  # (a jax.Array has its own .layout)
        raise ValueError("mixing MXFP4 layouts (k3 / paired) in one call is not supported")
    cfg = _resolve_config(x, ws, config, interpret)
    if layout == "paired":
        _check_paired(cfg, interpret)
    if quant and cfg.transpose_small:
        raise ValueError("transpose_small applies to dense weights; MXFP4 weights take the "
                         "transposed product through dequant='split_asm_t'")
    if quant and (cfg.block_k % mxfp4.GROUP or k % mxfp4.GROUP):
        raise ValueError(f"MXFP4 needs block_k and K multiples of {mxfp4.GROUP}")
    if quant and needs_split_x(cfg):
        if not isinstance(x, SplitX):
            x = split_x(x, cfg)
        elif (x.block_k, x.dequant) != (cfg.block_k, cfg.dequant):
            raise ValueError(f"x was split for block_k={x.block_k}, dequant={x.dequant!r}; the "
                             f"config is {cfg.name()}: split it with split_x(x, config) for the "
                             f"config moe_gmm runs (default_config of the same shapes)")
        x_in = x.data
    else:
        x_in = x.dense() if isinstance(x, SplitX) else x
    if cfg.fuse_tail and quant and (cfg.dequant != "split_asm_t" or cfg.x_split != "pre"):
        raise ValueError("fuse_tail with MXFP4 weights needs dequant='split_asm_t' with x_split="
                         f"'pre' (one dequantised tile for both products), got {cfg.name()}")
    if cfg.split_k > 1 and len(ws) > 1:
        raise ValueError("split_k sums partial products after the kernel, so the fused gate/up "
                         "(its activation in the epilogue) cannot take it: use fuse=False")
    if row_groups is not None:  # the kernel takes tile t as row t of group row_groups[t]
        meta = row_groups.astype(jnp.int32)
    else:
        meta = tile_plan(group_sizes, m, cfg.block_m, interpret=interpret,
                         tail=cfg.block_m_small if cfg.fuse_tail else 0)  # one launch
    flat_w = []
    for w in ws:
        flat_w += [w.packed, w.scales] if quant else [w]
    out = gmm_call(meta, x_in, flat_w, cfg=cfg, k=k, n=n, g=g, quant=quant, n_w=len(ws),
                   epilogue=epilogue, cdt=cdt, precision=precision,
                   out_dtype=jnp.float32 if cfg.split_k > 1 else out_dtype,
                   interpret=interpret, layout=layout)
    if cfg.split_k > 1:  # XLA fuses the sum into the cast and the layer's next elementwise op
        out = out.reshape(m, cfg.split_k, n).sum(axis=1).astype(out_dtype)
    return out


def _check_paired(cfg: GmmConfig, interpret: bool):
    """The paired layout decodes with CUDA PTX in the "split_asm_t" product only (the interpreter
    decodes it back to K3 bytes in the kernel, any variant)."""
    if cfg.block_n % paired.ROWS:
        raise ValueError(f"paired MXFP4 weights need block_n a multiple of {paired.ROWS}, "
                         f"got {cfg.block_n}")
    if not interpret and cfg.dequant != "split_asm_t":
        raise ValueError(f"paired MXFP4 weights are decoded by the CUDA 'split_asm_t' kernel only "
                         f"(config dequant={cfg.dequant!r}); use dequant='split_asm_t' on an NVIDIA "
                         f"GPU, or load the weights in the K3 layout (mxfp4_layout='k3') elsewhere")


def moe_gmm(x, w, group_sizes=None, *, row_groups=None, backend: str | None = None,
            preferred_element_type=None, config: GmmConfig | None = None, precision=None):
    """Grouped matmul, `jax.lax.ragged_dot` semantics: out[i] = x[i] @ w[group(i)].

    x [M, K]; w [G, K, N] dense or `MXFP4Weight(packed [G, N, K/2], scales [G, N, K/32])`;
    group_sizes [G] int32, sum <= M (rows sorted by group; rows past the sum are zero). Or, in
    its place, row_groups [M] int32 in [0, G]: each row's group, rows in any order (G: a zero
    row); the kernel then takes a tile per row, with no plan to compute: for a few rows (a
    decode step's routed pairs) that saves the sort that grouping needs, and re-reads a group's
    weights for each of its rows. fp32 accumulation; output in `preferred_element_type` or
    x.dtype. backend: "reference" | "pallas" | "interpret" | None.
    """
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if backend == "reference":
        x = x.dense() if isinstance(x, SplitX) else x
        return moe_gmm_reference(x, w, group_sizes, row_groups=row_groups,
                                 preferred_element_type=out_dtype)
    return _gmm_pallas(x, (w,), group_sizes, epilogue=lambda a: a, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision,
                       row_groups=row_groups)


def moe_gmm_glu(x, w1, w3, group_sizes=None, *, row_groups=None, activation: str = "swiglu",
                backend: str | None = None, preferred_element_type=None,
                config: GmmConfig | None = None, precision=None, situ_beta: float = 4.0,
                situ_linear_beta: float = 25.0, fuse: bool = False):
    """Gate/up: act(x @ w1[g]) * (x @ w3[g]) (activation "swiglu" or "situ": SiTU(a) *
    25 tanh(b / 25)). w1, w3 and group_sizes or row_groups as in `moe_gmm` (both weights
    dense or both MXFP4). `fuse`: one pass over
    x with both products and the activation in the kernel's epilogue; False: two `moe_gmm`
    launches with fp32 outputs, then the activation in XLA (same math, an [M, N] fp32 pair in
    memory). Unfused is the default: inside the K3 layer on the GPU it was the faster form
    (BENCHMARKS.md)."""
    backend = resolve_backend(backend)
    out_dtype = preferred_element_type or x.dtype
    if not fuse and backend != "reference":
        cfg = _resolve_config(x, (w1,), config, backend == "interpret")
        if is_mxfp4(w1) and needs_split_x(cfg) and not isinstance(x, SplitX):
            x = split_x(x, cfg)  # once for both products
        a, b = (moe_gmm(x, w, group_sizes, row_groups=row_groups, backend=backend,
                        preferred_element_type=jnp.float32, config=config, precision=precision)
                for w in (w1, w3))
        return glu(a, b, activation, situ_beta=situ_beta,
                   situ_linear_beta=situ_linear_beta).astype(out_dtype)
    if isinstance(x, SplitX) and backend == "reference":
        x = x.dense()
    if backend == "reference":
        return moe_gmm_glu_reference(x, w1, w3, group_sizes, row_groups=row_groups,
                                     activation=activation,
                                     preferred_element_type=out_dtype, situ_beta=situ_beta,
                                     situ_linear_beta=situ_linear_beta)
    glu(jnp.zeros(()), jnp.zeros(()), activation)  # validate the name early
    epi = functools.partial(glu, activation=activation, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)
    return _gmm_pallas(x, (w1, w3), group_sizes, epilogue=epi, out_dtype=out_dtype,
                       config=config, interpret=backend == "interpret", precision=precision,
                       row_groups=row_groups)
