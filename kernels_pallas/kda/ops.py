"""KDA entry points. Each takes `backend=` ("reference" | "pallas" | "interpret"; None = pallas on
GPU, reference elsewhere)."""
from __future__ import annotations

from .._backend import resolve_backend
from .reference import kda_chunk_reference


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
              use_qk_l2norm: bool = False, backend: str | None = None):
    """Chunked KDA prefill: (o [B,T,H,V], final_state [B,H,K,V] fp32). See reference.py."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return kda_chunk_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   lengths=lengths, use_qk_l2norm=use_qk_l2norm)
    # The Pallas chunk kernel (issue 4) plugs in here.
    from .chunk_pallas import kda_chunk_pallas

    return kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            lengths=lengths, use_qk_l2norm=use_qk_l2norm,
                            interpret=backend == "interpret")
