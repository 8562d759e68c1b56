"""Batch offline generation: prompts.jsonl in, results.jsonl out, resumable.

Each input line is a JSON object: {"id": ..., "prompt": "text" | [token ids]} or
{"id": ..., "messages": [{"role": ..., "content": ...}]}, with optional "max_new_tokens",
"temperature", "top_k", "top_p", "seed", "stop" (a list of strings). Results are appended one JSON
object per line as each request finishes and flushed, so a killed job loses nothing: rerunning
the same command skips ids already in the output (a torn last line is dropped and redone), and
each id appears exactly once. A line that cannot be run becomes {"id", "error"} and the rest of
the file still runs.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .engine import Engine, SamplingParams

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


def read_done(path: str) -> set:
    """Ids already written; truncates a torn final line left by a killed run."""
    done = set()
    if not os.path.exists(path):
        return done
    good = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                done.add(_key(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError):
                break
            good += len(line)
    if good != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def _key(i):
    return json.dumps(i, sort_keys=True)


def parse_line(n: int, line: str, tokenizer, defaults: dict):
    """(id, prompt ids, SamplingParams) or raise ValueError with the reason."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"line {n} is not JSON ({e.msg})") from None
    if not isinstance(obj, dict) or "id" not in obj:
        raise ValueError(f"line {n} has no \"id\"")
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
    kw = dict(defaults)
    for f in SAMPLING_FIELDS:
        if f in obj:
            kw[f] = obj[f]
    stop = obj.get("stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
        raise ValueError("\"stop\" must be a list of strings")
    try:
        params = SamplingParams(max_new_tokens=int(kw["max_new_tokens"]), temperature=float(kw["temperature"]),
                                top_k=int(kw["top_k"]), top_p=float(kw["top_p"]), seed=int(kw["seed"]),
                                stop_strings=tuple(stop))
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad sampling field: {e}") from None
    return obj["id"], prompt, params


class Progress:
    def __init__(self, total: int, out=sys.stderr):
        self.total, self.out, self.t0 = total, out, time.perf_counter()
        self.done = self.tokens = self.errors = 0

    def update(self, tokens=0, error=False):
        self.done += 1
        self.tokens += tokens
        self.errors += error
        dt = time.perf_counter() - self.t0
        width = 30
        fill = int(width * self.done / max(self.total, 1))
        self.out.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} requests, "
                       f"{self.tokens / max(dt, 1e-9):.1f} tok/s, {self.errors} errors")
        self.out.flush()


def run_batch(model, input_path: str, output_path: str, tokenizer, defaults: dict | None = None,
              progress: bool = True, **engine_kw) -> dict:
    defaults = dict(dict(max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=0), **(defaults or {}))
    done = read_done(output_path)
    engine = Engine(model, tokenizer=tokenizer, **engine_kw)
    seen, todo, errors = set(done), [], []
    with open(input_path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rid, prompt, params = parse_line(n, line, tokenizer, defaults)
            except ValueError as e:
                rid = _id_of(line, n)
                if _key(rid) not in seen:
                    errors.append({"id": rid, "error": str(e)})
                    seen.add(_key(rid))
                continue
            if _key(rid) in seen:
                if _key(rid) not in done:
                    print(f"\nkimik3 batch: line {n}: duplicate id {rid!r} skipped", file=sys.stderr)
                continue
            seen.add(_key(rid))
            todo.append((rid, prompt, params))
    bar = Progress(len(todo) + len(errors)) if progress else None
    summary = {"requests": 0, "tokens": 0, "errors": 0, "skipped": len(done)}
    t0 = time.perf_counter()
    with open(output_path, "a") as out:
        def write(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()
            os.fsync(out.fileno())

        for rec in errors:
            write(rec)
            summary["errors"] += 1
            bar and bar.update(error=True)
        ids = {}
        for rid, prompt, params in todo:
            try:
                ids[id(engine.submit(prompt, params, request_id=rid))] = rid
            except ValueError as e:
                write({"id": rid, "error": str(e)})
                summary["errors"] += 1
                bar and bar.update(error=True)
        while engine.has_work():
            for req, _ in engine.step():
                if req.finished is None:
                    continue
                if req.finish_reason.startswith("error"):
                    write({"id": req.id, "error": req.finish_reason[len("error: "):]})
                    summary["errors"] += 1
                    bar and bar.update(error=True)
                    continue
                text = req.text if req.text is not None else tokenizer.decode(req.output)
                write({"id": req.id, "output_tokens": req.output, "text": text,
                       "finish_reason": req.finish_reason, **req.metrics})
                summary["requests"] += 1
                summary["tokens"] += len(req.output)
                bar and bar.update(tokens=len(req.output))
    summary["seconds"] = time.perf_counter() - t0
    summary.update({k: v for k, v in engine.stats().items() if k not in summary})  # prefix-cache counters
    summary["tokens_per_s"] = summary["tokens"] / max(summary["seconds"], 1e-9)
    if progress:
        sys.stderr.write("\n")
    return summary


def _id_of(line: str, n: int):
    try:
        obj = json.loads(line)
        if isinstance(obj, dict) and "id" in obj:
            return obj["id"]
    except ValueError:
        pass
    return f"line-{n}"
