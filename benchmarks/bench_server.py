"""The HTTP server's cost over the in-process engine, and the agentic session replay curve, on the
12-layer K3 TP8-rank slice (issue 29): one TP8 rank's per-layer shapes (12 KDA heads, 12 MLA heads,
896 MXFP4 experts of intermediate 3072/8, shared experts 2 x 3072/8, dense layer 0 at 33792/8,
vocab 163840/8) with K3's first 12 layers (9 KDA, 3 MLA), random weights.

1. overhead: BENCH_STREAMS concurrent single-turn streams (BENCH_PROMPT prompt tokens,
   BENCH_OUTPUT output tokens each), all arriving at once, replayed on the same engine shapes
   in-process (AsyncEngine) and over HTTP (uvicorn on localhost, the openai client): total tokens/s
   and TTFT P50 of each (a warm-up run compiles first).
2. curve: generated coding-agent sessions (sizes BENCH_SESSIONS, BENCH_TURNS, BENCH_SYSTEM,
   BENCH_TOOL, BENCH_ANSWER, think time BENCH_THINK_MS) replayed in-process at each concurrency of
   BENCH_CONCURRENCY; the throughput at 50 output tokens/s per user at P90. This engine build has
   no prefix cache: every turn prefills its whole history.

Run (repo root): PYTHONUNBUFFERED=1 python3 benchmarks/bench_server.py   [BENCH_TINY=1 on CPU]
Writes $OUT/bench_server.json (after each part) and $OUT/bench_server.png.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import jax

import kimik3
from kimik3.tokenizer import ByteTokenizer
from serve import Engine
from serve.agentic_trace import Session, Turn, coding_agent_sessions
from serve.async_engine import AsyncEngine
from serve.replay import InProcess, OverHTTP, run_replay, replay, summarize

OUT = os.environ.get("OUT", "/tmp")
TINY = os.environ.get("BENCH_TINY") == "1"
env = lambda k, d: int(os.environ.get(k, d))  # noqa: E731
STREAMS, PROMPT, OUTPUT = env("BENCH_STREAMS", 16), env("BENCH_PROMPT", 1024), env("BENCH_OUTPUT", 256)
SESSIONS, TURNS, SYSTEM = env("BENCH_SESSIONS", 16), env("BENCH_TURNS", 4), env("BENCH_SYSTEM", 2048)
TOOL, ANSWER, THINK_MS = env("BENCH_TOOL", 256), env("BENCH_ANSWER", 64), env("BENCH_THINK_MS", 200)
CONCURRENCY = [int(c) for c in os.environ.get("BENCH_CONCURRENCY", "1,4,8,16").split(",")]
ENGINE = dict(max_batch=16, max_seq_len=4096, page_size=16, prefill_chunk=256, decode_steps=4)


def k3_slice():
    if TINY:
        return kimik3.Config.preset("tiny")
    return kimik3.Config.preset("kimi-k3").replace(
        name="k3-tp8-rank-12L", num_layers=12, layer_types=("kda", "kda", "kda", "mla") * 3, kda_num_heads=12,
        mla_num_heads=12, intermediate_size=33792 // 8, moe_intermediate_size=3072 // 8, vocab_size=163840 // 8,
        attn_res_block_size=12, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def streams_trace() -> list[Session]:
    """STREAMS one-turn sessions arriving together, prompts sharing nothing."""
    blocks = -(-PROMPT // 64)
    return [Session(i, 0.0, [Turn(PROMPT, OUTPUT, [f"s{i}b{b}" for b in range(blocks)])]) for i in range(STREAMS)]


async def overhead(model, tok) -> dict:
    from serve.server import ServerThread, build_app

    import openai

    sessions = streams_trace()
    aengine = AsyncEngine(Engine(model, tokenizer=tok, **ENGINE))
    out = {}
    try:
        await replay(sessions, InProcess(aengine), 64, model.cfg.vocab_size)  # compile
        for rep in range(2):
            for where in ("in_process", "http"):
                if where == "in_process":
                    records, wall = await replay(sessions, InProcess(aengine), 64, model.cfg.vocab_size)
                else:
                    server = ServerThread(build_app(aengine, tok, "slice")).start()
                    try:
                        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                                      timeout=None) as client:
                            records, wall = await replay(sessions, OverHTTP(client, "slice"), 64,
                                                         model.cfg.vocab_size)
                    finally:
                        await asyncio.to_thread(server.stop)
                out.setdefault(where, []).append(summarize(records, wall, 1))
    finally:
        aengine.close()
    best = {w: max(runs, key=lambda r: r["total_tokens_per_s"]) for w, runs in out.items()}
    return {"streams": STREAMS, "prompt": PROMPT, "output": OUTPUT, "runs": out,
            "http_throughput_ratio": best["http"]["total_tokens_per_s"] / best["in_process"]["total_tokens_per_s"],
            "http_ttft_p50_added_s": best["http"]["ttft_p50_s"] - best["in_process"]["ttft_p50_s"]}


def main():
    cfg = k3_slice()
    t = time.perf_counter()
    model = kimik3.init(cfg, seed=0)
    tok = ByteTokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)  # text is only decoded, never read
    result = {"device": str(jax.devices()[0].device_kind), "model": cfg.name, "engine": ENGINE,
              "init_s": time.perf_counter() - t}

    def save():
        with open(os.path.join(OUT, "bench_server.json"), "w") as f:
            json.dump(result, f, indent=2)

    result["overhead"] = asyncio.run(overhead(model, tok))
    print(json.dumps({k: v for k, v in result["overhead"].items() if k != "runs"}), flush=True)
    save()
    sessions = coding_agent_sessions(SESSIONS, TURNS, SYSTEM, 128, TOOL, ANSWER, THINK_MS, 100.0, 64, 0)
    result["curve"] = run_replay(sessions, engine_factory=lambda: Engine(model, tokenizer=tok, **ENGINE),
                                 concurrencies=CONCURRENCY, target=50.0, plot=os.path.join(OUT, "bench_server.png"))
    result["curve"]["trace"] = dict(sessions=SESSIONS, turns=TURNS, system=SYSTEM, tool=TOOL, answer=ANSWER,
                                    think_ms=THINK_MS)
    save()
    print(json.dumps({k: result["curve"][k] for k in ("total_tokens_per_s_per_gpu", "ttft_p50_s",
                                                      "output_tokens_per_s_per_user_p90", "trace_prefix_reuse")}))
    for p in result["curve"]["sweep"]["points"]:
        print(p)
    print("throughput at 50 tok/s/user P90:", result["curve"]["sweep"]["throughput_at_target_per_gpu"])


if __name__ == "__main__":
    main()
