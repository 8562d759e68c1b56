"""Entry point of the skinny matmul: `skinny_matmul(x, weights, backend=)` ("reference" |
"pallas" | "interpret"; None = pallas on GPU, reference elsewhere)."""
from __future__ import annotations

import math

from .._backend import resolve_backend
from .kernel import skinny_matmul_pallas
from .reference import skinny_matmul_reference
from .tuning import SkinnyConfig, skinny_config

# Past this many rows XLA's GEMM was as fast or faster at some of a K3 rank's groups (at 256 rows
# it won where N is 7168 and more; the kernel won the K-7168 groups)
MAX_ROWS = 64


def skinny_matmul(x, weights, *, backend: str | None = None, config: SkinnyConfig | None = None):
    """x [..., K] times each of `weights` ([K, N_i], cast to x's dtype) -> a tuple of [..., N_i]
    in x's dtype: one launch for the group at decode widths (at most MAX_ROWS rows and K a
    multiple of 16), XLA's dot otherwise and on the reference backend. The kernel accumulates in
    fp32 like XLA's GEMMs, in another order: results agree to the output dtype's rounding."""
    backend = resolve_backend(backend)
    weights = tuple(weights)
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    for w in weights:
        if w.ndim != 2 or w.shape[0] != k:
            raise ValueError(f"a weight of shape {w.shape} does not take inputs of width {k}")
    if backend == "reference" or not 0 < m <= MAX_ROWS or k % 16:
        return skinny_matmul_reference(x, weights)
    cfg = skinny_config(m, k, config)
    ys = skinny_matmul_pallas(x.reshape(m, k), tuple(w.astype(x.dtype) for w in weights),
                              block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                              num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                              interpret=backend == "interpret")
    return tuple(y.reshape(lead + (y.shape[-1],)) for y in ys)
