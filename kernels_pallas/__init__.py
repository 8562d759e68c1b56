"""Pallas kernels (Triton lowering: runs on ROCm and CUDA) with their plain-JAX references.

Imports nothing from kimik3/, sharding/ or serve/.
"""
from . import _triton_offsets
from ._backend import BACKENDS, resolve_backend

_triton_offsets.apply()  # before any kernel lowers: int32 offsets wrap on 2-4 GiB uint8/fp8 arrays
from .kda import (kda_chunk, kda_chunk_reference, kda_decode, kda_decode_reference, kda_gate,
                  kda_recurrent, kda_verify, kda_verify_reference, l2norm)

__all__ = ["BACKENDS", "resolve_backend", "kda_chunk", "kda_chunk_reference", "kda_gate",
           "kda_recurrent", "l2norm", "kda_decode", "kda_decode_reference", "kda_verify",
           "kda_verify_reference"]

from .mla import (merge_partials, mla_decode, mla_decode_reference, mla_prefill,  # noqa: E402
                  mla_prefill_reference)

__all__ += ["mla_decode", "mla_decode_reference", "merge_partials", "mla_prefill",
            "mla_prefill_reference"]

from .moe import (GmmConfig, MXFP4PairedWeight, MXFP4Weight, moe_gmm, moe_gmm_glu,  # noqa: E402
                  moe_gmm_glu_reference, moe_gmm_reference, pair_mxfp4)
from .moe import tile_metadata as moe_gmm_tile_metadata  # noqa: E402

__all__ += ["GmmConfig", "MXFP4Weight", "MXFP4PairedWeight", "pair_mxfp4", "moe_gmm",
            "moe_gmm_glu", "moe_gmm_glu_reference", "moe_gmm_reference", "moe_gmm_tile_metadata"]

from .attnres import NormConfig, attn_res_norm, attn_res_norm_reference  # noqa: E402

__all__ += ["NormConfig", "attn_res_norm", "attn_res_norm_reference"]
