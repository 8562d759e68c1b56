"""Agentic session replay: trace format, synthetic prefixes that follow the block hashes, the
coding-agent generator, the sweep's figure, and `kimik3 replay` on the tiny model in-process and
over HTTP giving the same token counts."""
import asyncio
import gc
import json
import weakref

import aiohttp
from aiohttp import web
import pytest

import kimik3

from serve import Engine
from kimik3.tokenizer import default_tokenizer
from serve.agentic_trace import coding_agent_sessions, prefix_reuse, prompt_tokens, read_trace, write_trace
from serve.async_engine import AsyncEngine
from serve.cli import main
from serve.replay import OverHTTP, Record, run_replay, throughput_at_target
from serve.server import ServerThread, build_app

SMALL = dict(sessions=2, turns=2, system_tokens=32, user_tokens=8, tool_tokens=8, output_tokens=4, block_size=16)
ENGINE_FLAGS = ["--max-batch", "4", "--max-seq-len", "128", "--page-size", "8", "--prefill-chunk", "32",
                "--decode-steps", "2"]


def test_generated_sessions_reuse_their_prefixes():
    for seed in range(3):  # the defaults give a coding agent's reuse
        assert prefix_reuse(coding_agent_sessions(seed=seed), 64) > 0.9
    sessions = coding_agent_sessions(sessions=4, turns=6, seed=1)
    for s in sessions:
        for a, b in zip(s.turns, s.turns[1:]):
            assert b.input_length > a.input_length and b.hash_ids[:a.input_length // 64] == a.hash_ids[:a.input_length // 64]
            pa, pb = prompt_tokens(a, 64, 1000), prompt_tokens(b, 64, 1000)
            keep = a.input_length // 64 * 64
            assert len(pb) == b.input_length and pa[:keep] == pb[:keep]
            assert pa[keep:keep + 64] != pb[keep:keep + 64]
    first = [prompt_tokens(s.turns[0], 64, 1000) for s in sessions]
    assert all(f[:6144] == first[0][:6144] for f in first)  # one shared system prompt + tool definitions
    assert first[0][6144:6208] != first[1][6144:6208]        # then each session's own request


def test_trace_round_trip_aliases_and_errors(tmp_path):
    sessions = coding_agent_sessions(**SMALL)
    path = tmp_path / "t.jsonl"
    write_trace(sessions, str(path))
    back = read_trace(str(path), 16)
    assert [(s.id, s.start_ms, s.turns) for s in back] == [(s.id, s.start_ms, s.turns) for s in sessions]

    mooncake = tmp_path / "m.jsonl"  # upstream field names; think time from timestamp gaps
    mooncake.write_text('{"session_id": "a", "timestamp": 100, "input_tokens": 20, "output_tokens": 3, "hash_ids": [1, 2]}\n'
                        '{"session_id": "a", "timestamp": 350, "input_tokens": 40, "output_tokens": 3, "hash_ids": [1, 2, 3]}\n'
                        '{"timestamp": 5, "input_length": 5, "output_length": 1, "hash_ids": [9]}\n')
    a, lone = read_trace(str(mooncake), 16)
    assert a.start_ms == 100 and a.turns[1].delay_ms == 250 and len(a.turns) == 2 and lone.turns[0].hash_ids == [9]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="line 1: 600 input tokens make 10 blocks.*--block-size"):
        read_trace(str(bad), 64)
    bad.write_text('{"input_length": 6, "hash_ids": [1]}\n')
    with pytest.raises(ValueError, match="line 1: missing \"output_length\""):
        read_trace(str(bad), 64)


def test_throughput_at_target_interpolates_between_sweep_points():
    pts = [{"concurrency": 1, "output_tokens_per_s_per_user_p90": 80.0, "total_tokens_per_s_per_gpu": 100.0},
           {"concurrency": 2, "output_tokens_per_s_per_user_p90": 60.0, "total_tokens_per_s_per_gpu": 180.0},
           {"concurrency": 4, "output_tokens_per_s_per_user_p90": 40.0, "total_tokens_per_s_per_gpu": 300.0}]
    assert throughput_at_target(pts, 50.0) == pytest.approx(240.0)  # halfway from c=2 to c=4
    assert throughput_at_target(pts, 30.0) == 300.0                  # every point meets it
    assert throughput_at_target(pts, 90.0) is None                   # none does


def test_replay_in_process_and_over_http_count_the_same_tokens(tmp_path):
    sessions = coding_agent_sessions(**SMALL)
    trace = tmp_path / "trace.jsonl"
    write_trace(sessions, str(trace))
    common = ["--trace", str(trace), "--block-size", "16", "--time-scale", "0", "--concurrency", "2"]
    local = tmp_path / "local.json"
    assert main(["replay", "--model", "tiny", *ENGINE_FLAGS, *common, "--output", str(local)]) == 0

    model = kimik3.init(kimik3.Config.preset("tiny"), seed=0)  # the weights `--model tiny` built
    aengine = AsyncEngine(Engine(model, max_batch=4, max_seq_len=128, page_size=8, prefill_chunk=32, decode_steps=2))
    try:
        with ServerThread(build_app(aengine, default_tokenizer(model.cfg), "tiny")) as server:
            remote = tmp_path / "remote.json"
            assert main(["replay", "--url", server.url, *common, "--output", str(remote)]) == 0
        assert aengine._ops == []  # one process: no copy of each prompt kept for followers
    finally:
        aengine.close()

    a, b = json.loads(local.read_text()), json.loads(remote.read_text())
    want_prompt = sum(t.input_length for s in sessions for t in s.turns)
    want_output = sum(t.output_length for s in sessions for t in s.turns)
    for r in (a, b):
        assert (r["requests"], r["errors"]) == (4, 0)
        assert (r["prompt_tokens"], r["output_tokens"]) == (want_prompt, want_output)
        assert r["total_tokens_per_s"] > 0 and r["total_tokens_per_s_per_gpu"] == r["total_tokens_per_s"]
        assert r["ttft_p90_s"] >= r["ttft_p50_s"] > 0 and r["itl_p50_s"] > 0
        assert r["output_tokens_per_s_per_user_p50"] >= r["output_tokens_per_s_per_user_p90"] > 0
        assert r["prefix_hit_rate"] == 0.0  # this engine build has no prefix cache
        assert r["trace_prefix_reuse"] == pytest.approx(prefix_reuse(sessions, 16))
        assert [p["concurrency"] for p in r["sweep"]["points"]] == [2]
        assert all(p["requests"] == 4 for p in r["sweep"]["points"])
        with open(r["sweep"]["plot"], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert a["replayed_against"] == "in-process engine" and b["replayed_against"].startswith("server http://")


def test_each_run_of_a_sweep_frees_its_engine_before_the_next():
    """Every run builds its own engine; the last one's cache must be gone when the next is built
    (on an 80 GB GPU two 32 GB caches did not fit), without waiting for the garbage collector."""
    model = kimik3.init(kimik3.Config.preset("tiny"), seed=0)
    engines = []  # (a step replaces the cache arrays, so the engines are what is watched)
    freed = lambda ref: ref() is None or ref().layers is None

    def engine():
        assert all(freed(e) for e in engines), "an earlier run's cache is still held"
        eng = Engine(model, max_batch=4, max_seq_len=128, page_size=8, prefill_chunk=32, decode_steps=2)
        engines.append(weakref.ref(eng))
        return eng

    gc.disable()
    try:
        report = run_replay(coding_agent_sessions(**SMALL), engine_factory=engine, concurrencies=[1, 2])
    finally:
        gc.enable()
    assert len(engines) == 3 and freed(engines[-1])
    assert [p["requests"] for p in report["sweep"]["points"]] == [4, 4]


def test_over_http_reads_the_stream_and_reports_server_errors():
    """The replay's HTTP client (aiohttp, plain Server-Sent Events) against canned responses from a
    local server: token ids counted as they stream, usage and cached tokens taken, an OpenAI-style
    error body given as its message, a count mismatch refused."""
    def sse(*chunks):
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    usage = {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}
    bodies = {"ok": (200, sse({"choices": [{"token_ids": [5, 6]}]}, {"choices": [{"token_ids": [7]}]},
                                {"choices": [], "usage": usage})),
              "bad": (400, json.dumps({"error": {"message": "max_tokens must be >= 1"}})),
              "short": (200, sse({"choices": [{"token_ids": [5]}]}, {"choices": [], "usage": usage}))}

    async def handler(request):
        sent = json.loads(await request.read())
        assert sent["prompt"] == [1, 2] and sent["stream"] and sent["return_token_ids"]
        status, text = bodies[sent["model"]]
        return web.Response(status=status, text=text)

    async def run(model):
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as http:
                rec = Record(0, 0, 2, start=0.0)
                await OverHTTP(http, f"http://127.0.0.1:{port}", model).complete([1, 2], 3, rec)
                return rec
        finally:
            await runner.cleanup()

    rec = asyncio.run(run("ok"))
    assert [n for _, n in rec.arrivals] == [2, 1] and (rec.output_tokens, rec.cached_tokens) == (3, 64)
    with pytest.raises(RuntimeError, match="HTTP 400: max_tokens must be >= 1"):
        asyncio.run(run("bad"))
    with pytest.raises(RuntimeError, match="reported 3 tokens but streamed 1"):
        asyncio.run(run("short"))
