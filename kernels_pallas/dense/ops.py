"""Entry point of the skinny matmul: `skinny_matmul(x, weights, backend=)` ("reference" |
"pallas" | "interpret"; None = pallas on GPU, reference elsewhere)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from .._backend import resolve_backend
from .kernel import skinny_matmul_pallas
from .reference import skinny_matmul_reference
from .tuning import SkinnyConfig, skinny_config

# Up to SHORT_ROWS rows the kernel was as fast as XLA's GEMMs or faster at every group of a K3
# rank; up to MAX_ROWS it still won where K is at least LONG_K (the projections of the hidden
# state: 1.4-1.8x at 256 rows) and lost where K is short (the output projections).
SHORT_ROWS = 64
MAX_ROWS = 256
LONG_K = 4096
MIN_K = 768  # the shortest K measured; shorter ones (KDA's f_b, K 128) keep XLA's dot


def on_kernel(m: int, k: int, backend: str) -> bool:
    """Whether x [m, k] goes through the kernel: on the GPU at decode widths (at most SHORT_ROWS
    rows, or MAX_ROWS where K is at least LONG_K; K at least MIN_K); in the interpreter (tests)
    at any K it takes (a multiple of 16) up to MAX_ROWS rows."""
    if backend == "reference" or not 0 < m <= MAX_ROWS or k % 16:
        return False
    return backend == "interpret" or (k >= MIN_K and m <= (SHORT_ROWS if k < LONG_K else MAX_ROWS))


def skinny_matmul(x, weights, *, out_dtypes=None, backend: str | None = None,
                  config: SkinnyConfig | None = None):
    """x [..., K] times each of `weights` ([K, N_i], cast to x's dtype) -> a tuple of [..., N_i],
    each in its `out_dtypes` entry (None, or no list: x's dtype; fp32 keeps the fp32 accumulation,
    as the router's logits need): one launch for the group at decode widths (`on_kernel`), XLA's
    dot otherwise and on the reference backend. The kernel accumulates in fp32 like XLA's GEMMs,
    in another order: results agree to the output dtype's rounding."""
    backend = resolve_backend(backend)
    weights = tuple(weights)
    out_dtypes = tuple(jnp.dtype(d or x.dtype).name for d in (out_dtypes or [None] * len(weights)))
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    if len(out_dtypes) != len(weights):
        raise ValueError(f"{len(out_dtypes)} out_dtypes for {len(weights)} weights: give one a weight")
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"a weight of shape {w.shape} does not take inputs of width {k}")
    if not on_kernel(m, k, backend):
        return skinny_matmul_reference(x, weights, out_dtypes)
    cfg = skinny_config(m, k, config)
    ys = skinny_matmul_pallas(x.reshape(m, k), tuple(w.astype(x.dtype) for w in weights),
                              out_dtypes=out_dtypes, block_m=cfg.block_m, block_n=cfg.block_n,
                              block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              interpret=backend == "interpret")
    return tuple(y.reshape(lead + (y.shape[-1],)) for y in ys)
