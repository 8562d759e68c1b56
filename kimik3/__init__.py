"""kimik3: Kimi K3 / Kimi Linear inference in JAX.

    cfg = kimik3.Config.preset("tiny")
    model = kimik3.init(cfg, seed=0)
    logits = kimik3.forward(model, tokens)
    toks = kimik3.generate(model, prompts, max_new_tokens=16)
"""
from . import _xla_workarounds

_xla_workarounds.apply()  # before JAX starts its CPU client

from .calibration import calibrate_mla_cache_scale
from .config import Config, ConfigError, PRESETS
from .generation import generate
from .model import Cache, KimiLM, Model, init_cache
from .io import SHIPPED_MODELS, load, save
from .memory import memory_report
from .params import abstract, init, param_count
from .runtime import decode_step, extend, forward, prefill
from .sampling import sample
from .tokenizer import ByteTokenizer, KimiTokenizer, Tokenizer, default_tokenizer, load_tokenizer

__all__ = ["calibrate_mla_cache_scale", "Config", "ConfigError", "PRESETS", "generate", "Cache", "KimiLM", "Model", "init_cache",
           "SHIPPED_MODELS", "load", "save", "memory_report", "abstract", "init", "param_count", "decode_step", "extend", "forward", "prefill", "sample",
           "ByteTokenizer", "KimiTokenizer", "Tokenizer", "default_tokenizer", "load_tokenizer"]
