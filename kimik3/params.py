"""Parameter trees: shapes without memory, random weights, logical parameter counts."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from sharding.rules import logical_axes, unboxed

from .config import Config
from .model import DecoderLayer, KimiLM, Model


def _boxed_init(cfg: Config):
    """Init returning every parameter boxed with the logical axes its layer declares. The forward
    that declares them runs on the plain-JAX path: the weights do not depend on the kernels, so
    the init program need not lower any Pallas kernel."""
    def init(key):
        tokens = jnp.zeros((1, 2), jnp.int32)
        return KimiLM(cfg).init(key, tokens, backend="reference")["params"]
    return init


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


def _first_layer_cfg(cfg: Config) -> Config:
    """The model cut to its first layer: it declares the embedding, layer 0, the output mix and
    norm and the head exactly as the whole model does."""
    mlp = None if cfg.mlp_layer_types is None else cfg.mlp_layer_types[:1]
    return cfg.replace(num_layers=1, layer_types=cfg.layer_types[:1], mlp_layer_types=mlp)


def _boxed_layer_init(cfg: Config, i: int):
    """Init of decoder layer i alone, fed stand-ins of the residual stream as it reaches layer i
    (the AttnRes blocks finished before it, a partial sum and a pending MLP output)."""
    def init(key):
        x = jnp.zeros((1, 2, cfg.hidden_size), cfg.jnp_dtype)
        bs = cfg.attn_res_block_size
        bank = [x] * (-(-i // bs) if bs else 0)  # layers j < i with j % bs == 0 wrote a block
        n = jnp.full((1,), 2, jnp.int32)
        return DecoderLayer(cfg, i).init(key, bank, x, x, None, jnp.zeros((1,), jnp.int32), n,
                                         "reference")["params"]
    return init


@functools.cache
def init_programs(cfg: Config, mesh) -> tuple:
    """The jitted programs that make random weights for one (config, mesh): programs[i] takes a
    key and returns layer i's weights (programs[0]: layer 0 and everything outside the layers,
    from the model cut to its first layer). Layers alike in structure, shapes, dtypes and placement
    share one program, so the compile time does not grow with the depth (one program for the
    whole model compiled every layer's random draws again). Kept, so a second init with any seed
    compiles nothing."""
    full, first = abstract(cfg), _first_layer_cfg(cfg)
    if mesh is None:
        shardings = jax.tree.map(lambda _: None, full)
    else:
        from sharding import param_shardings

        shardings = param_shardings(full, cfg, mesh)
    programs, kinds = [jax.jit(lambda key: unboxed(_boxed_init(first)(key)),
                               out_shardings={k: shardings[k] for k in abstract(first)})], {}
    for i in range(1, cfg.num_layers):
        name = f"layers_{i}"
        kind = (jax.tree.structure(full[name]), tuple((x.shape, x.dtype) for x in jax.tree.leaves(full[name])),
                tuple(jax.tree.leaves(shardings[name])))
        if kind not in kinds:
            kinds[kind] = jax.jit(lambda key, i=i: unboxed(_boxed_layer_init(cfg, i)(key)),
                                  out_shardings=shardings[name])
        programs.append(kinds[kind])
    return tuple(programs)


def init(cfg: Config, seed: int = 0, mesh=None) -> Model:
    """Random weights for any config; placed on `mesh` by the sharding rules if one is given.
    Layer i draws from the i-th split of the seed's key."""
    programs = init_programs(cfg, mesh)
    keys = jax.random.split(jax.random.key(seed), cfg.num_layers)
    params = dict(programs[0](keys[0]))
    for i in range(1, cfg.num_layers):
        params[f"layers_{i}"] = programs[i](keys[i])
    return Model(params={k: params[k] for k in abstract(cfg)}, cfg=cfg)  # the whole model's order


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
