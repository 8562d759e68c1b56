"""The benchmark tool: every benchmark's --smoke run on the CPU (its code paths at tiny shapes,
interpret-mode kernels, no peer) writes a JSON the report renders, and BENCHMARKS.md is exactly
what `python -m benchmarks report` makes of the committed results. (`sharded` runs in its own
subprocess: tests/test_bench_sharded.py.)"""
import json
import os

import pytest

from benchmarks import report
from benchmarks.__main__ import main


def test_benchmarks_md_is_the_report_of_the_committed_results(capsys):
    assert main(["report", "--check"]) == 0, capsys.readouterr().err
    assert len(open(report.OUTPUT).read()) < 14_000  # a table, not a diary (13 areas of kernels, 6 of serving)


def test_report_ratios_commands_and_per_row_runs(tmp_path):
    run = {"benchmark": "kda", "date": "2026-01-02", "device": "GPU X", "commit": "abc1234",
           "command": "python -m benchmarks kda", "rows": [
               {"area": "A", "shape": "s1", "ours": 2.0, "unit": "ms", "peer": 3.0, "peer_name": "P",
                "limit_pct": 50.0, "note": "of copy"},
               {"area": "A", "shape": "s2", "ours": 300.0, "unit": "tokens/s", "peer": 100.0,
                "peer_name": "P", "limit_pct": None, "note": "", "commit": "def5678",
                "command": "python -m benchmarks kda --sections decode"}]}
    (tmp_path / "kda.json").write_text(json.dumps(run))
    text = report.render(report.load(str(tmp_path)))
    assert "## A vs P" in text
    assert "| s1 | 2.000 ms | 3.000 ms | 1.50x | 50.0% of copy | 2026-01-02 | GPU X | abc1234 | (1) |" in text
    assert "| s2 | 300.0 tokens/s | 100.0 tokens/s | 3.00x | - | 2026-01-02 | GPU X | def5678 | (2) |" in text
    assert "(2) `python -m benchmarks kda --sections decode`" in text
    (tmp_path / "moe.json").write_text(json.dumps({**run, "benchmark": "moe", "rows": [
        {**run["rows"][0], "area": "B"}, {**run["rows"][0], "area": "B", "shape": "s3"}]}))
    text = report.render(report.load(str(tmp_path)))  # one run made both B rows: said once, under the heading
    assert "## B vs P\n\n2026-01-02, GPU X, commit abc1234, command (1)\n\n| shape | ours | peer | ratio | % of limit |\n" in text
    assert "| s3 | 2.000 ms | 3.000 ms | 1.50x | 50.0% of copy |\n" in text
    out = tmp_path / "B.md"
    assert main(["report", "--results", str(tmp_path), "--output", str(out), "--check"]) == 1
    assert main(["report", "--results", str(tmp_path), "--output", str(out)]) == 0
    assert out.read_text() == text


@pytest.mark.parametrize("name", ["kda", "mla", "mla-prefill", "moe", "attnres", "engine"])
def test_smoke_run(name, tmp_path):
    assert main([name, "--smoke", "--out", str(tmp_path)]) == 0

    run = json.loads((tmp_path / f"{name}.json").read_text())
    assert run["benchmark"] == name and run["smoke"] is True and run["errors"] == {}
    assert run["command"] == f"python -m benchmarks {name} --smoke --out {tmp_path}"
    assert run["rows"] and all(r["ours"] is not None and r["ours"] > 0 for r in run["rows"])
    report.render(report.load(str(tmp_path)))  # the report reads what the benchmark wrote


def test_a_smoke_run_never_writes_the_committed_results():
    from benchmarks.__main__ import RESULTS, SMOKE_OUT

    assert main(["attnres", "--smoke"]) == 0
    assert os.path.exists(os.path.join(SMOKE_OUT, "attnres.json"))
    assert not os.path.exists(os.path.join(RESULTS, "attnres.json"))
