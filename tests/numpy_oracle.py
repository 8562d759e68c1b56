"""An independent float64 NumPy implementation of Kimi Linear / Kimi K3 text models, written from
the equations (reference/k3_checkpoint.md section 3, reference/kda.md sections 1-2) and reading an
HF checkpoint directory in the official key names directly (safetensors' own numpy loader, its own
MXFP4 decode). It shares no code with kimik3: it is the oracle for the K3-only parts (AttnRes,
latent MoE, SiTU, bounded gate, full-rank gate, MLA output gate) that have no runnable public
reference here."""
from __future__ import annotations

import glob
import json
import os

import numpy as np
from safetensors.numpy import load_file

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def load(path):
    w = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        w.update({k: v.astype(np.float64) if v.dtype != np.uint8 else v for k, v in load_file(f).items()})
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    return w, raw.get("text_config") or raw


def rms(x, g, eps):
    return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def act(c, a, b):
    if c["hidden_act"] == "situ":
        be, lb = c["activation_situ_beta"], c["activation_situ_linear_beta"]
        return be * np.tanh(a / be) * sigmoid(a) * lb * np.tanh(b / lb)
    return silu(a) * b


def mxfp4(packed, scale):
    lo, hi = E2M1[packed & 15], E2M1[packed >> 4]
    vals = np.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    return vals * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


def expert(w, pre, name):
    if pre + name + ".weight" in w:
        return w[pre + name + ".weight"]
    return mxfp4(w[pre + name + ".weight_packed"], w[pre + name + ".weight_scale"])


def kda(w, p, c, x):
    la = c["linear_attn_config"]
    H, K = la["num_heads"], la["head_dim"]
    T = x.shape[0]
    eps = c["rms_norm_eps"]

    def conv(name):
        y = x @ w[p + name + "_proj.weight"].T  # [T, P]
        k = w[p + name + "_conv1d.weight"][:, 0, :]  # [P, W]
        W = k.shape[1]
        pad = np.concatenate([np.zeros((W - 1, y.shape[1])), y])
        return silu(sum(pad[i:i + T] * k[:, i] for i in range(W)))

    q, k, v = (conv(n).reshape(T, H, K) for n in "qkv")
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    f = (x @ w[p + "f_a_proj.weight"].T @ w[p + "f_b_proj.weight"].T).reshape(T, H, K)
    A = np.exp(w[p + "A_log"].reshape(-1)[:H])[:, None]
    z = f + w[p + "dt_bias"].reshape(H, K)
    lb = la.get("gate_lower_bound")
    g = lb * sigmoid(A * z) if lb is not None else -A * np.log1p(np.exp(z))
    beta = sigmoid(x @ w[p + "b_proj.weight"].T)
    S = np.zeros((H, K, K))
    o = np.zeros((T, H, K))
    for t in range(T):
        S = S * np.exp(g[t])[:, :, None]
        pred = np.einsum("hkv,hk->hv", S, k[t])
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - pred))[:, None, :]
        o[t] = np.einsum("hkv,hk->hv", S, q[t] / np.sqrt(K))
    if la.get("use_full_rank_gate"):
        gate = x @ w[p + "g_proj.weight"].T
    else:
        gate = x @ w[p + "g_a_proj.weight"].T @ w[p + "g_b_proj.weight"].T
    o = rms(o, w[p + "o_norm.weight"], eps) * sigmoid(gate.reshape(T, H, K))
    return o.reshape(T, H * K) @ w[p + "o_proj.weight"].T


def mla(w, p, c, x):
    T = x.shape[0]
    H, dn, dr, dv, R = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                        c["v_head_dim"], c["kv_lora_rank"])
    if c.get("q_lora_rank"):
        q = rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], 1e-6) @ w[p + "q_b_proj.weight"].T
    else:
        q = x @ w[p + "q_proj.weight"].T
    q = q.reshape(T, H, dn + dr)
    ckv = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    kv = (rms(ckv[:, :R], w[p + "kv_a_layernorm.weight"], 1e-6) @ w[p + "kv_b_proj.weight"].T).reshape(T, H, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(ckv[:, None, R:], (T, H, dr))], -1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(dn + dr)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("hts,shd->thd", pr, kv[..., dn:]).reshape(T, H * dv)
    if c.get("mla_use_output_gate"):
        o = o * sigmoid(x @ w[p + "g_proj.weight"].T)
    return o @ w[p + "o_proj.weight"].T


def mlp(w, p, c, x):
    return act(c, x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T) @ w[p + "down_proj.weight"].T


def moe(w, p, c, x):
    s = sigmoid(x @ w[p + "gate.weight"].T)
    choice = s + w[p + "gate.e_score_correction_bias"]
    k = c["num_experts_per_token"]
    latent = c.get("routed_expert_hidden_size")
    u = x @ w[p + "routed_expert_down_proj.weight"].T if latent else x
    routed = np.zeros_like(u)
    for t in range(x.shape[0]):
        top = np.argsort(-choice[t], kind="stable")[:k]
        wt = s[t, top]
        if c.get("moe_renormalize", True) and k > 1:
            wt = wt / (wt.sum() + 1e-20)
        wt = wt * c["routed_scaling_factor"]
        for e, we in zip(top, wt):
            pre = f"{p}experts.{e}."
            h = act(c, u[t] @ expert(w, pre, "w1").T, u[t] @ expert(w, pre, "w3").T)
            routed[t] += we * (h @ expert(w, pre, "w2").T)
    if latent:
        if c.get("latent_moe_use_norm"):
            routed = rms(routed, w[p + "routed_expert_norm.weight"], c["rms_norm_eps"])
        routed = routed @ w[p + "routed_expert_up_proj.weight"].T
    if c.get("num_shared_experts"):
        routed = routed + mlp(w, p + "shared_experts.", c, x)
    return routed


def mix(rows, g, proj, eps):
    R = np.stack(rows, 1)  # [T, n, H]
    score = (R / np.sqrt(np.mean(R * R, -1, keepdims=True) + eps) * (g * proj.reshape(-1))).sum(-1)
    pr = np.exp(score - score.max(1, keepdims=True))
    pr /= pr.sum(1, keepdims=True)
    return (pr[..., None] * R).sum(1)


def forward(path, tokens):
    """Logits [T, V] (float64) for one sequence of token ids."""
    w, c = load(path)
    pre = "language_model.model." if "language_model.lm_head.weight" in w else "model."
    head = w["language_model.lm_head.weight" if pre.startswith("language") else "lm_head.weight"]
    eps, bs = c["rms_norm_eps"], c.get("attn_res_block_size") or 0
    full = set(c["linear_attn_config"]["full_attn_layers"])
    bank, p = [], w[pre + "embed_tokens.weight"][np.asarray(tokens)]
    for i in range(c["num_hidden_layers"]):
        L = f"{pre}layers.{i}."
        h = mix(bank + [p], w[L + "self_attention_res_norm.weight"], w[L + "self_attention_res_proj.weight"], eps) \
            if bs and bank else p
        if bs and i % bs == 0:
            bank, p = bank + [p], None
        x = rms(h, w[L + "input_layernorm.weight"], eps)
        a = mla(w, L + "self_attn.", c, x) if i + 1 in full else kda(w, L + "self_attn.", c, x)
        p = a if p is None else p + a
        y = mix(bank + [p], w[L + "mlp_res_norm.weight"], w[L + "mlp_res_proj.weight"], eps) if bs else p
        y = rms(y, w[L + "post_attention_layernorm.weight"], eps)
        dense = L + "mlp.gate_proj.weight" in w  # the stored tensors say which layers are dense
        p = p + (mlp(w, L + "mlp.", c, y) if dense else moe(w, L + "block_sparse_moe.", c, y))
    if bs:
        p = mix(bank + [p], w[pre + "output_attn_res_norm.weight"], w[pre + "output_attn_res_proj.weight"], eps)
    return rms(p, w[pre + "norm.weight"], eps) @ head.T
