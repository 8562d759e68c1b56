"""Train the tiny-code model (`Config.preset("tiny-code")`) on the Python standard library's source
and export it as an HF checkpoint directory with MXFP4 experts: the checkpoint shipped in
kimik3/assets/tiny-code, which `kimik3.load("tiny-code")` and `kimik3 generate` load.

    python -m kimik3.train_tiny --out DIR [--steps N --batch B --seq-len T --seed S]

Data: kimik3/stdlib_corpus.py (every .py file of this Python's stdlib; a file is held out when
sha256 of its relative path is 0 mod 20). Training draws random windows of seq_len + 1 tokens
from the training files' document stream (BOS, bytes, EOS per file) with a fixed seed.

Model: the preset's shape with dense fp32 experts and fp32 activations, trained through the
model's own plain-JAX path (backend="reference") with optax AdamW, a warmup + cosine schedule and
gradient clipping. The routers' selection-only correction biases are not trained by gradients
(they get none): after each step they move by the auxiliary-loss-free balancing rule
(bias += rate * sign(mean load - expert load), DeepSeek-V3), from the routing of that step's batch.

Export: ordinary weights rounded to the preset's storage dtype (bf16; the fp32-by-design leaves
stay fp32), routed experts quantised to MXFP4 (round to nearest, kernels_pallas.moe.mxfp4); the
directory is then loaded back through `kimik3.load` and its held-out bits per byte measured, so
the figure printed is the shipped checkpoint's, after quantisation.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from . import stdlib_corpus
from .checkpoint.hf import _get, _set
from .checkpoint.hf_export import export_hf
from .config import Config
from .layers.moe import route
from .model import KimiLM, Model
from .params import abstract, init

PRESET = "tiny-code"


def train_config(cfg: Config) -> Config:
    """The shape of `cfg`, trainable: dense fp32 experts, fp32 weights and activations."""
    return cfg.replace(dtype="float32", param_dtype="float32", expert_format="dense")


def _is_router_bias(path) -> bool:
    return getattr(path[-1], "key", None) == "e_score_correction_bias"


def _moe_inputs_filter(module, method_name):
    """capture_intermediates filter: the MoE layers' inputs (post-attention norms' outputs)."""
    return module.name == "post_attention_layernorm"


def make_step(cfg: Config, optimizer, batch: int, seq_len: int, bias_rate: float):
    """The jitted training step: sample windows on the device, loss and grads through the
    reference path, AdamW update, balancing update of the router biases."""
    import optax

    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]

    def loss_fn(params, tokens):
        logits, state = KimiLM(cfg).apply({"params": params}, tokens[:, :-1], backend="reference",
                                          capture_intermediates=_moe_inputs_filter, mutable=["intermediates"])
        logits = logits[0]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        loads = []
        for i in moe_layers:
            y = state["intermediates"][f"layers_{i}"]["post_attention_layernorm"]["__call__"][0]
            moe = params[f"layers_{i}"]["block_sparse_moe"]
            idx, _ = route(y.reshape(-1, cfg.hidden_size) @ moe["gate"], moe["e_score_correction_bias"], cfg)
            loads.append(jnp.bincount(idx.reshape(-1), length=cfg.num_experts))
        return loss, jax.lax.stop_gradient(jnp.stack(loads).astype(jnp.float32))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, stream, key):
        starts = jax.random.randint(key, (batch,), 0, stream.shape[0] - seq_len - 1)
        tokens = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(stream, s, seq_len + 1))(starts)
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        for j, i in enumerate(moe_layers):  # auxiliary-loss-free balancing (no gradient reaches it)
            moe = params[f"layers_{i}"]["block_sparse_moe"]
            moe["e_score_correction_bias"] = moe["e_score_correction_bias"] + bias_rate * jnp.sign(
                loads[j].mean() - loads[j])
        imbalance = (loads.max(-1) / loads.mean(-1)).max()
        return params, opt_state, loss, imbalance

    return step


def make_optimizer(params, lr: float, steps: int, warmup: int, weight_decay: float):
    import optax

    warmup = min(warmup, steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 10)
    # No decay on norms, biases, gates' log-rates, conv taps (vectors); none at all on router biases.
    decay = jax.tree_util.tree_map_with_path(lambda p, x: x.ndim >= 2 and not _is_router_bias(p), params)
    trainable = jax.tree_util.tree_map_with_path(lambda p, x: "bias" if _is_router_bias(p) else "train", params)
    return optax.multi_transform(
        {"train": optax.chain(optax.clip_by_global_norm(1.0),
                              optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay)),
         "bias": optax.set_to_zero()}, trainable)


def export_model(params, cfg: Config) -> Model:
    """The trained fp32 tree in the shipped format: `cfg`'s storage dtypes, MXFP4 experts."""
    from kernels_pallas.moe import mxfp4

    host = jax.tree.map(np.asarray, params)
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract(cfg))[0]:
        keys = tuple(p.key for p in path)
        if keys[-2] == "experts" and keys[-1].endswith(("_packed", "_scale")):
            w, kind = keys[-1].split("_")
            dense = _get(host, keys[:-1] + (w,))
            packed, scales = mxfp4.quantize(np.swapaxes(dense, -1, -2))  # [E, out, in]: along in
            value = packed if kind == "packed" else scales
        else:
            value = _get(host, keys).astype(leaf.dtype)
        if value.shape != leaf.shape:
            raise ValueError(f"{'/'.join(keys)}: trained {value.shape}, preset {leaf.shape}")
        _set(out, keys, jnp.asarray(value))
    return Model(params=out, cfg=cfg)


def main(argv=None) -> int:
    import optax  # noqa: F401  (fail early, before reading the corpus, if it is missing)

    p = argparse.ArgumentParser(prog="python -m kimik3.train_tiny", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where to write the HF checkpoint directory")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="router bias balancing step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop training after this many seconds (the export still happens)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows of --seq-len bytes")
    args = p.parse_args(argv)

    shipped = Config.preset(PRESET)
    cfg = train_config(shipped)
    train_files, held_files = stdlib_corpus.split_files()
    stream = stdlib_corpus.document_tokens(train_files, cfg.bos_token_id, cfg.eos_token_id)
    print(f"corpus {stdlib_corpus.stdlib_root()}: {len(train_files)} training files ({stream.size} tokens), "
          f"{len(held_files)} held out; {jax.devices()[0].device_kind}", flush=True)

    model = init(cfg, seed=args.seed)
    optimizer = make_optimizer(model.params, args.lr, args.steps, args.warmup, args.weight_decay)
    opt_state = optimizer.init(model.params)
    step = make_step(cfg, optimizer, args.batch, args.seq_len, args.bias_rate)
    params, stream_d, key = model.params, jnp.asarray(stream), jax.random.key(args.seed)
    t0 = time.perf_counter()
    for s in range(args.steps):
        params, opt_state, loss, imbalance = step(params, opt_state, stream_d, jax.random.fold_in(key, s))
        out_of_time = args.time_limit is not None and time.perf_counter() - t0 > args.time_limit
        if s == 0 or (s + 1) % args.log_every == 0 or s + 1 == args.steps or out_of_time:
            loss = float(loss)
            print(f"step {s + 1}/{args.steps}: loss {loss:.4f} ({loss / math.log(2):.3f} bits/byte), "
                  f"max expert load / mean {float(imbalance):.2f}, {time.perf_counter() - t0:.1f}s", flush=True)
        if out_of_time:
            print(f"--time-limit reached after {s + 1} steps", flush=True)
            break
    train_s = time.perf_counter() - t0

    windows = stdlib_corpus.heldout_windows(args.seq_len, args.eval_windows)
    bpb_trained = stdlib_corpus.bits_per_byte(Model(params=params, cfg=cfg), windows, backend="reference")
    export_hf(export_model(params, shipped), args.out, num_shards=1)
    from .io import load

    exported = load(args.out, dtype="float32")
    bpb = stdlib_corpus.bits_per_byte(exported, windows, backend="reference")
    sample = stdlib_corpus.bits_per_byte(exported, stdlib_corpus.heldout_sample(), backend="reference")
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    summary = {"steps": s + 1, "batch": args.batch, "seq_len": args.seq_len, "train_seconds": round(train_s, 1),
               "heldout_windows": int(windows.shape[0]), "heldout_bpb_before_export": round(bpb_trained, 4),
               "heldout_bpb_exported": round(bpb, 4), "heldout_sample_bpb_exported": round(sample, 4),
               "checkpoint_bytes": size, "device": jax.devices()[0].device_kind}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
