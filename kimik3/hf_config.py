"""HF `config.json` <-> Config, in every form Kimi Linear / K3 configs have been written.

Two forms describe the same things:
- legacy (Moonshot's remote code, the released checkpoints): `linear_attn_config` {num_heads,
  head_dim, short_conv_kernel_size, full_attn_layers / kda_layers (1-based)} and
  `first_k_dense_replace` (+ `moe_layer_freq`);
- native (transformers' own `KimiLinearConfig`, 5.2x): `linear_num_heads`, `linear_head_dim`,
  `linear_conv_kernel_dim`, `layer_types` ("linear_attention" / "full_attention" per layer) and
  `mlp_layer_types` ("dense" / "sparse" per layer, any layer may be dense).
Depending on how a config was built, transformers writes one form or both. Where both are present
they must agree: a disagreement is a ConfigError naming the two fields. Note that transformers'
top-level `head_dim` is the MLA rope width, never the KDA head width.
"""
from __future__ import annotations

import os
from typing import Any

from .config import Config, ConfigError, read_json_object

LAYER_TYPE_NAMES = {"linear_attention": "kda", "kda": "kda", "linear": "kda",
                    "full_attention": "mla", "mla": "mla", "attention": "mla"}
_HF_LAYER_TYPE = {"kda": "linear_attention", "mla": "full_attention"}


def config_from_hf_file(path: str | os.PathLike) -> Config:
    """Config from a config.json file or a directory holding one; every error names the file."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ConfigError(f"no config.json at {file}")
    raw = read_json_object(file)
    try:
        return config_from_hf_dict(raw, name=os.path.basename(os.path.dirname(os.path.abspath(file))))
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


def _agreed(forms: list[tuple[str, Any]], default: Any = None) -> Any:
    """The value the present forms give (None entries are absent); they must agree."""
    present = [(name, value) for name, value in forms if value is not None]
    for name, value in present[1:]:
        if value != present[0][1]:
            raise ConfigError(f"{present[0][0]} ({_show(present[0][1])}) and {name} ({_show(value)}) "
                              "disagree; fix or remove one of them")
    return present[0][1] if present else default


def _show(v):
    return list(v) if isinstance(v, tuple) else v


def _number(c: dict, key: str, kind=int, default: Any = ...) -> Any:
    """c[key] as `kind`; a missing required field or a wrong type is a ConfigError naming it."""
    value = c.get(key)
    if value is None:
        if default is ...:
            raise ConfigError(f"missing required field {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ConfigError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _legacy_layer_types(lac: dict, n: int) -> tuple[str, ...] | None:
    full, kda = lac.get("full_attn_layers"), lac.get("kda_layers")
    if full is None and kda is None:
        return None
    for name, layers in (("full_attn_layers", full), ("kda_layers", kda)):
        bad = [i for i in layers or () if not isinstance(i, int) or not 1 <= i <= n]
        if bad:
            raise ConfigError(f"linear_attn_config.{name} {bad} outside 1..{n}")
    full = set(full) if full is not None else set(range(1, n + 1)) - set(kda)
    if kda is not None and set(kda) != set(range(1, n + 1)) - full:
        raise ConfigError(f"linear_attn_config.full_attn_layers and kda_layers must split layers 1..{n} "
                          "between them, each layer in exactly one")
    return tuple("mla" if i + 1 in full else "kda" for i in range(n))


def _native_layer_types(c: dict, n: int) -> tuple[str, ...] | None:
    types = c.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"layer_types must list one entry per layer ({n}), got {types!r}")
    bad = [t for t in types if t not in LAYER_TYPE_NAMES]
    if bad:
        raise ConfigError(f"layer_types entry {bad[0]!r} is not one of {sorted(LAYER_TYPE_NAMES)}")
    return tuple(LAYER_TYPE_NAMES[t] for t in types)


def _mlp_layer_types(c: dict, n: int, moe: bool) -> tuple[str, ...]:
    """Dense / sparse per layer from mlp_layer_types or first_k_dense_replace (+ moe_layer_freq)."""
    native = c.get("mlp_layer_types")
    if native is not None:
        if not isinstance(native, list) or len(native) != n or any(t not in ("dense", "sparse") for t in native):
            raise ConfigError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, "
                              f"got {native!r}")
        native = tuple(native)
        if "sparse" in native and not moe:
            raise ConfigError("mlp_layer_types marks MoE ('sparse') layers, but num_experts is 0")
    if c.get("first_k_dense_replace") is not None:
        k, freq = _number(c, "first_k_dense_replace"), _number(c, "moe_layer_freq", default=1)
        legacy = tuple("sparse" if moe and i >= k and i % max(freq, 1) == 0 else "dense" for i in range(n))
        forms = [("mlp_layer_types", native), (f"first_k_dense_replace={k}, moe_layer_freq={freq}", legacy)]
    else:
        forms = [("mlp_layer_types", native)]
    return _agreed(forms, default=tuple("sparse" if moe else "dense" for _ in range(n)))


def _mlp_fields(types: tuple[str, ...]) -> dict:
    """Config fields for `types`: the first_k_dense_replace rule where it says the same (so that
    equal layouts give equal configs), else the explicit per-layer list."""
    k = types.index("sparse") if "sparse" in types else len(types)
    if all(t == "sparse" for t in types[k:]):
        return dict(first_k_dense_replace=k, moe_layer_freq=1, mlp_layer_types=None)
    return dict(first_k_dense_replace=0, moe_layer_freq=1, mlp_layer_types=types)


def _token_id(c: dict, key: str, vocab: int):
    value = c.get(key)
    ids = value if isinstance(value, list) else [value]
    for v in ids:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
            raise ConfigError(f"{key} {value!r} is not a token id in [0, vocab_size={vocab})")
    return ids[0] if ids else None


def config_from_hf_dict(raw: dict[str, Any], name: str = "hf") -> Config:
    c = dict(raw.get("text_config") or raw)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c.get(key) is None and raw.get(key) is not None:
            c[key] = raw[key]
    quant = c.get("quantization_config") or raw.get("quantization_config") or {}
    n = _number(c, "num_hidden_layers")
    if n <= 0:
        raise ConfigError(f"num_hidden_layers must be > 0, got {n}")
    vocab = _number(c, "vocab_size")
    lac = c.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigError(f"linear_attn_config must be an object, got {lac!r}")
    layer_types = _agreed([("layer_types", _native_layer_types(c, n)),
                              ("linear_attn_config.full_attn_layers/kda_layers", _legacy_layer_types(lac, n))])
    if layer_types is None:
        raise ConfigError("neither layer_types nor linear_attn_config says which layers are KDA")
    heads = _number(c, "num_attention_heads", default=32)
    num_experts = _number(c, "num_experts", default=None) or _number(c, "n_routed_experts", default=0)
    kw = dict(
        name=name,
        vocab_size=vocab,
        hidden_size=_number(c, "hidden_size"),
        num_layers=n,
        layer_types=layer_types,
        rms_norm_eps=_number(c, "rms_norm_eps", float, 1e-5),
        dtype="bfloat16",
        param_dtype="bfloat16",
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=_token_id(c, "bos_token_id", vocab),
        eos_token_id=_token_id(c, "eos_token_id", vocab),
        pad_token_id=_token_id(c, "pad_token_id", vocab),
        max_position_embeddings=_number(c, "max_position_embeddings", default=None)
        or _number(c, "model_max_length", default=1048576),
        kda_num_heads=_agreed([("linear_num_heads", c.get("linear_num_heads")),
                                  ("linear_attn_config.num_heads", lac.get("num_heads"))], heads),
        kda_head_dim=_agreed([("linear_head_dim", c.get("linear_head_dim")),
                                 ("linear_attn_config.head_dim", lac.get("head_dim"))], 128),
        conv_size=_agreed([("linear_conv_kernel_dim", c.get("linear_conv_kernel_dim")),
                              ("linear_attn_config.short_conv_kernel_size", lac.get("short_conv_kernel_size"))], 4),
        gate_lower_bound=lac.get("gate_lower_bound"),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        mla_num_heads=heads,
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=_number(c, "kv_lora_rank", default=512),
        qk_nope_head_dim=_number(c, "qk_nope_head_dim", default=128),
        qk_rope_head_dim=_number(c, "qk_rope_head_dim", default=64),
        v_head_dim=_number(c, "v_head_dim", default=128),
        mla_use_nope=bool(c.get("mla_use_nope", True)),
        mla_use_output_gate=bool(c.get("mla_use_output_gate", False)),
        # transformers >= 5.2x may write the dense MLP's width as dense_ffn_hidden
        intermediate_size=_number(c, "dense_ffn_hidden", default=None) or _number(c, "intermediate_size"),
        **_mlp_fields(_mlp_layer_types(c, n, num_experts > 0)),
        num_experts=num_experts,
        num_experts_per_token=_number(c, "num_experts_per_token", default=None)
        or _number(c, "num_experts_per_tok", default=1),
        num_shared_experts=_number(c, "num_shared_experts", default=None) or _number(c, "n_shared_experts", default=0),
        moe_intermediate_size=_number(c, "moe_intermediate_size", default=1),
        routed_expert_hidden_size=c.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(c.get("latent_moe_use_norm", False)),
        routed_scaling_factor=_number(c, "routed_scaling_factor", float, 1.0),
        moe_renormalize=bool(c.get("moe_renormalize", True)),
        num_expert_group=_number(c, "num_expert_group", default=1),
        topk_group=_number(c, "topk_group", default=1),
        router_dtype="bfloat16" if c.get("hidden_act") == "situ" else "float32",
        expert_format="mxfp4" if "mxfp4" in str(quant.get("format", "")) else "dense",
        hidden_act={"silu": "silu", "swiglu": "silu", "situ": "situ"}.get(c.get("hidden_act", "silu"),
                                                                         c.get("hidden_act")),
        situ_beta=_number(c, "activation_situ_beta", float, 4.0),
        situ_linear_beta=_number(c, "activation_situ_linear_beta", float, 25.0),
        attn_res_block_size=_number(c, "attn_res_block_size", default=0),
    )
    moe_act = c.get("moe_router_activation_func", "sigmoid")
    if moe_act != "sigmoid":
        raise ConfigError(f"moe_router_activation_func {moe_act!r}: only sigmoid routers exist in Kimi Linear / K3")
    return Config(**kw)


def config_to_hf_dict(cfg: Config, k3_layout: bool | None = None) -> dict[str, Any]:
    """The config.json an HF checkpoint of `cfg` carries (K3: wrapped in text_config), with both
    the legacy and the native fields, as transformers 5.24 writes them."""
    k3 = cfg.attn_res_block_size > 0 if k3_layout is None else k3_layout
    mlp_types = ["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(cfg.num_layers)]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act, "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta, "attn_res_block_size": cfg.attn_res_block_size,
        "num_attention_heads": cfg.mla_num_heads, "num_key_value_heads": cfg.mla_num_heads,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "mla_use_nope": cfg.mla_use_nope,
        "mla_use_output_gate": cfg.mla_use_output_gate,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i in cfg.mla_layers], "kda_layers": [i + 1 for i in cfg.kda_layers],
            "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim, "short_conv_kernel_size": cfg.conv_size,
            "gate_lower_bound": cfg.gate_lower_bound, "use_full_rank_gate": cfg.use_full_rank_gate},
        "layer_types": [_HF_LAYER_TYPE[t] for t in cfg.layer_types], "mlp_layer_types": mlp_types,
        "linear_num_heads": cfg.kda_num_heads, "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.conv_size,
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "latent_moe_use_norm": cfg.latent_moe_use_norm, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": cfg.moe_renormalize, "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": cfg.num_expert_group, "topk_group": cfg.topk_group,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
    }
    if cfg.mlp_layer_types is None:  # the rule form only where it describes the layout
        text.update(first_k_dense_replace=cfg.first_k_dense_replace, moe_layer_freq=cfg.moe_layer_freq)
    if cfg.expert_format == "mxfp4":
        text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    if not k3:
        return text
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, "dtype": cfg.param_dtype, "tie_word_embeddings": False,
            "text_config": text}
