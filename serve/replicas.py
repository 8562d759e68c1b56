"""Data-parallel serving (`kimik3 serve --data-parallel N`), as vLLM's `--data-parallel-size`:
one API front end on process 0 dispatches each request to one of N replicas, each running its own
engine (its own slots and scheduler) on its own sub-mesh (sharding.replicas).

Replica 0 is an AsyncEngine on process 0. Every other replica's leader process runs
`serve_replica`: an AsyncEngine of its own fed by process 0's `RemoteReplica` through the
coordinator's key-value store (submissions and cancellations in, each request's deltas and the
replica's load figures out). The processes of a replica other than its leader `follow` it, as
the processes of a one-replica multi-process server follow process 0. `Dispatcher` puts a request
on the replica with the fewest requests in flight and looks like one AsyncEngine to the server.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading

from sharding.distributed import Messages

from .async_engine import STOP, AsyncEngine, Delta, RequestStream, params_from_json
from .request import SamplingParams
from .engine_stats import merge_stats


def _channels(index: int, leader: int):
    """(process 0 -> the replica's leader, the leader -> process 0)."""
    return (Messages(f"serve/replica{index}/in", sender=0, receivers=[leader]),
            Messages(f"serve/replica{index}/out", sender=leader, receivers=[0]))


class _Stream(RequestStream):
    """A request on a remote replica, as a RequestStream; `request` is process 0's copy, its
    output (and logprobs) filled in as deltas arrive."""

    def __init__(self, owner: "RemoteReplica", rid: int, request):
        super().__init__(owner, request, asyncio.Queue())
        self.rid = rid

    def cancel(self):
        if not self.finished:
            self.owner._send(["cancel", self.rid])


class RemoteReplica:
    """Process 0's handle on replica `index`, led by process `leader`: submit / snapshot / close
    as an AsyncEngine's; `check(prompt, params)` refuses a bad request before it is sent."""

    def __init__(self, index: int, leader: int, check):
        self.index, self.check = index, check
        self._in, out = _channels(index, leader)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, _Stream]] = {}
        self._snapshot = {"running": 0, "waiting": 0, "pages_free": 0, "pages_total": 0, "steps": 0,
                          "failed_steps": 0, "cancelled": 0}
        self._stats: dict | None = None  # the replica's AsyncEngine.stats(), once it sent them
        self._thread = threading.Thread(target=self._receive, args=(out,), name=f"kimik3-replica{index}", daemon=True)
        self._thread.start()

    def _send(self, message):
        with self._lock:
            self._in.send(message)

    async def submit(self, prompt, params: SamplingParams) -> _Stream:
        stream = _Stream(self, next(self._ids), self.check(prompt, params))  # ValueError as Engine.submit
        self._streams[stream.rid] = (asyncio.get_running_loop(), stream)
        self._send(["submit", stream.rid, [int(t) for t in prompt], dataclasses.asdict(params)])
        return stream

    def _receive(self, out):
        while True:
            message = out.receive()
            if message is None or message.get("stop"):
                return
            self._snapshot, self._stats = message["snapshot"], message["stats"]
            for rid, tokens, finished, reason, text, metrics, logprobs in message["deltas"]:
                target = self._streams.pop(rid, None) if finished else self._streams.get(rid)
                if target is not None:
                    loop, stream = target
                    _extend(stream.request, tokens, logprobs)
                    try:
                        loop.call_soon_threadsafe(stream._deltas.put_nowait,
                                                  Delta(tokens, finished, reason, text, metrics))
                    except RuntimeError:  # the consumer's event loop is closed
                        pass

    def snapshot(self) -> dict:
        """The replica's AsyncEngine.snapshot as of its last message."""
        return dict(self._snapshot, alive=self._thread.is_alive())

    def stats(self) -> dict | None:
        """The replica's engine counters as of its last message (None before the first)."""
        return self._stats

    def close(self):
        self._send(["stop"])
        self._thread.join(timeout=60)


async def serve_replica(aengine: AsyncEngine, index: int, leader: int) -> None:
    """On a replica's leader (not process 0): run process 0's submissions and cancellations on
    `aengine` and send each request's deltas back, until process 0 says stop."""
    inbox, out = _channels(index, leader)
    loop, streams, lock = asyncio.get_running_loop(), {}, threading.Lock()

    def send(deltas):
        with lock:
            out.send({"deltas": deltas, "snapshot": aengine.snapshot(), "stats": aengine.stats()})

    async def pump(rid, stream):
        n, req = 0, stream.request
        async for d in stream:
            logprobs = None
            if req.logprobs is not None:
                logprobs = [req.logprobs[n:n + len(d.tokens)], req.top_logprobs[n:n + len(d.tokens)]]
            n += len(d.tokens)
            send([[rid, d.tokens, d.finished, d.finish_reason, d.text, d.metrics, logprobs]])
        streams.pop(rid, None)

    while True:
        message = await loop.run_in_executor(None, inbox.receive)
        if message[0] == "submit":
            _, rid, prompt, params = message
            try:
                streams[rid] = await aengine.submit(prompt, params_from_json(params))
            except Exception as e:  # checked on process 0 already; a full queue, a stopped engine
                send([[rid, [], True, f"error: {e}", None, None, None]])
                continue
            loop.create_task(pump(rid, streams[rid]))
        elif message[0] == "cancel":
            if message[1] in streams:
                streams[message[1]].cancel()
        else:
            break
    await loop.run_in_executor(None, aengine.close)
    with lock:
        out.send(STOP)


def _extend(req, tokens, logprobs):
    """Append a delta's tokens (and their logprobs, when asked for) to process 0's copy."""
    req.output.extend(tokens)
    if logprobs is not None and req.logprobs is not None:
        req.logprobs.extend(logprobs[0])
        req.top_logprobs.extend({int(k): v for k, v in top.items()} for top in logprobs[1])


class Dispatcher:
    """Several replicas (AsyncEngine or RemoteReplica) behind one AsyncEngine-like front: each
    request goes to the replica with the fewest requests in flight (ties: the lowest index).
    `engine` is replica 0's Engine (the server reads the model's limits and stats from it)."""

    def __init__(self, replicas: list):
        self.replicas, self.engine = replicas, replicas[0].engine
        self.inflight = [0] * len(replicas)

    @property
    def fatal(self):
        """Why replica 0 (a multi-process one: the others stop on their own) stopped for good."""
        return self.replicas[0].fatal

    @property
    def on_fatal(self):
        return self.replicas[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, fn):
        self.replicas[0].on_fatal = fn

    async def submit(self, prompt, params: SamplingParams):
        r = min(range(len(self.replicas)), key=lambda i: self.inflight[i])
        stream = await self.replicas[r].submit(prompt, params)
        self.inflight[r] += 1
        return _Counted(stream, self, r)

    def snapshot(self) -> dict:
        snaps = [r.snapshot() for r in self.replicas]
        out = {k: sum(s[k] for s in snaps) for k in snaps[0] if k != "alive"}
        out["alive"] = all(s["alive"] for s in snaps)
        out["replicas"] = len(snaps)
        return out

    def stats(self) -> dict:
        """Every replica's engine counters added up (serve.engine_stats.merge_stats)."""
        return merge_stats([s for s in (r.stats() for r in self.replicas) if s is not None])

    def close(self):
        for r in self.replicas:
            r.close()


class _Counted:
    """A replica's stream that gives its slot in the dispatcher's count back when it ends."""

    def __init__(self, stream, owner: Dispatcher, index: int):
        self.stream, self.owner, self.index, self.done = stream, owner, index, False

    @property
    def finished(self):
        return self.stream.finished

    @property
    def request(self):
        return self.stream.request

    def _release(self):
        if not self.done:
            self.done = True
            self.owner.inflight[self.index] -= 1

    async def _iterate(self):
        try:
            async for delta in self.stream:
                yield delta
        finally:
            self._release()

    def __aiter__(self):
        return self._iterate()

    def cancel(self):
        self.stream.cancel()
        self._release()
