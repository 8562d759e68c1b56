"""Orbax save / restore of a Model: the parameter pytree plus the config as JSON beside it."""
from __future__ import annotations

import dataclasses
import json
import os

import jax

from ..config import Config
from ..model import Model

CONFIG_FILE = "kimik3_config.json"


def is_orbax_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, CONFIG_FILE))


def save(model: Model, path: str):
    """Write `model` to `path` (a new directory): params with Orbax, config as JSON."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), model.params)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(model.cfg), f, indent=1)


def load_orbax(path: str, mesh=None) -> Model:
    """Restore; with a mesh every shard is read straight onto its device."""
    import orbax.checkpoint as ocp

    from ..params import abstract

    path = os.path.abspath(path)
    with open(os.path.join(path, CONFIG_FILE)) as f:
        raw = json.load(f)
    raw["layer_types"] = tuple(raw["layer_types"])
    cfg = Config(**raw)
    target = abstract(cfg)
    if mesh is not None:
        from sharding import param_shardings
        shardings = param_shardings(target, cfg, mesh)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        params = ckpt.restore(os.path.join(path, "params"), target)
    return Model(params=params, cfg=cfg)
