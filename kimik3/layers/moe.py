"""Dense MLP and the (latent) MoE: sigmoid router with a selection-only correction bias, top-k,
renormalise, routed scaling; sort tokens by expert and run grouped matmuls (no expert computes
tokens it was not chosen for); weighted combine; K3's latent path (down, experts in latent space,
RMSNorm, up) and the shared experts. Math: reference/k3_checkpoint.md section 3."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from kernels_pallas.moe import MXFP4Weight, moe_gmm, moe_gmm_glu, mxfp4
from .common import F32, INIT_STD, RMSNorm, dense, glu

HIGHEST = jax.lax.Precision.HIGHEST


class MLP(nn.Module):
    cfg: object
    intermediate: int

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        a = dense(self.intermediate, "gate_proj", cfg)(x)
        b = dense(self.intermediate, "up_proj", cfg)(x)
        h = glu(cfg, a.astype(F32), b.astype(F32)).astype(cfg.jnp_dtype)
        return dense(cfg.hidden_size, "down_proj", cfg)(h)


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


def _grouped_weight(experts: dict, name: str, dtype):
    """Routed expert weight `name` for moe_gmm: dense [E, in, out], or MXFP4 kept packed
    ([E, out, in/2] + scales; the kernel dequantises in place, the reference path dequantises)."""
    if name in experts:
        return experts[name].astype(dtype)
    return MXFP4Weight(experts[f"{name}_packed"], experts[f"{name}_scale"])


class Experts(nn.Module):
    """Routed experts, stored dense ([E, in, out]) or as MXFP4 ([E, out, in/2] + [E, out, in/32])."""
    cfg: object

    @nn.compact
    def __call__(self, u, idx, weights, backend=None):
        cfg = self.cfg
        E, I, Din = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
        dt = cfg.jnp_dtype
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

        N, k = idx.shape
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = u[order // k]
        w = {n: _grouped_weight(experts, n, dt) for n in ("w1", "w3", "w2")}
        act = "situ" if cfg.hidden_act == "situ" else "swiglu"
        h = moe_gmm_glu(xs, w["w1"], w["w3"], group_sizes, activation=act, backend=backend,
                        situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta)
        y = moe_gmm(h.astype(dt), w["w2"], group_sizes, backend=backend)
        y = jnp.zeros_like(y).at[order].set(y).reshape(N, k, -1)
        return jnp.einsum("nk,nkd->nd", weights, y.astype(F32), precision=HIGHEST)


class MoE(nn.Module):
    cfg: object

    @nn.compact
    def __call__(self, x, backend=None):
        cfg = self.cfg
        B, T, D = x.shape
        xf = x.reshape(B * T, D)
        router_w = self.param("gate", nn.initializers.normal(INIT_STD), (D, cfg.num_experts),
                              jnp.dtype(cfg.router_dtype))
        bias = self.param("e_score_correction_bias", nn.initializers.normal(0.01), (cfg.num_experts,), F32)
        logits = jnp.dot(xf.astype(F32), router_w.astype(F32), precision=HIGHEST)
        idx, weights = route(logits, bias, cfg)

        latent = cfg.routed_expert_hidden_size
        u = dense(latent, "routed_expert_down_proj", cfg)(xf) if latent else xf
        routed = Experts(cfg, name="experts")(u, idx, weights, backend)
        routed = routed.astype(cfg.jnp_dtype)
        if latent:
            if cfg.latent_moe_use_norm:
                routed = RMSNorm(latent, cfg.rms_norm_eps, cfg.jnp_param_dtype, name="routed_expert_norm")(routed)
            routed = dense(D, "routed_expert_up_proj", cfg)(routed)
        out = routed
        if cfg.num_shared_experts:
            shared = MLP(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts, name="shared_experts")(xf)
            out = out + shared
        return out.reshape(B, T, D)
