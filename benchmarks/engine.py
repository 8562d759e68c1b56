"""Engine decode throughput on a reduced K3 against its roofline.

The model has the real per-layer shapes of one TP8 rank (12 KDA heads, 12 MLA heads, latent MoE
with 896 MXFP4 experts of intermediate 3072/8, shared experts 2 x 3072/8, dense layer 0 at
33792/8, vocab 163840/8) and 3 layers: a dense KDA layer, a KDA + MoE layer and an MLA + MoE
layer. For each batch size it times steady-state decode calls of the engine (each call =
`decode_steps` tokens per row on device) and compares with a roofline: the bytes one decode step
must move (weights incl. the experts hit, KDA state read + write, MLA cache) over the copy
bandwidth measured in the same run. First it checks that the engine's greedy tokens with the
default (Pallas) kernels equal the plain-JAX reference on this device.

    python -m benchmarks engine [--batches 1,16,64,256] [--mla-cache auto,fp8] [--prompt-len 16]
    python -m benchmarks engine --smoke     # CPU: the tiny preset, batch 1 and 2
"""
from __future__ import annotations

import time

import jax
import numpy as np

import kimik3
from serve import Engine, SamplingParams
from .common import ints_arg, jax_copy_Bps, names_arg

SMOKE = False  # set by run()


def add_args(p):
    p.add_argument("--batches", type=ints_arg, default=None, help="batch sizes (default 1,16,64,256)")
    p.add_argument("--mla-cache", type=names_arg, default=["auto"],
                   help='MLA cache dtypes, each in turn ("fp8": e4m3 words)')
    p.add_argument("--prompt-len", type=int, default=16,
                   help="tokens prefilled per row before decode (32768: a long MLA history)")
    p.add_argument("--prefill-chunk", type=int, default=16, help="tokens a row per prefill call")


def reduced_k3(mla_cache="auto"):
    if SMOKE:
        return kimik3.Config.preset("tiny").replace(num_layers=3, layer_types=("kda", "kda", "mla"),
                                                    mla_cache_dtype=mla_cache)
    return kimik3.Config.preset("kimi-k3").replace(
        name="k3-tp8-rank-3L", num_layers=3, layer_types=("kda", "kda", "mla"), kda_num_heads=12,
        mla_num_heads=12, intermediate_size=33792 // 8, moe_intermediate_size=3072 // 8,
        vocab_size=163840 // 8, attn_res_block_size=2, mla_cache_dtype=mla_cache,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)  # K3's ids lie past this vocabulary


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
    return ok, outs


def time_batch(model, B, prompt_len, prefill_chunk, steps=8, n_calls=4):
    """Prefill B rows of `prompt_len` random tokens, then time n_calls decode calls of `steps`
    tokens a row. Returns (seconds a decode step, the context it ended at, prefill s, warm-up s)."""
    eng = Engine(model, max_batch=B, max_seq_len=prompt_len + steps * (n_calls + 2) + 64,
                 page_size=64, prefill_chunk=prefill_chunk, decode_steps=steps)
    rng = np.random.RandomState(B)
    for i in range(B):
        eng.submit(list(map(int, rng.randint(0, 256, prompt_len))),
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
    return dt, prompt_len + steps * (n_calls + 1), prefill_s, warm


def run(rec, args):
    global SMOKE
    SMOKE = args.smoke
    batches = args.batches or ([2] if SMOKE else [1, 16, 64, 256])
    # on the CPU the default backend is the reference itself: nothing to compare
    ok, outs = (None, None) if SMOKE else check_kernels_in_model()
    rec.details.update(kernels_match_reference=ok, prompt_len=args.prompt_len,
                       prefill_chunk=args.prefill_chunk, runs=[])
    rec.log(f"kernels in the model (tiny, engine, greedy): {ok}")
    if ok is False:
        rec.data["errors"]["kernels_in_model"] = f"default {outs[None]} vs reference {outs['reference']}"
    bw = jax_copy_Bps(SMOKE)
    rec.details["copy_Bps"] = bw
    for mla_cache in args.mla_cache:
        cfg = reduced_k3(mla_cache)
        model = kimik3.init(cfg, seed=0)
        jax.block_until_ready(model.params)
        rec.details["config"] = cfg.name
        for B in batches:
            case = f"B{B} MLA cache {mla_cache}"
            if rec.skip(case):
                continue
            dt, ctx, prefill_s, warm = time_batch(model, B, args.prompt_len, args.prefill_chunk)
            nbytes, parts = step_bytes(cfg, model.params, B, ctx)
            roof = nbytes / bw
            rec.details["runs"].append(dict(
                batch=B, mla_cache=mla_cache, context=ctx, step_us=dt * 1e6, tokens_per_s=B / dt,
                per_layer_us=dt * 1e6 / cfg.num_layers, roofline_us=roof * 1e6,
                fraction_of_roofline=roof / dt, bytes=parts, prefill_s=prefill_s, warmup_s=warm))
            rec.log(f"{case} ctx {ctx}: {dt * 1e6:.1f} us/step, {B / dt:.1f} tok/s, roofline "
                    f"{roof * 1e6:.1f} us ({100 * roof / dt:.1f}%)")
            # % of limit: the roofline step time (bytes a step must move / copy bandwidth) over ours
            cache = "fp8" if mla_cache == "fp8" else "bf16"
            rec.row("Engine decode, 3-layer K3 TP8-rank slice (step time; % of its roofline)",
                    f"B{B} ctx {ctx}, MLA cache {cache}", dt * 1e6, "us", limit_pct=100 * roof / dt,
                    note=f"{B / dt:.0f} tokens/s")
        del model
