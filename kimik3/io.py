"""`kimik3.load` / `kimik3.save`: one entry point for HF safetensors and Orbax directories."""
from __future__ import annotations

import os

from .checkpoint import is_orbax_dir, load_hf, load_orbax, save
from .config import dtype_name
from .model import Model
from .params import with_mxfp4_layout

# Checkpoints shipped inside the package, by name: kimik3.load("tiny-code") (see train_tiny.py).
SHIPPED_MODELS = {"tiny-code": os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-code")}


def load(path, mesh=None, dtype=None, mxfp4_layout: str | None = None) -> Model:
    """Load an HF checkpoint directory (config.json + *.safetensors) or a kimik3 Orbax directory.

    dtype: None keeps the checkpoint's dtype; else the weights and activations in that dtype
    ("float32", "bfloat16", "float16", or jnp.float32, np.float32, jnp.dtype(...)), for both kinds.

    mxfp4_layout: the byte layout of MXFP4 experts in memory (Config.mxfp4_layout): "k3" (as K3
    stores them) or "paired" (re-encoded while loading, for the faster CUDA decode kernel);
    None: for an HF checkpoint "auto" (paired on an NVIDIA GPU with bf16 activations, else k3),
    for an Orbax directory the layout it was saved with (another is converted after restoring).

    A name in SHIPPED_MODELS ("tiny-code") loads that checkpoint from the package (unless a
    directory of that name exists here); it computes in float32 unless dtype says otherwise (its
    weights are stored in bf16 to keep the package small; float32 is the fast dtype on CPU)."""
    path = os.fspath(path)
    if path in SHIPPED_MODELS and not os.path.isdir(path):
        path, dtype = SHIPPED_MODELS[path], dtype or "float32"
    dtype = None if dtype is None else dtype_name(dtype)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected an HF checkpoint or a kimik3.save dir)")
    if is_orbax_dir(path):
        model = load_orbax(path, mesh=mesh, dtype=dtype)
        if mxfp4_layout in (None, "auto", model.cfg.mxfp4_layout):
            return model
        return with_mxfp4_layout(model, mxfp4_layout, donate=True)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has neither config.json (HF checkpoint) nor kimik3_config.json (Orbax)")
    return load_hf(path, mesh=mesh, dtype=dtype, mxfp4_layout=mxfp4_layout or "auto")


__all__ = ["SHIPPED_MODELS", "load", "save", "with_mxfp4_layout"]
