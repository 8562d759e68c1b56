"""The HTTP server's cost over the in-process engine it drives, and the agentic session replay
curve (throughput vs per-user speed), on the K3 slice.

1. overhead: --streams concurrent one-turn streams (--prompt tokens in, --output tokens out), all
   arriving at once, replayed on the same engine in-process (AsyncEngine) and over HTTP (uvicorn
   on localhost, the client `kimik3 replay --url` in a process of its own): total tokens/s and
   TTFT P50 of each, best of two runs after a warm-up run that compiles.
2. curve: generated coding-agent sessions replayed in-process at each --concurrency, with the
   prefix cache on and off; the throughput at --target output tokens/s per user at P90, drawn
   to server.png beside the JSON.

    python -m benchmarks server [--streams 16] [--concurrency 1,4,8,16]
    python -m benchmarks server --smoke     # CPU: the tiny preset
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import kimik3
from kimik3.tokenizer import ByteTokenizer
from serve import Engine
from serve.agentic_trace import Session, Turn, coding_agent_sessions, write_trace
from serve.async_engine import AsyncEngine
from serve.launch import settle_heap
from serve.replay import InProcess, replay, run_replay, summarize
from .common import choices_arg, ints_arg
from .k3_slice import k3_slice


def add_args(p):
    p.add_argument("--streams", type=int, default=16, help="concurrent streams of the overhead part")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens a stream (default 1024; smoke 32)")
    p.add_argument("--output", type=int, default=None, help="output tokens a stream (default 256; smoke 8)")
    p.add_argument("--concurrency", type=ints_arg, default=None, help="sessions in flight (default 1,4,8,16)")
    p.add_argument("--sessions", type=int, default=16, help="agent sessions of the curve")
    p.add_argument("--turns", type=int, default=4, help="turns a session")
    p.add_argument("--target", type=float, default=50.0, help="output tokens/s per user at P90")
    p.add_argument("--depth", type=int, default=12, help="layers of the K3 slice")
    p.add_argument("--cache-memory-gb", type=float, default=32.0,
                   help="the curves' device cache budget (MLA pages, KDA slots and checkpoints), as a server "
                        "given the memory its weights leave would have; smoke: the slots' own pages")
    p.add_argument("--parts", type=choices_arg(*PARTS), default=list(PARTS),
                   help=f"which parts to run, of {','.join(PARTS)} (default all)")


PARTS = ("overhead", "curve-on", "curve-off")  # the curves are parts of their own: each takes minutes on the GPU


def engine_kw(smoke):
    return dict(max_batch=16, max_seq_len=512 if smoke else 4096, page_size=16, prefill_chunk=32 if smoke else 256,
                decode_steps=4)


async def overhead(rec, model, tok, args, smoke):
    from serve.server import ServerThread, build_app
    prompt, output = args.prompt or (32 if smoke else 1024), args.output or (8 if smoke else 256)
    blocks = -(-prompt // 64)
    sessions = [Session(i, 0.0, [Turn(prompt, output, [f"s{i}b{b}" for b in range(blocks)])])
                for i in range(args.streams)]
    # prefix cache off: the same prompts run several times and must cost the same every time
    aengine = AsyncEngine(Engine(model, tokenizer=tok, prefix_cache=False, **engine_kw(smoke)))
    V = model.cfg.vocab_size
    runs = {}
    try:
        await replay(sessions, InProcess(aengine), 64, V)  # compile
        arrivals = ArrivalTrace(aengine)
        for _ in range(2):
            records, wall = await replay(sessions, InProcess(aengine), 64, V)
            runs.setdefault("in_process", []).append(dict(summarize(records, wall, 1),
                                                          **arrivals.take(len(sessions))))
        with ServerThread(build_app(aengine, tok, "slice")) as server:
            runs["http"] = [dict(r, **arrivals.take(len(sessions)))
                            for r in await asyncio.to_thread(http_client_runs, sessions, server.url, args.out)]
    finally:
        aengine.close()
    best = {w: max(rs, key=lambda r: r["total_tokens_per_s"]) for w, rs in runs.items()}
    rec.details["overhead"] = dict(streams=args.streams, prompt=prompt, output=output, runs=runs)
    shape = f"{args.streams} streams, {prompt} in / {output} out"
    note = "the client in its own process"
    rec.row("Server over HTTP", f"total tokens/s, {shape}",
            best["http"]["total_tokens_per_s"], "tokens/s", peer=best["in_process"]["total_tokens_per_s"],
            peer_name="in-process", note=note)
    rec.row("Server over HTTP", f"TTFT P50, {shape}", best["http"]["ttft_p50_s"] * 1e3,
            "ms", peer=best["in_process"]["ttft_p50_s"] * 1e3, peer_name="in-process", note=note)
    rec.log("overhead (tokens/s, TTFT P50 ms; at the engine: arrival spread ms, steps during it, TTFT P50 ms):",
            {w: [(round(r["total_tokens_per_s"], 1), round(r["ttft_p50_s"] * 1e3, 1), r["engine_arrival_spread_ms"],
                  r["engine_steps_during_arrival"], r["engine_ttft_p50_ms"]) for r in rs] for w, rs in runs.items()})


class ArrivalTrace:
    """Wraps an AsyncEngine's submit to time each request where the engine sees it: its arrival, the engine
    steps run by then, its first token. A client's TTFT minus the engine's is the transport's cost; a burst
    whose arrivals span engine steps has been split across prefill steps."""

    def __init__(self, aengine):
        self.aengine, self.records, self._submit = aengine, [], aengine.submit
        aengine.submit = self.submit

    async def submit(self, prompt, params):
        rec = {"t": time.monotonic(), "step": self.aengine.steps}
        stream = await self._submit(prompt, params)
        deltas = stream._iterate

        async def first_timed():
            async for d in deltas():
                rec.setdefault("first", time.monotonic())
                yield d
        stream._iterate = first_timed
        self.records.append(rec)
        return stream

    def take(self, n: int) -> dict:
        """The next n requests' arrival spread, engine steps during it and engine-side TTFT P50."""
        rs, self.records = self.records[:n], self.records[n:]
        ts = [r["t"] for r in rs]
        ttft = sorted(r["first"] - r["t"] for r in rs if "first" in r)
        return {"engine_arrival_spread_ms": round((max(ts) - min(ts)) * 1e3, 1) if ts else None,
                "engine_steps_during_arrival": rs[-1]["step"] - rs[0]["step"] if rs else None,
                "engine_ttft_p50_ms": round(ttft[len(ttft) // 2] * 1e3, 1) if ttft else None}


def http_client_runs(sessions, url, out_dir) -> list[dict]:
    """Two runs of every session at once over HTTP by `kimik3 replay --url` in a process of its
    own, as real clients are: a client parsing streamed chunks in the server's process would take
    the interpreter from the engine thread and be counted as the server's cost."""
    trace, report = os.path.join(out_dir, "overhead-trace.jsonl"), os.path.join(out_dir, "overhead-http.json")
    write_trace(sessions, trace)
    cmd = [sys.executable, "-m", "serve", "replay", "--url", url, "--trace", trace, "--concurrency",
           str(len(sessions)), "--output", report]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(report) as f:
        r = json.load(f)
    for path in (trace, report[:-5] + ".png"):
        os.remove(path)
    return [r, r["sweep"]["points"][0]]  # the trace's own arrivals (all at once), then concurrency = all


def curve(rec, model, tok, args, smoke, prefix_cache):
    sessions = coding_agent_sessions(args.sessions, args.turns, 256 if smoke else 2048, 32 if smoke else 128,
                                     32 if smoke else 256, 8 if smoke else 64, 20.0 if smoke else 200.0,
                                     10.0 if smoke else 100.0, 64, 0)
    name = "on" if prefix_cache else "off"
    budget = None if smoke else int(args.cache_memory_gb * 1e9)
    report = run_replay(sessions, engine_factory=lambda: Engine(model, tokenizer=tok, prefix_cache=prefix_cache,
                                                                memory_budget_bytes=budget, **engine_kw(smoke)),
                        concurrencies=args.concurrency or ([1, 4] if smoke else [1, 4, 8, 16]),
                        target=args.target, plot=os.path.join(args.out, f"server-prefix-{name}.png"))
    rec.details[f"curve_prefix_{name}"] = dict(report, cache_memory_bytes=budget)
    at = report["sweep"]["throughput_at_target_per_gpu"]
    rec.log(f"curve, prefix cache {name}:", [(p["concurrency"], round(p["total_tokens_per_s_per_gpu"], 1),
                                              p["output_tokens_per_s_per_user_p90"]) for p in report["sweep"]["points"]])
    rec.row(f"Agentic replay: total tokens/s per GPU at {args.target:g} tok/s/user P90",
            f"{args.sessions} sessions x {args.turns} turns, prefix cache {name}", at if at is not None else float("nan"), "tokens/s",
            note=hit_rates(report) + ("" if budget is None else f"; device cache budget {args.cache_memory_gb:g} GB")
            + ("" if at is not None else "; no concurrency met the target"))


def hit_rates(report) -> str:
    """The prefix hit rate at each concurrency of the sweep (the trace-timed run before it also
    compiles, so its rate says little)."""
    rates = "/".join(f"{100 * (p.get('prefix_hit_rate') or 0):.0f}" for p in report["sweep"]["points"])
    levels = "/".join(str(p["concurrency"]) for p in report["sweep"]["points"])
    return f"prefix hit rate {rates}% at concurrency {levels} (trace reuse {100 * report['trace_prefix_reuse']:.0f}%)"


def run(rec, args):
    smoke = args.smoke
    cfg = k3_slice(args.depth, smoke)
    t = time.perf_counter()
    model = kimik3.init(cfg, seed=0)
    settle_heap()  # as the server does after loading
    tok = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)  # output text is only decoded
    rec.details.update(model=cfg.name, engine=engine_kw(smoke), init_s=time.perf_counter() - t)
    if "overhead" in args.parts:
        rec.guard("overhead", lambda: asyncio.run(overhead(rec, model, tok, args, smoke)))
    for on in (on for on in (True, False) if f"curve-{'on' if on else 'off'}" in args.parts):
        rec.guard(f"curve prefix {'on' if on else 'off'}", curve, rec, model, tok, args, smoke, on)
