"""Load an HF checkpoint directory (config.json + safetensors shards, official Kimi Linear / K3
key names) into our parameter tree, tensor by tensor.

Each process reads only the box of each tensor that its devices own (`local_box`: all of it on
one process, its rows / columns / experts on one of several), transforms it (HF stores Linear
weights [out, in]; we store [in, out]) and places it on its devices; per-expert tensors go into
this process's block of the stacked expert array, placed once the block is complete (experts it
does not own are not read). Host memory stays near one tensor, or this process's share of one
stacked expert array; nothing gathers the model on one host. Anything that does not fit (missing,
unknown, wrong shape, truncated file) is an error naming the tensor and file, never a silent
partial model.
"""
from __future__ import annotations

import glob
import json
import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..config import Config, dtype_name
from ..model import Model
from .safetensors_io import CheckpointError, SafetensorsFile

# Multimodal parts of the K3 release share the shard set; the text model skips them.
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "language_model.vision_tower.",
                    "multi_modal_projector.")


class Slot(NamedTuple):
    path: tuple  # keys into our params dict
    index: int | None  # row of a stacked expert array, or None
    hf_shape: tuple | None  # expected HF shape (None: checked by the transform)
    transform: Callable[[np.ndarray], np.ndarray]


def _T(a):
    return a.T


def _ident(a):
    return a


def _flat(a):
    return a.reshape(-1)


def _squeeze_mid(a):
    return a.reshape(a.shape[0], a.shape[-1])


# Our box of a tensor -> the box of the HF tensor it comes from, per transform (a transform not
# here reads the whole HF tensor and cuts our box out of the result).
HF_BOX = {_T: lambda box: box[::-1], _ident: lambda box: box,
          _flat: lambda box: (slice(0, 1), *box), _squeeze_mid: lambda box: (box[0], slice(0, 1), box[1])}


def _first(n):
    def take(a):
        flat = a.reshape(-1)
        if flat.size < n:
            raise CheckpointError(f"holds {flat.size} values, the config needs at least {n}")
        return flat[:n]
    return take


def hf_param_map(cfg: Config, abstract: dict, prefix: str, head_key: str) -> dict[str, Slot]:
    """HF key -> where it goes in our tree, for every parameter of `abstract`."""
    m: dict[str, Slot] = {}

    def linear(hf, path):
        shape = _get(abstract, path).shape
        m[hf] = Slot(path, None, (shape[1], shape[0]), _T)

    def vector(hf, path, hf_shape=None, fn=_ident):
        shape = _get(abstract, path).shape
        m[hf] = Slot(path, None, hf_shape or shape, fn)

    m[f"{prefix}embed_tokens.weight"] = Slot(("embed_tokens", "embedding"), None,
                                             (cfg.vocab_size, cfg.hidden_size), _ident)
    vector(f"{prefix}norm.weight", ("norm", "weight"))
    if not cfg.tie_word_embeddings:
        linear(head_key, ("lm_head", "kernel"))
    if cfg.attn_res_block_size:
        vector(f"{prefix}output_attn_res_norm.weight", ("output_attn_res", "norm"))
        vector(f"{prefix}output_attn_res_proj.weight", ("output_attn_res", "proj"), (1, cfg.hidden_size), _flat)

    for i in range(cfg.num_layers):
        L, p = f"layers_{i}", f"{prefix}layers.{i}."
        tree = abstract[L]
        vector(p + "input_layernorm.weight", (L, "input_layernorm", "weight"))
        vector(p + "post_attention_layernorm.weight", (L, "post_attention_layernorm", "weight"))
        for hf_name, ours in (("self_attention_res", "self_attention_res"), ("mlp_res", "mlp_res")):
            if ours in tree:
                vector(f"{p}{hf_name}_norm.weight", (L, ours, "norm"))
                vector(f"{p}{hf_name}_proj.weight", (L, ours, "proj"), (1, cfg.hidden_size), _flat)
        a = p + "self_attn."
        for name, leaf in tree["self_attn"].items():
            path = (L, "self_attn", name)
            if isinstance(leaf, dict) and "kernel" in leaf:  # a projection: [in, out]
                linear(f"{a}{name}.weight", path + ("kernel",))
            elif isinstance(leaf, dict):  # a norm
                vector(f"{a}{name}.weight", path + ("weight",))
            elif name.endswith("_conv1d"):
                vector(f"{a}{name}.weight", path, (leaf.shape[0], 1, leaf.shape[1]), _squeeze_mid)
            elif name == "A_log":  # K3: [head_dim] zero-padded; Kimi Linear: [1, 1, H, 1]
                m[f"{a}A_log"] = Slot(path, None, None, _first(cfg.kda_num_heads))
            elif name == "o_norm":
                vector(f"{a}o_norm.weight", path)
            elif name == "dt_bias":
                vector(f"{a}dt_bias", path)
            else:
                vector(f"{a}{name}.weight", path)
        if "mlp" in tree:
            for name in ("gate_proj", "up_proj", "down_proj"):
                linear(f"{p}mlp.{name}.weight", (L, "mlp", name, "kernel"))
        if "block_sparse_moe" in tree:
            moe, b = tree["block_sparse_moe"], p + "block_sparse_moe."
            linear(b + "gate.weight", (L, "block_sparse_moe", "gate"))
            vector(b + "gate.e_score_correction_bias", (L, "block_sparse_moe", "e_score_correction_bias"))
            for name, sub in moe.items():
                if name in ("gate", "e_score_correction_bias", "experts"):
                    continue
                if name == "routed_expert_norm":
                    vector(f"{b}{name}.weight", (L, "block_sparse_moe", name, "weight"))
                elif name == "shared_experts":
                    for proj in sub:
                        linear(f"{b}shared_experts.{proj}.weight", (L, "block_sparse_moe", name, proj, "kernel"))
                else:
                    linear(f"{b}{name}.weight", (L, "block_sparse_moe", name, "kernel"))
            for name, leaf in moe["experts"].items():
                path = (L, "block_sparse_moe", "experts", name)
                for e in range(cfg.num_experts):
                    if name in ("w1", "w2", "w3"):  # dense: ours [E, in, out], HF [out, in]
                        m[f"{b}experts.{e}.{name}.weight"] = Slot(path, e, (leaf.shape[2], leaf.shape[1]), _T)
                    else:  # w1_packed -> w1.weight_packed, w1_scale -> w1.weight_scale
                        w, kind = name.split("_")
                        m[f"{b}experts.{e}.{w}.weight_{kind}"] = Slot(path, e, tuple(leaf.shape[1:]), _ident)
    return m


def hf_aliases(cfg: Config, prefix: str) -> dict[str, str]:
    """Other spellings of official names: transformers' save_pretrained writes the dense layers'
    `mlp.*` as `block_sparse_moe.*` (it reverses its load-time rename on every `.mlp.`)."""
    return {f"{prefix}layers.{i}.block_sparse_moe.{n}.weight": f"{prefix}layers.{i}.mlp.{n}.weight"
            for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)
            for n in ("gate_proj", "up_proj", "down_proj")}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def local_box(shape, sharding) -> tuple:
    """The part of a `shape` array that this process's devices hold, as one slice per dimension
    (the bounding box of their shards): all of it without a sharding or on one process."""
    if sharding is None:
        return tuple(slice(0, n) for n in shape)
    ranges = [[ix[d].indices(n)[:2] for ix in sharding.addressable_devices_indices_map(shape).values()]
              for d, n in enumerate(shape)]
    return tuple(slice(min(a for a, _ in r), max(b for _, b in r)) for r in ranges)


def place(block: np.ndarray, box: tuple, shape, sharding):
    """The global array of `shape` whose `box` (this process's part, `local_box`) is `block`."""
    if sharding is None:
        return jax.device_put(block)
    def shard(index):
        return block[tuple(slice(s.indices(n)[0] - b.start, s.indices(n)[1] - b.start)
                           for s, b, n in zip(index, box, shape))]
    return jax.make_array_from_callback(tuple(shape), sharding, shard)


def read_slot(f: SafetensorsFile, file_key: str, slot: Slot, box: tuple) -> np.ndarray:
    """Our `box` of the tensor (for a stacked expert: of its row), read and transformed."""
    to_hf = HF_BOX.get(slot.transform)
    if to_hf is None:
        return slot.transform(f.read(file_key))[box]
    return slot.transform(f.read(file_key, to_hf(box)))


def shard_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not in {path}: {missing[:3]}")
        return [os.path.join(path, f) for f in files]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def _checkpoint_dtype(raw_config: dict) -> str:
    text = raw_config.get("text_config") or {}
    d = raw_config.get("torch_dtype") or raw_config.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(str(d), "bfloat16")


def auto_mxfp4_layout(cfg: Config) -> str:
    """"paired" where its kernel runs (CUDA, bf16 activations, MXFP4 experts), else "k3"."""
    from kernels_pallas._backend import kernel_platform

    ok = (cfg.expert_format == "mxfp4" and cfg.dtype == "bfloat16" and cfg.expert_in_dim % 16 == 0
          and kernel_platform() == "cuda")
    return "paired" if ok else "k3"


def _read(f: SafetensorsFile, file_key: str, key: str, slot: Slot, box: tuple) -> np.ndarray:
    try:
        return read_slot(f, file_key, slot, box)
    except CheckpointError as e:
        raise CheckpointError(f"{f.path}: tensor {key!r} {e}") from None


def load_hf(path: str, mesh=None, dtype=None, mxfp4_layout: str = "auto") -> Model:
    """Load an HF checkpoint directory. dtype None keeps the checkpoint's dtype (else a name,
    jnp.float32, np.float32 or jnp.dtype(...)). mxfp4_layout:
    "k3" keeps MXFP4 experts' bytes as stored; "paired" re-encodes them after reading, on the
    devices that hold them (`with_mxfp4_layout`), for the faster CUDA decode kernel
    (Config.mxfp4_layout; kernels_pallas/moe/paired.py); "auto" picks "paired" on an NVIDIA GPU
    with bf16 activations (`auto_mxfp4_layout`), else "k3"."""
    from ..params import abstract as abstract_tree

    base = Config.from_hf(path)  # validates config.json; its errors name the file
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    files = [SafetensorsFile(p) for p in shard_files(path)]
    keys = [k for f in files for k in f.keys()]
    packed = any(k.endswith(".weight_packed") for k in keys)
    dtype = None if dtype is None else dtype_name(dtype)
    dt = dtype or _checkpoint_dtype(raw)
    cfg = base.replace(expert_format="mxfp4" if packed else "dense", dtype=dt, param_dtype=dt)
    if mxfp4_layout == "auto":
        mxfp4_layout = auto_mxfp4_layout(cfg)
    layout = mxfp4_layout if packed else "k3"
    if layout not in ("k3", "paired"):
        raise ValueError(f"mxfp4_layout={mxfp4_layout!r}: use 'k3', 'paired' or 'auto'")
    router = next(((f, k) for f in files for k in f.keys() if k.endswith("block_sparse_moe.gate.weight")), None)
    if router is not None:  # the router keeps its stored precision (fp32 in Kimi Linear, bf16 in K3)
        cfg = cfg.replace(router_dtype=str(router[0].dtype(router[1])) if dtype is None else dt)
    if any(k.startswith("language_model.") for k in keys):
        prefix, head_key = "language_model.model.", "language_model.lm_head.weight"
    else:
        prefix, head_key = "model.", "lm_head.weight"

    abstract = abstract_tree(cfg)
    if mesh is not None:
        from sharding import param_shardings
        shardings = param_shardings(abstract, cfg, mesh)
    else:
        shardings = jax.tree.map(lambda _: None, abstract)
    mapping = hf_param_map(cfg, abstract, prefix, head_key)
    aliases = hf_aliases(cfg, prefix)
    unused_ok = {f"{prefix}layers.0.self_attention_res_norm.weight",  # the empty bank never mixes
                 f"{prefix}layers.0.self_attention_res_proj.weight"}

    params: dict = {}
    seen: set[str] = set()
    blocks: dict = {}  # stacked expert leaf -> [this process's block, its box, rows still to come]
    skipped = 0
    for f in files:
        for file_key in f.keys():
            key = aliases.get(file_key, file_key)
            if key.startswith(SKIPPED_PREFIXES):
                skipped += 1
                continue
            if key in unused_ok:
                continue
            slot = mapping.get(key)
            if slot is None:
                raise CheckpointError(f"{f.path}: unknown tensor {key!r}: config.json describes no such "
                                      f"parameter (wrong config for these weights, or not a Kimi checkpoint)")
            if key in seen:
                raise CheckpointError(f"{f.path}: tensor {key!r} appears in more than one shard")
            leaf = _get(abstract, slot.path)
            if slot.hf_shape is not None and f.shape(file_key) != tuple(slot.hf_shape):
                raise CheckpointError(f"{f.path}: tensor {file_key!r} has shape {list(f.shape(file_key))}, but "
                                      f"config.json implies {list(slot.hf_shape)}")
            if leaf.dtype == jnp.uint8 and f.dtype(file_key) != np.uint8:
                raise CheckpointError(f"{f.path}: tensor {file_key!r} is {f.dtype(file_key)}, MXFP4 data must be uint8")
            sharding = _get(shardings, slot.path)
            if slot.index is None:
                box = local_box(leaf.shape, sharding)
                block = _read(f, file_key, key, slot, box).astype(leaf.dtype, copy=False)
                _set(params, slot.path, place(block, box, leaf.shape, sharding))
            else:
                if slot.path not in blocks:
                    box = local_box(leaf.shape, sharding)
                    blocks[slot.path] = [np.empty([b.stop - b.start for b in box], leaf.dtype), box, leaf.shape[0]]
                block, box, left = blocks[slot.path]
                if box[0].start <= slot.index < box[0].stop:  # an expert this process's devices hold
                    block[slot.index - box[0].start] = _read(f, file_key, key, slot, box[1:])
                blocks[slot.path][2] = left - 1
                if left == 1:  # every row seen: place this leaf
                    _set(params, slot.path, place(block, box, leaf.shape, sharding))
                    del blocks[slot.path]
            seen.add(key)
        f.close()
    missing = [k for k in mapping if k not in seen]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) the config needs are in no shard, "
                              f"e.g. {missing[:4]}; the checkpoint is incomplete or does not match config.json")
    if skipped:
        print(f"kimik3.load: skipped {skipped} vision/projector tensors (text model only)")
    from ..params import with_mxfp4_layout  # re-encode on the devices, each leaf in place
    return with_mxfp4_layout(Model(params=params, cfg=cfg), layout, donate=True)
