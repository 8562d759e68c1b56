"""`python -m benchmarks sharded --smoke` (issue 8): the whole benchmark on 8 fake CPU devices
with a tiny config, in a subprocess; its JSON has every section, says the sharded runs equal one
device, and its byte counts agree with the arrays and memory_report (~40 s on 2 cores)."""
import json
import subprocess
import sys
from tests import paths
from tests.sharding.processes import cpu_env

ROOT = str(paths.ROOT)


def test_bench_sharded_smoke(tmp_path):
    env = cpu_env(8)
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "sharded", "--smoke", "--out", str(tmp_path)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== sharded: 8 x cpu" in proc.stdout  # the closing table
    run = json.loads((tmp_path / "sharded.json").read_text())
    assert run["benchmark"] == "sharded" and run["command"] == "python -m benchmarks sharded --smoke --out " + str(tmp_path)
    assert run["errors"] == {} and {r["area"] for r in run["rows"]}  # the table's rows
    res = run["details"]

    assert res["machine"]["device_count"] == 8 and res["machine"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert res["skipped"] == []
    for section in ("correctness", "owned_rows", "dcp", "moe_dedup"):
        assert "error" not in res[section], (section, res[section].get("traceback"))

    corr = res["correctness"]
    assert corr["equal"] is True
    verdict = corr["verdict_pass"]
    assert min(verdict["prompt_lengths"]) < 8
    for name in ("tp8", "tp8_dcp8"):
        assert verdict[name]["tokens"] == verdict["one_device_tokens"]

    rows = {(r["ctx"], r["dcp"]): r for r in res["dcp"]["rows"]}
    assert set(rows) == {(ctx, d) for ctx in res["dcp"]["contexts"] for d in (1, 8)}
    for (ctx, d), r in rows.items():
        assert r["step_ms"] > 0
        assert r["mla_cache_bytes_per_gpu"] == r["memory_report"]["mla_cache"]  # the arrays = the arithmetic
        assert r["mla_cache_bytes_per_gpu"] * d == rows[ctx, 1]["mla_cache_bytes_per_gpu"]

    own = res["owned_rows"]
    assert own["freed_bytes_per_gpu"] == own["dedup_True"]["memory_report_dedup_saved"] > 0
    for dedup in ("True", "False"):
        assert own[f"dedup_{dedup}"]["param_bytes_per_gpu"]["max"] == own[f"dedup_{dedup}"]["memory_report_params"]
    assert all(v > 0 for v in own["mla_tokens_bought_per_gpu"].values())

    moe = res["moe_dedup"]
    assert {r["dedup"] for r in moe["layer_rows"]} == {True, False}
    for r in moe["layer_rows"]:
        c = r["collectives_per_layer"]
        assert r["layer_us"] > 0 and c["counts"]["all-reduce"] >= 1 and c["total_bytes"] > 0
    dedup_rows = {r["dedup"]: r for r in moe["layer_rows"]}
    assert dedup_rows[True]["layer_param_bytes_per_gpu"] < dedup_rows[False]["layer_param_bytes_per_gpu"]
    assert {r["dedup"] for r in moe["decode_rows"]} == {True, False}
    assert all(r["step_ms"] > 0 and r["collectives_in_decode_loop"]["total"] > 0 for r in moe["decode_rows"])


def test_a_device_fault_skips_the_rest(monkeypatch):
    """After a CUDA fault (the GPU context is lost) the script records the first error and skips
    the remaining measurements instead of failing each of them."""
    from benchmarks import sharded as bs

    monkeypatch.setattr(bs, "FAULT", [])
    monkeypatch.setattr(bs, "RESULTS", {})

    def faulty():
        raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")

    first, second = {}, {}
    assert bs.guarded(first, faulty) is None and "ILLEGAL_ADDRESS" in first["error"]
    assert bs.guarded(second, lambda: 1) is None and second["error"].startswith("not run: device fault")
    assert bs.RESULTS["device_fault"] == first["error"]
    assert not bs.Budget(1e9).allows("later section")
    ok = {}
    monkeypatch.setattr(bs, "FAULT", [])
    assert bs.guarded(ok, lambda: 1) == 1 and not ok
