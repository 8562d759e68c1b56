"""Prefix cache: what a hit saves, and what the cache costs when nothing hits (the K3 slice).

1. nothing hits: unique prompts with the cache off and on; wall time of the prefill calls and
   of a decode step (the cache's bookkeeping, chunk cuts at checkpoint positions, checkpoints).
2. a shared prefix of each --prefixes length: time to first token of a request extending it by
   16 tokens with the cache off (the prefix recomputed), after a device-tier hit, and after a
   host-tier hit (every cached page and checkpoint moved to pinned host memory first); the
   restore alone (pages + KDA checkpoint into the request's slot) against recomputing the prefix.
3. synthetic coding-agent sessions replayed in-process (serve.replay): the share of prompt tokens
   served from the cache.

    python -m benchmarks prefix-cache [--prefixes 8192,32768] [--chunk 2048]
    python -m benchmarks prefix-cache --smoke     # CPU: the tiny preset, short prefixes
"""
from __future__ import annotations

import time

import jax
import numpy as np

import kimik3
from serve import Engine, SamplingParams
from serve.agentic_trace import coding_agent_sessions
from serve.prefix_cache import PrefixCache
from serve.launch import settle_heap
from serve.replay import run_replay
from .common import choices_arg, ints_arg
from .k3_slice import k3_slice


def add_args(p):
    p.add_argument("--prefixes", type=ints_arg, default=None,
                   help="shared prefix lengths (default 8192,32768; smoke 256)")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 2048; smoke 32)")
    p.add_argument("--depth", type=int, default=12, help="layers of the K3 slice")
    p.add_argument("--sessions", type=int, default=16, help="agent sessions replayed")
    p.add_argument("--turns", type=int, default=6, help="turns per agent session")
    p.add_argument("--parts", type=choices_arg(*PARTS), default=list(PARTS),
                   help=f"which parts to run, of {','.join(PARTS)} (default all)")


PARTS = ("shared", "nothing", "sessions")


GEOMETRY = {}  # every engine of a run has the same shapes, so its device programs compile once


def engine(model, **kw):
    return Engine(model, **GEOMETRY, **kw)


def timed_restore():
    """Wrap PrefixCache.restore so each call's device time (to completion) is recorded."""
    times, inner = [], PrefixCache.restore

    def restore(self, req, hit, slot):
        t = time.perf_counter()
        ok = inner(self, req, hit, slot)
        jax.block_until_ready(self.eng.layers)
        times.append(time.perf_counter() - t)
        return ok
    return times, restore


def drain(eng):
    """Run the engine dry: (seconds in prefill calls, seconds per token of each decode call)."""
    pre, dec = 0.0, []
    while eng.has_work():
        prefilling = bool(eng.waiting) or any(r.fed < len(r.sequence) - 1 for r in eng.running)
        t = time.perf_counter()
        eng.step()
        jax.block_until_ready(eng.layers)
        if prefilling:
            pre += time.perf_counter() - t
        else:
            dec.append((time.perf_counter() - t) / eng.decode_steps)
    return pre, dec


def nothing_hits(rec, model, chunk, rng):
    out = {"off": ([], []), "on": ([], [])}  # (prefill seconds per pass, decode seconds per token per call)
    V = model.cfg.vocab_size
    for rep in range(5):  # the first pass compiles; the order alternates so neither side always runs second
        for on in ((False, True) if rep % 2 else (True, False)):
            eng = engine(model, prefix_cache=on)
            for i in range(4):  # fresh tokens every pass: nothing can hit
                prompt = list(map(int, rng.randint(0, V, 4 * chunk + 17 * i)))
                eng.submit(prompt, SamplingParams(max_new_tokens=128, stop_tokens=()))
            pre, dec = drain(eng)
            if rep:
                out["on" if on else "off"][0].append(pre)
                out["on" if on else "off"][1].extend(dec)
    rows = {k: {"prefill_s": float(np.median(p)), "decode_step_s": float(np.median(d))} for k, (p, d) in out.items()}
    passes, calls = len(out["on"][0]), len(out["on"][1])
    rec.details["nothing_hits"] = rows
    shape = f"4 x {4 * chunk} tokens, chunk {chunk}"
    rec.row("Prefix cache on, nothing hits", f"prefill, {shape}", rows["on"]["prefill_s"] * 1e3, "ms",
            peer=rows["off"]["prefill_s"] * 1e3, peer_name="cache off", note=f"median of {passes} passes")
    rec.row("Prefix cache on, nothing hits", "decode step, B4", rows["on"]["decode_step_s"] * 1e6,
            "us", peer=rows["off"]["decode_step_s"] * 1e6, peer_name="cache off", note=f"median of {calls} calls")
    rec.log("nothing hits:", rows)


def ttft(eng, prompt):
    r = eng.submit(prompt, SamplingParams(max_new_tokens=1, stop_tokens=()))
    t = time.perf_counter()
    while r.finished is None:
        eng.step()
    return time.perf_counter() - t, len(prompt) - (r.prefix_hit_tokens or 0)


def shared_prefix(rec, model, P, rng):
    V = model.cfg.vocab_size
    prefix = list(map(int, rng.randint(0, V, P)))
    extend = lambda: prefix + list(map(int, rng.randint(0, V, 16)))  # noqa: E731
    rows = {}
    for name, kw in (("off", dict(prefix_cache=False)), ("device", {}), ("host", dict(host_cache_bytes=1 << 34))):
        eng = engine(model, **kw)
        times, restore = timed_restore()
        PrefixCache.restore, inner = restore, PrefixCache.restore
        try:
            for _ in range(2):  # the second pass is the measured one (compiled)
                ttft(eng, extend())  # caches the prefix (or not)
                if name == "host":
                    eng.prefix.offload()  # every cached page and checkpoint to host
                    jax.block_until_ready(eng.layers)
                del times[:]
                secs, computed = ttft(eng, extend())
        finally:
            PrefixCache.restore = inner
        rows[name] = {"ttft_s": secs, "prefill_tokens_computed": computed,
                      "restore_s": max(times) if times else None, "stats": eng.stats()}
        rec.log(f"prefix {P}, {name}: ttft {secs * 1e3:.1f} ms, {computed} tokens computed, restore "
                f"{(rows[name]['restore_s'] or 0) * 1e3:.2f} ms")
    rec.details.setdefault("shared_prefix", {})[str(P)] = rows
    recompute = rows["off"]["ttft_s"]
    for tier in ("device", "host"):
        r = rows[tier]
        rec.row("Prefix cache hit: restore instead of recomputing the prefix", f"{tier} tier, {P} tokens",
                r["restore_s"] * 1e3, "ms", peer=recompute * 1e3, peer_name="cache off",
                note=f"TTFT {r['ttft_s'] * 1e3:.1f} ms vs {recompute * 1e3:.1f} ms")


def agent_trace(args, smoke):
    """The replay benchmark's coding-agent sessions (its default arrival and think times: sessions
    arrive one by one, as in a trace, so later ones find the shared system prompt cached)."""
    return coding_agent_sessions(args.sessions, args.turns, 512 if smoke else 6144, 64 if smoke else 256,
                                 64 if smoke else 384, 16 if smoke else 128, 0.0 if smoke else 2000.0,
                                 0.0 if smoke else 1000.0, 64, 0)


def sessions(rec, model, trace, args):
    report = run_replay(trace, engine_factory=lambda: engine(model), concurrencies=())
    if report["errors"]:
        raise RuntimeError(f"{report['errors']} replayed requests failed, the first: {report['first_error']}")
    keep = ("prefix_hit_rate", "trace_prefix_reuse", "total_tokens_per_s", "ttft_p50_s", "requests")
    rec.details["sessions"] = {k: report.get(k) for k in keep}
    rec.log("sessions:", rec.details["sessions"])
    rec.row("Prefix cache: prompt tokens hit, replayed coding-agent sessions", f"{args.sessions} x {args.turns} turns",
            100 * report["prefix_hit_rate"], "%", note=f"trace reuse {100 * report['trace_prefix_reuse']:.1f}%")


def run(rec, args):
    smoke = args.smoke
    chunk = args.chunk or (32 if smoke else 2048)
    prefixes = args.prefixes or ([256] if smoke else [8192, 32768])
    t = time.perf_counter()
    model = kimik3.init(k3_slice(args.depth, smoke), seed=0)
    jax.block_until_ready(model.params)
    settle_heap()  # as the server does after loading
    rec.details.update(model=model.cfg.name, chunk=chunk, init_s=time.perf_counter() - t)
    trace = agent_trace(args, smoke)
    longest = max(t.input_length + t.output_length for s in trace for t in s.turns)
    GEOMETRY.update(max_batch=4, max_seq_len=max(max(prefixes) + 4 * chunk, longest + 64), page_size=64,
                    prefill_chunk=chunk, decode_steps=8)
    rec.details["engine"] = GEOMETRY
    rng = np.random.RandomState(0)
    longest_first = sorted(prefixes, reverse=True)
    if "shared" in args.parts:
        rec.guard(f"shared prefix {longest_first[0]}", shared_prefix, rec, model, longest_first[0], rng)
    if "nothing" in args.parts:
        rec.guard("nothing hits", nothing_hits, rec, model, chunk, rng)
    if "sessions" in args.parts:
        rec.guard("sessions", sessions, rec, model, trace, args)
    if "shared" in args.parts:
        for P in longest_first[1:]:
            rec.guard(f"shared prefix {P}", shared_prefix, rec, model, P, rng)
