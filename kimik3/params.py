"""Parameter trees: shapes without memory, random weights, logical parameter counts."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sharding.rules import logical_axes, unboxed

from .config import Config
from .model import KimiLM, Model


def _boxed_init(cfg: Config):
    """Init returning every parameter boxed with the logical axes its layer declares. The forward
    that declares them runs on the plain-JAX path: the weights do not depend on the kernels, so
    the init program need not lower any Pallas kernel."""
    def init(key):
        tokens = jnp.zeros((1, 2), jnp.int32)
        return KimiLM(cfg).init(key, tokens, backend="reference")["params"]
    return init


def _init_fn(cfg: Config):
    return lambda key: unboxed(_boxed_init(cfg)(key))


@functools.lru_cache(maxsize=8)
def _boxed_abstract(cfg: Config) -> dict:
    return jax.eval_shape(_boxed_init(cfg), jax.random.key(0))


def abstract(cfg: Config) -> dict:
    """jax.ShapeDtypeStruct per parameter (no memory is allocated)."""
    return unboxed(_boxed_abstract(cfg))


def param_axes(cfg: Config) -> dict:
    """The logical axes of every parameter, as its layer declares them: a tree shaped like
    `abstract(cfg)` with a tuple of axis names per parameter (one per dimension), from which
    sharding/rules.py places it. The placement options do not change the tree."""
    return logical_axes(_boxed_abstract(cfg.replace(moe_dedup=True, moe_placement="auto")))


@functools.cache
def _init_program(cfg: Config, mesh):
    """The jitted init of one (config, mesh), kept: its compile is most of a small model's init
    (every parameter's random draw is code), so a second init with any seed compiles nothing."""
    if mesh is None:
        return jax.jit(_init_fn(cfg))
    from sharding import param_shardings

    return jax.jit(_init_fn(cfg), out_shardings=param_shardings(abstract(cfg), cfg, mesh))


def init(cfg: Config, seed: int = 0, mesh=None) -> Model:
    """Random weights for any config; placed on `mesh` by the sharding rules if one is given."""
    return Model(params=_init_program(cfg, mesh)(jax.random.key(seed)), cfg=cfg)


def _is_expert_packed(path) -> bool:
    """A routed expert's packed MXFP4 bytes (`experts/*_packed`)."""
    return (str(getattr(path[-1], "key", "")).endswith("_packed")
            and any(getattr(k, "key", None) == "experts" for k in path))


def with_mxfp4_layout(model: Model, layout: str, *, donate: bool = False) -> Model:
    """`model` with its MXFP4 experts' packed bytes in `layout` ("k3" | "paired",
    Config.mxfp4_layout): the same numbers. Converted by jit on the devices that hold each leaf,
    keeping its sharding; donate=True reuses each leaf's buffer (the old tree becomes unusable:
    for loaders that own it), so no second copy of the experts is ever held."""
    cfg = model.cfg.replace(mxfp4_layout=layout)  # validates the layout against the config
    if layout == model.cfg.mxfp4_layout:
        return model
    from kernels_pallas.moe import paired

    code = paired.encode if layout == "paired" else paired.decode
    fns = {}  # one jit per output sharding (the layers' leaves share shapes and shardings)

    def convert(path, leaf):
        if not _is_expert_packed(path):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if sharding not in fns:
            fns[sharding] = jax.jit(lambda a: code(a, jnp), out_shardings=sharding,
                                    donate_argnums=(0,) if donate else ())
        return fns[sharding](leaf)
    return Model(params=jax.tree_util.tree_map_with_path(convert, model.params), cfg=cfg)


def _logical_size(path, leaf) -> int:
    """Parameters a leaf stands for: MXFP4 packed bytes hold two values, scales are metadata."""
    name = str(getattr(path[-1], "key", path[-1]))
    if name.endswith("_scale") and leaf.dtype == jnp.uint8:
        return 0
    if name.endswith("_packed"):
        return 2 * math.prod(leaf.shape)
    return math.prod(leaf.shape)


def param_count(cfg: Config) -> dict:
    """{"total", "active"} logical parameters (active: per token, with top-k routed experts)."""
    total = 0
    routed = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract(cfg))[0]:
        n = _logical_size(path, leaf)
        total += n
        if any(getattr(k, "key", None) == "experts" for k in path):
            routed += n
    inactive = routed * (cfg.num_experts - cfg.num_experts_per_token) // max(cfg.num_experts, 1)
    return {"total": total, "active": total - inactive}
