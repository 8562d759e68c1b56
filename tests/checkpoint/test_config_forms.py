"""config.json in every form HF transformers' KimiLinearConfig writes (tests/make_config_forms.py,
transformers 5.24): native arguments only (linear_num_heads / linear_head_dim /
linear_conv_kernel_dim / layer_types / mlp_layer_types, no linear_attn_config, no
first_k_dense_replace), legacy arguments (both forms), and the legacy fields alone (Moonshot's
release form). Each is paired with the HF parity weights of its case and must reproduce HF's logits;
a dense MLP between MoE layers must load and match the float64 oracle."""
import json
import os
import shutil

import numpy as np
import pytest

import kimik3
from kimik3 import Config, ConfigError
from kimik3.checkpoint.hf_export import export_hf

from tests import numpy_oracle  # noqa: E402
from tests import paths

FIXTURES = str(paths.FIXTURES)
FORMS = os.path.join(FIXTURES, "hf_config_forms")
HF = os.path.join(FIXTURES, "hf_kimi_linear")
CASES = ("kda_mla_moe", "mla_qlora_top3", "grouped_router_long")


def _checkpoint(tmp_path, form, case):
    """The HF weights of `case` with the config.json of `form` (the directory name is the case's,
    so that equal layouts give equal configs, names included)."""
    d = tmp_path / form / case
    d.mkdir(parents=True)
    shutil.copy(os.path.join(FORMS, form, case, "config.json"), d / "config.json")
    os.symlink(os.path.join(HF, case, "model.safetensors"), d / "model.safetensors")
    return d


@pytest.mark.parametrize("form", ["native", "legacy_args", "legacy_only"])
@pytest.mark.parametrize("case", CASES)
def test_every_form_reads_as_the_parity_config(form, case):
    raw = json.load(open(os.path.join(FORMS, form, case, "config.json")))
    assert ("linear_attn_config" in raw) == (form != "native")
    assert ("mlp_layer_types" in raw) == (form != "legacy_only")
    assert Config.from_hf(os.path.join(FORMS, form, case)) == Config.from_hf(os.path.join(HF, case))


@pytest.mark.parametrize("form", ["native", "legacy_only"])
def test_each_form_loads_and_reproduces_hf_logits(tmp_path, form):
    for case in CASES:
        model = kimik3.load(_checkpoint(tmp_path, form, case), dtype="float32")
        exp = np.load(os.path.join(HF, case, "expected.npz"))
        ours = np.asarray(kimik3.forward(model, exp["input_ids"][:1].astype(np.int32)))
        ref = exp["logits"][:1]
        assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-4, (form, case)


def test_native_kda_dims_are_not_taken_from_head_dim():
    """transformers' top-level head_dim is the MLA rope width (8 here), not the KDA head width."""
    cfg = Config.from_hf(os.path.join(FORMS, "native", "mla_qlora_top3"))
    raw = json.load(open(os.path.join(FORMS, "native", "mla_qlora_top3", "config.json")))
    assert raw["head_dim"] == 8 and (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_size) == (2, 32, 4)


def test_a_dense_layer_between_moe_layers(tmp_path):
    """mlp_layer_types may mark any layer dense: sparse, dense, sparse, dense."""
    d = os.path.join(FORMS, "native", "dense_middle")
    cfg = Config.from_hf(d).replace(dtype="float32", param_dtype="float32")
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    model = kimik3.init(cfg, seed=3)
    assert "mlp" in model.params["layers_1"] and "block_sparse_moe" in model.params["layers_2"]
    export_hf(model, str(tmp_path / "ours"), num_shards=1)
    assert json.load(open(tmp_path / "ours" / "config.json"))["mlp_layer_types"] == [
        "sparse", "dense", "sparse", "dense"]
    # the same weights under transformers' native config.json
    hf = tmp_path / "hf"
    shutil.copytree(tmp_path / "ours", hf)
    shutil.copy(os.path.join(d, "config.json"), hf / "config.json")
    loaded = kimik3.load(str(hf), dtype=np.float32)
    toks = np.random.RandomState(7).randint(3, 256, 24)
    ours = np.asarray(kimik3.forward(loaded, toks[None].astype(np.int32)))[0]
    ref = numpy_oracle.forward(str(tmp_path / "ours"), toks)  # dense where the weights say mlp.*
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) < 1e-4


def _native(**changes):
    raw = json.load(open(os.path.join(FORMS, "native", "kda_mla_moe", "config.json")))
    raw.update(changes)
    return raw


def _legacy_args(**changes):
    raw = json.load(open(os.path.join(FORMS, "legacy_args", "kda_mla_moe", "config.json")))
    raw.update(changes)
    return raw


LAC = {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 2, "head_dim": 16,
       "short_conv_kernel_size": 4}


@pytest.mark.parametrize("raw,first,second", [
    (_legacy_args(linear_num_heads=4), "linear_num_heads", "linear_attn_config.num_heads"),
    (_legacy_args(linear_head_dim=32), "linear_head_dim", "linear_attn_config.head_dim"),
    (_legacy_args(linear_conv_kernel_dim=3), "linear_conv_kernel_dim", "linear_attn_config.short_conv_kernel_size"),
    (_native(linear_attn_config=dict(LAC, full_attn_layers=[4], kda_layers=[1, 2, 3])),
     "layer_types", "linear_attn_config.full_attn_layers/kda_layers"),
    (_native(first_k_dense_replace=2), "mlp_layer_types", "first_k_dense_replace"),
])
def test_two_forms_that_disagree_are_an_error_naming_both(tmp_path, raw, first, second):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        Config.from_hf(tmp_path)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(tmp_path / "config.json") in msg
    assert msg.index(first) < msg.index(second) and "disagree" in msg, msg


def test_export_writes_a_non_prefix_layout_without_first_k_dense_replace(tmp_path):
    cfg = Config.preset("tiny-linear").replace(mlp_layer_types=("dense", "sparse", "dense", "sparse"))
    from kimik3.hf_config import config_from_hf_dict, config_to_hf_dict

    raw = config_to_hf_dict(cfg)
    assert "first_k_dense_replace" not in raw
    back = config_from_hf_dict(raw, name=cfg.name)
    assert back.mlp_layer_types == cfg.mlp_layer_types and back.num_moe_layers == 2
    prefix = Config.preset("tiny-linear")
    assert config_from_hf_dict(config_to_hf_dict(prefix), name=prefix.name).mlp_layer_types is None
    with pytest.raises(ConfigError, match="Config.mlp_layer_types"):
        cfg.replace(mlp_layer_types=("dense", "sparse"))
    with pytest.raises(ConfigError, match="Config.mlp_layer_types"):
        cfg.replace(mlp_layer_types=("dense", "moe", "dense", "sparse"))
