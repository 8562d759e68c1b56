"""`kimik3 batch`: results appended as they finish; a SIGKILL'd run resumes to the same output,
each id exactly once; bad lines become error records."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tests import paths
from tests.sharding.processes import cpu_env, finish, free_port, process_flags

ROOT = str(paths.ROOT)


def _write_input(path, n=24):
    rng = np.random.RandomState(0)
    with open(path, "w") as f:
        for i in range(n):
            if i % 3 == 0:
                rec = {"id": f"r{i}", "prompt": "hello " * int(rng.randint(1, 6))}
            else:
                rec = {"id": i, "prompt": [int(t) for t in rng.randint(0, 256, rng.randint(1, 30))],
                       "max_new_tokens": int(rng.randint(2, 10)), "temperature": 0.8, "seed": i}
            f.write(json.dumps(rec) + "\n")
        f.write("{not json\n")
        f.write(json.dumps({"id": "long", "prompt": list(range(200))}) + "\n")
        f.write(json.dumps({"id": "nothing"}) + "\n")


def _cmd(inp, out):
    return [sys.executable, "-m", "serve", "batch", "--model", "tiny", "--input", str(inp), "--output", str(out),
            "--max-new-tokens", "6", "--max-batch", "4", "--max-seq-len", "64", "--page-size", "8", "--quiet"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _rkey(rec):
    """A record's identity: its id, and its input line when it is about a line (bad or duplicate id)."""
    return json.dumps([rec["id"], rec.get("line")])


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_kill_and_resume(tmp_path):
    inp = tmp_path / "prompts.jsonl"
    _write_input(inp)
    ref_out = tmp_path / "ref.jsonl"
    subprocess.run(_cmd(inp, ref_out), env=_env(), check=True, capture_output=True)
    ref = {_rkey(r): r for r in _records(ref_out)}
    assert len(ref) == 27

    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen(_cmd(inp, out), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        if out.exists() and out.read_text().count("\n") >= 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = out.read_text().count("\n")
    assert 0 < partial < 27, partial  # it really died mid-run
    with open(out, "a") as f:
        f.write('{"id": "torn')  # a half-written line, as a kill during write leaves it
    done = subprocess.run(_cmd(inp, out), env=_env(), check=True, capture_output=True, text=True)
    assert "already done" in done.stderr
    got = _records(out)
    ids = [_rkey(r) for r in got]
    assert len(ids) == len(set(ids)) == 27
    for r in got:
        want = ref[_rkey(r)]
        for key in ("tokens", "text", "error", "finish_reason", "usage"):
            assert r.get(key) == want.get(key), (r["id"], key)


def test_error_records_and_summary(tmp_path):
    inp = tmp_path / "p.jsonl"
    _write_input(inp, n=3)
    out = tmp_path / "o.jsonl"
    res = subprocess.run(_cmd(inp, out)[:-1], env=_env(), check=True, capture_output=True, text=True)
    recs = {_rkey(r): r for r in _records(out)}
    assert "not JSON" in recs["[null, 4]"]["error"]
    assert "exceeds the engine's max_seq_len" in recs['["long", null]']["error"]
    assert "needs \"prompt\"" in recs['["nothing", null]']["error"]
    assert recs['["r0", null]']["tokens"] and recs['["r0", null]']["metrics"]["ttft_s"] > 0
    assert "3 requests" in res.stderr and "3 errors" in res.stderr and "tok/s" in res.stderr
    assert "6/6 requests" in res.stderr  # the progress bar reached the end


def test_batch_on_a_mesh_with_dcp(tmp_path, tiny_models):
    """`--tensor 2 --dcp 4` (8 devices): the greedy tokens of one device; a page size that does not
    split over the DCP ranks is refused with a message."""
    import kimik3

    inp, out = tmp_path / "in.jsonl", tmp_path / "mesh.jsonl"
    prompts = [list(range(1, 4 + 7 * i)) for i in range(5)]
    with open(inp, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": i, "prompt": p, "max_new_tokens": 5}) + "\n")
    env = cpu_env(8)
    subprocess.run(_cmd(inp, out) + ["--tensor", "2", "--dcp", "4"], env=env, check=True, capture_output=True,
                   timeout=300)
    got = sorted((r["id"], r["tokens"]) for r in map(json.loads, open(out)))
    assert got == list(enumerate(kimik3.generate(tiny_models["tiny"], prompts, max_new_tokens=5)))
    bad = subprocess.run(_cmd(inp, tmp_path / "bad.jsonl") + ["--dcp", "4", "--page-size", "6"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "multiple of the DCP size" in bad.stderr


def _run_in_process(tmp_path, model, lines, name="in", **kw):
    from serve.batch import run_batch

    inp, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    inp.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    tok = __import__("kimik3").default_tokenizer(model.cfg)
    summary = run_batch(model, str(inp), str(out), tok, defaults=dict(max_new_tokens=5), max_batch=2,
                        max_seq_len=32, page_size=8, prefill_chunk=16, **kw)
    return summary, out


def test_records_keep_token_ids_usage_and_key_bad_ids_by_line(tmp_path, tiny_models):
    import kimik3

    model = tiny_models["tiny"]
    lines = [{"id": "a", "prompt": [1, 2, 3], "max_new_tokens": 4},
             {"id": None, "prompt": [1, 2]},
             {"prompt": [1, 2]},
             {"id": "a", "prompt": [4, 5]},
             {"id": 0, "prompt": [6, 7], "max_tokens": 3},
             {"id": "frac", "prompt": [1], "max_new_tokens": 2.5},
             {"id": "both", "prompt": [1], "max_tokens": 2, "max_new_tokens": 3},
             {"id": {"not": "scalar"}, "prompt": [1]}]
    summary, out = _run_in_process(tmp_path, model, lines, progress=False)
    recs = {_rkey(r): r for r in _records(out)}
    assert len(recs) == len(lines) and summary["requests"] == 2 and summary["errors"] == 6
    a = recs['["a", null]']
    assert a["tokens"] == kimik3.generate(model, [[1, 2, 3]], max_new_tokens=4)[0]
    assert a["usage"] == {"prompt_tokens": 3, "completion_tokens": len(a["tokens"]),
                          "total_tokens": 3 + len(a["tokens"])}
    assert a["text"] == kimik3.default_tokenizer(model.cfg).decode(a["tokens"])
    zero = recs["[0, null]"]  # a real id 0, max_tokens honoured
    assert "error" not in zero and zero["tokens"] == kimik3.generate(model, [[6, 7]], max_new_tokens=3)[0]
    for line in (2, 3):  # "id": null and a missing id: keyed by the line, not by an engine counter
        assert 'no "id"' in recs[f"[null, {line}]"]["error"]
    assert "duplicate id \"a\" (first on line 1)" in recs['["a", 4]']["error"]
    assert "max_new_tokens must be an integer >= 1, got 2.5" in recs['["frac", null]']["error"]
    assert "differ" in recs['["both", null]']["error"]
    assert "must be a string or an integer" in recs["[null, 8]"]["error"]
    before = out.read_text()
    again, _ = _run_in_process(tmp_path, model, lines, progress=False)
    assert out.read_text() == before and again["skipped"] == len(lines)  # a rerun adds nothing


def test_progress_bar_shows_requests_tokens_per_s_and_errors(tmp_path, tiny_models, capsys):
    import tqdm

    from serve.batch import Progress

    assert isinstance(Progress(1, disable=True).bar, tqdm.tqdm)
    lines = [{"id": 1, "prompt": [1, 2]}, {"id": 2, "prompt": "hi"}, {"id": 3}]
    _run_in_process(tmp_path, tiny_models["tiny"], lines, name="bar", progress=True)
    err = capsys.readouterr().err
    assert "3/3 requests" in err and "tok/s, 1 errors" in err and "[00:" in err


@pytest.mark.parametrize("mesh,kill", [(["--data-parallel", "2", "--tensor", "4"], True)], ids=["dp2_tp4_killed"])
def test_two_processes(tmp_path, tiny_models, mesh, kill):
    """`kimik3 batch` over 2 processes x 4 CPU devices as 2 data-parallel replicas of TP4 (one per
    process, each its own engine; process 1 sends its results to process 0), process 0 reading the
    input and writing the output: every id once, and the greedy tokens of one process on one
    device; SIGKILL both mid-run, add a torn line, rerun both (resuming must also tell process 1
    what is left). A TP8 mesh over two processes runs the same process-0 bookkeeping with one
    engine: tests/sharding/test_multiprocess.py covers its decoding and tests/serve/test_server.py
    its serving ("--tensor", "8" here is the same run, a minute of CPU more)."""
    import kimik3

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # answers of very different lengths: results arrive over many steps, so a kill lands mid-run
    prompts, lengths = [list(range(1, 4 + 5 * i)) for i in range(8)], [2 + 3 * i for i in range(8)]
    with open(inp, "w") as f:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            f.write(json.dumps({"id": i, "prompt": p, "max_new_tokens": n}) + "\n")
        f.write("{not json\n")

    def two_processes():
        port = free_port()
        return [subprocess.Popen(_cmd(inp, out) + mesh + process_flags(pid, 2, port), env=cpu_env(4),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for pid in range(2)]

    if kill:
        procs = two_processes()
        deadline = time.time() + 400
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if out.exists() and out.read_text().count("\n") >= 3:  # the bad line's record and 2 results
                break
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        finish(procs, 60)
        partial = out.read_text().count("\n")
        assert 2 < partial < 9, partial  # it really died mid-run
        with open(out, "a") as f:
            f.write('{"id": 3, "tok')  # a half-written line, as a kill during write leaves it
    (rc0, err0), (rc1, err1) = finish(two_processes(), 400)
    assert rc0 == rc1 == 0, err0[-2000:] + err1[-2000:]
    if kill:
        assert f"{partial} already done" in err0
    got = {_rkey(r): r for r in _records(out)}
    assert len(got) == len(_records(out)) == 9  # each id exactly once
    assert "not JSON" in got["[null, 9]"]["error"]
    # greedy continuations are prefixes of longer ones: one call gives every request's tokens
    want = kimik3.generate(tiny_models["tiny"], prompts, max_new_tokens=max(lengths))
    assert [got[f"[{i}, null]"]["tokens"] for i in range(8)] == [w[:n] for w, n in zip(want, lengths)]
