"""Engine decode throughput on a reduced K3 (issue 7): the real per-layer shapes of one TP8 rank
(12 KDA heads, 12 MLA heads, latent MoE with 896 MXFP4 experts of intermediate 3072/8, shared
experts 2 x 3072/8, dense layer 0 at 33792/8, vocab 163840/8) with 3 layers: a dense KDA layer, a
KDA + MoE layer and an MLA + MoE layer. For batch sizes 1..256 it times steady-state decode calls
of the engine (each call = `decode_steps` tokens per row on device) and compares with a roofline:
bytes one decode step must read (weights incl. the experts hit, KDA state read + write, MLA cache)
over the copy bandwidth measured in the same run.

Run (repo root): PYTHONUNBUFFERED=1 python3 benchmarks/bench_engine.py   [BENCH_TINY=1 on CPU]
Knobs: BENCH_BATCHES="1,16,64,256"; BENCH_MLA_CACHE="auto,fp8" (each in turn; "fp8": the MLA
cache as e4m3 words, Config.mla_cache_dtype="fp8"); BENCH_PROMPT_LEN (default 16: decode at a
context of 16-56 tokens; 32768: every row prefilled with 32K tokens first, so the decode step
reads a long MLA history) and BENCH_PREFILL_CHUNK (default 16; tokens a row per prefill call).
Writes $OUT/bench_engine.json (after every batch size) and prints a table.
"""
from __future__ import annotations

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import kimik3
from serve import Engine, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
TINY = os.environ.get("BENCH_TINY") == "1"
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "1,16,64,256").split(",")]
BUDGET = float(os.environ.get("BENCH_BUDGET_S", "250"))
MLA_CACHES = os.environ.get("BENCH_MLA_CACHE", "auto").split(",")  # "fp8": e4m3 words
PROMPT_LEN = int(os.environ.get("BENCH_PROMPT_LEN", "16"))
PREFILL_CHUNK = int(os.environ.get("BENCH_PREFILL_CHUNK", "16"))


def reduced_k3(mla_cache="auto"):
    if TINY:
        return kimik3.Config.preset("tiny").replace(num_layers=3, layer_types=("kda", "kda", "mla"),
                                                    mla_cache_dtype=mla_cache)
    return kimik3.Config.preset("kimi-k3").replace(
        name="k3-tp8-rank-3L", num_layers=3, layer_types=("kda", "kda", "mla"), kda_num_heads=12,
        mla_num_heads=12, intermediate_size=33792 // 8, moe_intermediate_size=3072 // 8,
        vocab_size=163840 // 8, attn_res_block_size=2, mla_cache_dtype=mla_cache,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # K3's ids lie past this vocabulary


def copy_bandwidth():
    x = jnp.ones((1 << 29,) if not TINY else (1 << 20,), jnp.bfloat16)  # 1 GiB
    f = jax.jit(lambda a: a * 2)
    f(x).block_until_ready()
    t = time.perf_counter()
    for _ in range(10):
        y = f(x)
    y.block_until_ready()
    return 2 * x.nbytes * 10 / (time.perf_counter() - t)


def step_bytes(cfg, params, batch, ctx):
    """Bytes one decode step reads/writes at least: non-expert weights, the experts the batch's
    16 x batch routings hit (expected count under uniform routing), KDA state read + write, MLA
    cache of every row."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    expert = sum(x.nbytes for p, x in leaves if any(getattr(k, "key", None) == "experts" for k in p))
    embed = params["embed_tokens"]["embedding"]
    # the embedding table is gathered (B rows), not streamed
    other = sum(x.nbytes for p, x in leaves) - expert - embed.nbytes + batch * embed.shape[1] * embed.dtype.itemsize
    hit = cfg.num_experts * (1 - (1 - cfg.num_experts_per_token / cfg.num_experts) ** batch)
    experts = expert * hit / cfg.num_experts
    kda = len(cfg.kda_layers) * batch * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * 4 * 2
    mla = len(cfg.mla_layers) * batch * ctx * cfg.mla_cache_dim * (1 if cfg.mla_cache_dtype == "fp8" else 2)
    return other + experts + kda + mla, dict(other=other, experts=experts, kda=kda, mla=mla)


def check_kernels_in_model():
    """Greedy tokens of the tiny K3-like model through the engine: default backend (Pallas on GPU)
    vs the plain-JAX reference, on this device."""
    m = kimik3.init(kimik3.Config.preset("tiny"), seed=0)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 70))]
    outs = {}
    for backend in (None, "reference"):
        eng = Engine(m, max_batch=2, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=4, backend=backend)
        outs[backend] = eng.generate(prompts, max_new_tokens=8, stop_tokens=[])
    ok = outs[None] == outs["reference"]
    print(f"kernels-in-model check (tiny, engine, greedy): {'match' if ok else 'MISMATCH'} "
          f"{outs[None]} vs {outs['reference']}", flush=True)
    return ok


def time_batch(model, B, steps=8, n_calls=4):
    """Prefill B rows of PROMPT_LEN random tokens, then time n_calls decode calls of `steps`
    tokens a row. Returns (seconds a decode step, the context it ended at, prefill s, warm-up s)."""
    eng = Engine(model, max_batch=B, max_seq_len=PROMPT_LEN + steps * (n_calls + 2) + 64,
                 page_size=64, prefill_chunk=PREFILL_CHUNK, decode_steps=steps)
    rng = np.random.RandomState(B)
    for i in range(B):
        eng.submit(list(map(int, rng.randint(0, 256, PROMPT_LEN))),
                   SamplingParams(max_new_tokens=steps * (n_calls + 2), stop_tokens=()),
                   request_id=i)
    t0 = time.perf_counter()
    eng.step()  # the first prefill call (compiles)
    jax.block_until_ready(eng.layers)
    t1 = time.perf_counter()
    while any(r.fed < len(r.prompt) for r in eng.running) or eng.waiting:
        eng.step()  # the rest of the prefill
    jax.block_until_ready(eng.layers)
    prefill_s = time.perf_counter() - t1
    eng.step()  # compile the decode loop
    jax.block_until_ready(eng.layers)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_calls):
        eng.step()
    jax.block_until_ready(eng.layers)
    dt = (time.perf_counter() - t0) / (n_calls * steps)
    return dt, PROMPT_LEN + steps * (n_calls + 1), prefill_s, warm


def main():
    t_start = time.perf_counter()
    check = check_kernels_in_model()
    bw = copy_bandwidth()
    results = {"copy_bw": bw, "kernels_match_reference": check, "prompt_len": PROMPT_LEN,
               "prefill_chunk": PREFILL_CHUNK, "rows": []}
    print(f"device {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for mla_cache in MLA_CACHES:
        cfg = reduced_k3(mla_cache)
        model = kimik3.init(cfg, seed=0)
        jax.block_until_ready(model.params)
        results["config"] = cfg.name
        print(f"{cfg.name}, MLA cache {mla_cache}: params "
              f"{sum(x.nbytes for x in jax.tree.leaves(model.params)) / 1e9:.2f} GB", flush=True)
        for B in BATCHES:
            if time.perf_counter() - t_start > BUDGET:
                print(f"budget reached before B={B}, MLA cache {mla_cache}")
                break
            dt, ctx, prefill_s, warm = time_batch(model, B)
            nbytes, parts = step_bytes(cfg, model.params, B, ctx)
            row = dict(batch=B, mla_cache=mla_cache, context=ctx, step_us=dt * 1e6,
                       tokens_per_s=B / dt, per_layer_us=dt * 1e6 / cfg.num_layers,
                       roofline_us=nbytes / bw * 1e6, fraction_of_roofline=nbytes / bw / dt,
                       bytes=parts, prefill_s=prefill_s, warmup_s=warm)
            results["rows"].append(row)
            print(f"B={B:4d} MLA cache {mla_cache:4s} ctx {ctx:6d}: {dt * 1e6:9.1f} us/step "
                  f"{B / dt:10.1f} tok/s  roofline {nbytes / bw * 1e6:8.1f} us "
                  f"({100 * nbytes / bw / dt:5.1f}%; MLA cache {parts['mla'] / 1e6:.0f} MB)  "
                  f"prefill {prefill_s:.1f}s  warmup {warm:.1f}s", flush=True)
            with open(os.path.join(OUT, "bench_engine.json"), "w") as f:
                json.dump(results, f, indent=1)
        del model


if __name__ == "__main__":
    main()
