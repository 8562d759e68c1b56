"""KDA (Kimi Delta Attention) layer: projections, short convs, gates, the recurrence (via
kernels_pallas), gated RMSNorm output. Math: reference/kda.md sections 1-2, k3_checkpoint.md 3."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

import kernels_pallas
from kernels_pallas import resolve_backend
from kernels_pallas.kda.decode import kda_decode
from .common import F32, causal_conv, dense, rms_normalize

# At most this many new tokens per sequence go through the per-token recurrence (decode, verify);
# longer extends use the chunked form.
RECURRENT_MAX_T = 8


def kda_cache_shapes(cfg, batch: int):
    P = cfg.kda_num_heads * cfg.kda_head_dim
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    return {"state": ((batch, H, K, K), F32), "conv": ((batch, cfg.conv_size - 1, 3 * P), cfg.jnp_dtype)}


class KDA(nn.Module):
    cfg: object

    @nn.compact
    def __call__(self, x, cache, n_new, backend=None):
        """x [B, T, D]; cache {"state", "conv"} or None (fresh sequences); n_new [B] valid tokens."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        P = H * K
        W = cfg.conv_size
        if cache is None:
            shapes = kda_cache_shapes(cfg, B)
            cache = {k: jnp.zeros(s, d) for k, (s, d) in shapes.items()}

        conv_init = nn.initializers.normal(0.3)
        qkv_raw = jnp.concatenate([dense(P, "q_proj", cfg)(x), dense(P, "k_proj", cfg)(x),
                                   dense(P, "v_proj", cfg)(x)], axis=-1)
        conv_w = jnp.concatenate([self.param(f"{n}_conv1d", conv_init, (P, W), F32) for n in "qkv"])
        f = dense(P, "f_b_proj", cfg)(dense(K, "f_a_proj", cfg)(x))
        A_log = self.param("A_log", lambda key, s: jnp.log(jax.random.uniform(key, s, F32, 1, 16)), (H,))
        dt_bias = self.param("dt_bias", nn.initializers.normal(0.5), (P,), F32)
        b_logits = dense(H, "b_proj", cfg)(x).astype(F32)
        if cfg.use_full_rank_gate:
            gate = dense(P, "g_proj", cfg)(x)
        else:
            gate = dense(P, "g_b_proj", cfg)(dense(K, "g_a_proj", cfg)(x))
        o_norm = self.param("o_norm", nn.initializers.ones, (K,), F32)

        if T == 1 and resolve_backend(backend) != "reference":
            # One fused launch: conv update, norms, gates, state update in place, gated norm.
            # Idle rows (n_new = 0) get gate and beta logits of -1e30, i.e. decay 1 and no write, so
            # the big state stays in place untouched; only the small conv state is selected back.
            idle = (n_new == 0)[:, None]
            old_conv = jnp.copy(cache["conv"])  # the kernel donates (updates in place) its inputs
            o, conv_state, state = kda_decode(
                qkv_raw[:, 0], cache["conv"], conv_w, jnp.where(idle, -1e30, f[:, 0].astype(F32)), A_log,
                dt_bias, jnp.where(idle, -1e30, b_logits[:, 0]), gate[:, 0], o_norm, cache["state"],
                num_heads=H, lower_bound=cfg.gate_lower_bound, eps=cfg.rms_norm_eps, backend=backend)
            conv_state = jnp.where(idle[:, :, None], old_conv, conv_state)
            out = dense(cfg.hidden_size, "o_proj", cfg)(o[:, None].astype(cfg.jnp_dtype))
            return out, {"state": state, "conv": conv_state}

        qkv, conv_state = causal_conv(qkv_raw, cache["conv"], conv_w, n_new)
        q, k, v = (a.reshape(B, T, H, K) for a in jnp.split(qkv, 3, axis=-1))
        g = kernels_pallas.kda_gate(f.reshape(B, T, H, K), A_log, dt_bias, lower_bound=cfg.gate_lower_bound)
        beta = jax.nn.sigmoid(b_logits)

        args = dict(initial_state=cache["state"], lengths=n_new, use_qk_l2norm=True)
        if T <= RECURRENT_MAX_T:
            o, state = kernels_pallas.kda_recurrent(q, k, v, g, beta, **args)
        else:
            o, state = kernels_pallas.kda_chunk(q, k, v, g, beta, backend=backend, **args)

        o = rms_normalize(o.astype(F32), cfg.rms_norm_eps) * o_norm
        o = o * jax.nn.sigmoid(gate.astype(F32).reshape(B, T, H, K))
        out = dense(cfg.hidden_size, "o_proj", cfg)(o.reshape(B, T, P).astype(cfg.jnp_dtype))
        return out, {"state": state, "conv": conv_state}
