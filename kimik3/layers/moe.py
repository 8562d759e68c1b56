"""Dense MLP and the (latent) MoE: sigmoid router with a selection-only correction bias, top-k,
renormalise, routed scaling; sort tokens by expert and run grouped matmuls (no expert computes
tokens it was not chosen for); weighted combine; K3's latent path (down, experts in latent space,
RMSNorm, up) and the shared experts. Math: reference/k3_checkpoint.md section 3.

The math is written once, as pure functions of a parameter dict (`moe_apply`, `experts_combine`,
`mlp_apply`); the Linen modules only declare the weights and call them. Under a mesh the same
`moe_apply` runs per shard inside shard_map (sharding/moe.py), told by `MoEAxes` which of its
weights are split over which mesh axis and therefore which partial sums to reduce.
"""
from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas.moe import (MXFP4PairedWeight, MXFP4Weight, gather_rows, moe_gmm,
                                moe_gmm_glu, mxfp4)
from .common import F32, INIT_STD, Weight, glu, rms_normalize

HIGHEST = jax.lax.Precision.HIGHEST


class MoEAxes(NamedTuple):
    """Mesh axes one shard's MoE weights are split over (None: the whole dimension on every rank).

    expert: the routed experts' expert dimension (expert parallelism): rank r holds experts
      [r * E_local, (r + 1) * E_local) and computes only the (token, expert) pairs routed to them.
    expert_inner: the routed experts' intermediate dimension (tensor parallelism).
    shared: the shared experts' intermediate dimension.
    up: the latent up-projection's output columns (MoE dedup: each rank computes the hidden
      coordinates it owns and adds them into the shared experts' partial sum).
    """
    expert: str | None = None
    expert_inner: str | None = None
    shared: str | None = None
    up: str | None = None


def _proj(x, p, dt):
    """x @ kernel in the compute dtype (what flax's Dense does)."""
    return x.astype(dt) @ p["kernel"].astype(dt)


def mlp_apply(cfg, p, x):
    """Gated MLP (gate_proj, up_proj, down_proj); partial over ranks if the intermediate is split."""
    dt = cfg.jnp_dtype
    a, b = _proj(x, p["gate_proj"], dt), _proj(x, p["up_proj"], dt)
    return _proj(glu(cfg, a.astype(F32), b.astype(F32)).astype(dt), p["down_proj"], dt)


def mlp_weights(cfg, intermediate: int) -> dict:
    """Declare gate/up/down kernels in the calling (compact) module; returns them as a dict."""
    D, pdt = cfg.hidden_size, cfg.jnp_param_dtype
    shapes = {"gate_proj": (D, intermediate), "up_proj": (D, intermediate), "down_proj": (intermediate, D)}
    return {n: {"kernel": Weight(s, pdt, name=n)()} for n, s in shapes.items()}


class MLP(nn.Module):
    cfg: object
    intermediate: int

    @nn.compact
    def __call__(self, x):
        return mlp_apply(self.cfg, mlp_weights(self.cfg, self.intermediate), x)


class MLPWeights(nn.Module):
    """An MLP's weights as a dict (the shared experts, handed to `moe_apply`)."""
    cfg: object
    intermediate: int

    @nn.compact
    def __call__(self):
        return mlp_weights(self.cfg, self.intermediate)


def route(logits, bias, cfg):
    """Router: (expert ids [N, k], combine weights [N, k] fp32) from fp32 router logits [N, E].

    The correction bias only decides which experts are selected; the weights come from the
    unbiased sigmoid scores, renormalised over the chosen k, times routed_scaling_factor.
    """
    scores = jax.nn.sigmoid(logits.astype(F32))
    choice = scores + bias.astype(F32)
    if cfg.num_expert_group > 1:  # group-limited selection (DeepSeek V3): best groups by top-2 sum
        N, E = choice.shape
        grouped = choice.reshape(N, cfg.num_expert_group, E // cfg.num_expert_group)
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
        keep = jax.lax.top_k(group_score, cfg.topk_group)[1]
        group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(N)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, E // cfg.num_expert_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_token)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def _grouped_weight(experts: dict, name: str, dtype, layout: str = "k3"):
    """Routed expert weight `name` for moe_gmm: dense [E, in, out], or MXFP4 kept packed
    ([E, out, in/2] + scales; the kernel dequantises in place, the reference path dequantises),
    its bytes in Config.mxfp4_layout."""
    if name in experts:
        return experts[name].astype(dtype)
    cls = MXFP4PairedWeight if layout == "paired" else MXFP4Weight
    return cls(experts[f"{name}_packed"], experts[f"{name}_scale"])


def experts_combine(cfg, experts: dict, u, idx, weights, backend=None, first=0,
                    fuse_glu=False):
    """sum_j weights[n, j] * expert_{idx[n, j]}(u[n]) in fp32 [N, in], over the experts held here:
    `experts` holds E_local of them (its leading dimension), ids first .. first + E_local - 1;
    pairs routed elsewhere contribute 0. With the whole set (first 0, E_local = E) this is the
    layer's routed output; split intermediates give a partial sum. `fuse_glu`: gate/up and the
    activation in one kernel (see `moe_gmm_glu`); off by default: at K3 dims on the H200 the two
    products plus the activation in XLA were faster at every token count (results_moe.md run 6,
    MXFP4 layer 3.81 vs 4.14 ms at 64 tokens, 46.8 vs 51.4 ms at 8192)."""
    dt = cfg.jnp_dtype
    w = {n: _grouped_weight(experts, n, dt, cfg.mxfp4_layout) for n in ("w1", "w3", "w2")}
    E_local = w["w1"].shape[0]
    N, k = idx.shape
    local = idx.reshape(-1) - first
    key = jnp.where((local >= 0) & (local < E_local), local, E_local)  # held elsewhere: sorted last
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=E_local + 1)[:E_local].astype(jnp.int32)
    rows = order[:N * min(k, E_local)]  # a token's k experts are distinct: its held pairs fit
    # x split (where the kernel wants it) on the N tokens, then the N * k rows gathered
    xs = gather_rows(u, rows // k, w["w1"], backend=backend, fused_glu=fuse_glu)
    act = "situ" if cfg.hidden_act == "situ" else "swiglu"
    h = moe_gmm_glu(xs, w["w1"], w["w3"], group_sizes, activation=act, backend=backend,
                    situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, fuse=fuse_glu)
    y = moe_gmm(h.astype(dt), w["w2"], group_sizes, backend=backend)  # rows past the sum are zero
    # Un-permute as a gather through the inverse of `rows` (pairs without a row read zeros), then
    # the weighted k-sum. A scatter of y into pair order was a 224 us kernel at 512 tokens on the
    # H200; with the gather the layer took 6.006 instead of 6.275 ms (results_moe.md run 10).
    pos = jnp.full((N * k,), rows.shape[0], jnp.int32).at[rows].set(
        jnp.arange(rows.shape[0], dtype=jnp.int32))
    yk = jnp.take(y, pos.reshape(N, k), axis=0, mode="fill", fill_value=0)  # [N, k, D]
    return jnp.sum(weights.astype(F32)[..., None] * yk.astype(F32), axis=1)


def sum_partials(terms):
    """sum over ranks of [(x, axes x is a partial sum over)]: one psum over the union of the axes
    (a term whole along some of them counts on their rank 0 only); whole terms are added after."""
    union = tuple(dict.fromkeys(a for _, axes in terms for a in axes))
    partial = []
    for x, axes in terms:
        if axes:
            for a in union:
                if a not in axes:
                    x = jnp.where(jax.lax.axis_index(a) == 0, x, jnp.zeros_like(x))
            partial.append(x)
    whole = [x for x, axes in terms if not axes]
    parts = ([jax.lax.psum(functools.reduce(operator.add, partial), union)] if partial else []) + whole
    return functools.reduce(operator.add, parts)


def moe_apply(cfg, p, xf, backend=None, axes: MoEAxes = MoEAxes(), fuse_glu=False):
    """One MoE layer on tokens xf [N, D] -> [N, D]; p holds this rank's slices of the weights as
    `axes` says (the default: whole weights, no collective). Collectives: the routed experts'
    partial latent sums reduce over their axes (latent MoE; one psum), then one psum assembles
    shared experts + up-projection (dedup) or shared + routed (no latent). `fuse_glu`: see
    `experts_combine`."""
    dt = cfg.jnp_dtype
    logits = jnp.dot(xf.astype(F32), p["gate"].astype(F32), precision=HIGHEST)
    idx, w = route(logits, p["e_score_correction_bias"], cfg)
    L = cfg.routed_expert_hidden_size
    u = _proj(xf, p["routed_expert_down_proj"], dt) if L else xf
    first = 0
    if axes.expert:
        first = jax.lax.axis_index(axes.expert) * jax.tree.leaves(p["experts"])[0].shape[0]
    routed = experts_combine(cfg, p["experts"], u, idx, w, backend, first, fuse_glu)
    routed_axes = tuple(a for a in (axes.expert, axes.expert_inner) if a)
    terms = []
    if cfg.num_shared_experts:
        terms.append((mlp_apply(cfg, p["shared_experts"], xf), (axes.shared,) if axes.shared else ()))
    if not L:
        return sum_partials(terms + [(routed.astype(dt), routed_axes)])
    latent = (jax.lax.psum(routed, routed_axes) if routed_axes else routed).astype(dt)
    if cfg.latent_moe_use_norm:
        latent = p["routed_expert_norm"]["weight"].astype(dt) * rms_normalize(latent, cfg.rms_norm_eps)
    up = _proj(latent, p["routed_expert_up_proj"], dt)  # [N, D], or this rank's D / TP columns
    if axes.up:  # dedup: the owned columns go into this rank's slice of the partial sum
        cols = up.shape[-1]
        up = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((xf.shape[0], cfg.hidden_size), dt), up,
                                                 jax.lax.axis_index(axes.up) * cols, 1)
    return sum_partials(terms + [(up, (axes.up,) if axes.up else ())])


class Experts(nn.Module):
    """Routed experts' weights, stored dense ([E, in, out]) or as MXFP4 ([E, out, in/2] +
    [E, out, in/32]); returns them as a dict for `experts_combine`."""
    cfg: object

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        E, I, Din = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
        shapes = {"w1": (Din, I), "w3": (Din, I), "w2": (I, Din)}  # w1 gate, w3 up, w2 down
        experts = {}
        for n, (din, dout) in shapes.items():
            if cfg.expert_format == "dense":
                experts[n] = self.param(n, nn.initializers.normal(INIT_STD), (E, din, dout),
                                        cfg.jnp_param_dtype)
            else:
                experts[f"{n}_packed"] = self.param(
                    f"{n}_packed", lambda k, s: jax.random.randint(k, s, 0, 256, jnp.int32).astype(jnp.uint8),
                    (E, dout, din // 2))
                experts[f"{n}_scale"] = self.param(  # 2^-8..2^-6: magnitudes near INIT_STD
                    f"{n}_scale", lambda k, s: jax.random.randint(k, s, 119, 122, jnp.int32).astype(jnp.uint8),
                    (E, dout, din // mxfp4.GROUP))
        return experts


def _splitting_mesh():
    """The ambient mesh if it splits MoE weights (a tensor or expert axis > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(mesh.shape.get(a, 1) == 1 for a in ("tensor", "expert")):
        return None
    return mesh


class MoE(nn.Module):
    """The MoE layer. Under an ambient mesh with a tensor or expert axis > 1 (kimik3's functions
    set the model's mesh) it runs `moe_apply` per shard in shard_map (sharding/moe.py), with MoE
    dedup (Config.moe_dedup) and the expert placement the config and mesh select."""
    cfg: object

    @nn.compact
    def __call__(self, x, backend=None):
        cfg = self.cfg
        B, T, D = x.shape
        L, pdt = cfg.routed_expert_hidden_size, cfg.jnp_param_dtype
        p = {"gate": self.param("gate", nn.initializers.normal(INIT_STD), (D, cfg.num_experts),
                                jnp.dtype(cfg.router_dtype)),
             "e_score_correction_bias": self.param("e_score_correction_bias", nn.initializers.normal(0.01),
                                                   (cfg.num_experts,), F32)}
        if L:
            p["routed_expert_down_proj"] = {"kernel": Weight((D, L), pdt, name="routed_expert_down_proj")()}
        p["experts"] = Experts(cfg, name="experts")()
        if L and cfg.latent_moe_use_norm:
            p["routed_expert_norm"] = {"weight": Weight((L,), pdt, nn.initializers.ones, "weight",
                                                        name="routed_expert_norm")()}
        if L:
            p["routed_expert_up_proj"] = {"kernel": Weight((L, D), pdt, name="routed_expert_up_proj")()}
        if cfg.num_shared_experts:
            p["shared_experts"] = MLPWeights(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                             name="shared_experts")()
        xf = x.reshape(B * T, D)
        mesh = _splitting_mesh()
        if mesh is None:
            out = moe_apply(cfg, p, xf, backend)
        else:
            from sharding.moe import moe_sharded  # sharding knows the placement rules

            out = moe_sharded(cfg, p, xf, backend, mesh)
        return out.reshape(B, T, D)
