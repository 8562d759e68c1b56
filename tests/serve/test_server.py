"""The OpenAI-compatible server, driven by the official `openai` client: outputs equal the engine's,
every error is an OpenAI-style JSON error, a disconnect frees the request's pages."""
import asyncio
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

import kimik3
from kimik3.tokenizer import ByteTokenizer
from serve import Engine, SamplingParams
from serve.async_engine import AsyncEngine
from serve.server import ServerThread, TextStream, build_app
from tests.sharding.processes import cpu_env, finish, free_port, process_flags, wait_for_health

ENGINE_SHAPE = dict(max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=2)


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a minimal chat template (the tiny preset ships none)."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""), add_bos=True)


@pytest.fixture(scope="module")
def model():
    return kimik3.init(kimik3.Config.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def served(model):
    tok = ChatBytes(model.cfg.vocab_size, model.cfg.bos_token_id, model.cfg.eos_token_id)
    engine = Engine(model, tokenizer=tok, **ENGINE_SHAPE)
    aengine = AsyncEngine(engine)
    with ServerThread(build_app(aengine, tok, "tiny")) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        yield server, client, aengine, tok
    aengine.close()


def _prompts(n, seed):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 256, rng.randint(2, 14)))) for _ in range(n)]


def _wait_idle(aengine, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = aengine.snapshot()
        if s["running"] == 0 and s["waiting"] == 0 and s["pages_free"] == s["pages_total"]:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {aengine.snapshot()}")


def test_models_health_and_metrics(served):
    server, client, _, _ = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["devices"] == 1
    text = httpx.get(server.url + "/metrics").text
    assert "kimik3_requests_running" in text and "kimik3_cache_pages_total" in text
    assert "kimik3_engine_spec_draft_tokens" in text  # Engine.stats() as gauges


def test_completion_chat_and_stream_agree_with_the_engine(served, model):
    server, client, aengine, tok = served
    prompt = "def f(x):"
    ref = Engine(model, tokenizer=tok, **ENGINE_SHAPE)
    want = ref.generate([prompt], max_new_tokens=6)[0]

    c = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert c.choices[0].model_extra["token_ids"] == want
    assert c.choices[0].text == tok.decode(want)
    assert c.choices[0].finish_reason == ("length" if len(want) == 6 else "stop")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(tok.encode(prompt, add_bos=True)), len(want))
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.usage.prompt_tokens_details.cached_tokens == 0  # no prefix cache in this engine build

    pieces = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == tok.decode(want)
    assert pieces[-1].usage.completion_tokens == len(want)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat_want = ref.generate([tok.apply_chat_template(messages)], max_new_tokens=5)[0]
    ch = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert ch.choices[0].message.role == "assistant"
    assert ch.choices[0].message.content == tok.decode(chat_want)
    assert ch.usage.prompt_tokens == len(tok.apply_chat_template(messages))
    deltas = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == tok.decode(chat_want)
    assert deltas[-1].choices[0].finish_reason in ("stop", "length")

    # sampling follows the seed, not the batch: the same seed gives the same tokens
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"top_k": 20, "return_token_ids": True})
    a, b = (client.completions.create(**kw).choices[0].model_extra["token_ids"] for _ in range(2))
    assert a == b == ref.generate([prompt], max_new_tokens=6, temperature=1.0, top_p=0.9, top_k=20, seed=7)[0]


def test_twenty_concurrent_streams_equal_engine_generate(served, model):
    server, _, aengine, tok = served
    prompts = _prompts(20, 0)
    want = Engine(model, tokenizer=tok, **ENGINE_SHAPE).generate(prompts, max_new_tokens=6)

    async def one(client, p):
        ids, text = [], ""
        stream = await client.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, stream=True,
                                                 extra_body={"return_token_ids": True})
        async for chunk in stream:
            ids += chunk.choices[0].model_extra["token_ids"]
            text += chunk.choices[0].text
        return ids, text

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert [ids for ids, _ in got] == want
    assert [text for _, text in got] == [tok.decode(w) for w in want]
    _wait_idle(aengine)
    aengine.engine.check_pages()


def test_client_disconnect_cancels_and_frees_pages(served):
    server, client, aengine, _ = served
    before = aengine.snapshot()["cancelled"]
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the request is running: it holds a slot and pages
    assert aengine.snapshot()["pages_free"] < aengine.snapshot()["pages_total"]
    stream.close()
    after = _wait_idle(aengine)
    assert after["cancelled"] == before + 1  # stopped by the disconnect, not by max_tokens
    aengine.engine.check_pages()


@pytest.mark.parametrize("kw, param", [
    (dict(model="nope"), "model"),
    (dict(max_tokens=60, prompt="x" * 10), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=2), "n"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[5, 100000]), None),  # a token id outside the vocabulary
    (dict(prompt=["one", "two"]), "prompt"),
])
def test_bad_requests_get_400(served, kw, param):
    _, client, _, _ = served
    args = dict(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    args.update(kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert param in (err["param"] or "") or param in err["message"]


def test_chat_errors_and_malformed_json(served):
    server, client, _, _ = served
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=64)
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', 
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_logprobs_equal_the_engines(served, model):
    """completions (logprobs=N), chat (logprobs + top_logprobs) and a chat stream carry the chosen
    tokens' log-probabilities and alternatives that Engine.generate(return_logprobs=True) gives."""
    _, client, _, tok = served
    want = Engine(model, tokenizer=tok, **ENGINE_SHAPE).generate(["def f(x):"], max_new_tokens=5, stop_tokens=[],
                                                                  return_logprobs=True, top_logprobs=2)[0]
    c = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs, want.logprobs, rtol=1e-5, atol=1e-6)
    for got_top, want_top in zip(lp.top_logprobs, want.top_logprobs):  # keyed by text: ids may share one
        assert all(min(abs(v - w) for w in want_top.values()) < 1e-5 for v in got_top.values())
    assert lp.tokens == [tok.decode([t]) for t in want] and lp.text_offset[0] == 0

    chat_want = Engine(model, tokenizer=tok, **ENGINE_SHAPE).generate(
        [tok.apply_chat_template([{"role": "user", "content": "hi"}])], max_new_tokens=4, stop_tokens=[],
        return_logprobs=True, top_logprobs=2)[0]
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    np.testing.assert_allclose([x.logprob for x in content], chat_want.logprobs, rtol=1e-5, atol=1e-6)
    assert all(len(x.top_logprobs) == 2 for x in content)
    streamed = [x.logprob for ch in client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs
        for x in ch.choices[0].logprobs.content]
    np.testing.assert_allclose(streamed, chat_want.logprobs, rtol=1e-5, atol=1e-6)


def test_queue_over_its_bound_gets_503_and_the_server_lives_on(served):
    server, _, aengine, _ = served
    aengine.max_waiting = 2
    try:
        async def one(client):
            try:
                await client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=40, temperature=0,
                                                extra_body={"ignore_eos": True})
                return 200
            except openai.APIStatusError as e:
                assert e.body["type"] == "server_overloaded" and "retry later" in e.body["message"]
                return e.status_code

        async def burst():
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                          timeout=300) as client:
                return await asyncio.gather(*(one(client) for _ in range(10)))

        codes = asyncio.run(burst())
    finally:
        aengine.max_waiting = 256
    # 4 slots + 2 queued can be in flight; the rest are turned away
    assert codes.count(503) >= 4 and codes.count(200) >= 1 and set(codes) <= {200, 503}
    _wait_idle(aengine)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kimik3_requests_total{endpoint="/v1/completions",status="503"}' in metrics


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    tok = ByteTokenizer(320)
    ts = TextStream(tok, ("END",))
    assert ts.push(list(b"ab")) == "ab"
    assert ts.push(list(b"cE")) == "c"  # "E" may start "END"
    assert ts.push(list(b"x")) == "Ex"  # it did not
    assert ts.push(list("é".encode())[:1]) == ""  # half a UTF-8 character waits for the rest
    assert ts.push(list("é".encode())[1:]) == "é"
    assert ts.push(list(b"EN"), final_text="abcExé", finished=True) == ""  # the engine cut at the stop


def test_a_failing_engine_step_fails_its_requests_not_the_server(served):
    server, client, aengine, _ = served
    engine = aengine.engine
    real_step = engine.step

    def broken_step():
        engine.step = real_step  # only this one step fails
        raise RuntimeError("device lost")

    engine.step = broken_step
    try:
        with pytest.raises(openai.APIStatusError, match="engine step failed: RuntimeError: device lost") as e:
            client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert e.value.status_code == 503
    finally:
        engine.step = real_step
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens
    assert httpx.get(server.url + "/health").json()["failed_steps"] == 1
    _wait_idle(aengine)
    engine.check_pages()


@pytest.mark.parametrize("mesh", [["--tensor", "8", "--warmup"], ["--data-parallel", "2", "--tensor", "4"]],
                         ids=["tp8_warmup", "dp2_tp4"])
def test_two_processes_serve_one_mesh(model, mesh):
    """`kimik3 serve` over 2 processes x 4 CPU devices, TP8 or 2 data-parallel replicas of TP4:
    process 0 answers HTTP; with TP8 process 1 steps its engine with process 0's submissions and
    cancellations (after both compiled their programs with --warmup, in step), with replicas
    process 0 dispatches requests to its own engine and to process 1's. Concurrent greedy requests, one cancelled by a client disconnect mid-stream and one sent
    after it, get the one-device tokens; SIGINT to process 0 ends both cleanly."""
    port, http = free_port(), free_port()
    cmd = [sys.executable, "-m", "serve", "serve", "--model", "tiny", *mesh, "--port", str(http),
           "--max-batch", "4", "--max-seq-len", "64", "--page-size", "8", "--prefill-chunk", "32",
           "--decode-steps", "4"]  # test_batch's 2-process engine: its programs are in the compilation cache
    procs = [subprocess.Popen(cmd + process_flags(pid, 2, port), env=cpu_env(4), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for pid in range(2)]
    url, served = f"http://127.0.0.1:{http}", False
    try:
        wait_for_health(url, procs, 400)
        prompts, lengths = _prompts(3, 1), [3, 6, 9]

        async def complete(client, prompt, n):
            r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        async def cancelled(client):
            stream = await client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=40, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            async for _ in stream:
                break  # the request runs; closing the stream cancels it
            await stream.close()

        async def run():
            async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
                got = await asyncio.gather(*(complete(c, p, n) for p, n in zip(prompts, lengths)), cancelled(c))
                return got[:3] + [await complete(c, prompts[0], 4)]

        got = asyncio.run(run())
        health = httpx.get(url + "/health", timeout=10).json()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        served = True
    finally:
        procs[0].send_signal(signal.SIGINT)
        status = finish(procs, 120)
        if not served:  # what the servers said, beside what the client saw
            for pid, (rc, err) in enumerate(status):
                print(f"--- process {pid} exited {rc}:\n{err[-3000:]}")
    want = [kimik3.generate(model, [p], max_new_tokens=n)[0] for p, n in zip(prompts + prompts[:1], lengths + [4])]
    assert got == want
    # the engine counters cover every replica: each request's prompt counted once
    sent = sum(map(len, prompts)) + 3 + len(prompts[0])
    assert re.search(r"^kimik3_engine_prompt_tokens (\S+)$", metrics, re.M).group(1) == f"{float(sent)}", metrics
    if "--data-parallel" in mesh:
        assert health["replicas"] == 2 and health["steps"] > 0
    for pid, (rc, err) in enumerate(status):
        assert rc == 0, f"process {pid} exited {rc}: {err[-2000:]}"


def test_text_stream_decoding_a_window_gives_the_text_of_decoding_everything():
    """Random pushes of multi-byte characters, stop-string prefixes and textless ids: the deltas
    join to the full decode (held-back tails included once finished)."""
    rng = np.random.default_rng(0)
    tok = ByteTokenizer(320)
    pieces = [b"a", b"E", b"N", b"D", "é".encode(), "漢".encode(), "🙂".encode(), bytes([0x80])]
    for trial in range(50):
        ids = [int(b) for _ in range(rng.integers(1, 40)) for b in pieces[rng.integers(len(pieces))]]
        ids += [300] * int(rng.integers(0, 2))  # an id with no text
        ts, out, i = TextStream(tok, ("END", "é!")), [], 0
        while i < len(ids):
            n = int(rng.integers(1, 6))
            out.append(ts.push(ids[i:i + n], finished=i + n >= len(ids)))
            i += n
        assert "".join(out) == tok.decode(ids), trial


def test_an_idle_engine_takes_a_burst_in_one_step(model):
    """Requests reaching an idle engine a few ms apart start in one step (a request that missed
    the first step would wait a whole prefill step behind it) and give the tokens they give alone."""
    engine = Engine(model, **ENGINE_SHAPE)
    first_step, step = [], engine.step

    def recording():
        if not first_step:
            first_step.append(len(engine.running) + len(engine.waiting))
        return step()

    engine.step = recording
    aengine = AsyncEngine(engine, batch_window_s=1.0)  # waits until 0.2 s pass with no request
    prompts = _prompts(4, 11)

    async def one(i, prompt):
        await asyncio.sleep(0.02 if i else 0)  # the rest come 20 ms after the first
        stream = await aengine.submit(prompt, SamplingParams(max_new_tokens=5, stop_tokens=()))
        return [t async for delta in stream for t in delta.tokens]

    async def burst():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(burst())
    finally:
        aengine.close()
    assert first_step == [4]
    alone = Engine(model, **ENGINE_SHAPE).generate(prompts, max_new_tokens=5, stop_tokens=[])
    assert outs == [list(c) for c in alone]
    with pytest.raises(ValueError, match="batch_window_s"):
        AsyncEngine(Engine(model, **ENGINE_SHAPE), batch_window_s=-1)
