"""The engine behind an asyncio event loop: one background thread steps the Engine continuously,
requests join and leave between steps, and each request's new tokens reach its consumer through
an asyncio queue. The HTTP server and the in-process session replay both drive the engine this way.

The Engine is not thread-safe, so every call into it (submit, step, cancel) happens on the engine
thread: callers post commands and await their answer.

Over several processes (one mesh, one SPMD program) process 0 runs the AsyncEngine with
`followers`: before each step it sends the submissions and cancellations it applied since the
last one, and every other process runs `follow`, which applies them to its own Engine in the same
order and steps with it, so that all engines take the same decisions. A step that fails there
cannot be stepped past (the others may wait inside that step's collectives): process 0 fails the
requests in flight, tells every process (sharding.distributed.announce_failure: they stop with one
line) and stops (`fatal`, `on_fatal`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import traceback

from sharding.distributed import announce_failure

from .engine import Engine
from .request import Request, SamplingParams

STOP = {"ops": [], "stop": True}
STATS_EVERY_S = 0.5  # how stale AsyncEngine.stats() may be while the engine is busy

log = logging.getLogger("kimik3.serve")


class QueueFull(RuntimeError):
    """The engine's waiting queue is at its bound: the caller should retry later."""


class EngineStopped(RuntimeError):
    """The engine stopped for good (a failed step of a multi-process run): nothing more runs."""


@dataclasses.dataclass
class Delta:
    """What one engine step produced for one request."""
    tokens: list[int]
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None     # the engine's final text when it cut it at a stop string
    metrics: dict | None = None  # Request.metrics, on the last delta


class RequestStream:
    """A submitted request: iterate it for Deltas (the last one has finished=True); cancel() frees
    the request's slot and pages if it has not finished (safe to call at any time, repeatedly)."""

    def __init__(self, owner: "AsyncEngine", request: Request, deltas: asyncio.Queue):
        self.owner, self.request, self._deltas = owner, request, deltas
        self.finished = False

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while not self.finished:
            delta = await self._deltas.get()
            self.finished = delta.finished
            yield delta

    def cancel(self):
        if not self.finished:
            self.owner._post(("cancel", self.request))


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 256, followers=None, batch_window_s: float = 0.01):
        """max_waiting: submissions beyond this many queued (not yet running) requests raise
        QueueFull. followers: a sharding.distributed.Messages on process 0 of a multi-process
        run (the other processes `follow` it). batch_window_s: how long an idle engine woken by a
        request may wait for the rest of a burst (see _gather_burst; 0: step at once)."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if not 0 <= batch_window_s <= 1:
            raise ValueError(f"batch_window_s must be in [0, 1] seconds, got {batch_window_s}")
        self.engine, self.max_waiting, self.followers = engine, max_waiting, followers
        self.batch_window_s = batch_window_s
        self._ops: list = []  # what the followers must apply before the next step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._consumers: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.steps = 0
        self.failed_steps = 0
        self.cancelled = 0
        self._stats, self._stats_at = engine.stats(), time.monotonic()
        self.fatal: str | None = None  # why a multi-process engine stopped for good
        self.on_fatal = lambda: None   # called on the engine thread once `fatal` is set
        self._thread = threading.Thread(target=self._run, name="kimik3-engine", daemon=True)
        self._thread.start()

    # ---- called from event loops ----
    async def submit(self, prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError (bad request, as Engine.submit) or QueueFull."""
        if self.fatal is not None:
            raise EngineStopped(f"the engine stopped: {self.fatal}")
        loop = asyncio.get_running_loop()
        answer: concurrent.futures.Future = concurrent.futures.Future()
        deltas: asyncio.Queue = asyncio.Queue()
        self._post(("submit", prompt, params, loop, deltas, answer))
        request = await asyncio.wrap_future(answer)
        return RequestStream(self, request, deltas)

    def snapshot(self) -> dict:
        """Load figures for /metrics and /health (read without the engine thread: approximate)."""
        eng = self.engine
        return {"running": sum(r is not None for r in eng.slots), "waiting": len(eng.waiting),
                "pages_free": eng.available_pages(), "pages_total": eng.allocator.num_pages,
                "steps": self.steps, "failed_steps": self.failed_steps, "cancelled": self.cancelled,
                "alive": self._thread.is_alive()}

    def stats(self) -> dict:
        """Engine.stats() as of the last refresh: the engine thread takes it between steps (no read
        races a step) when a request finished, else at most every STATS_EVERY_S seconds, and when
        it goes idle."""
        return self._stats

    def close(self):
        self._stopping = True
        self._wake.set()
        self._thread.join()

    # ---- the engine thread ----
    def _post(self, command):
        self._commands.put(command)
        self._wake.set()

    def _run(self):
        eng = self.engine
        while not self._stopping:
            self._wake.clear()  # before draining: a command posted after the drain sets it again
            self._drain()
            if not eng.has_work():
                self._refresh_stats()
                self._wake.wait()
                self._gather_burst()
                continue
            if self.followers is not None:
                self.followers.send({"ops": self._ops, "stop": False})
                self._ops = []
            try:
                events = eng.step()
                self.steps += 1
            except Exception:  # one bad step must not stop the server: fail what was in flight
                self.failed_steps += 1
                reason = "error: engine step failed: " + traceback.format_exc(limit=1).strip().splitlines()[-1]
                log.exception("engine step failed; failing the requests in flight")
                events = _fail_all(eng, reason)
                if self.followers is not None:
                    self.fatal = reason[len("error: "):]
                    announce_failure(f"process 0: {self.fatal}")
                    self._stopping = True
            if eng.done or time.monotonic() - self._stats_at > STATS_EVERY_S:
                self._refresh_stats()  # before delivering: a finished request's last delta sees its counts
            for req, tokens in events:
                self._deliver(req, tokens)
            eng.done.clear()  # finished requests were delivered; a server must not keep them all
        if self.fatal is not None:
            self._refuse_pending()
            self.on_fatal()
        elif self.followers is not None:
            self.followers.send(STOP)

    def _gather_burst(self):
        """An idle engine woken by a request waits for the rest of a burst before its first step:
        until no request has come for a fifth of the window, at most the window. Clients that
        send several requests at once reach the engine over a few milliseconds, and a request
        that misses the first step waits a whole prefill step behind it (the step's programs span
        every slot, so a lone row costs nearly what all of them do). A lone request pays the
        quiet fifth."""
        end, quiet = time.monotonic() + self.batch_window_s, self.batch_window_s / 5
        while not self._stopping:
            left = end - time.monotonic()
            self._wake.clear()  # set again by the next command posted
            if left <= 0 or not self._wake.wait(min(left, quiet)):
                break

    def _refresh_stats(self):
        self._stats, self._stats_at = self.engine.stats(), time.monotonic()

    def _posted(self):
        """The commands posted so far, oldest first (taken off the queue)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _refuse_pending(self):
        """After a fatal step: submissions posted meanwhile are refused (they would wait forever)."""
        for command in self._posted():
            if command[0] == "submit":
                command[-1].set_exception(EngineStopped(f"the engine stopped: {self.fatal}"))

    def _drain(self):
        for command in self._posted():
            if command[0] == "submit":
                _, prompt, params, loop, deltas, answer = command
                try:
                    if len(self.engine.waiting) >= self.max_waiting:
                        raise QueueFull(f"{len(self.engine.waiting)} requests are already waiting "
                                        f"(the bound is {self.max_waiting}): retry later")
                    req = self.engine.submit(prompt, params)
                except Exception as e:  # ValueError (bad input) or QueueFull go back to the caller
                    answer.set_exception(e)
                    continue
                self._consumers[id(req)] = (loop, deltas)
                if self.followers is not None:  # (alone, nothing is sent: a copy would only pile up)
                    self._ops.append(["submit", req.id, [int(t) for t in req.prompt], dataclasses.asdict(req.params)])
                answer.set_result(req)
            elif command[0] == "cancel":
                req = command[1]
                if self.engine.abort(req):
                    self.cancelled += 1
                    if self.followers is not None:
                        self._ops.append(["cancel", req.id])
                    self._deliver(req, [])

    def _deliver(self, req: Request, tokens: list[int]):
        finished = req.finished is not None
        target = self._consumers.pop(id(req), None) if finished else self._consumers.get(id(req))
        if target is None:
            return
        loop, deltas = target
        delta = Delta(list(tokens), finished, req.finish_reason, req.text, req.metrics if finished else None)
        try:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass


def _fail_all(eng: Engine, reason: str) -> list:
    """Abort every request in flight after a failed step; their (request, no tokens) events."""
    victims = list(eng.waiting) + [r for r in eng.slots if r is not None]
    for req in victims:
        eng.abort(req)
        req.finish_reason = reason
    return [(req, []) for req in victims]


def params_from_json(fields: dict) -> SamplingParams:
    """SamplingParams from the form sent between processes (dataclasses.asdict through JSON:
    lists where it had tuples)."""
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def follow(engine: Engine, leader) -> None:
    """A process other than 0 of a multi-process server: apply process 0's submissions and
    cancellations (received from `leader`, a sharding.distributed.Messages) to `engine` and step
    it with process 0's engine, until process 0 stops. A failed step raises."""
    requests: dict = {}
    while True:
        message = leader.receive()
        for op in message["ops"]:
            if op[0] == "submit":
                _, rid, prompt, params = op
                requests[rid] = engine.submit(prompt, params_from_json(params), request_id=rid)
            else:
                engine.abort(requests.pop(op[1]))
        if message["stop"]:
            return
        engine.step()  # a failure ends this process, and (its CLI tells them) the others
        for req in engine.done:
            requests.pop(req.id, None)
        engine.done.clear()
