"""The decoder as Flax (Linen) modules, plus the two pytrees users hold: `Model` (config + weights)
and `Cache` (per-sequence lengths, per-layer KDA state / conv state / MLA latent cache).

Linen because its modules are pure descriptions: `KimiLM(cfg).apply({"params": params}, ...)` is a
pure function of a plain nested dict of arrays, which jit, shard_map, eval_shape and Orbax take
as they are; caches are explicit inputs and outputs rather than mutable module state.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.kda import kda_cache_specs
from .config import Config
from .layers.attnres import mixed_norm
from .layers.common import F32, INIT_STD, kernel
from .layers.kda import KDA, kda_cache_shapes
from .layers.mla import MLA, mla_cache_shapes
from .layers.moe import MLP, MoE


@struct.dataclass
class Model:
    """Weights (a plain nested dict) and the static config they belong to."""
    params: dict
    cfg: Config = struct.field(pytree_node=False)


@struct.dataclass
class Cache:
    """Decode state for a batch of sequences. `lengths[b]`: tokens already held for row b."""
    lengths: jax.Array
    layers: tuple  # per layer: {"state", "conv"} (KDA) or {"latent"} (MLA)
    page_table: jax.Array | None = None  # [B, pages per row] when the MLA latents are paged
    mesh: object = struct.field(pytree_node=False, default=None)  # where the cache lives
    dcp_axes: tuple = struct.field(pytree_node=False, default=())  # mesh axes splitting MLA positions

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_seq_len(self) -> int:
        for entry in self.layers:
            if "latent" in entry:
                pages = 1 if self.page_table is None else self.page_table.shape[1]
                return pages * entry["latent"].shape[1]
        return 2 ** 31 - 1  # no MLA layer: KDA state is fixed-size, any length fits


def cache_shapes(cfg: Config, batch: int, max_seq_len: int):
    return tuple(kda_cache_shapes(cfg, batch) if t == "kda" else mla_cache_shapes(cfg, batch, max_seq_len)
                 for t in cfg.layer_types)


def init_cache(cfg: Config, batch: int, max_seq_len: int, mesh=None, dcp_axes: tuple = ()) -> Cache:
    """Empty cache: zero KDA state and conv state, zero MLA latents, lengths 0.

    With a mesh and dcp_axes (decode context parallelism), every sequence's MLA positions are split
    over those mesh axes (each device holds max_seq_len / dcp of them); dcp_axes may name the
    tensor axis itself (TP8 + DCP8 on 8 devices).
    """
    dcp_axes = tuple(dcp_axes)
    if dcp_axes and mesh is None:
        raise ValueError("dcp_axes needs the mesh they belong to")
    if mesh is not None:
        missing = [a for a in dcp_axes if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"dcp_axes {missing} are not axes of the mesh {mesh.axis_names}")
        n = math.prod(mesh.shape[a] for a in dcp_axes)
        if max_seq_len % n:
            raise ValueError(f"max_seq_len {max_seq_len} must be a multiple of the DCP size {n}")
    layers = []
    for entry in cache_shapes(cfg, batch, max_seq_len):
        e = {k: jnp.zeros(s, d) for k, (s, d) in entry.items()}
        if mesh is not None:
            if "latent" in e:  # MLA: positions over the DCP axes (else every rank holds all)
                specs = {k: P(None, dcp_axes or None, None) for k in e}
            else:  # KDA: heads over tensor, as the layer's shard_map computes them
                specs = kda_cache_specs(cfg, mesh)
            e = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in e.items()}
        layers.append(e)
    return Cache(lengths=jnp.zeros((batch,), jnp.int32), layers=tuple(layers), mesh=mesh, dcp_axes=dcp_axes)


class DecoderLayer(nn.Module):
    cfg: Config
    index: int

    @nn.compact
    def __call__(self, bank, p, pending, cache, start, n_new, backend, page_table=None, dcp_axes=(),
                 all_positions=False):
        """The residual stream arrives as p + pending (the previous MLP's output, not yet added: the
        add is fused into the next mix and norm) and leaves the same way."""
        cfg, i = self.cfg, self.index
        bs = cfg.attn_res_block_size
        # attention side
        x, p = mixed_norm(cfg, "self_attention_res", "input_layernorm", bank, p, pending, backend)
        if bs and i % bs == 0:  # write layer: freeze the finished block (or the embedding)
            bank, p = bank + [p], None
        if cfg.layer_types[i] == "kda":
            a, cache = KDA(cfg, name="self_attn")(x, cache, n_new, backend, all_positions)
        else:
            a, cache = MLA(cfg, name="self_attn")(x, cache, start, n_new, backend, page_table, dcp_axes)
        # MLP side: the stream is p + a (a alone right after a write layer)
        y, p = mixed_norm(cfg, "mlp_res", "post_attention_layernorm", bank, p, a, backend)
        if cfg.is_moe_layer(i):
            m = MoE(cfg, name="block_sparse_moe")(y, backend)
        else:
            m = MLP(cfg, cfg.intermediate_size, name="mlp")(y, backend)
        return bank, p, m, cache


class KimiLM(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens, cache_layers=None, start=None, n_new=None, backend=None, page_table=None,
                 dcp_axes=(), all_positions=False):
        """tokens [B, T] -> (logits [B, T, V] fp32, new cache layers or None).

        Without cache_layers: a causal pass over `tokens` alone (fresh sequences).
        all_positions (speculative verify): KDA layers return their state after every position;
        `keep_positions` then keeps each row's accepted prefix.
        With them: tokens extend each row after its `start[b]` cached tokens; only the first
        `n_new[b]` tokens of row b are real (the rest is padding and leaves the cache untouched).
        """
        cfg = self.cfg
        B, T = tokens.shape
        if n_new is None:
            n_new = jnp.full((B,), T, jnp.int32)
        if start is None:
            start = jnp.zeros((B,), jnp.int32)
        embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                                     ("vocab", "embed")),
                         name="embed_tokens")
        bank, p, pending = [], embed(tokens), None
        new_layers = []
        for i in range(cfg.num_layers):
            entry = None if cache_layers is None else cache_layers[i]
            bank, p, pending, entry = DecoderLayer(cfg, i, name=f"layers_{i}")(
                bank, p, pending, entry, start, n_new, backend, page_table, dcp_axes, all_positions)
            new_layers.append(entry)
        z, _ = mixed_norm(cfg, "output_attn_res", "norm", bank, p, pending, backend)
        if cfg.tie_word_embeddings:
            logits = embed.attend(z)
        else:
            # XLA's GEMM reads the wide head at copy speed: no skinny matmul here
            lm_head = kernel((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), cfg, "lm_head")
            logits = z.astype(cfg.jnp_dtype) @ lm_head.astype(cfg.jnp_dtype)
        return logits.astype(F32), (None if cache_layers is None else tuple(new_layers))
