import json

import pytest

import kimik3
from kimik3 import Config, ConfigError


def test_presets_have_the_published_layouts():
    k3 = Config.preset("kimi-k3")
    assert (len(k3.kda_layers), len(k3.mla_layers), k3.num_moe_layers) == (69, 24, 92)
    assert k3.mla_layers[:3] == (3, 7, 11) and k3.mla_layers[-2:] == (91, 92)
    kl = Config.preset("kimi-linear-48b")
    assert (len(kl.kda_layers), len(kl.mla_layers)) == (20, 7)
    assert kl.gate_lower_bound is None and kl.attn_res_block_size == 0


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'kimi-k9'.*kimi-k3"):
        Config.preset("kimi-k9")


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", 0, "positive"),
    ("layer_types", ("kda",), "one entry per layer"),
    ("gate_lower_bound", -7.0, r"\[-5, 0\)"),
    ("num_experts_per_token", 999, "num_experts_per_token"),
    ("hidden_act", "gelu", "hidden_act"),
    ("mla_use_nope", False, "rotary"),
    ("moe_intermediate_size", 48, "multiple of 32"),
])
def test_invalid_values_fail_at_construction_naming_the_field(field, value, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        Config.preset("tiny").replace(**{field: value})
    assert f"Config.{field}" in str(e.value) or field == "moe_intermediate_size"


KIMI_LINEAR_JSON = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "num_hidden_layers": 27, "intermediate_size": 9216, "rms_norm_eps": 1e-5,
    "num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.446,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "num_expert_group": 1,
    "topk_group": 1, "hidden_act": "silu", "bos_token_id": 163584, "eos_token_id": 163586,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                           "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                           "num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
}


def test_from_hf_kimi_linear_matches_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR_JSON))
    cfg = Config.from_hf(tmp_path)
    preset = Config.preset("kimi-linear-48b")
    for f in ("layer_types", "kda_num_heads", "gate_lower_bound", "use_full_rank_gate", "q_lora_rank",
              "num_experts", "routed_scaling_factor", "hidden_act", "attn_res_block_size", "expert_format"):
        assert getattr(cfg, f) == getattr(preset, f), f
    assert kimik3.param_count(cfg) == kimik3.param_count(preset)


def test_from_hf_transformers_layer_types(tmp_path):
    raw = {k: v for k, v in KIMI_LINEAR_JSON.items() if k != "linear_attn_config"}
    raw["layer_types"] = ["full_attention" if i + 1 in (4, 8, 12, 16, 20, 24, 27) else "linear_attention"
                          for i in range(27)]
    raw["linear_attn_config"] = None
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert Config.from_hf(tmp_path).layer_types == Config.preset("kimi-linear-48b").layer_types


def test_from_hf_k3_text_config(tmp_path):
    k3 = Config.preset("kimi-k3")
    full = [i + 1 for i in k3.mla_layers]
    text = {
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93,
        "intermediate_size": 33792, "rms_norm_eps": 1e-5, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": [i for i in range(1, 94) if i not in full],
                               "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    }
    raw = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
           "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "text_config": text,
           "vision_config": {"model_type": "moonvit3d"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = Config.from_hf(tmp_path)
    for f in ("layer_types", "kda_num_heads", "gate_lower_bound", "use_full_rank_gate", "mla_use_output_gate",
              "num_experts", "routed_expert_hidden_size", "hidden_act", "attn_res_block_size",
              "expert_format", "eos_token_id", "pad_token_id"):
        assert getattr(cfg, f) == getattr(k3, f), f


def test_from_hf_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Config.from_hf(tmp_path)
    bad = dict(KIMI_LINEAR_JSON, linear_attn_config={"full_attn_layers": [4, 99]})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"\[99\] outside 1..27"):
        Config.from_hf(tmp_path)


def _one_line_error(tmp_path, raw_text):
    (tmp_path / "config.json").write_text(raw_text)
    with pytest.raises(ConfigError) as e:
        Config.from_hf(tmp_path)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith(str(tmp_path / "config.json") + ": "), msg
    return msg


def test_config_json_errors_are_one_line_naming_the_file(tmp_path):
    assert "not valid JSON" in _one_line_error(tmp_path, '{"vocab_size": 163840,,}')
    for field in ("num_hidden_layers", "vocab_size", "hidden_size"):
        raw = {k: v for k, v in KIMI_LINEAR_JSON.items() if k != field}
        assert f"missing required field '{field}'" in _one_line_error(tmp_path, json.dumps(raw))
    raw = dict(KIMI_LINEAR_JSON, num_hidden_layers="27")
    assert "num_hidden_layers must be an integer" in _one_line_error(tmp_path, json.dumps(raw))
    # kimik3.load reports the same line (it used to json.load the file itself first)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        kimik3.load(tmp_path)


@pytest.mark.parametrize("changes,field", [
    ({"eos_token_id": 163840}, "eos_token_id"),  # one past the last id
    ({"vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 99999}, "eos_token_id"),
    ({"eos_token_id": [163586, 200000]}, "eos_token_id"),
    ({"vocab_size": 1000}, "bos_token_id"),  # bos/eos/pad ids of 163584.. do not fit
    ({"pad_token_id": -1}, "pad_token_id"),
])
def test_special_token_ids_outside_the_vocabulary(tmp_path, changes, field):
    msg = _one_line_error(tmp_path, json.dumps(dict(KIMI_LINEAR_JSON, **changes)))
    assert field in msg and "vocab_size" in msg, msg
    with pytest.raises(ConfigError, match=f"Config.{field}"):
        Config.preset("tiny").replace(**{field: 320})  # tiny's vocabulary is 0..319


def test_dtype_arguments_take_what_jax_users_pass():
    import jax.numpy as jnp
    import numpy as np

    tiny = Config.preset("tiny")
    for given in ("float32", jnp.float32, np.float32, jnp.dtype("float32"), np.dtype("float32")):
        assert tiny.replace(dtype=given, param_dtype=given) == tiny  # canonical names
    cfg = tiny.replace(dtype=jnp.dtype("bfloat16"), router_dtype=jnp.bfloat16)
    assert (cfg.dtype, cfg.router_dtype, cfg.jnp_dtype) == ("bfloat16", "bfloat16", jnp.bfloat16)
    for bad in ("fp32", jnp.int8, None, 3):
        with pytest.raises(ConfigError, match="Config.dtype=.*not a supported dtype") as e:
            tiny.replace(dtype=bad)
        assert len(str(e.value).splitlines()) == 1
