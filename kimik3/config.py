"""Model configuration: one frozen dataclass, presets, and `Config.from_hf(dir)`.

Every field is validated at construction; a bad value raises `ConfigError` naming the field.
Layer indices are 0-based internally; HF's `linear_attn_config.full_attn_layers` is 1-based.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax.numpy as jnp


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("silu", "situ")
EXPERT_FORMATS = ("dense", "mxfp4")
MXFP4_LAYOUTS = ("k3", "paired")
MOE_PLACEMENTS = ("auto", "tensor", "expert")
MLA_CACHE_DTYPES = ("auto", "fp8")


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    # "kda" or "mla" per layer.
    layer_types: tuple[str, ...] = ()
    rms_norm_eps: float = 1e-5
    dtype: str = "bfloat16"  # activations and matmul inputs
    param_dtype: str = "bfloat16"  # storage of ordinary weights (some stay fp32 by design)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    max_position_embeddings: int = 1048576
    # KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    conv_size: int = 4
    gate_lower_bound: float | None = -5.0  # None: Kimi Linear's softplus gate
    use_full_rank_gate: bool = True  # K3: g_proj [P, H]; Kimi Linear: low-rank g_a/g_b
    # MLA
    mla_num_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # KimiRMSNorm default used by q_a/kv_a layernorms
    # MLA cache storage: "auto" (the activation dtype) or "fp8": e4m3 values stored / scale, in
    # the decode kernel's words form (two values a uint16: half of bf16's bytes, read by the
    # kernel's fast fp8 path); mla_cache_scale is the per-tensor dequantisation scale
    mla_cache_dtype: str = "auto"
    mla_cache_scale: float = 1.0
    # MLP / MoE
    intermediate_size: int = 33792
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent MoE width; None: experts in hidden space
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    router_dtype: str = "bfloat16"  # storage of the router weight (Kimi Linear keeps fp32)
    expert_format: str = "mxfp4"  # routed experts: "dense" or "mxfp4" (packed E2M1 + E8M0 scales)
    # byte layout of MXFP4 experts in memory (a load-time choice, not in HF config.json): "k3" as
    # stored; "paired": re-encoded for the CUDA decode kernel's cheaper nibble decode
    # (kernels_pallas/moe/paired.py; NVIDIA GPUs only: fewer instructions per weight, BENCHMARKS.md)
    mxfp4_layout: str = "k3"
    hidden_act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # MoE on a mesh (runtime choices, not in HF config.json; see sharding/rules.py moe_axes):
    # "expert": routed experts split over the mesh's `expert` axis (each rank holds E / ep whole
    # experts); "tensor": every rank holds every expert, their intermediate split over `tensor`;
    # "auto": "expert" when the mesh has an expert axis > 1, else "tensor".
    moe_placement: str = "auto"
    # MoE dedup under TP: each rank computes only its 1/TP of the latent up-projection's outputs and
    # holds only those rows; False: every rank computes (and holds) the whole up-projection.
    moe_dedup: bool = True
    # AttnRes: block size in decoder layers; 0 = ordinary residuals
    attn_res_block_size: int = 12

    def __post_init__(self):
        def need(cond, field, msg):
            if not cond:
                raise ConfigError(f"Config.{field}: {msg} (got {getattr(self, field)!r})")

        for f in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                  "conv_size", "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                  "intermediate_size", "moe_layer_freq", "num_expert_group", "topk_group"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
        for f in ("qk_rope_head_dim", "first_k_dense_replace", "attn_res_block_size",
                  "num_shared_experts", "num_experts"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "must be an int >= 0")
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        need(self.param_dtype in DTYPES, "param_dtype", f"must be one of {DTYPES}")
        need(self.router_dtype in DTYPES, "router_dtype", f"must be one of {DTYPES}")
        need(self.hidden_act in ACTIVATIONS, "hidden_act", f"must be one of {ACTIVATIONS}")
        need(self.expert_format in EXPERT_FORMATS, "expert_format", f"must be one of {EXPERT_FORMATS}")
        need(self.mxfp4_layout in MXFP4_LAYOUTS, "mxfp4_layout", f"must be one of {MXFP4_LAYOUTS}")
        need(self.moe_placement in MOE_PLACEMENTS, "moe_placement", f"must be one of {MOE_PLACEMENTS}")
        need(isinstance(self.moe_dedup, bool), "moe_dedup", "must be True or False")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(len(self.layer_types) == self.num_layers, "layer_types",
             f"must have one entry per layer ({self.num_layers})")
        need(all(t in ("kda", "mla") for t in self.layer_types), "layer_types",
             "entries must be 'kda' or 'mla'")
        need(self.gate_lower_bound is None or -5.0 <= self.gate_lower_bound < 0, "gate_lower_bound",
             "must be None (softplus gate) or in [-5, 0)")
        need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be None or > 0")
        need(self.mla_cache_dtype in MLA_CACHE_DTYPES, "mla_cache_dtype",
             f"must be one of {MLA_CACHE_DTYPES}")
        need(isinstance(self.mla_cache_scale, (int, float)) and self.mla_cache_scale > 0,
             "mla_cache_scale", "must be a number > 0")
        need(self.mla_cache_dtype != "fp8" or self.mla_cache_dim % 2 == 0, "mla_cache_dtype",
             f"'fp8' stores two values a word: kv_lora_rank + qk_rope_head_dim "
             f"({self.mla_cache_dim}) must be even")
        need(self.mla_use_nope, "mla_use_nope",
             "rotary MLA is not supported: Kimi Linear and K3 use NoPE (mla_use_nope=true)")
        need(self.routed_expert_hidden_size is None or self.routed_expert_hidden_size > 0,
             "routed_expert_hidden_size", "must be None or > 0")
        if self.num_moe_layers:
            need(self.num_experts > 0, "num_experts", "must be > 0 when MoE layers exist")
            need(0 < self.num_experts_per_token <= self.num_experts, "num_experts_per_token",
                 f"must be in [1, num_experts={self.num_experts}]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
            need(self.num_experts % self.num_expert_group == 0, "num_expert_group",
                 f"must divide num_experts={self.num_experts}")
            need(self.topk_group <= self.num_expert_group, "topk_group",
                 f"must be <= num_expert_group={self.num_expert_group}")
            if self.mxfp4_layout == "paired":
                need(self.expert_format == "mxfp4", "mxfp4_layout",
                     "'paired' re-encodes MXFP4 experts; these experts are dense (use 'k3')")
                need(self.expert_in_dim % 16 == 0, "mxfp4_layout",
                     f"'paired' needs the experts' input width ({self.expert_in_dim}) to be a "
                     f"multiple of 16 (the down-projection's rows); use 'k3'")
            if self.expert_format == "mxfp4":
                for dim, what in ((self.expert_in_dim, "the experts' input width"),
                                  (self.moe_intermediate_size, "moe_intermediate_size")):
                    need(dim % 32 == 0, "expert_format",
                         f"mxfp4 needs {what} ({dim}) to be a multiple of 32")

    # ---- derived ----
    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_in_dim(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def mla_cache_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **kw) -> "Config":
        return dataclasses.replace(self, **kw)

    # ---- construction ----
    @staticmethod
    def preset(name: str) -> "Config":
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)} "
                              "or load a checkpoint's config.json with Config.from_hf(dir)")
        return PRESETS[name]()

    @staticmethod
    def from_hf(path: str | os.PathLike) -> "Config":
        """Read a Kimi Linear or Kimi K3 `config.json` (a file or a checkpoint directory)."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ConfigError(f"no config.json at {file}")
        with open(file) as f:
            raw = json.load(f)
        return config_from_hf_dict(raw, name=os.path.basename(os.path.dirname(os.path.abspath(file))))


def _layer_types_from_hf(c: dict[str, Any], n: int) -> tuple[str, ...]:
    lac = c.get("linear_attn_config")
    if lac:
        full = lac.get("full_attn_layers")
        kda = lac.get("kda_layers")
        if full is None and kda is None:
            raise ConfigError("config.json: linear_attn_config needs full_attn_layers or kda_layers")
        full = set(full) if full is not None else set(range(1, n + 1)) - set(kda)
        bad = [i for i in full if not 1 <= i <= n]
        if bad:
            raise ConfigError(f"config.json: linear_attn_config.full_attn_layers {bad} outside 1..{n}")
        return tuple("mla" if i + 1 in full else "kda" for i in range(n))
    if "layer_types" in c:
        names = {"linear_attention": "kda", "kda": "kda", "linear": "kda",
                 "full_attention": "mla", "mla": "mla", "attention": "mla"}
        out = []
        for t in c["layer_types"]:
            if t not in names:
                raise ConfigError(f"config.json: layer_types entry {t!r} is not one of {sorted(names)}")
            out.append(names[t])
        return tuple(out)
    raise ConfigError("config.json: neither linear_attn_config nor layer_types says which layers are KDA")


def config_from_hf_dict(raw: dict[str, Any], name: str = "hf") -> Config:
    c = dict(raw.get("text_config") or raw)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if c.get(key) is None and raw.get(key) is not None:
            c[key] = raw[key]
    quant = c.get("quantization_config") or raw.get("quantization_config") or {}
    n = int(c["num_hidden_layers"])
    lac = c.get("linear_attn_config") or {}
    eos = c.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    heads = int(c.get("num_attention_heads", 32))
    kw = dict(
        name=name,
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=n,
        layer_types=_layer_types_from_hf(c, n),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        dtype="bfloat16",
        param_dtype="bfloat16",
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=c.get("pad_token_id"),
        max_position_embeddings=int(c.get("max_position_embeddings", 1048576)),
        kda_num_heads=int(lac.get("num_heads", heads)),
        kda_head_dim=int(lac.get("head_dim", c.get("head_dim") or 128)),
        conv_size=int(lac.get("short_conv_kernel_size", 4)),
        gate_lower_bound=lac.get("gate_lower_bound"),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        mla_num_heads=heads,
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=int(c.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(c.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(c.get("qk_rope_head_dim", 64)),
        v_head_dim=int(c.get("v_head_dim", 128)),
        mla_use_nope=bool(c.get("mla_use_nope", True)),
        mla_use_output_gate=bool(c.get("mla_use_output_gate", False)),
        intermediate_size=int(c["intermediate_size"]),
        first_k_dense_replace=int(c.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(c.get("moe_layer_freq", 1)),
        num_experts=int(c.get("num_experts") or c.get("n_routed_experts") or 0),
        num_experts_per_token=int(c.get("num_experts_per_token") or c.get("num_experts_per_tok") or 1),
        num_shared_experts=int(c.get("num_shared_experts") or c.get("n_shared_experts") or 0),
        moe_intermediate_size=int(c.get("moe_intermediate_size") or 1),
        routed_expert_hidden_size=c.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(c.get("latent_moe_use_norm", False)),
        routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(c.get("moe_renormalize", True)),
        num_expert_group=int(c.get("num_expert_group") or 1),
        topk_group=int(c.get("topk_group") or 1),
        router_dtype="bfloat16" if c.get("hidden_act") == "situ" else "float32",
        expert_format="mxfp4" if "mxfp4" in str(quant.get("format", "")) else "dense",
        hidden_act={"silu": "silu", "swiglu": "silu", "situ": "situ"}.get(c.get("hidden_act", "silu"),
                                                                         c.get("hidden_act")),
        situ_beta=float(c.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(c.get("activation_situ_linear_beta", 25.0)),
        attn_res_block_size=int(c.get("attn_res_block_size") or 0),
    )
    moe_act = c.get("moe_router_activation_func", "sigmoid")
    if moe_act != "sigmoid":
        raise ConfigError(f"config.json: moe_router_activation_func {moe_act!r}: only sigmoid routers exist "
                          "in Kimi Linear / K3")
    return Config(**kw)


def _mla_every(n: int, every: int, extra: tuple[int, ...] = ()) -> tuple[str, ...]:
    """Layer types from a 1-based 'every k-th layer is MLA' rule plus explicit extras."""
    full = {i for i in range(every, n + 1, every)} | set(extra)
    return tuple("mla" if i + 1 in full else "kda" for i in range(n))


def _kimi_k3() -> Config:
    return Config(name="kimi-k3", layer_types=_mla_every(93, 4, (93,)))


def _kimi_linear_48b() -> Config:
    return Config(
        name="kimi-linear-48b", vocab_size=163840, hidden_size=2304, num_layers=27,
        layer_types=_mla_every(27, 4, (27,)), kda_num_heads=32, gate_lower_bound=None,
        use_full_rank_gate=False, mla_num_heads=32, q_lora_rank=None, mla_use_output_gate=False,
        intermediate_size=9216, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=1024, routed_expert_hidden_size=None, latent_moe_use_norm=False,
        routed_scaling_factor=2.446, router_dtype="float32", expert_format="dense", hidden_act="silu",
        attn_res_block_size=0)


# Tiny configs: a few layers of every kind, small dims, fp32 so CPU tests hold fp32 tolerances.
_TINY_COMMON = dict(vocab_size=320, hidden_size=64, bos_token_id=256, eos_token_id=257,
                    pad_token_id=258, max_position_embeddings=4096, dtype="float32",
                    param_dtype="float32", kda_num_heads=2, kda_head_dim=16, mla_num_heads=4,
                    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                    intermediate_size=128, num_experts=8, num_experts_per_token=2,
                    moe_intermediate_size=32)


def _tiny() -> Config:
    """K3-like: AttnRes (blocks of 2), latent MoE with MXFP4 experts, SiTU, bounded gate,
    full-rank KDA gate, q-LoRA, MLA output gate."""
    return Config(name="tiny", num_layers=5, layer_types=("kda", "kda", "mla", "kda", "mla"),
                  q_lora_rank=32, num_shared_experts=1, routed_expert_hidden_size=32,
                  attn_res_block_size=2, router_dtype="float32", **_TINY_COMMON)


def _tiny_linear() -> Config:
    """Kimi-Linear-like: softplus gate, low-rank KDA gate, no q-LoRA, no output gate, SwiGLU,
    dense experts in hidden space, ordinary residuals."""
    return Config(name="tiny-linear", num_layers=4, layer_types=("kda", "mla", "kda", "mla"),
                  gate_lower_bound=None, use_full_rank_gate=False, q_lora_rank=None,
                  mla_use_output_gate=False, num_shared_experts=1, routed_expert_hidden_size=None,
                  latent_moe_use_norm=False, routed_scaling_factor=2.446, router_dtype="float32",
                  expert_format="dense", hidden_act="silu", attn_res_block_size=0, **_TINY_COMMON)


def _tiny_code() -> Config:
    """The shape of the trained tiny-code model (kimik3/assets/tiny-code, kimik3/train_tiny.py):
    K3's layer pattern (every fourth layer MLA, the last one too), AttnRes, latent MoE with MXFP4
    experts, SiTU, bounded full-rank KDA gate; byte vocabulary; a few million parameters."""
    return Config(name="tiny-code", vocab_size=320, hidden_size=192, num_layers=8,
                  layer_types=_mla_every(8, 4), bos_token_id=256, eos_token_id=257, pad_token_id=258,
                  max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16",
                  kda_num_heads=3, kda_head_dim=64, mla_num_heads=3, q_lora_rank=96, kv_lora_rank=96,
                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=512,
                  num_experts=16, num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=128,
                  routed_expert_hidden_size=96, attn_res_block_size=2, router_dtype="float32")


PRESETS = {
    "tiny": _tiny,
    "tiny-code": _tiny_code,
    "tiny-linear": _tiny_linear,
    "kimi-linear-48b": _kimi_linear_48b,
    "kimi-k3": _kimi_k3,
}


def config_to_hf_dict(cfg: Config, k3_layout: bool | None = None) -> dict[str, Any]:
    """The config.json an HF checkpoint of `cfg` carries (K3: wrapped in text_config)."""
    k3 = cfg.attn_res_block_size > 0 if k3_layout is None else k3_layout
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
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_expert_hidden_size": cfg.routed_expert_hidden_size,
        "latent_moe_use_norm": cfg.latent_moe_use_norm, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": cfg.moe_renormalize, "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_expert_group": cfg.num_expert_group, "topk_group": cfg.topk_group,
        "first_k_dense_replace": cfg.first_k_dense_replace, "moe_layer_freq": cfg.moe_layer_freq,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "dtype": cfg.param_dtype,
    }
    if cfg.expert_format == "mxfp4":
        text["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    if not k3:
        return text
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, "dtype": cfg.param_dtype, "tie_word_embeddings": False,
            "text_config": text}
