"""KDA entry points. Each takes `backend=` ("reference" | "pallas" | "interpret"; None = pallas on
GPU, reference elsewhere)."""
from __future__ import annotations

from .._backend import resolve_backend
from .reference import kda_chunk_reference


def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, lengths=None,
              use_qk_l2norm: bool = False, backend: str | None = None, safe_gate: bool = False,
              **kernel_options):
    """Chunked KDA prefill: (o [B,T,H,V], final_state [B,H,K,V] fp32). See reference.py.

    safe_gate=True: the caller promises g >= -5 per token (K3's bounded gate); the Pallas kernel
    then forms its diagonal 16x16 blocks with one matmul instead of per-element exps.
    kernel_options: `config=ChunkConfig(...)` (tuning.py: block sizes, warps and stages per
    launch; the fields it sets override the tuned configuration)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return kda_chunk_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   lengths=lengths, use_qk_l2norm=use_qk_l2norm)
    from .chunk_pallas import kda_chunk_pallas

    return kda_chunk_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            lengths=lengths, use_qk_l2norm=use_qk_l2norm,
                            interpret=backend == "interpret", safe_gate=safe_gate,
                            **kernel_options)


from .decode import kda_decode, kda_decode_reference  # noqa: E402
from .verify import kda_verify, kda_verify_reference  # noqa: E402
