"""Model configuration: one frozen dataclass, presets, and `Config.from_hf(dir)`.

Every field is validated at construction; a bad value raises `ConfigError` naming the field.
Layer indices are 0-based internally; HF's `linear_attn_config.full_attn_layers` is 1-based.
Reading and writing HF config.json lives in hf_config.py.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os

import jax.numpy as jnp


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field."""


DTYPES = ("float32", "bfloat16", "float16")
ACTIVATIONS = ("silu", "situ")
EXPERT_FORMATS = ("dense", "mxfp4")
MXFP4_LAYOUTS = ("k3", "paired")
MOE_PLACEMENTS = ("auto", "tensor", "expert")
MLA_CACHE_DTYPES = ("auto", "fp8")
MLP_TYPES = ("dense", "sparse")


def dtype_name(value, what: str = "dtype") -> str:
    """The name of a float dtype given any way JAX users write one ("float32", jnp.float32,
    np.float32, jnp.dtype("bfloat16")); a ConfigError naming `what` for anything else."""
    try:
        name = None if value is None or isinstance(value, bool) else jnp.dtype(value).name
    except (TypeError, ValueError):
        name = None
    if name not in DTYPES:
        raise ConfigError(f"{what}={value!r} is not a supported dtype: use one of {DTYPES} "
                          "(a name, jnp.float32, np.float32 or jnp.dtype(...))")
    return name


def read_json_object(file: str) -> dict:
    """A JSON object from `file`; unreadable or invalid JSON is a one-line ConfigError naming it."""
    try:
        with open(file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


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
    intermediate_size: int = 33792  # the dense layers' MLP
    # which layers have a dense MLP and which a MoE: mlp_layer_types ("dense" / "sparse" per layer)
    # when given; None: the rule, layers >= first_k_dense_replace with i % moe_layer_freq == 0 are MoE
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    mlp_layer_types: tuple[str, ...] | None = None
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

        # canonical forms, so that equal configs compare equal: dtype names, tuples (JSON gives lists)
        for f in ("dtype", "param_dtype", "router_dtype"):
            object.__setattr__(self, f, dtype_name(getattr(self, f), f"Config.{f}"))
        for f in ("layer_types", "mlp_layer_types"):
            if isinstance(getattr(self, f), list):
                object.__setattr__(self, f, tuple(getattr(self, f)))

        for f in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim",
                  "conv_size", "mla_num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                  "intermediate_size", "moe_layer_freq", "num_expert_group", "topk_group"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
        for f in ("qk_rope_head_dim", "first_k_dense_replace", "attn_res_block_size",
                  "num_shared_experts", "num_experts"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "must be an int >= 0")
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
        if self.mlp_layer_types is not None:
            need(isinstance(self.mlp_layer_types, tuple) and len(self.mlp_layer_types) == self.num_layers,
                 "mlp_layer_types", f"must be None or have one entry per layer ({self.num_layers})")
            need(all(t in MLP_TYPES for t in self.mlp_layer_types), "mlp_layer_types",
                 f"entries must be one of {MLP_TYPES}")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, f)
            need(v is None or (isinstance(v, numbers.Integral) and 0 <= v < self.vocab_size), f,
                 f"must be None or a token id in [0, vocab_size={self.vocab_size})")
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
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[i] == "sparse"
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

    def param_axes(self) -> dict:
        """The logical axes of every parameter (kimik3.params.param_axes): what the sharding
        rules place each weight by."""
        from .params import param_axes

        return param_axes(self)

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
        """Read a Kimi Linear or Kimi K3 `config.json` (a file or a checkpoint directory), in any
        form HF transformers or Moonshot wrote it (hf_config.py); errors name the file."""
        from .hf_config import config_from_hf_file

        return config_from_hf_file(path)


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
    full-rank KDA gate, q-LoRA, MLA output gate. Three layers, ending in MLA as K3 does: a full
    AttnRes block and a partial one, and as few layers as that takes (the tests compile every
    engine program for it, and XLA:CPU's compile time grows with the layers)."""
    return Config(name="tiny", num_layers=3, layer_types=("kda", "kda", "mla"),
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
