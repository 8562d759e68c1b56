"""Engine decode and prefill on the first `--depth` layers of K3 with one TP8 rank's shapes.

The model is benchmarks/k3_slice.py's (12 KDA heads, 12 MLA heads, latent MoE with 896 MXFP4
experts of intermediate 3072/8, shared experts 2 x 3072/8, dense layer 0 at 33792/8, vocab
163840/8, K3's layer pattern with an MLA layer every 4th, AttnRes block 12, random weights), 12
layers by default. First it checks that the engine's greedy tokens with the default (Pallas)
kernels equal the plain-JAX reference on this device (the tiny preset).

decode: for each batch size, steady-state decode calls of the engine (each call = 8 tokens a row
on device) against a roofline: the bytes one decode step must move (weights, incl. the experts
the batch's routings hit, KDA state read + write, MLA cache) over the copy bandwidth measured in
the same run (in the details also at torch's copy rate, where torch has CUDA). With --profile,
where a decode token's GPU time goes (JAX profiler, kernels classified by name: dense matmuls,
MoE grouped matmul, KDA, MLA, norms/AttnRes, routing/sort, other XLA fusions, and the host gap =
wall time - GPU busy time), per token, in the details and a compact line in each row's note; the
same for a whole prefill.

prefill: time to first token of one request with a `--prefill-lens` prompt (a second prompt,
after a first one compiles), and its TFLOP/s (the linear layers' FLOPs plus MLA's causal attention
and KDA's chunked delta rule: engine_metrics.prefill_flops says what is counted) as a percentage
of the bf16 matmul peak of a large jnp.dot measured in the same run.

    python -m benchmarks engine [--depth 12] [--mode decode,prefill] [--batches 1,16,64,256]
        [--profile [--name-kernels]] [--mla-cache auto,fp8] [--prompt-len 16] [--prefill-lens 8192,32768]
        [--ttft-chunk 8192]
    python -m benchmarks engine --mode decode --batches 1,16,64 --profile
    python -m benchmarks engine --mode prefill [--profile]
    python -m benchmarks engine --smoke     # CPU: the tiny preset, decode batch 2, a 64-token prompt
"""
from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np

import kimik3
from serve import Engine, SamplingParams
from .common import choices_arg, ints_arg, jax_copy_Bps, names_arg, torch_copy_Bps_subprocess
from .engine_metrics import (decode_profile, hlo_names, jax_matmul_flops, prefill_flops, prefill_profile,
                             profile_note)
from .k3_slice import k3_slice

STEPS, CALLS, PROFILE_CALLS = 8, 4, 4  # decode tokens a call, timed calls, profiled calls
TORCH_BW = None  # torch's copy rate (the targets also quote it), set by prepare_env
HLO_DUMP = None  # where XLA dumps the decode programs (--name-kernels), set by prepare_env


def add_args(p):
    p.add_argument("--depth", type=int, default=12, help="layers of the K3 slice (default 12)")
    p.add_argument("--mode", type=choices_arg("decode", "prefill"), default=["decode", "prefill"],
                   help="what to measure: decode, prefill or both (default decode,prefill)")
    p.add_argument("--batches", type=ints_arg, default=None, help="decode batch sizes (default 1,16,64,256)")
    p.add_argument("--profile", action="store_true",
                   help="GPU time by kernel category from the JAX profiler, a decode token's and a "
                        "prefill's (on with --smoke, where the CPU trace has no GPU plane and it is skipped)")
    p.add_argument("--name-kernels", action="store_true",
                   help="with --profile: the top 40 kernels, each named by the XLA fusion it is and the jax "
                        "op it came from (XLA's optimized HLO, dumped to a temporary folder)")
    p.add_argument("--mla-cache", type=names_arg, default=["auto"],
                   help='MLA cache dtypes, each in turn for decode ("fp8": e4m3 words); prefill '
                        "uses the last")
    p.add_argument("--prompt-len", type=int, default=16,
                   help="decode: tokens prefilled per row before decode (32768: a long MLA history)")
    p.add_argument("--prefill-chunk", type=int, default=16,
                   help="decode: tokens a row per prefill call before the timed decode")
    p.add_argument("--prefill-lens", type=ints_arg, default=None,
                   help="prefill: prompt lengths (default 8192,32768; 64 with --smoke)")
    p.add_argument("--ttft-chunk", type=int, default=None,
                   help="prefill: the engine's prefill chunk (default 8192, where the MoE's grouped "
                        "matmuls take the prefill regime's tiles; 32 with --smoke)")


def prepare_env(args):
    """torch's copy bandwidth in a subprocess, before this process's JAX takes the GPU; with
    --name-kernels, XLA told to dump the decode programs' optimized HLO."""
    global TORCH_BW, HLO_DUMP
    if args.name_kernels:
        HLO_DUMP = tempfile.mkdtemp(prefix="kimik3-hlo-")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={HLO_DUMP} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_steps.*").strip()
    if not args.smoke and "decode" in args.mode:
        TORCH_BW = torch_copy_Bps_subprocess()


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


def decode_engine(model, B, prompt_len, prefill_chunk, calls):
    """An engine with B rows of `prompt_len` random tokens prefilled and its decode loop compiled,
    room left for `calls` more decode calls. Returns (engine, prefill s, warm-up s)."""
    budget = STEPS * (calls + 4)  # the timed calls, the warm-up ones and the one queued ahead
    eng = Engine(model, max_batch=B, max_seq_len=prompt_len + budget + 64, page_size=64,
                 prefill_chunk=prefill_chunk, decode_steps=STEPS)
    rng = np.random.RandomState(B)
    for i in range(B):
        eng.submit(list(map(int, rng.randint(0, 256, prompt_len))),
                   SamplingParams(max_new_tokens=budget, stop_tokens=()), request_id=i)
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
    return eng, prefill_s, time.perf_counter() - t0


def time_decode(eng, calls):
    """Seconds a decode step in steady state: `calls` engine steps after a first one, each ending
    when a call's tokens reach the host (the engine keeps the next call queued on the device)."""
    eng.step()
    rows = eng.running
    fed = sum(r.fed for r in rows)
    t0 = time.perf_counter()
    for _ in range(calls):
        eng.step()
    dt = time.perf_counter() - t0
    return dt * len(rows) / (sum(r.fed for r in rows) - fed)


class Slices:
    """The K3 slice of each MLA cache dtype, built when first asked for; only the last one is
    kept (a 12-layer slice holds ~25 GB of weights, and its init takes minutes)."""

    def __init__(self, depth, smoke):
        self.depth, self.smoke, self.last = depth, smoke, None

    def __call__(self, mla_cache="auto"):
        if self.last is None or self.last.cfg.mla_cache_dtype != mla_cache:
            self.last = None  # free the previous slice first
            self.last = kimik3.init(k3_slice(self.depth, self.smoke, mla_cache), seed=0)
            jax.block_until_ready(self.last.params)
        return self.last


def decode(rec, args, bw, slices):
    batches = args.batches or ([2] if args.smoke else [1, 16, 64, 256])
    profile = args.profile or args.smoke
    for mla_cache in args.mla_cache:
        model = slices(mla_cache)
        cfg = model.cfg
        rec.details["config"] = cfg.name
        cache = "fp8" if mla_cache == "fp8" else "bf16"
        for B in batches:
            case = f"B{B} MLA cache {mla_cache}"
            if rec.skip(case):
                continue
            eng, prefill_s, warm = decode_engine(model, B, args.prompt_len, args.prefill_chunk,
                                                 CALLS + (PROFILE_CALLS + 1 if profile else 0))
            dt = time_decode(eng, CALLS)
            ctx = args.prompt_len + STEPS * (CALLS + 1)
            nbytes, parts = step_bytes(cfg, model.params, B, ctx)
            roof, torch_bw = nbytes / bw, rec.details.get("torch_copy_Bps")
            run = dict(batch=B, mla_cache=mla_cache, context=ctx, step_us=dt * 1e6, tokens_per_s=B / dt,
                       per_layer_us=dt * 1e6 / cfg.num_layers, roofline_us=roof * 1e6,
                       fraction_of_roofline=roof / dt, bytes=parts, prefill_s=prefill_s, warmup_s=warm,
                       fraction_of_torch_copy_roofline=torch_bw and nbytes / torch_bw / dt)
            note = f"{B / dt:.0f} tokens/s"
            if profile:
                prof = decode_profile(eng, dt * 1e6, reps=PROFILE_CALLS, top=40 if HLO_DUMP else 12)
                if prof and HLO_DUMP:
                    prof["top_kernels_hlo"] = hlo_names(HLO_DUMP, prof["top_kernels_us"])
                run["profile"] = prof or "skipped: the trace has no GPU plane (CPU)"
                if prof:
                    note += "; " + profile_note(prof)
                rec.log(f"{case} profile: {prof and profile_note(prof) or run['profile']}")
            rec.details["runs"].append(run)
            rec.log(f"{case} ctx {ctx}: {dt * 1e6:.1f} us/step, {B / dt:.1f} tok/s, roofline "
                    f"{roof * 1e6:.1f} us ({100 * roof / dt:.1f}%)")
            # % of limit: the roofline step time (bytes a step must move / copy bandwidth) over ours
            rec.row(f"Engine decode, {cfg.name} (step time; % of its roofline)",
                    f"B{B} ctx {ctx}, MLA cache {cache}", dt * 1e6, "us", limit_pct=100 * roof / dt,
                    note=note)
            del eng


def ttft(eng, prompt_len, seed):
    """Seconds from submitting one `prompt_len`-token random prompt to `eng` (one slot, idle) to
    its first token."""
    rng = np.random.RandomState(seed)
    t0 = time.perf_counter()
    eng.submit(list(map(int, rng.randint(0, eng.model.cfg.vocab_size, prompt_len))),
               SamplingParams(max_new_tokens=1, stop_tokens=()), request_id=seed)
    while eng.has_work():
        eng.step()
    jax.block_until_ready(eng.layers)
    return time.perf_counter() - t0


def prefill(rec, args, slices):
    lens = args.prefill_lens or ([64] if args.smoke else [8192, 32768])
    chunk = args.ttft_chunk or (32 if args.smoke else 8192)
    peak = jax_matmul_flops(args.smoke)
    rec.details.update(dense_peak_flops=peak, ttft_chunk=chunk, prefill=[])
    rec.log(f"dense bf16 jnp.dot peak: {peak / 1e12:.1f} TFLOP/s")
    mla_cache = args.mla_cache[-1]  # the slice decode left, if it ran
    model, cache = slices(mla_cache), "fp8" if mla_cache == "fp8" else "bf16"
    cfg = model.cfg
    for T in lens:
        case = f"prefill {T}"
        if rec.skip(case):
            continue
        # one engine for every prompt of this length: its construction stays out of the profile
        eng = Engine(model, max_batch=1, max_seq_len=T + 64, page_size=64, prefill_chunk=chunk,
                     decode_steps=4, prefix_cache=False)
        first = ttft(eng, T, seed=0)  # compiles the prefill widths
        s = ttft(eng, T, seed=1)
        fl = prefill_flops(cfg, model.params, T)
        rate = fl["total"] / s
        run = dict(prompt_len=T, chunk=chunk, first_s=first, ttft_s=s, tokens_per_s=T / s, flops=fl,
                   flops_per_s=rate, pct_of_peak=100 * rate / peak)
        note = f"{T / s:.0f} tokens/s, {rate / 1e12:.0f} TFLOP/s"
        if args.profile or args.smoke:
            prof = prefill_profile(lambda: ttft(eng, T, seed=2), s * 1e6, top=20)
            run["profile"] = prof or "skipped: the trace has no GPU plane (CPU)"
            if prof:
                note += "; " + profile_note(prof)
            rec.log(f"{case} profile: {prof and profile_note(prof) or run['profile']}")
        rec.details["prefill"].append(run)
        rec.log(f"{case}: TTFT {s * 1e3:.1f} ms (first {first:.1f} s), {T / s:.0f} tok/s, "
                f"{rate / 1e12:.1f} TFLOP/s ({100 * rate / peak:.1f}% of peak)")
        rec.row(f"Engine prefill, {cfg.name} (TTFT; % of the dense bf16 peak)",
                f"{T} tokens, chunk {chunk}, MLA cache {cache}", s * 1e3, "ms", limit_pct=100 * rate / peak,
                note=note)


def run(rec, args):
    # on the CPU the default backend is the reference itself: nothing to compare
    ok, outs = (None, None) if args.smoke else check_kernels_in_model()
    rec.details.update(kernels_match_reference=ok, depth=args.depth, modes=args.mode,
                       prompt_len=args.prompt_len, prefill_chunk=args.prefill_chunk, runs=[])
    rec.log(f"kernels in the model (tiny, engine, greedy): {ok}")
    if ok is False:
        rec.data["errors"]["kernels_in_model"] = f"default {outs[None]} vs reference {outs['reference']}"
    bw = jax_copy_Bps(args.smoke) if "decode" in args.mode else None
    rec.details["copy_Bps"] = bw
    rec.details["torch_copy_Bps"] = TORCH_BW
    slices = Slices(args.depth, args.smoke)
    if "decode" in args.mode:
        decode(rec, args, bw, slices)
    if "prefill" in args.mode:
        prefill(rec, args, slices)
