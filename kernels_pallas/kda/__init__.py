"""KDA kernels: the plain-JAX reference (reference.py) and the entry points that dispatch on backend."""
from .reference import kda_chunk_reference, kda_gate, kda_recurrent, l2norm
from .ops import kda_chunk

__all__ = ["kda_chunk", "kda_chunk_reference", "kda_gate", "kda_recurrent", "l2norm"]
