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
import json
import numbers
import os
import sys
import time

from tqdm import tqdm

from sharding.distributed import broadcast_json, is_primary

from .engine import Engine, SamplingParams

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
              progress: bool = True, **engine_kw) -> dict:
    """Run every request of `input_path` not yet in `output_path` and append their results; over
    several processes every process runs the engine and process 0 alone writes."""
    defaults = dict(dict(max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0), **(defaults or {}))
    plan, skipped = shared_plan(input_path, output_path)
    engine = Engine(model, tokenizer=tokenizer, **engine_kw)
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
    primary = is_primary()
    bar = Progress(len(todo) + len(errors), disable=not (progress and primary))
    summary = {"requests": 0, "tokens": 0, "errors": 0, "skipped": skipped}
    t0 = time.perf_counter()
    with open(output_path, "a") if primary else contextlib.nullcontext() as out:
        def write(rec):
            if primary:
                out.write(json.dumps(rec) + "\n")
                out.flush()
                os.fsync(out.fileno())
            if "error" in rec:
                summary["errors"] += 1
                bar.update(error=True)

        for rec in errors:
            write(rec)
        for rid, prompt, params in todo:
            try:
                engine.submit(prompt, params, request_id=rid)
            except ValueError as e:
                write({"id": rid, "error": str(e)})
        while engine.has_work():
            for req, _ in engine.step():
                if req.finished is None:
                    continue
                if req.finish_reason.startswith("error"):
                    write({"id": req.id, "error": req.finish_reason[len("error: "):]})
                    continue
                write(_result(req, tokenizer))
                summary["requests"] += 1
                summary["tokens"] += len(req.output)
                bar.update(tokens=len(req.output))
    bar.close()
    summary["seconds"] = time.perf_counter() - t0
    summary.update({k: v for k, v in engine.stats().items() if k not in summary})  # prefix-cache counters
    summary["tokens_per_s"] = summary["tokens"] / max(summary["seconds"], 1e-9)
    return summary


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
