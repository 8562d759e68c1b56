"""`kimik3.load` / `kimik3.save`: one entry point for HF safetensors and Orbax directories."""
from __future__ import annotations

import os

from .checkpoint import is_orbax_dir, load_hf, load_orbax, save
from .model import Model


def load(path, mesh=None, dtype: str | None = None) -> Model:
    """Load an HF checkpoint directory (config.json + *.safetensors) or a kimik3 Orbax directory."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected an HF checkpoint or a kimik3.save dir)")
    if is_orbax_dir(path):
        if dtype is not None:
            raise ValueError("dtype= applies to HF checkpoints; an Orbax checkpoint restores as saved")
        return load_orbax(path, mesh=mesh)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} has neither config.json (HF checkpoint) nor kimik3_config.json (Orbax)")
    return load_hf(path, mesh=mesh, dtype=dtype)


__all__ = ["load", "save"]
