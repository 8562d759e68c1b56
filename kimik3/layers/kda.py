"""KDA (Kimi Delta Attention) layer: projections, short convs, gates, the recurrence (via
kernels_pallas), gated RMSNorm output. Math: reference/kda.md sections 1-2, k3_checkpoint.md 3."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax import shard_map
from jax.sharding import PartitionSpec as P

import kernels_pallas
from kernels_pallas import resolve_backend
from kernels_pallas.kda.decode import kda_decode
from sharding.kda import AXIS, kda_cache_specs, kda_tensor_axis
from sharding.rules import param_specs
from .common import F32, Weight, causal_conv, declared_axes, project, rms_normalize

# At most this many new tokens per sequence go through the per-token recurrence (decode, verify);
# longer extends use the chunked form.
RECURRENT_MAX_T = 8


def kda_cache_shapes(cfg, batch: int):
    P = cfg.kda_num_heads * cfg.kda_head_dim
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    return {"state": ((batch, H, K, K), F32), "conv": ((batch, cfg.conv_size - 1, 3 * P), cfg.jnp_dtype)}


def kda_weights(module, cfg) -> dict:
    """Declare the KDA layer's weights in `module` (a compact Linen module) and return them as a
    dict for `kda_apply`. Names, shapes and initialisers are the checkpoint's (Dense-style
    `{name: {"kernel": [in, out]}}` for projections), with their logical axes."""
    D, H, K, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_size
    P, pdt = H * K, cfg.jnp_param_dtype
    to_channels, from_rank = ((D, P), ("embed", "kda_channels")), ((K, P), ("gate_rank", "kda_channels"))
    to_rank = ((D, K), ("embed", "gate_rank"))
    proj = {"q_proj": to_channels, "k_proj": to_channels, "v_proj": to_channels, "f_a_proj": to_rank,
            "f_b_proj": from_rank, "b_proj": ((D, H), ("embed", "kda_heads")),
            "o_proj": ((P, D), ("kda_channels", "embed"))}
    proj.update({"g_proj": to_channels} if cfg.use_full_rank_gate else {"g_a_proj": to_rank, "g_b_proj": from_rank})
    p = {n: {"kernel": Weight(s, pdt, axes, name=n)()} for n, (s, axes) in proj.items()}

    def param(name, init, shape, axes):
        return module.param(name, nn.with_logical_partitioning(init, axes), shape, F32)
    for n in "qkv":
        p[f"{n}_conv1d"] = param(f"{n}_conv1d", nn.initializers.normal(0.3), (P, W), ("kda_channels", "conv_kernel"))
    p["A_log"] = param("A_log", lambda key, s, dt: jnp.log(jax.random.uniform(key, s, dt, 1, 16)), (H,),
                       ("kda_heads",))
    p["dt_bias"] = param("dt_bias", nn.initializers.normal(0.5), (P,), ("kda_channels",))
    p["o_norm"] = param("o_norm", nn.initializers.ones, (K,), ("kda_head_dim",))
    return p


def kda_apply(cfg, p, x, cache, n_new, backend=None, tensor_axis=None, all_positions=False):
    """The KDA layer on the heads its weights hold: x [B, T, D], cache {"state" [B, H, K, K],
    "conv" [B, W-1, 3P] (this rank's q | k | v channels)} -> (out [B, T, D], new cache).

    all_positions (speculative verify, T <= RECURRENT_MAX_T): the new cache holds the state after
    every position, {"state" [B, T, H, K, K], "conv" [B, W-1+T, 3P] (the conv inputs)}, so that
    `keep_positions` can roll a row back to any accepted prefix.

    Under shard_map (`tensor_axis` named) the weights are one rank's heads and the output
    projection's partial sums are all-reduced over that axis; the recurrence kernels see only
    local heads."""
    B, T, _ = x.shape
    K = cfg.kda_head_dim
    P = p["dt_bias"].shape[0]
    H = P // K
    dt = cfg.jnp_dtype
    gate_in = "g_proj" if cfg.use_full_rank_gate else "g_a_proj"
    q, k, v, f_a, b_logits, gate = project(  # every projection of x in one launch at decode
        x, [p[n]["kernel"] for n in ("q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", gate_in)],
        dt, backend)
    conv_ws = [p[f"{n}_conv1d"] for n in "qkv"]
    f = project(f_a, [p["f_b_proj"]["kernel"]], dt, backend)[0]
    A_log, dt_bias, o_norm = p["A_log"], p["dt_bias"], p["o_norm"]
    if not cfg.use_full_rank_gate:
        gate = project(gate, [p["g_b_proj"]["kernel"]], dt, backend)[0]

    def out_proj(o):
        y = project(o, [p["o_proj"]["kernel"]], dt, backend)[0]
        return y if tensor_axis is None else jax.lax.psum(y, tensor_axis)

    if T == 1 and not all_positions and resolve_backend(backend) != "reference":
        # One fused launch: conv update, norms, gates, state update in place, gated norm. Idle
        # rows (n_new = 0) are skipped inside it: both states stay in place untouched. q, k, v,
        # their conv weights and the beta logits go in as they are (it concatenates and casts).
        o, conv_state, state = kda_decode(
            (q[:, 0], k[:, 0], v[:, 0]), cache["conv"], conv_ws, f[:, 0], A_log, dt_bias,
            b_logits[:, 0], gate[:, 0], o_norm, cache["state"], n_new, num_heads=H,
            lower_bound=cfg.gate_lower_bound, eps=cfg.rms_norm_eps, backend=backend)
        return out_proj(o[:, None].astype(dt)), {"state": state, "conv": conv_state}

    qkv_raw = jnp.concatenate([q, k, v], axis=-1)
    conv_w = jnp.concatenate(conv_ws)
    b_logits = b_logits.astype(F32)
    qkv, conv_state = causal_conv(qkv_raw, cache["conv"], conv_w, n_new)
    q, k, v = (a.reshape(B, T, H, K) for a in jnp.split(qkv, 3, axis=-1))
    g = kernels_pallas.kda_gate(f.reshape(B, T, H, K), A_log, dt_bias, lower_bound=cfg.gate_lower_bound)
    beta = jax.nn.sigmoid(b_logits)

    args = dict(initial_state=cache["state"], lengths=n_new, use_qk_l2norm=True)
    if all_positions:
        if T > RECURRENT_MAX_T:
            raise ValueError(f"a verify pass takes at most {RECURRENT_MAX_T} tokens a row, got {T}")
        o, state = kernels_pallas.kda_verify(q, k, v, g, beta, backend=backend, **args)
        conv_state = jnp.concatenate([cache["conv"], qkv_raw.astype(cache["conv"].dtype)], axis=1)
    elif T <= RECURRENT_MAX_T:
        o, state = kernels_pallas.kda_recurrent(q, k, v, g, beta, **args)
    else:
        # K3's bounded gate lies in (lower_bound, 0) with lower_bound >= -5 (Config checks it):
        # the chunk kernel's safe_gate promise, so its diagonal blocks skip the span check
        o, state = kernels_pallas.kda_chunk(q, k, v, g, beta, backend=backend,
                                            safe_gate=cfg.gate_lower_bound is not None, **args)

    o = rms_normalize(o.astype(F32), cfg.rms_norm_eps) * o_norm
    o = o * jax.nn.sigmoid(gate.astype(F32).reshape(B, T, H, K))
    return out_proj(o.reshape(B, T, P).astype(dt)), {"state": state, "conv": conv_state}


def kda_sharded(cfg, p, x, cache, n_new, backend=None, mesh=None, all_positions=False):
    """One KDA layer per rank's heads on `mesh` (default: the ambient one); traceable in jit.
    x [B, T, D] and the output are replicated; the cache stays split over heads. The Pallas
    decode / chunk kernels see only local heads (no custom call is ever partitioned by XLA), and
    the output projection's partial sums meet in one all-reduce."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    specs = param_specs(declared_axes(kda_weights, cfg), p, mesh, cfg)
    cspecs = kda_cache_specs(cfg, mesh)
    out_cspecs = cspecs
    if all_positions:  # the state after every position: [B, T, H, K, K], heads still split
        out_cspecs = {**cspecs, "state": P(None, None, *cspecs["state"][1:])}
    f = shard_map(lambda p, x, c, n: kda_apply(cfg, p, x, c, n, backend, tensor_axis=AXIS,
                                               all_positions=all_positions),
                  mesh=mesh, in_specs=(specs, P(), cspecs, P()), out_specs=(P(), out_cspecs),
                  check_vma=False)
    return f(p, x, cache, n_new)


class KDA(nn.Module):
    """The KDA layer. Under an ambient mesh whose tensor axis divides the heads (kimik3's
    functions set the model's mesh) it runs `kda_apply` per rank's heads in shard_map
    (`kda_sharded`, placement in sharding/kda.py): the recurrence kernels see local heads and
    the state stays split."""
    cfg: object

    @nn.compact
    def __call__(self, x, cache, n_new, backend=None, all_positions=False):
        """x [B, T, D]; cache {"state", "conv"} or None (fresh sequences); n_new [B] valid tokens."""
        cfg = self.cfg
        if cache is None:
            shapes = kda_cache_shapes(cfg, x.shape[0])
            cache = {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}
        p = kda_weights(self, cfg)
        if self.is_initializing():
            return kda_apply(cfg, p, x, cache, n_new, backend)
        if kda_tensor_axis(cfg, jax.sharding.get_abstract_mesh()) is not None:
            return kda_sharded(cfg, p, x, cache, n_new, backend, all_positions=all_positions)
        return kda_apply(cfg, p, x, cache, n_new, backend, all_positions=all_positions)


def keep_positions(entry, n):
    """Collapse a KDA cache entry made with all_positions to the state after the first n[b] new
    tokens of row b (n[b] = 0 keeps the state the pass started from)."""
    W1 = entry["conv"].shape[1] - entry["state"].shape[1]  # W - 1
    rows = jnp.arange(n.shape[0])
    state = entry["state"][rows, jnp.maximum(n - 1, 0)]
    first = entry["state"][:, 0]  # an idle row's states all equal its starting state
    state = jnp.where((n > 0).reshape(-1, 1, 1, 1), state, first)
    conv = jax.vmap(lambda r, m: jax.lax.dynamic_slice_in_dim(r, m, W1, axis=0))(entry["conv"], n)
    return {"state": state, "conv": conv}
