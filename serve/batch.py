"""Batch offline generation: prompts.jsonl in, results.jsonl out, resumable.

Each input line is a JSON object: {"id": ..., "prompt": "text" | [token ids]} or
{"id": ..., "messages": [{"role": ..., "content": ...}]}, with optional "max_new_tokens" (or its
alias "max_tokens"), "temperature", "top_k", "top_p", "seed", "stop" (a list of strings). "id" is
a string or an integer, unique in the file.

Results are appended one JSON object per line as each request finishes and flushed, so a killed
job loses nothing: rerunning the same command skips what the output already has (a torn last line
is dropped and redone). A result is
    {"id", "tokens": [generated ids], "text", "finish_reason": "stop" | "length",
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
     "metrics": {"ttft_s", "decode_tokens_per_s", "preemptions"}}.
A request that cannot be run becomes {"id", "error"}; a line without a usable id (not JSON, no
"id", "id": null) or with an id an earlier line already used becomes {"id": null | the duplicate,
"line": n, "error"}, keyed by its line number; the rest of the file still runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import os
import queue
import sys
import threading
import time

import jax
from tqdm import tqdm

from sharding.distributed import Messages, broadcast_json, is_primary

from .engine import Engine
from .request import SamplingParams
from .engine_stats import merge_stats

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def read_done(path: str) -> set:
    """Keys (see `_record_key`) of the records already written; truncates a torn final line left
    by a killed run."""
    done = set()
    if not os.path.exists(path):
        return done
    good = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(_record_key(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                break
            good += len(line)
    if good != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _key(i):
    return ("id", json.dumps(i, sort_keys=True))


def _record_key(rec: dict):
    """What a result stands for: its input line when it has "line", else its id."""
    return ("line", rec["line"]) if "line" in rec else _key(rec["id"])


def read_request(n: int, line: str):
    """(id, object) of input line n, or raise ValueError when the line has no usable id."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"line {n} is not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or obj.get("id") is None:
        raise ValueError(f"line {n} has no \"id\": give every line a unique string or integer id")
    rid = obj["id"]
    if not isinstance(rid, (str, numbers.Integral)) or isinstance(rid, bool):
        raise ValueError(f"line {n}: \"id\" must be a string or an integer, got {json.dumps(rid)}")
    return rid, obj


def parse_request(obj: dict, tokenizer, defaults: dict):
    """(prompt ids, SamplingParams) of one input object, or raise ValueError with the reason."""
    if "messages" in obj:
        if not isinstance(obj["messages"], list):
            raise ValueError("\"messages\" must be a list of {role, content}")
        prompt = tokenizer.apply_chat_template(obj["messages"])
    elif isinstance(obj.get("prompt"), str):
        prompt = tokenizer.encode(obj["prompt"], add_bos=True)
    elif isinstance(obj.get("prompt"), list) and all(isinstance(t, int) for t in obj["prompt"]):
        prompt = obj["prompt"]
    else:
        raise ValueError("needs \"prompt\" (a string or a list of token ids) or \"messages\"")
    if "max_tokens" in obj:  # the OpenAI name
        if "max_new_tokens" in obj and obj["max_new_tokens"] != obj["max_tokens"]:
            raise ValueError("\"max_tokens\" and \"max_new_tokens\" differ: give one of them")
        obj = dict(obj, max_new_tokens=obj["max_tokens"])
    stop = obj.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError("\"stop\" must be a list of strings")
    kw = dict(defaults, **{f: obj[f] for f in SAMPLING_FIELDS if f in obj})
    params = SamplingParams(**kw, stop_strings=tuple(stop))
    params.check()  # one line naming the bad field; values are never truncated or coerced
    return prompt, params


class Progress:
    """The batch's progress on stderr: a tqdm bar of requests done, with tokens/s and errors."""

    def __init__(self, total: int, disable: bool = False, file=None):
        self.bar = tqdm(total=total, disable=disable, file=file or sys.stderr, unit="req", dynamic_ncols=True,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} requests [{elapsed}<{remaining}{postfix}]")
        self.tokens = self.errors = 0
        self.t0 = time.perf_counter()

    def update(self, tokens=0, error=False):
        self.tokens += tokens
        self.errors += error
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.1f} tok/s, {self.errors} errors", refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


def read_plan(input_path: str, done: set) -> list:
    """The input lines not in `done`, in file order: ["error", record] for a line that cannot
    run, ["run", id, object] for a request."""
    first_line, plan = {}, []
    with open(input_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rid, obj = read_request(n, line)
            except ValueError as e:
                if ("line", n) not in done:
                    plan.append(["error", {"id": None, "line": n, "error": str(e)}])
                continue
            k = _key(rid)
            if k in first_line:
                if ("line", n) not in done:
                    plan.append(["error", {"id": rid, "line": n, "error": f"duplicate id {json.dumps(rid)} (first "
                                                                          f"on line {first_line[k]}): ids must be unique"}])
                continue
            first_line[k] = n
            if k not in done:
                plan.append(["run", rid, obj])
    return plan


def shared_plan(input_path: str, output_path: str):
    """(`read_plan`'s list, how many requests are already done), read by process 0 (it owns the
    input and the output, and truncates a torn last line) and sent to every process, so that all
    of them submit the same requests in the same order (one SPMD program)."""
    shared = None
    if is_primary():
        done = read_done(output_path)
        shared = [read_plan(input_path, done), len(done)]
    plan, skipped = broadcast_json(shared)
    return plan, skipped


def run_batch(model, input_path: str, output_path: str, tokenizer, defaults: dict | None = None,
              progress: bool = True, mesh=None, **engine_kw) -> dict:
    """Run every request of `input_path` not yet in `output_path` and append their results; over
    several processes every process runs the engine and process 0 alone writes.

    `mesh` with a `data` axis > 1 (the weights placed on it): data-parallel replicas, one Engine
    per replica on its sub-mesh, the requests dealt out to them in turn; each replica's leader
    sends its results to process 0, which writes every one of them."""
    defaults = dict(dict(max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0), **(defaults or {}))
    plan, skipped = shared_plan(input_path, output_path)
    todo, errors = [], []
    for kind, *entry in plan:
        if kind == "error":
            errors.append(entry[0])
            continue
        rid, obj = entry
        try:
            prompt, params = parse_request(obj, tokenizer, defaults)
        except ValueError as e:
            errors.append({"id": rid, "error": str(e)})
            continue
        todo.append((rid, prompt, params))
    lanes = _lanes(model, mesh, tokenizer, engine_kw)
    primary = is_primary()
    bar = Progress(len(todo) + len(errors), disable=not (progress and primary))
    summary = {"requests": 0, "tokens": 0, "errors": 0, "skipped": skipped}
    t0 = time.perf_counter()
    with open(output_path, "a") if primary else contextlib.nullcontext() as out:
        def write(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()
            os.fsync(out.fileno())
            if "error" in rec:
                summary["errors"] += 1
                bar.update(error=True)
            else:
                summary["requests"] += 1
                summary["tokens"] += len(rec["tokens"])
                bar.update(tokens=len(rec["tokens"]))

        if primary:
            for rec in errors:
                write(rec)
        remote = _Remote(lanes.remote) if primary else None
        for lane in lanes.local:
            lane.submit(todo[lane.index::lanes.count])
        while any(lane.engine.has_work() for lane in lanes.local):
            for lane in lanes.local:
                lane.step()
            for lane in lanes.local:
                lane.flush(write if primary else None)
            if remote:
                remote.drain(write, block=False)
        for lane in lanes.local:
            lane.finish()
        stats = [lane.engine.stats() for lane in lanes.local]
        if remote:
            stats += remote.drain(write, block=True)
    bar.close()
    _end_together(lanes.count > 1)
    summary["seconds"] = time.perf_counter() - t0
    summary.update({k: v for k, v in merge_stats(stats).items() if k not in summary})  # prefix-cache counters
    summary["tokens_per_s"] = summary["tokens"] / max(summary["seconds"], 1e-9)
    return summary


class _Lane:
    """One replica's engine on this process: its requests, its finished records, and (on the
    replica's leader, when that is not process 0) the channel they go to process 0 by."""

    def __init__(self, index: int, engine: Engine, tokenizer, outbox=None):
        self.index, self.engine, self.tokenizer, self.outbox, self.records = index, engine, tokenizer, outbox, []

    def submit(self, share):
        for rid, prompt, params in share:
            try:
                self.engine.submit(prompt, params, request_id=rid)
            except ValueError as e:
                self.records.append({"id": rid, "error": str(e)})

    def step(self):
        for req, _ in self.engine.step():
            if req.finished is None:
                continue
            if req.finish_reason.startswith("error"):
                self.records.append({"id": req.id, "error": req.finish_reason[len("error: "):]})
            else:
                self.records.append(_result(req, self.tokenizer))

    def flush(self, write):
        """Hand the finished records on: to `write` on process 0, to process 0 from a replica's
        leader, nowhere from its other processes."""
        if write is not None:
            for rec in self.records:
                write(rec)
        elif self.outbox is not None and self.records:
            self.outbox.send(["records", self.records])
        self.records = []

    def finish(self):
        if self.outbox is not None:
            self.outbox.send(["done", self.engine.stats()])


@dataclasses.dataclass
class _Lanes:
    count: int      # replicas in all
    local: list     # _Lane per replica this process holds devices of
    remote: list    # the leaders of the replicas without process 0, by replica index (process 0 only)


def _channel(index: int, leader: int):
    return Messages(f"batch/replica{index}", sender=leader, receivers=[0])


def _lanes(model, mesh, tokenizer, engine_kw) -> _Lanes:
    from sharding.replicas import on_replica, replicas

    if mesh is None or mesh.shape.get("data", 1) == 1:
        return _Lanes(1, [_Lane(0, Engine(model, tokenizer=tokenizer, **engine_kw), tokenizer)], [])
    reps, me = replicas(mesh), jax.process_index()
    local = [_Lane(r.index, Engine(model.replace(params=on_replica(model.params, r)), tokenizer=tokenizer, **engine_kw),
                   tokenizer, _channel(r.index, me) if r.leader == me != 0 else None) for r in reps if r.local]
    remote = [(r.index, r.leader) for r in reps if r.leader != 0] if me == 0 else []
    return _Lanes(len(reps), local, remote)


class _Remote:
    """On process 0: the records the other replicas' leaders send, gathered by one thread per
    replica into one queue."""

    def __init__(self, leaders):
        self.queue, self.open, self.stats = queue.SimpleQueue(), len(leaders), []
        for index, leader in leaders:
            threading.Thread(target=self._receive, args=(_channel(index, leader),), daemon=True,
                             name=f"kimik3-replica{index}").start()

    def _receive(self, channel):
        while True:
            message = channel.receive()
            self.queue.put(message)
            if message[0] == "done":
                return

    def drain(self, write, block: bool) -> list:
        """Write what arrived; with `block`, until every replica said it is done. The engine
        stats of those that are done."""
        while self.open:
            try:
                kind, value = self.queue.get(block=block)
            except queue.Empty:
                break
            if kind == "records":
                for rec in value:
                    write(rec)
            else:
                self.open -= 1
                self.stats.append(value)
        return self.stats


def _end_together(replicated: bool) -> None:
    """Data-parallel replicas finish at different times: the others wait until process 0 wrote
    the last record (its exit must not find them gone, nor they it)."""
    if not replicated or jax.process_count() == 1:
        return
    end = Messages("batch/end")
    if is_primary():
        end.send(True)
    else:
        end.receive()


def _result(req, tokenizer) -> dict:
    """The record of a finished request: its ids and text, a usage count, and its timings."""
    m = req.metrics
    n_out = len(req.output)
    return {"id": req.id, "tokens": list(req.output),
            "text": req.text if req.text is not None else tokenizer.decode(req.output),
            "finish_reason": req.finish_reason,
            "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": n_out,
                      "total_tokens": len(req.prompt) + n_out},
            "metrics": {k: m[k] for k in ("ttft_s", "decode_tokens_per_s", "preemptions")}}
