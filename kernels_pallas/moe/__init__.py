"""MoE kernels: grouped matmul (ragged_dot) over dense or MXFP4 expert weights, and the MXFP4 codec."""
from . import mxfp4, paired
from .gmm import (GmmConfig, SplitX, default_config, gather_rows, moe_gmm, moe_gmm_glu,
                  needs_split_x, split_x, tile_metadata)
from .reference import (MXFP4PairedWeight, MXFP4Weight, glu, moe_gmm_glu_reference,
                        moe_gmm_reference, pair_mxfp4, situ)

__all__ = ["mxfp4", "paired", "GmmConfig", "default_config", "moe_gmm", "moe_gmm_glu",
           "tile_metadata", "SplitX", "split_x", "needs_split_x", "gather_rows", "MXFP4Weight",
           "MXFP4PairedWeight", "pair_mxfp4", "glu", "moe_gmm_glu_reference", "moe_gmm_reference",
           "situ"]
