"""The reference model for end-to-end figures: the first `depth` layers of Kimi K3 with one TP8
rank's shapes (12 KDA heads, 12 MLA heads, 896 MXFP4 experts of intermediate 3072/8, shared
experts 2 x 3072/8, dense layer 0 at 33792/8, vocab 163840/8), K3's layer pattern (an MLA layer
every 4th) and AttnRes block 12; random weights. With --smoke: the tiny preset."""
from __future__ import annotations

import kimik3


def k3_slice(depth: int = 12, smoke: bool = False, mla_cache: str = "auto") -> kimik3.Config:
    if smoke:
        return kimik3.Config.preset("tiny").replace(mla_cache_dtype=mla_cache)
    types = tuple("mla" if (i + 1) % 4 == 0 else "kda" for i in range(depth))
    return kimik3.Config.preset("kimi-k3").replace(
        name=f"k3-tp8-rank-{depth}L", num_layers=depth, layer_types=types, kda_num_heads=12,
        mla_num_heads=12, intermediate_size=33792 // 8, moe_intermediate_size=3072 // 8,
        vocab_size=163840 // 8, attn_res_block_size=12, mla_cache_dtype=mla_cache,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # K3's ids lie past this vocabulary
