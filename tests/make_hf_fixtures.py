"""Regenerate the HF transformers parity fixtures in tests/fixtures/hf_kimi_linear/.

Runs under a separate Python 3.11 venv with PyTorch (CPU) and transformers >= 5.23, NOT the project env:

    python3 -m venv /work/venv311
    /work/venv311/bin/pip install torch==2.13.0          # first, so pip takes the local CPU wheel
    /work/venv311/bin/pip install "transformers>=5.23" safetensors numpy
    /work/venv311/bin/python tests/make_hf_fixtures.py   # [--out DIR] [--case NAME ...] [--no-oracle]

For each case it builds a tiny random `KimiLinearForCausalLM` (fp32, CPU, fixed seeds), randomises every
weight (so that a wrong transpose / order / eps / gate shows), saves it with `save_pretrained`, and writes
`expected.npz` with the input ids, the fp32 logits of a plain forward, the per-layer hidden states, and a
greedy `generate` continuation (prompt, output ids and the per-step logits).

Key names: `save_pretrained` (transformers 5.24) reverses its load-time conversion, which gives the official
Kimi-Linear key names, except that it also renames the DENSE layers' `mlp.*` to `block_sparse_moe.*` (its
reverse of the `.block_sparse_moe.` -> `.mlp.` rename is applied to every `.mlp.`). The official checkpoints
store dense layers as `mlp.{gate,up,down}_proj`, so this script renames those keys back and then checks that
HF's `from_pretrained` loads the rewritten file with no missing / unexpected keys and reproduces the logits
bit for bit.

It also checks HF against an independent float64 NumPy oracle of the Kimi Linear math (kda.md sections 1.2,
2 and 5), written from the spec and reading the saved safetensors, both for the forward logits and for the
greedy continuation (teacher-forced argmax). See NOTES.md / MAPPING.md beside the fixtures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file
from transformers import GenerationConfig, KimiLinearConfig, KimiLinearForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fixture_cases import CASES, COMMON  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "fixtures" / "hf_kimi_linear"

# Cases (tiny: hidden 64, vocab 256, 3-4 layers, 8 experts): hf_fixture_cases.py, shared with make_config_forms.py.


def make_config(case: dict) -> KimiLinearConfig:
    kw = dict(COMMON)
    kw.update(case["config"])
    cfg = KimiLinearConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


# --------------------------------------------------------------------------------------------------------------
# Randomisation: every tensor gets a distinct, discriminating value.
# --------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def randomize(model: KimiLinearForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 1000 + 7)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=g, dtype=torch.float32) * (hi - lo) + lo

    for name, p in sorted(model.named_parameters()):
        shape = tuple(p.shape)
        if name.endswith("A_log"):
            val = uniform(shape, np.log(0.5), np.log(8.0))           # decay rate exp(A_log) in (0.5, 8)
        elif name.endswith("dt_bias"):
            val = normal(shape, 1.0, mean=-2.0)                       # softplus(dt_bias) ~ 0.02 .. 0.7
        elif "conv1d" in name:
            val = normal(shape, 0.4)                                  # depthwise taps, [3P, 1, W] packed
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            val = normal(shape, 0.1, mean=1.0)                        # RMSNorm gains 1 +- 0.1
        elif name.endswith("embed_tokens.weight"):
            val = normal(shape, 0.5)
        elif name.endswith("gate.weight") and "mlp.gate" in name:     # router [E, D]
            val = normal(shape, 0.3)
        elif name.endswith("b_proj.weight") and "kv_b_proj" not in name and "q_b_proj" not in name \
                and "g_b_proj" not in name and "f_b_proj" not in name:
            val = normal(shape, 0.3)                                  # beta logits
        elif name.endswith("experts.gate_up_proj"):                  # [E, 2I, D]
            val = normal(shape, 1.0 / np.sqrt(shape[-1]))
        elif name.endswith("experts.down_proj"):                     # [E, D, I]
            val = normal(shape, 1.0 / np.sqrt(shape[-1]))
        elif p.dim() == 2:                                            # nn.Linear [out, in]
            val = normal(shape, 1.0 / np.sqrt(shape[-1]))
        else:
            raise RuntimeError(f"no randomisation rule for {name} {shape}")
        p.copy_(val)
    # buffers: the router's correction bias (selection only) must be nonzero and able to change the choice
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(normal(tuple(b.shape), 0.15))


# --------------------------------------------------------------------------------------------------------------
# Official key names: undo HF's over-eager `mlp.` -> `block_sparse_moe.` reverse rename for dense layers.
# --------------------------------------------------------------------------------------------------------------
def fix_dense_mlp_keys(path: Path, cfg: KimiLinearConfig) -> list[str]:
    f = path / "model.safetensors"
    with safe_open(str(f), "np") as sf:
        meta = sf.metadata()
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    renamed = []
    out = {}
    for k, v in tensors.items():
        parts = k.split(".")
        if (len(parts) == 6 and parts[0] == "model" and parts[1] == "layers" and parts[3] == "block_sparse_moe"
                and parts[4] in ("gate_proj", "up_proj", "down_proj")
                and cfg.mlp_layer_types[int(parts[2])] == "dense"):
            nk = ".".join(parts[:3] + ["mlp"] + parts[4:])
            renamed.append(f"{k} -> {nk}")
            k = nk
        out[k] = np.ascontiguousarray(v)
    np_save_file(out, str(f), metadata=meta)
    return renamed


# --------------------------------------------------------------------------------------------------------------
# Independent float64 oracle of the Kimi Linear math, from the saved tensors (official key names).
# --------------------------------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus20(x):
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def oracle_logits(W: dict, cfg: dict, ids: np.ndarray) -> np.ndarray:
    """ids [T] -> logits [T, V] in float64. cfg is the saved config.json dict."""
    D = cfg["hidden_size"]
    eps = cfg["rms_norm_eps"]
    lac = cfg["linear_attn_config"]
    kda = {i - 1 for i in lac["kda_layers"]}
    H, K, Wc = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    T = len(ids)
    x = W["model.embed_tokens.weight"][ids]
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        if l in kda:
            def conv(name, u):                                        # causal depthwise conv + SiLU
                w = W[a + name][:, 0, :]                               # [P, W]
                up = np.concatenate([np.zeros((Wc - 1, u.shape[1])), u], 0)
                return _silu(sum(w[:, i] * up[i:i + T] for i in range(Wc)))
            q = conv("q_conv1d.weight", h @ W[a + "q_proj.weight"].T).reshape(T, H, K)
            k = conv("k_conv1d.weight", h @ W[a + "k_proj.weight"].T).reshape(T, H, K)
            v = conv("v_conv1d.weight", h @ W[a + "v_proj.weight"].T).reshape(T, H, K)
            q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
            k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
            f = (h @ W[a + "f_a_proj.weight"].T) @ W[a + "f_b_proj.weight"].T + W[a + "dt_bias"]
            A = np.exp(W[a + "A_log"].reshape(H))
            gk = (-A[None, :, None] * _softplus20(f.reshape(T, H, K)))          # [T, H, K], <= 0
            beta = _sigmoid(h @ W[a + "b_proj.weight"].T)                        # [T, H]
            S = np.zeros((H, K, K))
            o = np.zeros((T, H, K))
            for t in range(T):
                S = S * np.exp(gk[t])[:, :, None]                                # decay key rows first
                pred = np.einsum("hkv,hk->hv", S, k[t])
                delta = beta[t][:, None] * (v[t] - pred)
                S = S + k[t][:, :, None] * delta[:, None, :]
                o[t] = np.einsum("hkv,hk->hv", S, q[t] * K ** -0.5)
            gate = (h @ W[a + "g_a_proj.weight"].T) @ W[a + "g_b_proj.weight"].T
            o = _rms(o, W[a + "o_norm.weight"], eps) * _sigmoid(gate.reshape(T, H, K))
            att = o.reshape(T, H * K) @ W[a + "o_proj.weight"].T
        else:
            nh = cfg["num_attention_heads"]
            dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
            if cfg.get("q_lora_rank"):
                qa = _rms(h @ W[a + "q_a_proj.weight"].T, W[a + "q_a_layernorm.weight"], 1e-6)
                q = qa @ W[a + "q_b_proj.weight"].T
            else:
                q = h @ W[a + "q_proj.weight"].T
            q = q.reshape(T, nh, dn + dr)
            c = h @ W[a + "kv_a_proj_with_mqa.weight"].T
            lat, krot = c[:, :r], c[:, r:]
            lat = _rms(lat, W[a + "kv_a_layernorm.weight"], 1e-6)
            kv = (lat @ W[a + "kv_b_proj.weight"].T).reshape(T, nh, dn + dv)
            knope, vv = kv[..., :dn], kv[..., dn:]
            kk = np.concatenate([knope, np.broadcast_to(krot[:, None, :], (T, nh, dr))], -1)   # NoPE: no rotary
            s = np.einsum("thd,shd->hts", q, kk) * (dn + dr) ** -0.5
            s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            s = s / s.sum(-1, keepdims=True)
            att = np.einsum("hts,shd->thd", s, vv).reshape(T, nh * dv) @ W[a + "o_proj.weight"].T
        x = x + att
        h = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        if l < cfg.get("first_k_dense_replace", 0):
            m = p + "mlp."
            y = (_silu(h @ W[m + "gate_proj.weight"].T) * (h @ W[m + "up_proj.weight"].T)) @ W[m + "down_proj.weight"].T
        else:
            m = p + "block_sparse_moe."
            E, topk = cfg["num_experts"], cfg["num_experts_per_token"]
            ng, tg = cfg["num_expert_group"], cfg["topk_group"]
            sc = _sigmoid(h @ W[m + "gate.weight"].T)                             # [T, E]
            choice = sc + W[m + "gate.e_score_correction_bias"]
            gs = np.sort(choice.reshape(T, ng, E // ng), -1)[..., -2:].sum(-1)     # group score: top-2 sum
            keep_g = np.argsort(-gs, -1)[:, :tg]
            gmask = np.zeros((T, ng), bool)
            np.put_along_axis(gmask, keep_g, True, -1)
            choice = np.where(np.repeat(gmask, E // ng, -1), choice, -np.inf)
            idx = np.argsort(-choice, -1)[:, :topk]
            wt = np.take_along_axis(sc, idx, -1)                                  # weights from unbiased scores
            if cfg.get("moe_renormalize", True):
                wt = wt / (wt.sum(-1, keepdims=True) + 1e-20)
            wt = wt * cfg["routed_scaling_factor"]
            y = np.zeros_like(h)
            for t in range(T):
                for j in range(topk):
                    e = f"{m}experts.{idx[t, j]}."
                    u = _silu(h[t] @ W[e + "w1.weight"].T) * (h[t] @ W[e + "w3.weight"].T)
                    y[t] += wt[t, j] * (u @ W[e + "w2.weight"].T)
            s_ = m + "shared_experts."
            y += (_silu(h @ W[s_ + "gate_proj.weight"].T) * (h @ W[s_ + "up_proj.weight"].T)) @ W[s_ + "down_proj.weight"].T
        x = x + y
    x = _rms(x, W["model.norm.weight"], eps)
    return x @ W["lm_head.weight"].T


ROUTING_MARGIN = 1e-3  # smallest allowed gap at a routing decision (fp32 implementations may differ by ~1e-5)


def routing_margin(model, ids: np.ndarray) -> float:
    """The closest call any router makes on `ids`: the gap between the last chosen and the first
    rejected expert score (within the kept groups), and between the last kept and first dropped group.
    Fixtures whose routing is a near-tie would make a correct fp32 implementation look wrong."""
    gaps = []

    def hook(router, args, _out):
        x = args[0].reshape(-1, router.hidden_dim).float()
        choice = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias
        if router.num_group > 1:
            per = router.num_experts // router.num_group
            group_score = choice.view(-1, router.num_group, per).topk(2, dim=-1)[0].sum(-1)
            gs = group_score.sort(-1, descending=True)[0]
            gaps.append(float((gs[:, router.topk_group - 1] - gs[:, router.topk_group]).min()))
            keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(router.topk_group)[1], 1)
            choice = choice.masked_fill(~keep.bool().repeat_interleave(per, 1), float("-inf"))
        top = choice.sort(-1, descending=True)[0]
        gaps.append(float((top[:, router.top_k - 1] - top[:, router.top_k]).min()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    with torch.no_grad():
        model(input_ids=torch.from_numpy(ids), use_cache=False)
    for h in handles:
        h.remove()
    return min(gaps)


# --------------------------------------------------------------------------------------------------------------
def build_case(name: str, case: dict, out_root: Path, run_oracle: bool) -> dict:
    torch.manual_seed(case["seed"])
    cfg = make_config(case)
    model = KimiLinearForCausalLM(cfg).to(torch.float32).eval()
    randomize(model, case["seed"])

    rng = np.random.default_rng(case["seed"])
    V = cfg.vocab_size
    for _ in range(50):  # avoid pad/bos/eos ids, and routing near-ties
        input_ids = rng.integers(3, V, size=(2, case["seq_len"]), dtype=np.int64)
        if routing_margin(model, input_ids) > ROUTING_MARGIN:
            break
    else:
        raise RuntimeError(f"{name}: no input with routing margin > {ROUTING_MARGIN}")
    ids_t = torch.from_numpy(input_ids)

    with torch.no_grad():
        out = model(input_ids=ids_t, output_hidden_states=True, use_cache=False)
        logits = out.logits.float().numpy()
        hidden = np.stack([h.float().numpy() for h in out.hidden_states])         # [L+1, B, T, D]
        # Discrimination check: zeroing the correction bias must change the logits (it changes routing).
        saved = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        for n, b in model.named_buffers():
            if n in saved:
                b.zero_()
        nobias = model(input_ids=ids_t, use_cache=False).logits.float().numpy()
        for n, b in model.named_buffers():
            if n in saved:
                b.copy_(saved[n])
        bias_effect = float(np.abs(nobias - logits).max())
        assert bias_effect > 1e-3, f"{name}: e_score_correction_bias has no effect ({bias_effect})"
        group_effect = None
        if cfg.num_expert_group > 1:                 # the group limit must change the routing too
            routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
            for r in routers:
                r.num_group, r.topk_group = 1, 1
            ungrouped = model(input_ids=ids_t, use_cache=False).logits.float().numpy()
            for r in routers:
                r.num_group, r.topk_group = cfg.num_expert_group, cfg.topk_group
            group_effect = float(np.abs(ungrouped - logits).max())
            assert group_effect > 1e-3, f"{name}: group-limited routing has no effect ({group_effect})"

    # Greedy generate from a shorter prompt; pick a prompt whose greedy steps are not near-ties and that never
    # generates pad/bos/eos (so a test that stops at eos or masks pad still sees all 8 tokens).
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=case["new_tokens"], min_new_tokens=0,
                               eos_token_id=None, pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id,
                               use_cache=True)
    # generate() merges the model's generation_config, whose eos_token_id comes from config.json: clear it too so
    # that every row runs exactly new_tokens greedy steps (no eos stop / pad fill).
    model.generation_config.eos_token_id = None
    for attempt in range(20):
        prompt = rng.integers(3, V, size=(2, case["prompt_len"]), dtype=np.int64)
        with torch.no_grad():
            g = model.generate(torch.from_numpy(prompt), attention_mask=torch.ones_like(torch.from_numpy(prompt)),
                               generation_config=gen_cfg, return_dict_in_generate=True, output_logits=True)
        gen_ids = g.sequences.numpy()
        step_logits = np.stack([s.float().numpy() for s in g.logits], 1)          # [B, new, V]
        top2 = np.sort(step_logits, -1)[..., -2:]
        margin = float((top2[..., 1] - top2[..., 0]).min())
        special = {cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id}
        if (margin > 2e-2 and not np.isin(gen_ids[:, case["prompt_len"]:], list(special)).any()
                and routing_margin(model, gen_ids) > ROUTING_MARGIN):
            break
    else:
        raise RuntimeError(f"{name}: no prompt with greedy margin > 2e-2 and no special token generated")
    assert gen_ids.shape == (2, case["prompt_len"] + case["new_tokens"])
    # HF's own consistency: a plain full forward over the generated sequence gives the same greedy tokens
    with torch.no_grad():
        full = model(input_ids=torch.from_numpy(gen_ids), use_cache=False).logits.float().numpy()
    P = case["prompt_len"]
    tf_pred = full[:, P - 1:-1].argmax(-1)
    assert (tf_pred == gen_ids[:, P:]).all(), f"{name}: HF generate disagrees with HF teacher-forced argmax"
    decode_vs_full = float(np.abs(full[:, P - 1:-1] - step_logits).max())

    # Save
    d = out_root / name
    if d.exists():
        shutil.rmtree(d)
    model.save_pretrained(str(d), safe_serialization=True)
    renamed = fix_dense_mlp_keys(d, cfg)
    gc = d / "generation_config.json"
    if gc.exists():
        gc.unlink()                                                                # not needed by the tests

    # Round trip through HF's loader: official names must load cleanly and reproduce logits exactly.
    m2, info = KimiLinearForCausalLM.from_pretrained(str(d), output_loading_info=True, dtype=torch.float32)
    m2.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), f"{name}: reload {key}: {info.get(key)}"
    m2.config._attn_implementation = "eager"
    with torch.no_grad():
        re_logits = m2(input_ids=ids_t, use_cache=False).logits.float().numpy()
    assert np.array_equal(re_logits, logits), f"{name}: reload changed logits {np.abs(re_logits - logits).max()}"

    np.savez(d / "expected.npz",
             input_ids=input_ids,
             logits=logits.astype(np.float32),
             hidden_states=hidden.astype(np.float32),
             prompt_ids=prompt,
             generate_ids=gen_ids,
             generate_step_logits=step_logits.astype(np.float32))

    info_out = dict(case=name, seed=case["seed"], bias_effect=bias_effect, group_effect=group_effect,
                    greedy_margin=margin,
                    decode_vs_full_max_abs=decode_vs_full, renamed_dense_keys=len(renamed),
                    logits_absmax=float(np.abs(logits).max()), logits_std=float(logits.std()))

    if run_oracle:
        with open(d / "config.json") as fh:
            saved_cfg = json.load(fh)
        with safe_open(str(d / "model.safetensors"), "np") as sf:
            W = {k: sf.get_tensor(k).astype(np.float64) for k in sf.keys()}
        errs = []
        for b in range(2):
            ref = oracle_logits(W, saved_cfg, input_ids[b])
            errs.append(np.abs(ref - logits[b]).max() / np.abs(ref).max())
            ref_g = oracle_logits(W, saved_cfg, gen_ids[b])
            assert (ref_g[P - 1:-1].argmax(-1) == gen_ids[b, P:]).all(), f"{name}: oracle greedy mismatch"
        info_out["oracle_max_rel_err"] = float(max(errs))
        assert info_out["oracle_max_rel_err"] < 1e-4, f"{name}: HF vs float64 oracle {info_out['oracle_max_rel_err']}"
    return info_out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (default: all)")
    ap.add_argument("--no-oracle", action="store_true", help="skip the float64 NumPy cross-check")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)                       # bitwise-reproducible CPU reductions
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    for name in args.case or list(CASES):
        info = build_case(name, CASES[name], args.out, not args.no_oracle)
        print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
