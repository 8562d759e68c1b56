"""Per-device memory for K3 on 8 devices (the source documents' example: 142K tokens, fp8 cache)."""
import kimik3


def test_k3_tp8_and_dcp8_at_142k_tokens():
    cfg = kimik3.Config.preset("kimi-k3")
    tp8 = kimik3.memory_report(cfg, tensor=8, tokens=142_000, cache_dtype="float8_e4m3fn")
    dcp8 = kimik3.memory_report(cfg, tensor=8, dcp=8, tokens=142_000, cache_dtype="float8_e4m3fn")
    print(f"\nK3 TP8: params {tp8['params'] / 2**30:.1f} GiB/GPU, MLA cache {tp8['mla_cache'] / 1e9:.3f} GB, "
          f"KDA state {tp8['kda_state'] / 2**20:.1f} MiB; TP8+DCP8: MLA cache {dcp8['mla_cache'] / 1e6:.1f} MB; "
          f"dedup frees {tp8['dedup_saved'] / 2**30:.2f} GiB/GPU")
    assert tp8["mla_cache"] == 24 * 142_000 * 576  # 1.96 GB, as the source documents say
    assert abs(dcp8["mla_cache"] - 245.4e6) < 0.1e6  # ~245 MB
    assert tp8["params"] == dcp8["params"]  # DCP ranks are TP ranks for the weights
    assert 3.8 < tp8["dedup_saved"] / 2**30 < 3.9  # the documents: about 3.85 GiB per GPU over 92 layers
    no_dedup = kimik3.memory_report(cfg, tensor=8, tokens=142_000, dedup=False)
    assert no_dedup["params"] - tp8["params"] == tp8["dedup_saved"]
    # 2.8T params, mostly MXFP4 (0.53 B each), plus what TP8 replicates (embeddings, latent down-proj):
    # about 205 GB per GPU, within an MI355X's 288 GB, beyond an H200's 141 GB
    assert 190e9 < tp8["params"] < 215e9


def test_k3_expert_parallel_holds_a_share_of_the_experts():
    cfg = kimik3.Config.preset("kimi-k3")
    tp8 = kimik3.memory_report(cfg, tensor=8)
    ep8 = kimik3.memory_report(cfg, expert=8)
    tp2_ep4 = kimik3.memory_report(cfg, tensor=2, expert=4)
    # 896 MXFP4 experts per MoE layer: 3 matrices of 3584 x 3072 at half a byte plus a scale byte per 32
    per_expert = 3 * 3584 * 3072 * (1 / 2 + 1 / 32)
    for r in (tp8, ep8, tp2_ep4):  # every layout splits them 8 ways
        assert r["routed_experts"] == cfg.num_moe_layers * 896 * per_expert / 8
    # EP8 keeps attention, shared experts and the up-projection whole on every rank (no dedup without TP)
    one = kimik3.memory_report(cfg)
    assert ep8["params"] - ep8["routed_experts"] == one["params"] - one["routed_experts"]
    assert ep8["dedup_saved"] == 0 and tp2_ep4["dedup_saved"] > 0
    assert tp8["params"] < tp2_ep4["params"] < ep8["params"]
