"""Speculative decoding (depth chosen by measured cycle time) against plain decoding on the K3
slice (copy, random) and on the trained tiny-code model (code): decode tokens/s per batch size,
with the depth the controller settled on and the measurements behind it.

- copy: the answer repeats a span the drafter already has, as a code edit re-emits the code it
  edits. A random-weight model copies nothing on its own, so the drafts come from the target
  model itself drafting greedily on its own cache (serve's ModelDrafter), with its drafting time
  left out of the measured time: the drafts a free, perfect copier would make. Its drafts follow
  plain decoding's numerics; where the verify pass rounds a near-tie the other way (on the GPU
  its kernels differ from the decode step's) the draft is rejected and the next cycle re-syncs,
  as a real drafter's would. This is the n-gram drafter's best case on copied spans, and the upper
  bound of what speculation gains on this model and device.
- random: random prompts sampled at temperature 1 (a seed per row) with the n-gram drafter, which
  finds nothing to draft: the controller should turn speculation off, at little cost.
- code: the trained tiny-code model (kimik3.load("tiny-code"), not the slice) re-emitting a span
  of held-out standard-library code from its first line, greedy, with the n-gram drafter: a code
  edit with a model whose choices are not near-ties, so acceptance is the drafts' and the model's
  own (a random-weight model's verify pass flips near-ties its decode step does not).
Each engine is warmed up (Engine.warmup), then decodes the prompts twice, the second time as new
requests: the first pass has a fresh depth controller, which must time the depths it tries on
these very requests; the second runs as a server's controller does, on cycle times measured on
earlier requests. The rows give the second pass against plain decoding's second pass while the
batch was full (until a first row finished: a server refills its slot, and rows that finish apart
leave a tail of a few rows that plain decoding, whose rows finish together, does not have); the
whole pass's ratio and the first pass's are in the note (all in the details). Outputs with
speculation should equal plain decoding's (same seeds); the rows that differ, and where, are
recorded with plain decoding's logprob lead over speculation's token there (near_tie_gaps: on the
GPU the verify pass's kernels round differently from the decode step's, so a near-tie can flip a
greedy choice; a lead far above rounding would be a bug).

    python -m benchmarks speculative [--batches 1,16,64] [--new-tokens 192] [--workloads random,code]
        [--spec-depth auto|K] [--profile]
    python -m benchmarks speculative --smoke     # CPU: the tiny preset
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

import kimik3
from kimik3 import stdlib_corpus
from kimik3.tokenizer import default_tokenizer
from serve import Engine, SamplingParams
from serve.drafters import ModelDrafter
from serve.launch import settle_heap
from .common import choices_arg, ints_arg
from .engine_metrics import decode_profile
from .k3_slice import k3_slice


def spec_depth_arg(v: str):
    if v == "auto" or (v.isdigit() and 1 <= int(v) <= 7):
        return v if v == "auto" else int(v)
    raise argparse.ArgumentTypeError(f"{v!r}: use auto or a depth 1..7")


def add_args(p):
    p.add_argument("--batches", type=ints_arg, default=None, help="batch sizes (default 1,16,64; smoke 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per row (default 192)")
    p.add_argument("--prompt-len", type=int, default=None, help="length of P (default 128; smoke 24)")
    p.add_argument("--depth", type=int, default=12, help="layers of the K3 slice")
    p.add_argument("--spec-depth", type=spec_depth_arg, default="auto",
                   help='num_speculative_tokens: "auto" (the controller) or a fixed depth 1..7')
    p.add_argument("--profile", action="store_true",
                   help="a third pass: wall time, GPU busy time, launches and kernel categories of a "
                        "few engine steps (a cycle each, or a plain decode call), per decode token a row")
    p.add_argument("--workloads", type=choices_arg(*WORKLOADS), default=list(WORKLOADS),
                   help=f"which workloads to run, of {','.join(WORKLOADS)} (default all)")


WORKLOADS = ("copy", "random", "code")
EDIT_CUE = "\n\n# the same code, edited:\n"


def code_edit_prompts(model, n: int, span: int) -> list[list[int]]:
    """n prompts: `span` bytes of a held-out stdlib file, a cue, then the span's first 80 bytes
    again (the model continues re-emitting it)."""
    tok = default_tokenizer(model.cfg)
    held = stdlib_corpus.split_files()[1]
    prompts = []
    for i in range(n):
        src = stdlib_corpus.read_bytes(held[i % len(held)]).decode(errors="replace")
        body = src[len(src) // 3:len(src) // 3 + span]
        prompts.append(tok.encode(body + EDIT_CUE + body[:80], add_bos=True))
    return prompts


class FreeTargetDrafter(ModelDrafter):
    """The target model drafting for itself; `seconds` is the time its drafting took (left out)."""
    seconds = 0.0

    def propose_batch(self, rows, k, max_batch, max_seq_len):
        t = time.perf_counter()
        out = super().propose_batch(rows, k, max_batch, max_seq_len)  # host lists: the drafts are done
        self.seconds += time.perf_counter() - t
        return out


PROFILED_STEPS = 4
ENGINE = dict(page_size=64, prefill_chunk=256, decode_steps=8, prefix_cache=False)  # every engine here


def submit_and_prefill(eng, prompts, params, first_id: int) -> list:
    """The prompts as requests first_id, first_id + 1, ..., stepped until every prompt is cached."""
    reqs = [eng.submit(p, sp, request_id=first_id + i) for i, (p, sp) in enumerate(zip(prompts, params))]
    while eng.waiting or any(r.fed < len(r.prompt) for r in eng.running):
        eng.step()
    return reqs


def step_profile(eng):
    """Wall time a decode token (a step of the batch) over PROFILED_STEPS engine steps, then
    engine_metrics.decode_profile of as many more (a cycle each, or a plain decode call):
    {wall_us_per_token, gpu_busy_us, launches_per_token, us_per_token by category}; None off the
    GPU or where the requests end first."""
    rows = eng.running
    fed, t = sum(r.fed for r in rows), time.perf_counter()
    for _ in range(PROFILED_STEPS):
        eng.step()
    eng.drain()
    tokens = sum(r.fed for r in rows) - fed
    if not tokens or not eng.running:  # the requests ended first (too few --new-tokens)
        return None
    wall_us = 1e6 * (time.perf_counter() - t) * len(rows) / tokens
    prof = decode_profile(eng, wall_us, reps=PROFILED_STEPS)
    return prof and dict(prof, wall_us_per_token=wall_us)


def decode(model, B, prompts, params, speculative, max_seq_len, depth="auto", profile=False):
    """The prompts decoded twice on one engine, each pass prefilled and then timed to the end:
    [(outputs, decode seconds, committed decode tokens, stats)] for the first pass (a fresh
    controller, which must time the depths it tries) and the second (as a running server's
    controller, which has timed them on earlier requests). With `profile`, a third pass of the
    same prompts is profiled (step_profile), its figures in the second pass's stats."""
    eng = Engine(model, max_batch=B, max_seq_len=max_seq_len, speculative=speculative,
                 num_speculative_tokens=depth, **ENGINE)
    # every depth's verify pass compiled before anything is timed (the sampling programs only
    # where a row samples)
    eng.warmup(sampling=any(p.temperature > 0 for p in params))
    drafter = eng.spec.drafter if eng.spec is not None else None
    passes = []
    for first_id in (0, len(prompts)):
        reqs = submit_and_prefill(eng, prompts, params, first_id)
        jax.block_until_ready(eng.layers)
        before = sum(len(r.output) for r in reqs)
        left_out, t, full = getattr(drafter, "seconds", 0.0), time.perf_counter(), None
        decoded = lambda: sum(len(r.output) for r in reqs) - before  # noqa: E731
        elapsed = lambda: time.perf_counter() - t - (getattr(drafter, "seconds", 0.0) - left_out)  # noqa: E731
        while eng.has_work():
            eng.step()
            if full is None and any(r.finished for r in reqs):  # the batch was full until now
                full = (decoded(), elapsed())
        jax.block_until_ready(eng.layers)
        secs = elapsed()
        full = full or (decoded(), secs)
        stats = dict(eng.stats(), full_batch_tokens_per_s=full[0] / full[1])
        passes.append(([list(r.output) for r in reqs], secs, decoded(), stats))
    if profile:  # a pass of its own: the profiler's time stays out of the timed ones
        submit_and_prefill(eng, prompts, params, 2 * len(prompts))
        for _ in range(2):  # past the first calls of the decode
            eng.step()
        passes[1][3]["step_profile"] = step_profile(eng)
        while eng.has_work():
            eng.step()
    return passes


def divergence(a, b):
    """Per row whose outputs differ: the first position where they do."""
    return {i: next((j for j, (x, y) in enumerate(zip(r, s)) if x != y), min(len(r), len(s)))
            for i, (r, s) in enumerate(zip(a, b)) if r != s}


def near_tie_gaps(model, prompts, params, max_seq_len, plain, ours, differ) -> dict:
    """Plain decoding re-run with logprobs, per differing row at its first divergence j: how many
    nats plain decoding's choice led the token speculation chose there (a rounding-sized gap is a
    near-tie the verify pass's numerics flipped; a large one is a bug). "rerun differs" where the
    re-run's tokens to j are not the plain pass's, "not in top 5" where the other token ranks lower."""
    eng = Engine(model, max_batch=len(prompts), max_seq_len=max_seq_len, **ENGINE)
    lp = [dataclasses.replace(p, return_logprobs=True, top_logprobs=5) for p in params]
    reqs = submit_and_prefill(eng, prompts, lp, 0)
    while eng.has_work():
        eng.step()
    gaps = {}
    for i, j in differ.items():
        out = reqs[i].output
        theirs = ours[i][j] if j < len(ours[i]) else None
        if list(out[:j + 1]) != plain[i][:j + 1]:
            gaps[i] = "rerun differs"
        elif theirs in out.top_logprobs[j]:
            gaps[i] = round(out.logprobs[j] - out.top_logprobs[j][theirs], 4)
        else:
            gaps[i] = "not in top 5"
    return gaps


def case(rec, model, B, workload, n_new, plen, rng, depth="auto", profile=False):
    V = model.cfg.vocab_size
    prompts = (code_edit_prompts(model, B, 4 * plen) if workload == "code"
               else [list(map(int, rng.randint(0, V, plen))) for _ in range(B)])
    max_len = max(map(len, prompts)) + n_new + 64
    drafter, drafter_name = (lambda: "ngram"), "n-gram"
    if workload == "copy":
        drafter, drafter_name = (lambda: FreeTargetDrafter(model)), "free target-model"  # a fresh cache a run
    temperature = 1.0 if workload == "random" else 0.0  # (seed i: a sampled row's own stream)
    params = [SamplingParams(max_new_tokens=n_new, temperature=temperature, seed=1000 + i, stop_tokens=())
              for i in range(B)]
    runs = {}
    for spec in (None, drafter):
        runs[spec is None] = decode(model, B, prompts, params, spec and spec(), max_len, depth, profile)
    tps, full, differs, gaps = {}, {}, {}, {}
    for i, name in enumerate(("cold", "warm")):
        (plain, t_plain, n_plain, plain_stats), (ours, t_spec, n_spec, stats) = runs[True][i], runs[False][i]
        differ = differs[name] = divergence(plain, ours)
        gap = gaps[name] = (near_tie_gaps(model, prompts, params, max_len, plain, ours, differ)
                            if differ and not temperature else {})
        tps[name] = (n_spec / t_spec, n_plain / t_plain)
        full[name] = (stats["full_batch_tokens_per_s"], plain_stats["full_batch_tokens_per_s"])
        acc = stats.get("spec_acceptance")
        rec.details.setdefault("cases", []).append(dict(
            batch=B, workload=workload, drafter=drafter_name, controller=name,
            plain_tokens_per_s=tps[name][1], spec_tokens_per_s=tps[name][0],
            speedup=tps[name][0] / tps[name][1], plain_full_batch_tokens_per_s=full[name][1],
            full_batch_speedup=full[name][0] / full[name][1], rows_differing=len(differ),
            first_divergence=differ, logprob_gap_at_divergence=gap, **stats))
        rec.log(f"B{B} {workload} ({name} controller): plain {tps[name][1]:.1f} tok/s, {drafter_name} "
                f"{tps[name][0]:.1f} tok/s ({tps[name][0] / tps[name][1]:.2f}x; "
                f"{full[name][0] / full[name][1]:.2f}x while the batch was full), {main_depth(stats)}, "
                f"acceptance {acc}, rows differing {len(differ)}/{B} {differ}, plain's lead there {gap}")
    # the row: the warm controller's pass while the batch was full (the module docstring says why)
    (spec_tps, plain_tps), whole = full["warm"], tps["warm"][0] / tps["warm"][1]
    area = f"Speculative decoding, {drafter_name} drafts, " + ("auto depth" if depth == "auto" else f"depth {depth}")
    cold = full["cold"][0] / full["cold"][1]
    rec.row(area + (", trained tiny-code model" if workload == "code" else ""), f"B{B} {workload}",
            spec_tps, "tokens/s", peer=plain_tps, peer_name="plain",
            note=f"{main_depth(stats)}, acceptance {0 if acc is None else acc:.2f}, {len(differ)}/{B} rows "
                 f"differ; to the last row {whole:.2f}x; fresh controller {cold:.2f}x"
                 + (f", {len(differs['cold'])}/{B} rows differ" if differs["cold"] else "")
                 + gap_note(gaps) + profile_note(runs))


def gap_note(gaps) -> str:
    """The differing rows' logprob gaps at their divergence (near_tie_gaps), both passes."""
    leads = [g if isinstance(g, str) else f"{g} nats" for per_row in gaps.values() for g in per_row.values()]
    return f" (plain's lead there: {', '.join(leads)})" if leads else ""


def main_depth(stats) -> str:
    """The depth that committed most of the pass's tokens, and its share."""
    spent = {k: v["tokens"] for k, v in stats.get("spec_spent", {}).items()}
    if not spent:
        return "depth 0"
    top = max(spent, key=spent.get)
    return f"{top} ({spent[top] / max(1, sum(spent.values())):.0%} of tokens)"


def profile_note(runs) -> str:
    """A decode token's wall vs GPU busy time with speculation and without (--profile)."""
    profs = [runs[plain][1][3].get("step_profile") for plain in (False, True)]
    if not all(profs):
        return ""
    return "; us/token wall/GPU: spec " + ", plain ".join(
        f"{p['wall_us_per_token']:.0f}/{p['gpu_busy_us']:.0f}" for p in profs)


def run(rec, args):
    smoke = args.smoke
    batches = args.batches or ([2] if smoke else [1, 16, 64])
    n_new = args.new_tokens or (24 if smoke else 192)
    plen = args.prompt_len or (24 if smoke else 128)
    slice_model = kimik3.init(k3_slice(args.depth, smoke), seed=0) if set(args.workloads) - {"code"} else None
    code_model = kimik3.load("tiny-code") if "code" in args.workloads else None
    settle_heap()  # as the server does after loading: the drafters' indexes then trigger no full collections
    rec.details.update(model=slice_model and slice_model.cfg.name, code_model=code_model and code_model.cfg.name,
                       new_tokens=n_new, prompt_len=plen)
    rng = np.random.RandomState(0)
    for B in batches:
        for workload in args.workloads:
            model = code_model if workload == "code" else slice_model
            rec.guard(f"B{B} {workload}", case, rec, model, B, workload, n_new, plen, rng, args.spec_depth,
                      args.profile)
