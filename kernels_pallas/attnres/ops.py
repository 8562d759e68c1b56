"""Entry point of the fused AttnRes mix + RMSNorm: `attn_res_norm(..., backend=)` ("reference" |
"pallas" | "interpret"; None = pallas on GPU, reference elsewhere)."""
from __future__ import annotations

import jax.numpy as jnp

from .._backend import resolve_backend
from .kernel import attn_res_norm_pallas
from .reference import attn_res_norm_reference
from .tuning import NormConfig, norm_config

# Fewer tokens than this leave the kernel a few programs, each reading its rows' whole hidden
# size alone; XLA's fusion spreads them over the GPU and was faster there (BENCHMARKS.md, AttnRes
# rows; the kernel won from 64). The interpreter runs the kernel at any size.
MIN_TOKENS = 64


def attn_res_norm(bank, residual, delta, g, w, gain, *, eps: float, backend: str | None = None,
                  config: NormConfig | None = None):
    """AttnRes mix of the stored blocks and the residual stream, then the Kimi RMSNorm.

    bank: sequence of [..., H] block rows (may be empty: no mix, as at the first layer);
    residual, delta: [..., H], the stream before a pending sublayer output and that output
    (either may be None: the stream is the other); g, w: the mix's key-norm gain and
    pseudo-query [H] (unused with an empty bank); gain: the RMSNorm weight [H].
    Returns (y, s): the normalised rows and the residual stream s = residual + delta, which is
    bit-identical on every backend (the caller persists it, and freezes it as a bank row at a
    block end)."""
    backend = resolve_backend(backend)
    rows = residual if residual is not None else delta
    tokens = rows.size // rows.shape[-1] if rows.size else 0
    if backend == "reference" or tokens == 0 or (backend == "pallas" and tokens < MIN_TOKENS):
        return attn_res_norm_reference(bank, residual, delta, g, w, gain, eps=eps)
    if residual is None:
        residual, delta = delta, None
    lead, H = residual.shape[:-1], residual.shape[-1]
    flat = lambda x: x.reshape(-1, H)  # noqa: E731
    c = (g.astype(jnp.float32) * w.astype(jnp.float32) if len(bank)
         else jnp.zeros((H,), jnp.float32))
    cfg = norm_config(flat(residual).shape[0], H, config)
    y, s = attn_res_norm_pallas(tuple(flat(b) for b in bank), flat(residual),
                                None if delta is None else flat(delta), c, gain, eps=float(eps),
                                block_t=cfg.block_t, block_h=cfg.block_h,
                                num_warps=cfg.num_warps, interpret=backend == "interpret")
    return y.reshape(lead + (H,)), (residual if s is None else s.reshape(lead + (H,)))
