"""The tiny Kimi Linear configurations of the HF parity fixtures (make_hf_fixtures.py) and of the
config-form fixtures (make_config_forms.py): KimiLinearConfig keyword arguments, in the legacy form
(linear_attn_config, first_k_dense_replace) that Moonshot's released configs use."""

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    attention_bias=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    num_experts=8,
)

CASES = {
    # (a) KDA, KDA, MLA, KDA; dense layer 0 then MoE with one shared expert; top-2; Kimi-Linear-like router.
    "kda_mla_moe": dict(
        config=dict(
            num_hidden_layers=4,
            linear_attn_config=dict(kda_layers=[1, 2, 4], full_attn_layers=[3], num_heads=2, head_dim=16,
                                    short_conv_kernel_size=4),
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            intermediate_size=96, moe_intermediate_size=16, num_experts_per_token=2, num_shared_experts=1,
            routed_scaling_factor=2.446, moe_renormalize=True, num_expert_group=1, topk_group=1,
            first_k_dense_replace=1,
        ),
        seed=1, seq_len=24, prompt_len=8, new_tokens=8,
    ),
    # (b) MLA first and last (q-LoRA, v_head_dim != qk_nope_head_dim), KDA head_dim 32 in the middle; every layer
    # MoE (first_k_dense_replace 0); top-3; 2 shared experts; no renormalisation; another scaling factor.
    "mla_qlora_top3": dict(
        config=dict(
            num_hidden_layers=3,
            linear_attn_config=dict(kda_layers=[2], full_attn_layers=[1, 3], num_heads=2, head_dim=32,
                                    short_conv_kernel_size=4),
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=24,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            intermediate_size=96, moe_intermediate_size=16, num_experts_per_token=3, num_shared_experts=2,
            routed_scaling_factor=1.5, moe_renormalize=False, num_expert_group=1, topk_group=1,
            first_k_dense_replace=0,
        ),
        seed=2, seq_len=24, prompt_len=6, new_tokens=8,
    ),
    # (c) group-limited routing (4 groups of 2 experts, best 2 groups, top-3) and a prefill longer than one
    # 64-token chunk (HF's chunked KDA path runs 2 chunks).
    "grouped_router_long": dict(
        config=dict(
            num_hidden_layers=4,
            linear_attn_config=dict(kda_layers=[1, 3, 4], full_attn_layers=[2], num_heads=2, head_dim=16,
                                    short_conv_kernel_size=4),
            num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
            intermediate_size=64, moe_intermediate_size=16, num_experts_per_token=3, num_shared_experts=1,
            routed_scaling_factor=2.0, moe_renormalize=True, num_expert_group=4, topk_group=2,
            first_k_dense_replace=1, vocab_size=192,
        ),
        seed=3, seq_len=68, prompt_len=10, new_tokens=8,
    ),
}
