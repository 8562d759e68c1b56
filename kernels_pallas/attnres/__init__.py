"""AttnRes: the mix over stored block sums fused with the RMSNorm after it (kernel.py), beside
its plain-JAX reference (reference.py). Entry point: ops.py; configuration: tuning.py."""
from .reference import attn_res_mix, attn_res_norm_reference, residual_sum, rms_normalize
from .ops import attn_res_norm
from .tuning import NormConfig

__all__ = ["attn_res_mix", "attn_res_norm", "attn_res_norm_reference", "residual_sum",
           "rms_normalize", "NormConfig"]
