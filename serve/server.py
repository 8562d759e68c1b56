"""An OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn; `pip install -e ".[serve]"`).

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat
template), GET /health, GET /metrics (Prometheus text). Request fields as OpenAI's (max_tokens,
temperature, top_p, stop, seed, stream with `data: [DONE]`, stream_options.include_usage, n=1),
plus vLLM's extra-body fields top_k, ignore_eos and return_token_ids. Errors are OpenAI-style JSON:
400 for bad input, 503 when the waiting queue is over its bound. A client that disconnects
mid-stream has its request cancelled (its pages are freed at once).
"""
from __future__ import annotations

import json
import secrets
import threading
import time
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimik3.tokenizer import IncrementalDecoder

from .async_engine import AsyncEngine, EngineStopped, QueueFull
from .request import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(message: str, kind: str, param: str | None = None, code: int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---- request bodies (unknown fields are ignored, as OpenAI-compatible servers do) ----
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extra body; 0 or -1: off
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False          # vLLM's extra body: generate exactly max_tokens
    return_token_ids: bool = False    # vLLM's extra body: each choice also carries its token ids


class CompletionBody(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatBody(_Sampling):
    messages: list[dict]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def _wanted_logprobs(body) -> int | None:
    """How many alternatives a request asks for per token (None: no logprobs): completions'
    `logprobs: N`, chat's `logprobs: true` + `top_logprobs: N`."""
    if isinstance(body.logprobs, bool):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def logprobs_json(tokenizer, ids, chosen, tops, chat: bool, offset: int = 0) -> dict:
    """OpenAI's logprobs object for generated ids: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}, or completions' {tokens, token_logprobs, top_logprobs, text_offset}."""
    text = [tokenizer.decode([t]) for t in ids]
    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                             "top_logprobs": [{"token": (a := tokenizer.decode([i])), "logprob": v,
                                               "bytes": list(a.encode())} for i, v in top.items()]}
                            for s, lp, top in zip(text, chosen, tops)]}
    offsets = [offset + sum(len(x) for x in text[:j]) for j in range(len(text))]
    return {"tokens": text, "token_logprobs": chosen, "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([i]): v for i, v in top.items()} for top in tops]}


def _stop_strings(stop) -> tuple:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise APIError(400, "stop takes at most 4 non-empty strings", "stop")
    return tuple(stops)


def sampling_params(body: _Sampling, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for an OpenAI body (OpenAI's defaults: temperature 1, top_p 1)."""
    if body.n != 1:
        raise APIError(400, f"n={body.n} is not supported: this server returns one choice per request (n=1)", "n")
    if body.presence_penalty or body.frequency_penalty:
        raise APIError(400, "presence_penalty and frequency_penalty are not supported: leave them at 0",
                       "presence_penalty" if body.presence_penalty else "frequency_penalty")
    return SamplingParams(max_new_tokens=max_tokens,
                          temperature=1.0 if body.temperature is None else body.temperature,
                          top_k=max(body.top_k or 0, 0), top_p=1.0 if body.top_p is None else body.top_p,
                          seed=secrets.randbits(31) if body.seed is None else body.seed,
                          stop_tokens=() if body.ignore_eos else None, stop_strings=_stop_strings(body.stop),
                          return_logprobs=_wanted_logprobs(body) is not None,
                          top_logprobs=_wanted_logprobs(body) or 0)


def _message_text(message: dict) -> dict:
    """A chat message with its content as plain text (OpenAI's list-of-parts form joined)."""
    if not isinstance(message, dict) or "role" not in message:
        raise APIError(400, "each message needs a \"role\" and a \"content\"", "messages")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise APIError(400, "only text content parts are supported", "messages")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise APIError(400, "message content must be a string or a list of text parts", "messages")
    return {**message, "content": content or ""}


class TextStream:
    """Turns a growing token list into text deltas. Holds back a trailing partial UTF-8 character
    and any tail that could still become a stop string (the engine cuts the text at the stop)."""

    def __init__(self, tokenizer, stops: tuple):
        self.decoder, self.stops = IncrementalDecoder(tokenizer), stops
        self.sent = 0

    def push(self, tokens, final_text: str | None = None, finished: bool = False) -> str:
        text = self.decoder.push(tokens) if final_text is None else final_text
        ready = len(text)
        if not finished:
            ready = len(text.rstrip("\ufffd"))
            head = text[max(0, ready - max(map(len, self.stops), default=0)):ready]
            ready -= max((k for s in self.stops for k in range(1, len(s)) if head.endswith(s[:k])), default=0)
        out = text[self.sent:max(ready, self.sent)]
        self.sent = max(ready, self.sent)
        return out


class CountRequests:
    """ASGI middleware counting requests by path and status (a plain ASGI wrapper: Starlette's
    BaseHTTPMiddleware would pass every streamed chunk through an extra task and queue)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
        try:
            await self.app(scope, receive, sending)
        finally:
            self.counter.labels(scope["path"], str(status)).inc()


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

    def __init__(self, aengine: AsyncEngine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kimik3_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("kimik3_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kimik3_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.output_tokens = Counter("kimik3_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("kimik3_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        gauges = {k: Gauge(f"kimik3_{k}", h, registry=r) for k, h in (
            ("requests_running", "requests in decode slots"), ("requests_waiting", "requests queued"),
            ("cache_pages_free", "free MLA cache pages"), ("cache_pages_total", "MLA cache pages"),
            ("engine_steps", "engine steps run"), ("engine_failed_steps", "engine steps that raised"))}
        names = {"requests_running": "running", "requests_waiting": "waiting", "cache_pages_free": "pages_free",
                 "cache_pages_total": "pages_total", "engine_steps": "steps", "engine_failed_steps": "failed_steps"}
        for k, g in gauges.items():
            g.set_function(lambda key=names[k]: aengine.snapshot()[key])
        r.register(_EngineStats(aengine))

    def finished(self, usage: dict, ttft: float | None):
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.cached_tokens.inc(usage["prompt_tokens_details"]["cached_tokens"])
        self.output_tokens.inc(usage["completion_tokens"])
        if ttft is not None:
            self.ttft.observe(ttft)


class _EngineStats:
    """Every number of the engine's stats (prefix cache, speculation; added up over data-parallel
    replicas) as a gauge kimik3_engine_<key>."""

    def __init__(self, aengine: AsyncEngine):
        self.aengine = aengine

    def collect(self):
        for k, v in self.aengine.stats().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield GaugeMetricFamily(f"kimik3_engine_{k}", f"Engine.stats()[{k!r}]", value=v)


def _usage(prompt_tokens: int, output_tokens: int, metrics: dict | None) -> dict:
    cached = int((metrics or {}).get("prefix_hit_tokens") or 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(aengine: AsyncEngine, tokenizer, model_name: str, devices: int = 1) -> FastAPI:
    """The FastAPI app serving `aengine` as model `model_name`; `devices` is reported by /health
    (the session replay divides throughput by it)."""
    engine = aengine.engine
    app = FastAPI(title="kimik3", docs_url=None, redoc_url=None)
    metrics = Metrics(aengine)
    created = int(time.time())

    app.add_middleware(CountRequests, counter=metrics.requests)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.kind, e.param, e.status), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"invalid request: {where + ': ' if where else ''}{first.get('msg', 'malformed body')}"
        if first.get("type") == "json_invalid":
            msg = "invalid request: the body is not valid JSON"
        return JSONResponse(error_body(msg, "invalid_request_error", where or None, 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", None, e.status_code),
                            status_code=e.status_code)

    @app.get("/health")
    async def health():
        snap = aengine.snapshot()
        status = 200 if snap["alive"] else 503
        return JSONResponse({"status": "ok" if snap["alive"] else "engine stopped", "devices": devices, **snap},
                            status_code=status)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "kimik3",
            "max_model_len": engine.max_seq_len, "vocab_size": engine.cfg.vocab_size}]}

    def check_model(body: _Sampling):
        if body.model != model_name:
            raise APIError(400, f"unknown model {body.model!r}: this server serves "
                           f"{model_name!r} (GET /v1/models lists it)", "model", "invalid_request_error")

    def check_length(prompt: list[int], max_tokens: int | None) -> int:
        """max_tokens, defaulting to what is left of the context; 400 when they do not fit."""
        room = engine.max_seq_len - len(prompt)
        if max_tokens is None:
            max_tokens = room
        if len(prompt) + max_tokens > engine.max_seq_len:
            raise APIError(400, f"this model's maximum context length is {engine.max_seq_len} tokens; the request "
                                f"has {len(prompt)} prompt tokens + max_tokens {max_tokens}: shorten the prompt or "
                                "lower max_tokens", "max_tokens")
        if max_tokens < 1:
            raise APIError(400, f"the prompt's {len(prompt)} tokens leave no room to generate within the "
                                f"{engine.max_seq_len}-token context", "messages")
        return max_tokens

    async def start(prompt: list[int], params: SamplingParams):
        try:
            return await aengine.submit(prompt, params)
        except QueueFull as e:
            raise APIError(503, f"server overloaded: {e}", None, "server_overloaded")
        except EngineStopped as e:
            raise APIError(503, str(e), None, "server_error")
        except ValueError as e:
            raise APIError(400, str(e), None)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        check_model(body)
        if body.echo:
            raise APIError(400, "echo is not supported: leave it false", "echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request: send one prompt per request", "prompt")
            prompt = prompt[0]
        ids = tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "empty prompt: send at least one token", "prompt")
        params = sampling_params(body, check_length(ids, body.max_tokens))
        stream = await start(ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        def choice(text, reason, tokens, logprobs=None):
            c = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
            return {**c, "token_ids": tokens} if body.return_token_ids else c

        return await respond(body, stream, ids, head, choice, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        check_model(body)
        if not body.messages:
            raise APIError(400, "messages is empty: send at least one message", "messages")
        try:
            ids = tokenizer.apply_chat_template([_message_text(m) for m in body.messages])
        except (ValueError, KeyError, TypeError) as e:
            raise APIError(400, f"cannot apply the chat template: {e}", "messages")
        except Exception as e:  # jinja2 errors from a template that needs fields this request lacks
            raise APIError(400, f"cannot apply the chat template: {type(e).__name__}: {e}", "messages")
        params = sampling_params(body, check_length(ids, body.max_completion_tokens or body.max_tokens))
        stream = await start(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}

        def choice(text, reason, tokens, logprobs=None, delta=False):
            c = {"index": 0, "delta" if delta else "message": ({"content": text} if delta else
                                                              {"role": "assistant", "content": text}),
                 "logprobs": logprobs, "finish_reason": reason}
            return {**c, "token_ids": tokens} if body.return_token_ids else c

        return await respond(body, stream, ids, head, choice, "chat.completion")

    async def respond(body, stream, prompt, head, choice, kind):
        text = TextStream(tokenizer, stream.request.params.stop_strings)
        req, chat = stream.request, kind == "chat.completion"

        def logprobs(start: int, ids: list[int]):
            """The logprobs object of req's output tokens start.. (ids), when asked for."""
            if not req.params.return_logprobs or not ids:
                return None
            end = start + len(ids)
            return logprobs_json(tokenizer, ids, req.logprobs[start:end], req.top_logprobs[start:end], chat,
                                 offset=len(tokenizer.decode(list(req.output[:start]))))
        if not body.stream:
            tokens, last = [], None
            try:
                async for d in stream:
                    tokens += d.tokens
                    last = d
            finally:
                stream.cancel()
            if last.finish_reason.startswith("error") or last.finish_reason == "abort":
                raise APIError(503, f"the request failed: {last.finish_reason}", None, "server_error")
            usage = _usage(len(prompt), len(tokens), last.metrics)
            metrics.finished(usage, last.metrics.get("ttft_s"))
            out = text.push(tokens, last.text, finished=True)
            return {**head, "choices": [choice(out, _finish_reason(last.finish_reason), tokens, logprobs(0, tokens))],
                    "usage": usage}

        chunk_kind = kind + ".chunk" if kind == "chat.completion" else kind
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def chunk(choices, usage=None):
            return _sse({**head, "object": chunk_kind, "choices": choices, **({"usage": usage} if usage else {})})

        def piece(out, reason, tokens, start):
            if chat:
                return choice(out, reason, tokens, logprobs(start, tokens), delta=True)
            return choice(out, reason, tokens, logprobs(start, tokens))

        async def events():
            n = 0
            try:
                if kind == "chat.completion":
                    first = choice("", None, [], None, delta=True)
                    first["delta"]["role"] = "assistant"
                    yield chunk([first])
                async for d in stream:
                    start, n = n, n + len(d.tokens)
                    out = text.push(d.tokens, d.text, finished=d.finished)
                    if d.finished:
                        if d.finish_reason.startswith("error") or d.finish_reason == "abort":
                            yield _sse(error_body(f"the request failed: {d.finish_reason}", "server_error", None, 503))
                            break
                        yield chunk([piece(out, _finish_reason(d.finish_reason), d.tokens, start)])
                        usage = _usage(len(prompt), n, d.metrics)
                        metrics.finished(usage, d.metrics.get("ttft_s"))
                        if include_usage:
                            yield chunk([], usage)
                    elif out or body.return_token_ids or req.params.return_logprobs:
                        yield chunk([piece(out, None, d.tokens, start)])
                yield "data: [DONE]\n\n"
            finally:  # also runs when the client disconnects (the generator is cancelled or closed)
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


class ServerThread:
    """Serve an app with uvicorn on a background thread (tests, notebooks): port 0 picks a free
    port; `url` is the base URL once started. Use as a context manager or call start()/stop()."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self):
        self.server.should_exit = True
        self._thread.join()
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
