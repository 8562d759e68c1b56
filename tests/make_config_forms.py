"""Regenerate tests/fixtures/hf_config_forms/: the config.json forms Kimi Linear configs exist in.

Needs HF transformers >= 5.23 (configuration only, no PyTorch), NOT the project env:

    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install "transformers>=5.23"
    /tmp/hfvenv/bin/python tests/make_config_forms.py      # [--out DIR]

For each HF parity case (hf_fixture_cases.py; weights and HF logits in fixtures/hf_kimi_linear/<case>)
it writes `<form>/<case>/config.json`:
- `native`: KimiLinearConfig built from transformers' own arguments only (linear_num_heads,
  linear_head_dim, linear_conv_kernel_dim, layer_types, mlp_layer_types) and saved by transformers:
  no linear_attn_config, no first_k_dense_replace;
- `legacy_args`: built from the legacy arguments (linear_attn_config, first_k_dense_replace) and
  saved by transformers, which then writes both forms;
- `legacy_only`: the legacy form alone, as Moonshot's released config.json files carry it (the
  legacy_args file less the fields only transformers writes).
and `native/dense_middle/config.json`: a layout with a dense MLP between MoE layers (mlp_layer_types
only; weights are made by the test, checked against the float64 NumPy oracle).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import transformers
from transformers import KimiLinearConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fixture_cases import CASES, COMMON  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "fixtures" / "hf_config_forms"
# written by transformers only: the native fields and derived values
TRANSFORMERS_ONLY = ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "head_dim", "qk_head_dim")


def native_args(legacy: dict) -> dict:
    """The same model in transformers' native arguments."""
    kw = {k: v for k, v in legacy.items() if k not in ("linear_attn_config", "first_k_dense_replace")}
    lac, n = legacy["linear_attn_config"], legacy["num_hidden_layers"]
    kw.update(linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
              linear_conv_kernel_dim=lac["short_conv_kernel_size"],
              layer_types=["full_attention" if i + 1 in lac["full_attn_layers"] else "linear_attention"
                           for i in range(n)],
              mlp_layer_types=["dense" if i < legacy["first_k_dense_replace"] else "sparse" for i in range(n)])
    return kw


def saved(cfg: KimiLinearConfig) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        return json.loads((Path(d) / "config.json").read_text())


def write(path: Path, raw: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    print(f"transformers {transformers.__version__}")
    for name, case in CASES.items():
        legacy = dict(COMMON, **case["config"])
        native = native_args(legacy)
        write(args.out / "native" / name, saved(KimiLinearConfig(**native)))
        both = saved(KimiLinearConfig(**legacy))
        write(args.out / "legacy_args" / name, both)
        write(args.out / "legacy_only" / name, {k: v for k, v in both.items() if k not in TRANSFORMERS_ONLY})
    middle = native_args(dict(COMMON, **CASES["kda_mla_moe"]["config"]))
    middle["mlp_layer_types"] = ["sparse", "dense", "sparse", "dense"]
    write(args.out / "native" / "dense_middle", saved(KimiLinearConfig(**middle)))


if __name__ == "__main__":
    sys.exit(main())
