"""MoE kernels: grouped matmul (ragged_dot) over dense or MXFP4 expert weights, and the MXFP4 codec.

By stage: `ops` (entry points, backend dispatch), `tuning` (block configurations), `tiles` (the
row-tile plan), `kernel` (the grouped matmul), `dequant` (MXFP4 in the kernel), `reference`."""
from . import mxfp4, paired
from .kernel import GmmConfig
from .ops import SplitX, gather_rows, moe_gmm, moe_gmm_glu, needs_split_x, split_x
from .reference import (MXFP4PairedWeight, MXFP4Weight, glu, moe_gmm_glu_reference,
                        moe_gmm_reference, pair_mxfp4, situ)
from .tiles import tile_metadata
from .tuning import default_config

__all__ = ["mxfp4", "paired", "GmmConfig", "default_config", "moe_gmm", "moe_gmm_glu",
           "tile_metadata", "SplitX", "split_x", "needs_split_x", "gather_rows", "MXFP4Weight",
           "MXFP4PairedWeight", "pair_mxfp4", "glu", "moe_gmm_glu_reference", "moe_gmm_reference",
           "situ"]
