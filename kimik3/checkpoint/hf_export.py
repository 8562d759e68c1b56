"""Write a Model as an HF checkpoint directory in the official key names (K3 layout with the
`language_model.` prefix when AttnRes is on, else Kimi Linear's `model.`), sharded with an index.
Used to build test checkpoints of the real formats and to hand weights to other runtimes."""
from __future__ import annotations

import json
import os

import jax
import numpy as np

from ..hf_config import config_to_hf_dict
from ..model import Model
from ..params import with_mxfp4_layout
from .hf import _T, _first, _flat, _get, _squeeze_mid, hf_param_map
from .safetensors_io import write_safetensors


def _inverse(slot, arr, cfg, k3):
    fn = slot.transform
    if fn is _T:
        return arr.T
    if fn is _squeeze_mid:
        return arr.reshape(arr.shape[0], 1, arr.shape[1])
    if fn is _flat:
        return arr.reshape(1, -1)
    if slot.hf_shape is None:  # A_log: K3 pads to head_dim with zeros, Kimi Linear stores [1,1,H,1]
        if k3:
            return np.concatenate([arr, np.zeros(max(0, cfg.kda_head_dim - arr.size), arr.dtype)])
        return arr.reshape(1, 1, -1, 1)
    return arr


def export_hf(model: Model, path: str, num_shards: int = 2, extra_tensors: dict | None = None):
    model = with_mxfp4_layout(model, "k3")  # HF checkpoints hold K3's bytes
    cfg = model.cfg
    k3 = cfg.attn_res_block_size > 0
    prefix, head = ("language_model.model.", "language_model.lm_head.weight") if k3 else ("model.", "lm_head.weight")
    os.makedirs(path, exist_ok=True)
    mapping = hf_param_map(cfg, model.params, prefix, head)
    host = jax.tree.map(np.asarray, model.params)
    tensors = {}
    for key, slot in mapping.items():
        arr = _get(host, slot.path)
        if slot.index is not None:
            arr = arr[slot.index]
        tensors[key] = np.ascontiguousarray(_inverse(slot, arr, cfg, k3))
    tensors.update(extra_tensors or {})
    keys = list(tensors)
    n = max(1, min(num_shards, len(keys)))
    weight_map = {}
    for s in range(n):
        name = f"model-{s + 1:05d}-of-{n:06d}.safetensors"
        part = keys[s::n]
        write_safetensors(os.path.join(path, name), {k: tensors[k] for k in part})
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                   "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf_dict(cfg), f, indent=1)
    return path
