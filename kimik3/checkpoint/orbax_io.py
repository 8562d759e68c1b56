"""Orbax save / restore of a Model: the parameter pytree plus the config as JSON beside it.

Restoring checks what it can before reading any array (the config file, the files Orbax needs, every
parameter's stored shape against the config) and turns what Orbax / TensorStore report while reading
into one line naming the file and the parameter.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil

import jax

from ..config import Config, ConfigError, dtype_name, read_json_object
from ..model import Model
from .safetensors_io import CheckpointError

CONFIG_FILE = "kimik3_config.json"
_READ_ERROR = re.compile(r'Error reading "([^"/]+)/.*?(Requested byte range.*?value of size (\d+)|$)', re.S)


def is_orbax_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, CONFIG_FILE))


def save(model: Model, path: str, overwrite: bool = False):
    """Write `model` to `path`: params with Orbax, config as JSON. `path` must not exist, unless
    overwrite=True, which replaces an earlier kimik3.save directory (nothing else is deleted).
    Over several processes every process calls it with the same `path` on a file system they all
    see: each writes the shards its devices hold, process 0 the metadata and the config."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import multihost

    path = os.path.abspath(path)
    primary = jax.process_index() == 0
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path} already exists; choose a new directory, or pass overwrite=True "
                                  "to replace it")
        if not (os.path.isdir(path) and (is_orbax_dir(path) or not os.listdir(path))):
            raise FileExistsError(f"{path} exists and is not a kimik3.save directory; overwrite=True only "
                                  "replaces those: choose another path")
        multihost.sync_global_processes("kimik3_save_checked")  # every process has looked before any deletes
        if primary:
            shutil.rmtree(path)
    multihost.sync_global_processes("kimik3_save_start")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), model.params)
    if primary:
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump(dataclasses.asdict(model.cfg), f, indent=1)
    multihost.sync_global_processes("kimik3_save_done")  # no process goes on before the directory is whole


def read_config(path: str) -> Config:
    """The Config saved beside the params; errors name the file (and the key)."""
    file = os.path.join(path, CONFIG_FILE)
    raw = read_json_object(file)
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ConfigError(f"{file}: unknown key(s) {unknown}: not Config fields (written by another "
                          "kimik3 version, or edited?)")
    try:
        return Config(**raw)
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


def _check_files(params: str):
    if not os.path.isdir(params):
        raise CheckpointError(f"{params} is missing: not a complete kimik3.save directory")
    needed = ["_METADATA"]
    if any(d.startswith("ocdbt.process_") for d in os.listdir(params)):
        needed.append("manifest.ocdbt")
    for name in needed:
        if not os.path.exists(os.path.join(params, name)):
            raise CheckpointError(f"{os.path.join(params, name)} is missing: the checkpoint is incomplete "
                                  "(an interrupted save?); save it again")


def _check_shapes(params: str, target: dict, ckpt):
    """Every parameter the config needs is stored, with the shape the config implies."""
    try:
        stored = ckpt.metadata(params).item_metadata.tree
    except Exception as e:  # Orbax raises many types for a damaged _METADATA
        raise CheckpointError(f"{os.path.join(params, '_METADATA')}: unreadable ({_first_line(e)})") from None
    want = {jax.tree_util.keystr(k, simple=True, separator="."): v
            for k, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    have = {jax.tree_util.keystr(k, simple=True, separator="."): v
            for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    for name, leaf in want.items():
        if name not in have:
            raise CheckpointError(f"{params}: parameter {name} is not stored; {CONFIG_FILE} describes "
                                  "another model than these weights")
        if tuple(have[name].shape) != tuple(leaf.shape):
            raise CheckpointError(f"{params}: parameter {name} has shape {list(have[name].shape)}, but "
                                  f"{CONFIG_FILE} implies {list(leaf.shape)}")
    extra = sorted(set(have) - set(want))
    if extra:
        raise CheckpointError(f"{params}: parameter {extra[0]} is stored but {CONFIG_FILE} describes no "
                              "such parameter")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def _read_failure(params: str, e: BaseException) -> CheckpointError:
    """One line for an array that TensorStore could not read: the parameter and, where the sizes
    say which, the data file."""
    chain, c = [], e
    while c is not None and len(chain) < 8:
        chain.append(c)
        c = c.__cause__ or c.__context__
    for c in chain:
        m = _READ_ERROR.search(str(c))
        if m:
            where = params
            if m.group(3):  # the value's size is the data file's size: name that file
                data = glob.glob(os.path.join(params, "ocdbt.process_*", "d", "*"))
                hits = [f for f in data if os.path.getsize(f) == int(m.group(3))]
                if len(hits) == 1:
                    where = hits[0]
            return CheckpointError(f"{where}: parameter {m.group(1)} cannot be read (truncated or damaged "
                                   f"data: {_first_line(c)}); save the checkpoint again")
    return CheckpointError(f"{params}: restoring failed: {_first_line(chain[-1])}")


def load_orbax(path: str, mesh=None, dtype=None) -> Model:
    """Restore; with a mesh every shard is read straight onto its device (over several processes
    each reads the shards its devices hold). dtype (None: as saved)
    casts the weights while reading, as `load_hf(dtype=...)` does."""
    import orbax.checkpoint as ocp

    from ..params import abstract

    path = os.path.abspath(path)
    cfg = read_config(path)
    if dtype is not None:
        dt = dtype_name(dtype)
        cfg = cfg.replace(dtype=dt, param_dtype=dt, router_dtype=dt)
    params_dir = os.path.join(path, "params")
    _check_files(params_dir)
    target = abstract(cfg)
    if mesh is not None:
        from sharding import param_shardings
        shardings = param_shardings(target, cfg, mesh)
    else:  # one device, whatever devices (or processes) saved it
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), target)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), target, shardings)
    with ocp.StandardCheckpointer() as ckpt:
        _check_shapes(params_dir, target, ckpt)
        try:
            params = ckpt.restore(params_dir, target)
        except Exception as e:  # TensorStore / Orbax errors: many types, long messages
            raise _read_failure(params_dir, e) from None
    return Model(params=params, cfg=cfg)
