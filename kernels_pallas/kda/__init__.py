"""KDA kernels: the plain-JAX reference (reference.py) and the entry points that dispatch on backend."""
from .reference import kda_chunk_reference, kda_gate, kda_recurrent, l2norm
from .ops import kda_chunk, kda_decode, kda_decode_reference, kda_verify, kda_verify_reference
from .tuning import ChunkConfig

__all__ = ["ChunkConfig", "kda_chunk", "kda_decode", "kda_decode_reference", "kda_verify",
           "kda_verify_reference", "kda_chunk_reference", "kda_gate", "kda_recurrent", "l2norm"]
