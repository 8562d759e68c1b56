"""HF safetensors directories (K3 and Kimi Linear key names, MXFP4) and Orbax round trips."""
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
from kimik3.checkpoint import CheckpointError, SafetensorsFile, write_safetensors
from kimik3.checkpoint.hf_export import export_hf


def _equal_trees(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.dtype == y.dtype and bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def exported(tiny_models, tmp_path_factory):
    out = {}
    for name, model in tiny_models.items():
        d = str(tmp_path_factory.mktemp(name))
        export_hf(model, d, num_shards=3, extra_tensors={"vision_tower.patch_embed.weight": np.ones((4, 4), np.float32)})
        out[name] = d
    return out


def test_k3_layout_names_and_mxfp4(exported):
    d = exported["tiny"]
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        names = set(json.load(f)["weight_map"])
    for key in ("language_model.lm_head.weight", "language_model.model.output_attn_res_proj.weight",
                "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed",
                "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale",
                "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
                "language_model.model.layers.0.self_attn.q_conv1d.weight",
                "language_model.model.layers.2.self_attn.kv_b_proj.weight"):
        assert key in names, key
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # dense layer 0 is mlp.*


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_hf_load_is_exact(tiny_models, exported, name, capsys):
    model = kimik3.load(exported[name])
    assert "skipped 1 vision/projector tensors" in capsys.readouterr().out
    assert _equal_trees(model.params, tiny_models[name].params)
    toks = np.arange(12, dtype=np.int32).reshape(1, 12)
    np.testing.assert_array_equal(kimik3.forward(model, toks), kimik3.forward(tiny_models[name], toks))


def test_orbax_round_trip_is_bit_exact_and_restores_onto_a_mesh(tiny_models, tmp_path):
    import sharding

    model = tiny_models["tiny"]
    kimik3.save(model, str(tmp_path / "ckpt"))
    back = kimik3.load(str(tmp_path / "ckpt"))
    assert back.cfg == model.cfg and _equal_trees(back.params, model.params)
    mesh = sharding.make_mesh(tensor=4)
    placed = kimik3.load(str(tmp_path / "ckpt"), mesh=mesh)
    q = placed.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 4)
    assert _equal_trees(jax.tree.map(np.asarray, placed.params), jax.tree.map(np.asarray, model.params))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(d, fn):
    """Apply fn(dict of tensors) to the shard holding layer 1's router and rewrite it."""
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    key = next(k for k in wm if k.endswith("layers.1.block_sparse_moe.gate.weight"))
    path = os.path.join(d, wm[key])
    f = SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    fn(tensors, key)
    write_safetensors(path, tensors)
    return key


def test_bad_checkpoints_fail_with_the_tensor_named(exported, tmp_path):
    src = exported["tiny-linear"]
    d = _copy(src, tmp_path / "missing")
    key = _rewrite_shard(d, lambda t, k: t.pop(k))
    with pytest.raises(CheckpointError, match="in no shard.*" + key.replace(".", r"\.")):
        kimik3.load(d)

    d = _copy(src, tmp_path / "shape")
    key = _rewrite_shard(d, lambda t, k: t.__setitem__(k, t[k][:, :-1]))
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.") + r".*shape.*config.json implies"):
        kimik3.load(d)

    d = _copy(src, tmp_path / "unknown")
    _rewrite_shard(d, lambda t, k: t.__setitem__("model.layers.1.block_sparse_moe.mystery.weight", t[k]))
    with pytest.raises(CheckpointError, match="unknown tensor 'model.layers.1.block_sparse_moe.mystery.weight'"):
        kimik3.load(d)

    d = _copy(src, tmp_path / "truncated")
    shard = sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))[0]
    size = os.path.getsize(os.path.join(d, shard))
    with open(os.path.join(d, shard), "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=f"{shard}: truncated"):
        kimik3.load(d)

    d = _copy(src, tmp_path / "config")
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg["moe_intermediate_size"] = 64  # the weights were saved with 32
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="' has shape \\[32, 64\\], but config.json implies \\[64, 64\\]"):
        kimik3.load(d)

    with pytest.raises(FileNotFoundError, match="neither config.json"):
        kimik3.load(str(tmp_path))


def test_transformers_spelling_of_dense_layers_loads(tiny_models, exported, tmp_path):
    """save_pretrained writes the dense layer 0 as block_sparse_moe.*; it is the same tensor."""
    d = _copy(exported["tiny-linear"], tmp_path / "alias")
    for shard in [p for p in os.listdir(d) if p.endswith(".safetensors")]:
        f = SafetensorsFile(os.path.join(d, shard))
        tensors = {k.replace("layers.0.mlp.", "layers.0.block_sparse_moe."): np.array(f.get(k)) for k in f.keys()}
        f.close()
        write_safetensors(os.path.join(d, shard), tensors)
    assert _equal_trees(kimik3.load(d).params, tiny_models["tiny-linear"].params)


def test_hf_load_onto_a_mesh_places_owned_rows(tiny_models, exported):
    import sharding

    mesh = sharding.make_mesh(tensor=4)
    model = kimik3.load(exported["tiny"], mesh=mesh)
    up = model.params["layers_1"]["block_sparse_moe"]["routed_expert_up_proj"]["kernel"]  # [L, D]
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert up.addressable_shards[0].data.shape == (up.shape[0], up.shape[1] // 4)  # only owned rows
    assert _equal_trees(jax.tree.map(np.asarray, model.params), jax.tree.map(np.asarray, tiny_models["tiny"].params))


def test_hf_load_in_the_paired_mxfp4_layout(tiny_models, exported, tmp_path):
    """mxfp4_layout="paired" re-encodes the experts' packed bytes while loading: other bytes in
    memory, the same model (logits bit-equal); export and Orbax keep what was loaded."""
    from kernels_pallas.moe import paired

    base = tiny_models["tiny"]
    model = kimik3.load(exported["tiny"], mxfp4_layout="paired")
    assert model.cfg.mxfp4_layout == "paired" and base.cfg.mxfp4_layout == "k3"
    ex, ex0 = (m.params["layers_1"]["block_sparse_moe"]["experts"] for m in (model, base))
    for name in ("w1_packed", "w2_packed", "w3_packed"):
        assert not np.array_equal(ex[name], ex0[name])
        np.testing.assert_array_equal(paired.decode(np.asarray(ex[name])), ex0[name])
    np.testing.assert_array_equal(ex["w1_scale"], ex0["w1_scale"])
    toks = np.arange(12, dtype=np.int32).reshape(1, 12)
    np.testing.assert_array_equal(kimik3.forward(model, toks), kimik3.forward(base, toks))
    export_hf(model, str(tmp_path / "hf"), num_shards=2)  # written back in K3's layout
    assert _equal_trees(kimik3.load(str(tmp_path / "hf")).params, base.params)
    kimik3.save(model, str(tmp_path / "ckpt"))
    back = kimik3.load(str(tmp_path / "ckpt"))
    assert back.cfg.mxfp4_layout == "paired" and _equal_trees(back.params, model.params)
    as_k3 = kimik3.load(str(tmp_path / "ckpt"), mxfp4_layout="k3")  # converted after restoring
    assert as_k3.cfg.mxfp4_layout == "k3" and _equal_trees(as_k3.params, base.params)
    with pytest.raises(ValueError, match="mxfp4_layout"):
        base.cfg.replace(expert_format="dense", mxfp4_layout="paired")


def test_auto_mxfp4_layout_is_paired_only_where_its_kernel_runs(tiny_models, exported, monkeypatch):
    from kernels_pallas import _backend
    from kimik3.checkpoint import hf

    assert kimik3.load(exported["tiny"]).cfg.mxfp4_layout == "k3"  # this machine: CPU
    monkeypatch.setattr(_backend, "kernel_platform", lambda device=None: "cuda")
    cfg = tiny_models["tiny"].cfg
    assert hf.auto_mxfp4_layout(cfg.replace(dtype="bfloat16")) == "paired"
    assert hf.auto_mxfp4_layout(cfg.replace(dtype="float32")) == "k3"  # the PTX takes bf16 x only
    assert hf.auto_mxfp4_layout(cfg.replace(expert_format="dense")) == "k3"


def test_paired_layout_onto_a_mesh(tiny_models, exported):
    import sharding

    mesh = sharding.make_mesh(tensor=4)
    model = kimik3.load(exported["tiny"], mesh=mesh, mxfp4_layout="paired")
    toks = np.arange(12, dtype=np.int32).reshape(1, 12)
    np.testing.assert_allclose(np.asarray(kimik3.forward(model, toks)),
                               np.asarray(kimik3.forward(tiny_models["tiny"], toks)), rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def saved_linear(tiny_models, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("orbax") / "ckpt")
    kimik3.save(tiny_models["tiny-linear"], d)
    return d


def _one_line(exc_info, *parts):
    msg = str(exc_info.value)
    assert len(msg.splitlines()) == 1, msg
    for p in parts:
        assert str(p) in msg, (p, msg)
    return msg


def test_damaged_orbax_dirs_fail_in_one_line_naming_file_and_parameter(saved_linear, tmp_path):
    from kimik3 import ConfigError

    d = _copy(saved_linear, tmp_path / "truncated")
    data = os.path.join(d, "params", "ocdbt.process_0", "d")
    biggest = max(os.listdir(data), key=lambda f: os.path.getsize(os.path.join(data, f)))
    os.truncate(os.path.join(data, biggest), os.path.getsize(os.path.join(data, biggest)) // 2)
    with pytest.raises(CheckpointError) as e:
        kimik3.load(d)
    msg = _one_line(e, os.path.join(data, biggest), "truncated or damaged")
    assert re.search(r"parameter (embed_tokens|layers_\d+|norm|lm_head|output_attn_res)\.\S+ cannot be read", msg), msg

    d = _copy(saved_linear, tmp_path / "manifest")
    os.remove(os.path.join(d, "params", "manifest.ocdbt"))
    with pytest.raises(CheckpointError) as e:
        kimik3.load(d)
    _one_line(e, os.path.join(d, "params", "manifest.ocdbt"), "is missing")

    d = _copy(saved_linear, tmp_path / "key")
    cfg_file = os.path.join(d, "kimik3_config.json")
    raw = json.load(open(cfg_file))
    json.dump(dict(raw, hidden_sise=64), open(cfg_file, "w"))
    with pytest.raises(ConfigError) as e:
        kimik3.load(d)
    _one_line(e, cfg_file, "unknown key(s) ['hidden_sise']")

    json.dump(dict(raw, intermediate_size=96), open(cfg_file, "w"))  # saved with 128
    with pytest.raises(CheckpointError) as e:
        kimik3.load(d)
    _one_line(e, os.path.join(d, "params"), "parameter layers_0.mlp.down_proj.kernel has shape [128, 64]",
              "kimik3_config.json implies [96, 64]")


def test_save_to_an_existing_directory_needs_overwrite(tiny_models, saved_linear, tmp_path):
    d = _copy(saved_linear, tmp_path / "ckpt")
    model = tiny_models["tiny"]
    with pytest.raises(FileExistsError) as e:
        kimik3.save(model, d)
    _one_line(e, d, "already exists", "overwrite=True")
    assert kimik3.load(d).cfg.name == "tiny-linear"  # untouched
    kimik3.save(model, d, overwrite=True)
    assert _equal_trees(kimik3.load(d).params, model.params)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a kimik3.save directory"):
        kimik3.save(model, str(other), overwrite=True)
    assert (other / "keep.txt").read_text() == "mine"


def test_load_dtype_takes_jax_and_numpy_dtypes_for_both_kinds(tiny_models, exported, saved_linear):
    base = tiny_models["tiny-linear"]
    for path in (exported["tiny-linear"], saved_linear):
        for given in ("bfloat16", jnp.bfloat16, jnp.dtype("bfloat16")):
            model = kimik3.load(path, dtype=given)
            assert model.cfg.dtype == model.cfg.param_dtype == "bfloat16"
            q = model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
            assert q.dtype == jnp.bfloat16
            np.testing.assert_array_equal(
                np.asarray(q), np.asarray(base.params["layers_0"]["self_attn"]["q_proj"]["kernel"].astype(jnp.bfloat16)))
        assert kimik3.load(path, dtype=np.float32).cfg == base.cfg.replace(name=kimik3.load(path).cfg.name)
        with pytest.raises(ValueError, match="dtype='int8' is not a supported dtype") as e:
            kimik3.load(path, dtype="int8")
        assert len(str(e.value).splitlines()) == 1


def test_reading_a_box_reads_only_its_bytes(tmp_path):
    """SafetensorsFile.read(name, box) equals numpy's slice for any box and reads exactly its
    bytes (one read per contiguous run), what a process of a multi-process load relies on."""
    import ml_dtypes

    rng = np.random.RandomState(0)
    tensors = {"a": rng.randn(6, 5, 7).astype(np.float32), "b": rng.randn(9).astype(ml_dtypes.bfloat16)}
    write_safetensors(str(tmp_path / "x.safetensors"), tensors)
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    reads = []
    read_at = f.read_at
    f.read_at = lambda offset, buf: (reads.append(len(buf)), read_at(offset, buf))
    for name, arr in tensors.items():
        assert np.array_equal(f.read(name), arr) and reads == [arr.nbytes]
        reads.clear()
    for _ in range(100):
        box = tuple(slice(a, rng.randint(a, n + 1)) for n in tensors["a"].shape for a in [rng.randint(0, n)])
        got = f.read("a", box)
        assert np.array_equal(got, tensors["a"][box]) and sum(reads) == got.nbytes, box
        reads.clear()
    assert f.read("a", (slice(1, 3), slice(0, 5), slice(0, 7))).shape == (2, 5, 7) and len(reads) == 1  # whole rows
    f.close()
