"""Agentic session replay: drives the engine (in-process, or a running server over HTTP) with a
session trace, closed-loop per session (a turn starts when the previous turn's answer has arrived,
plus its think time), and reports throughput and interactivity; a concurrency sweep gives the
throughput-vs-interactivity curve and the throughput at a per-user speed target.

    kimik3 replay --model tiny --sessions 8 --turns 4 --output report.json
    kimik3 replay --url http://127.0.0.1:8000 --trace sessions.jsonl --output report.json

Report keys: total_tokens_per_s (prompt tokens, reused ones included, plus output tokens, over the
wall time), total_tokens_per_s_per_gpu, output_tokens_per_s_per_user_p50 / _p90 (a request's output
speed after its first token; p90 is the speed 90% of requests reach or beat), ttft_p50_s,
ttft_p90_s, itl_p50_s, itl_p90_s (gap per token between arrivals), prefix_hit_rate (prompt tokens
the engine served from its prefix cache), trace_prefix_reuse (what an unbounded cache could
serve), and sweep: one point per concurrency (sessions in flight at once) with
throughput_at_target_per_gpu.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import time

import numpy as np

from .agentic_trace import Session, coding_agent_sessions, prefix_reuse, prompt_tokens, read_trace


@dataclasses.dataclass
class Record:
    """One request as its client saw it."""
    session: object
    turn: int
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    start: float = 0.0
    arrivals: list = dataclasses.field(default_factory=list)  # (time, tokens) per delivery
    error: str | None = None


class InProcess:
    """Requests straight to an AsyncEngine (no HTTP)."""

    def __init__(self, aengine):
        self.aengine = aengine

    async def complete(self, prompt: list[int], max_tokens: int, rec: Record):
        from .request import SamplingParams

        stream = await self.aengine.submit(prompt, SamplingParams(max_new_tokens=max_tokens, stop_tokens=()))
        async for d in stream:
            if d.tokens:
                rec.arrivals.append((time.perf_counter(), len(d.tokens)))
            if d.finished:
                if d.finish_reason not in ("length", "stop"):
                    raise RuntimeError(d.finish_reason)
                rec.cached_tokens = int(d.metrics.get("prefix_hit_tokens") or 0)
        rec.output_tokens = sum(n for _, n in rec.arrivals)


class OverHTTP:
    """Streamed /v1/completions requests (token-id prompts) to an OpenAI-compatible server, sent with
    aiohttp and read as plain Server-Sent Events, as vLLM's benchmark_serving does. Not the openai
    client: its request building walks a long token-id prompt in Python, and not httpx: its async
    client holds back requests started together until it has prepared all of them. Sessions
    starting together then reached the server late, and the client's TTFT counted the wait
    as the server's."""

    def __init__(self, http, base: str, model: str):
        self.http, self.url, self.model = http, base + "/v1/completions", model

    async def complete(self, prompt: list[int], max_tokens: int, rec: Record):
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                           "return_token_ids": True})
        async with self.http.post(self.url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {_error_message(await r.read())}")
            async for raw in r.content:  # one line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(_error_message(line[6:]))
                for choice in chunk.get("choices") or ():
                    n = len(choice.get("token_ids") or ())
                    if n:
                        rec.arrivals.append((time.perf_counter(), n))
                usage = chunk.get("usage")
                if usage:
                    rec.output_tokens = usage["completion_tokens"]
                    rec.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if rec.output_tokens != sum(n for _, n in rec.arrivals):
            raise RuntimeError(f"the server reported {rec.output_tokens} tokens but streamed "
                               f"{sum(n for _, n in rec.arrivals)} token ids (does it support return_token_ids?)")


def _error_message(body) -> str:
    """An OpenAI-style error body's message, else the body itself (shortened)."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return (body.decode(errors="replace") if isinstance(body, bytes) else str(body))[:300]


async def replay(sessions: list[Session], backend, block_size: int, vocab_size: int,
                 concurrency: int | None = None, time_scale: float = 1.0) -> tuple[list[Record], float]:
    """Run every session closed-loop; at most `concurrency` sessions at once (None: as the trace's
    arrival times say). Times in the trace are multiplied by time_scale. Returns the records and
    the wall time from the first arrival to the last answer."""
    gate = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    records: list[Record] = []
    t0 = time.perf_counter()

    async def run(s: Session):
        async with gate:
            await asyncio.sleep(max(0.0, t0 + s.start_ms / 1e3 * time_scale - time.perf_counter()))
            for k, turn in enumerate(s.turns):
                if k:
                    await asyncio.sleep(turn.delay_ms / 1e3 * time_scale)
                rec = Record(s.id, k, turn.input_length, start=time.perf_counter())
                records.append(rec)
                try:
                    await backend.complete(prompt_tokens(turn, block_size, vocab_size), turn.output_length, rec)
                except Exception as e:  # recorded, and the session stops (its next turn needs this answer)
                    rec.error = f"{type(e).__name__}: {e}"
                    return

    await asyncio.gather(*(run(s) for s in sessions))
    return records, time.perf_counter() - t0


def summarize(records: list[Record], wall_s: float, devices: int) -> dict:
    ok = [r for r in records if r.error is None and r.arrivals]
    pct = lambda xs, q: float(np.percentile(xs, q)) if len(xs) else None  # noqa: E731
    ttft = [r.arrivals[0][0] - r.start for r in ok]
    speed, itl = [], []
    for r in ok:
        span = r.arrivals[-1][0] - r.arrivals[0][0]
        if r.output_tokens > 1 and span > 0:
            speed.append((r.output_tokens - r.arrivals[0][1]) / span)
        for (t0, _), (t1, n) in zip(r.arrivals, r.arrivals[1:]):
            itl += [(t1 - t0) / n] * n
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    total = (prompt + output) / wall_s if wall_s > 0 else None
    errors = [r for r in records if r.error is not None]
    return {
        "requests": len(ok), "errors": len(errors), "first_error": errors[0].error if errors else None,
        "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": sum(r.cached_tokens for r in ok),
        "wall_s": wall_s, "devices": devices,
        "total_tokens_per_s": total, "total_tokens_per_s_per_gpu": total / devices if total is not None else None,
        "output_tokens_per_s": output / wall_s if wall_s > 0 else None,
        "output_tokens_per_s_per_user_p50": pct(speed, 50),
        "output_tokens_per_s_per_user_p90": pct(speed, 10),  # the speed 90% of requests reach
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
        "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90),
        "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else None,
    }


def throughput_at_target(points: list[dict], target: float) -> float | None:
    """Total tokens/s per GPU where the per-user P90 speed meets `target`: the best measured point
    that meets it, or the value interpolated linearly (in per-user speed) towards the next
    concurrency that misses it. None when no point meets it."""
    pts = sorted(points, key=lambda p: p["concurrency"])
    best = None
    for i, p in enumerate(pts):
        s, y = p["output_tokens_per_s_per_user_p90"], p["total_tokens_per_s_per_gpu"]
        if s is None or y is None or s < target:
            continue
        cand = y
        if i + 1 < len(pts):
            s2, y2 = pts[i + 1]["output_tokens_per_s_per_user_p90"], pts[i + 1]["total_tokens_per_s_per_gpu"]
            if s2 is not None and y2 is not None and s2 < target:
                cand = y + (y2 - y) * (s - target) / (s - s2)
        best = cand if best is None else max(best, cand)
    return best


def plot_sweep(points: list[dict], target: float, path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in sorted(points, key=lambda p: p["concurrency"])
           if p["output_tokens_per_s_per_user_p90"] is not None and p["total_tokens_per_s_per_gpu"] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot([p["output_tokens_per_s_per_user_p90"] for p in pts], [p["total_tokens_per_s_per_gpu"] for p in pts],
            "o-")
    for p in pts:
        ax.annotate(f"c={p['concurrency']}", (p["output_tokens_per_s_per_user_p90"], p["total_tokens_per_s_per_gpu"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axvline(target, color="gray", ls="--", lw=1, label=f"target {target:g} tok/s/user")
    ax.set_xlabel("output tokens/s per user (P90: reached by 90% of requests)")
    ax.set_ylabel("total tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_fits(sessions: list[Session], max_len: int):
    for s in sessions:
        for k, t in enumerate(s.turns):
            if t.input_length + t.output_length > max_len:
                raise ValueError(f"session {s.id!r} turn {k} needs {t.input_length} + {t.output_length} tokens but the "
                                 f"engine holds {max_len} per sequence: raise --max-seq-len or shorten the sessions")


def run_replay(sessions: list[Session], *, engine_factory=None, url: str | None = None, model: str | None = None,
               concurrencies=(1, 2, 4, 8), target: float = 50.0, block_size: int = 64, time_scale: float = 1.0,
               devices: int | None = None, plot: str | None = None) -> dict:
    """Replay `sessions` against a fresh engine from `engine_factory()` per run (in-process), or
    against the server at `url`. One run with the trace's own arrivals, then one per concurrency
    in `concurrencies`. Returns the report (see the module docstring); draws the sweep to `plot`."""
    if (engine_factory is None) == (url is None):
        raise ValueError("replay needs exactly one of an engine (in-process) or a server URL")
    if time_scale < 0 or target <= 0 or any(c < 1 for c in concurrencies):
        raise ValueError("time_scale must be >= 0, target > 0 and every concurrency >= 1")
    if url is not None:
        return asyncio.run(_over_http(sessions, url, model, concurrencies, target, block_size, time_scale, devices,
                                      plot))

    async def one(concurrency):
        from kimik3.runtime import run_mesh

        from .async_engine import AsyncEngine

        engine = engine_factory()
        check_fits(sessions, engine.max_seq_len)
        mesh = run_mesh(engine.model)
        aengine = AsyncEngine(engine, max_waiting=max(len(sessions), 1))
        try:
            records, wall = await replay(sessions, InProcess(aengine), block_size, engine.cfg.vocab_size, concurrency,
                                         time_scale)
        finally:
            aengine.close()
            engine.close()  # now: the next run's engine must not find this one's cache still held
        return summarize(records, wall, devices or (mesh.size if mesh is not None else 1))

    return asyncio.run(_report(sessions, one, concurrencies, target, block_size, plot, "in-process engine"))


async def _over_http(sessions, url, model, concurrencies, target, block_size, time_scale, devices, plot):
    import aiohttp

    base = url.rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        try:
            async with http.get(base + "/v1/models") as r:
                cards = (await r.json(content_type=None))["data"]
            async with http.get(base + "/health") as r:
                health = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as e:
            raise ValueError(f"no OpenAI-compatible server at {url} ({type(e).__name__}: {e})") from None
    card = next((c for c in cards if model in (None, c["id"])), None)
    if card is None:
        raise ValueError(f"the server at {url} does not serve {model!r}; it serves {[c['id'] for c in cards]}")
    if "vocab_size" not in card:
        raise ValueError(f"the server at {url} does not say its vocabulary size in /v1/models: replay needs a "
                         "kimik3 server (synthetic token ids must be valid for the model)")
    check_fits(sessions, card.get("max_model_len") or sys.maxsize)
    n_dev = devices or int(health.get("devices", 1))

    async def one(concurrency):
        connector = aiohttp.TCPConnector(limit=0)  # no bound: a connection per session in flight
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
            records, wall = await replay(sessions, OverHTTP(http, base, card["id"]), block_size, card["vocab_size"],
                                         concurrency, time_scale)
        return summarize(records, wall, n_dev)

    return await _report(sessions, one, concurrencies, target, block_size, plot, f"server {url}")


async def _report(sessions, run_at, concurrencies, target, block_size, plot, where) -> dict:
    report = await run_at(None)
    points = []
    for c in concurrencies:
        point = await run_at(c)
        points.append({"concurrency": c, **{k: point[k] for k in (
            "requests", "errors", "total_tokens_per_s", "total_tokens_per_s_per_gpu",
            "output_tokens_per_s_per_user_p50", "output_tokens_per_s_per_user_p90", "ttft_p50_s", "ttft_p90_s",
            "itl_p50_s", "prefix_hit_rate")}})
    report.update(sessions=len(sessions), turns=sum(len(s.turns) for s in sessions), block_size=block_size,
                  trace_prefix_reuse=prefix_reuse(sessions, block_size), replayed_against=where)
    report["sweep"] = {"target_output_tokens_per_s_per_user": target, "points": points,
                       "throughput_at_target_per_gpu": throughput_at_target(points, target) if points else None}
    if plot and points:
        plot_sweep(points, target, plot, f"session replay, {where}")
        report["sweep"]["plot"] = plot
    return report


def add_parser(subparsers):
    """`kimik3 replay`: adds the subcommand (its handler as `run`) and returns its parser."""
    from .launch import add_engine_arguments

    p = subparsers.add_parser("replay", help="replay agentic sessions against the engine or a server; report JSON")
    add_engine_arguments(p, model_default=None)
    p.add_argument("--url", default=None, help="a running server (kimik3 serve) to replay against; without it the "
                                               "engine runs in this process")
    p.add_argument("--trace", default=None, help="a JSONL session trace (format: serve/agentic_trace.py); without it "
                                                 "coding-agent sessions are generated")
    p.add_argument("--sessions", type=int, default=16, help="generated sessions")
    p.add_argument("--turns", type=int, default=10, help="turns per generated session")
    p.add_argument("--system-tokens", type=int, default=6144, help="shared system prompt + tool definitions")
    p.add_argument("--user-tokens", type=int, default=256, help="first user message (mean)")
    p.add_argument("--tool-tokens", type=int, default=384, help="tool output appended after each answer (mean)")
    p.add_argument("--output-tokens", type=int, default=128, help="answer length (mean)")
    p.add_argument("--think-ms", type=float, default=2000.0, help="think time between turns (mean)")
    p.add_argument("--arrival-ms", type=float, default=1000.0, help="gap between session arrivals (mean)")
    p.add_argument("--block-size", type=int, default=64, help="tokens per trace block (hash id)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's times (0: no think time)")
    p.add_argument("--concurrency", default="1,2,4,8",
                   help="sweep: comma-separated numbers of sessions in flight at once (empty: no sweep)")
    p.add_argument("--target", type=float, default=50.0, help="per-user P90 output tokens/s for the sweep's figure")
    p.add_argument("--gpus", type=int, default=None,
                   help="divide throughput by this many devices (default: the engine's, or the server's /health)")
    p.add_argument("--save-trace", default=None, help="also write the generated sessions as a JSONL trace")
    p.add_argument("--plot", default=None, help="the sweep's PNG (default: the report's path with .png)")
    p.add_argument("--output", required=True, help="report.json")
    p.set_defaults(run=_replay)
    return p


def _replay(args) -> int:
    try:
        conc = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    except ValueError:
        print(f"kimik3: --concurrency takes comma-separated integers, got {args.concurrency!r}", file=sys.stderr)
        return 2
    try:
        if args.trace:
            sessions = read_trace(args.trace, args.block_size)
        else:
            sessions = coding_agent_sessions(args.sessions, args.turns, args.system_tokens, args.user_tokens,
                                             args.tool_tokens, args.output_tokens, args.think_ms, args.arrival_ms,
                                             args.block_size, args.seed)
            if args.save_trace:
                from .agentic_trace import write_trace

                write_trace(sessions, args.save_trace)
        plot = args.plot or (args.output[:-5] if args.output.endswith(".json") else args.output) + ".png"
        kw = dict(concurrencies=conc, target=args.target, block_size=args.block_size, time_scale=args.time_scale,
                  devices=args.gpus, plot=plot)
        if args.url:
            report = run_replay(sessions, url=args.url, model=args.model, **kw)
        else:
            from .launch import engine_factory

            args.model = args.model or "tiny"
            report = run_replay(sessions, engine_factory=engine_factory(args)[0], **kw)
    except (ValueError, FileNotFoundError) as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"kimik3 replay: {report['requests']} requests, {report['errors']} errors, "
          f"{report['total_tokens_per_s_per_gpu']} total tok/s per GPU, sweep at the target: "
          f"{report['sweep']['throughput_at_target_per_gpu']}; report {args.output}", file=sys.stderr)
    return 0 if report["requests"] and not report["errors"] else 1

