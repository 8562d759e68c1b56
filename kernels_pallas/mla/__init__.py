"""MLA kernels: absorbed decode over the paged latent cache (flash-decoding, bf16/fp8 cache), the
exact log-sum-exp merge of partial results, and a causal variable-length prefill attention; each
beside its plain-JAX reference (reference.py). Entry points: ops.py; configurations: tuning.py."""
from .reference import (fp8_to_words, merge_partials, merge_stacked, mla_decode_reference,
                        mla_prefill_reference, words_to_fp8)
from .ops import mla_decode, mla_prefill
from .prefill import mla_prefill_chunked
from .tuning import DecodeConfig, PrefillConfig

__all__ = ["fp8_to_words", "words_to_fp8", "mla_decode", "mla_decode_reference", "merge_partials",
           "merge_stacked", "mla_prefill", "mla_prefill_chunked", "mla_prefill_reference",
           "DecodeConfig", "PrefillConfig"]
