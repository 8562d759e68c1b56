"""Pallas kernels (Triton lowering: runs on ROCm and CUDA) with their plain-JAX references.

Imports nothing from kimik3/, sharding/ or serve/.
"""
from ._backend import BACKENDS, resolve_backend
from .kda import kda_chunk, kda_chunk_reference, kda_gate, kda_recurrent, l2norm

__all__ = ["BACKENDS", "resolve_backend", "kda_chunk", "kda_chunk_reference", "kda_gate",
           "kda_recurrent", "l2norm"]
