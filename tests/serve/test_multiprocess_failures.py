"""A step that fails on process 0 only (tests/serve/failing_step.py injects it) in a 2-process
TP8 run, while process 1 waits inside that step's collectives: every process ends with one line
saying what failed, and none hangs (each subprocess has a deadline)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import httpx

from tests.sharding.processes import cpu_env, finish, free_port, process_flags, wait_for_health

HERE = pathlib.Path(__file__).resolve().parent
FLAGS = ["--model", "tiny", "--tensor", "8", "--max-batch", "4", "--max-seq-len", "64", "--page-size", "8",
         "--prefill-chunk", "32"]


def start(argv, port):
    return [subprocess.Popen([sys.executable, str(HERE / "failing_step.py"), *argv, *process_flags(pid, 2, port)],
                             env=cpu_env(4), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for pid in range(2)]


def one_line_each(status):
    lines = []
    for pid, (rc, err) in enumerate(status):
        mine = [line for line in err.splitlines() if line.startswith("kimik3:")]
        assert rc == 1 and len(mine) == 1, f"process {pid} exited {rc}: {err[-2000:]}"
        lines.append(mine[0])
    return lines


def test_batch_step_failing_on_process_0_stops_both(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": [1, 2, 3 + i], "max_new_tokens": 4}) + "\n"
                           for i in range(3)))
    t0 = time.monotonic()
    procs = start(["batch", "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--quiet", *FLAGS],
                  free_port())
    first, second = one_line_each(finish(procs, 300))
    assert "RuntimeError: injected failure" in first, first
    assert "process 1: stopping because process 0 failed: RuntimeError: injected failure" in second, second
    assert time.monotonic() - t0 < 300


def test_server_step_failing_on_process_0_stops_both():
    """The request in flight gets a 503 naming the failure; then both processes stop."""
    http = free_port()
    procs = start(["serve", "--port", str(http), "--decode-steps", "4", *FLAGS], free_port())
    url = f"http://127.0.0.1:{http}"
    try:
        wait_for_health(url, procs, 300)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3},
                       timeout=120)
        assert r.status_code == 503 and "injected failure" in r.text, r.text
    finally:
        status = finish(procs, 120)
    first, second = one_line_each(status)
    assert "process 0: engine step failed: RuntimeError: injected failure" in first and "restart" in first, first
    assert "process 1: stopping because process 0 failed" in second, second
