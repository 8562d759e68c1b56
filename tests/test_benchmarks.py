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
    # a table, not a diary: one table per area, its headline shapes only (the rest stay in the
    # JSON's details), one line per command
    assert len(open(report.OUTPUT).read()) < 16_000


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
    # date and device are shared (said under the heading); commit and command differ (columns)
    assert "## A vs P\n\n2026-01-02, GPU X\n\n| shape | ours | peer | ratio | % of limit | commit | command |\n" in text
    assert "| s1 | 2.000 ms | 3.000 ms | 1.50x | 50.0% of copy | abc1234 | (1) |" in text
    assert "| s2 | 300.0 tokens/s | 100.0 tokens/s | 3.00x | - | def5678 | (2) |" in text
    assert "(2) `kda --sections decode`" in text  # the common prefix said once, above the list
    assert "`python -m benchmarks` is left out" in text
    (tmp_path / "moe.json").write_text(json.dumps({**run, "benchmark": "moe", "rows": [
        {**run["rows"][0], "area": "B"}, {**run["rows"][0], "area": "B", "shape": "s3"}]}))
    text = report.render(report.load(str(tmp_path)))  # one run made both B rows: said once, under the heading
    assert "## B vs P\n\n2026-01-02, GPU X, commit abc1234, command (1)\n\n| shape | ours | peer | ratio | % of limit |\n" in text
    assert "| s3 | 2.000 ms | 3.000 ms | 1.50x | 50.0% of copy |\n" in text
    (tmp_path / "attnres.json").write_text(json.dumps({**run, "benchmark": "attnres", "rows": [
        {**run["rows"][0], "area": "C", "shape": f"s{i}", "peer": None, "limit_pct": None, "note": "same"}
        for i in (4, 5)]}))
    text = report.render(report.load(str(tmp_path)))  # no peer, no limit: those columns go; the note is said once
    assert "| shape | ours |\n|---|---|\n| s4 | 2.000 ms |\n| s5 | 2.000 ms |\n\nsame\n" in text
    out = tmp_path / "B.md"
    assert main(["report", "--results", str(tmp_path), "--output", str(out), "--check"]) == 1
    assert main(["report", "--results", str(tmp_path), "--output", str(out)]) == 0
    assert out.read_text() == text


@pytest.mark.parametrize("name", ["kda", "mla", "mla-prefill", "moe", "attnres", "dense", "engine"])
def test_smoke_run(name, tmp_path):
    assert main([name, "--smoke", "--out", str(tmp_path)]) == 0

    run = json.loads((tmp_path / f"{name}.json").read_text())
    assert run["benchmark"] == name and run["smoke"] is True and run["errors"] == {}
    assert run["command"] == f"python -m benchmarks {name} --smoke --out {tmp_path}"
    assert run["rows"] and all(r["ours"] is not None and r["ours"] > 0 for r in run["rows"])
    report.render(report.load(str(tmp_path)))  # the report reads what the benchmark wrote


@pytest.mark.parametrize("argv", [["attnres", "--smoke"],
                                  ["mla", "--lower", "--shapes", "16x32768", "--heads", "",
                                   "--configs", "bf16:default"]], ids=["smoke", "lower"])
def test_a_cpu_check_never_writes_the_committed_results(argv):
    from benchmarks.__main__ import RESULTS, SMOKE_OUT

    committed = os.path.join(RESULTS, f"{argv[0]}.json")
    before = open(committed).read() if os.path.exists(committed) else None
    assert main(argv) == 0
    assert os.path.exists(os.path.join(SMOKE_OUT, f"{argv[0]}.json"))
    assert (open(committed).read() if os.path.exists(committed) else None) == before


def test_engine_profile_categories_from_kernel_names():
    from benchmarks.engine_metrics import busy_ns, classify

    want = {"gemm_fusion_dot_123": "dense_matmul",
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": "dense_matmul",
            "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma": "dense_matmul",
            "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT": "dense_matmul",
            "moe_gmm": "moe", "moe_gmm_tiles": "moe",
            "kda_decode": "kda", "kda_chunk_diag": "kda", "kda_chunk_out": "kda",
            "mla_decode_bh16_bk64_bf16": "mla", "mla_merge_splits": "mla", "mla_prefill": "mla",
            "attn_res_norm": "norms_attnres",
            "skinny_matmul_m16_k7168_n6284": "dense_matmul", "route_top_k": "routing_sort",
            "radix_sort_onesweep_kernel": "routing_sort",
            "void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<int, int>>": "routing_sort",
            "fusion_12": "other_fusions", "loop_reduce_fusion": "other_fusions",
            "input_scatter_fusion": "other_fusions", "wrapped_convert": "other_fusions"}
    assert {n: classify(n) for n in want} == want
    # overlapping kernels count once: [0, 10) + [5, 12) + [20, 25) -> 17
    assert busy_ns([("s", "a", 0, 10), ("s", "b", 20, 5), ("t", "c", 5, 7)]) == 17


def test_prefill_profile_sums_categories_over_the_traced_prefills(monkeypatch):
    from benchmarks import engine_metrics

    events = [("s", "moe_gmm", 0, 4000), ("s", "fusion_7", 2000, 4000), ("s", "skinny_matmul_m1", 10000, 8000)]
    monkeypatch.setattr(engine_metrics, "trace_events", lambda fn, reps, sync: events)
    prof = engine_metrics.prefill_profile(lambda: None, wall_us=20.0, reps=2)
    assert prof["us_per_prefill"] == dict(dense_matmul=4.0, moe=2.0, kda=0.0, mla=0.0, norms_attnres=0.0,
                                          routing_sort=0.0, other_fusions=2.0, host_gap=13.0)
    assert prof["gpu_busy_us"] == 7.0 and prof["launches"] == 1.5
    assert engine_metrics.profile_note(prof) == "ms/prefill mm 0.0 moe 0.0 other 0.0 host 0.0"  # no empty ones


def test_engine_prefill_flops_count_linear_attention_and_kda():
    import jax
    import kimik3
    from benchmarks.engine_metrics import prefill_flops

    cfg = kimik3.Config.preset("tiny")
    params = jax.eval_shape(lambda: kimik3.init(cfg, seed=0).params)
    one, two = prefill_flops(cfg, params, 64), prefill_flops(cfg, params, 128)
    assert one["total"] == one["linear"] + one["mla"] + one["kda"] and min(one.values()) > 0
    lm = 2 * cfg.hidden_size * cfg.vocab_size  # lm_head: the last token only
    assert two["linear"] - lm == 2 * (one["linear"] - lm) and two["kda"] == 2 * one["kda"]
    assert two["mla"] == one["mla"] * (128 * 129) // (64 * 65)  # causal pairs


def test_speculative_smoke_at_a_fixed_depth_with_the_step_profile(tmp_path):
    """Two passes per engine (a fresh controller's, then one that has timed its depths), the row
    from the second; --spec-depth fixes the depth; --profile records each engine's steps (GPU
    busy time and launches only where the trace has a GPU plane)."""
    argv = ["speculative", "--smoke", "--workloads", "random", "--spec-depth", "2", "--profile",
            "--new-tokens", "12", "--out", str(tmp_path)]
    assert main(argv) == 0
    run = json.load(open(tmp_path / "speculative.json"))
    assert run["errors"] == {} and [r["area"] for r in run["rows"]] == ["Speculative decoding, n-gram drafts, depth 2"]
    assert [c["controller"] for c in run["details"]["cases"]] == ["cold", "warm"]
    assert "step_profile" in run["details"]["cases"][1] and all(c["rows_differing"] == 0 for c in run["details"]["cases"])
    assert all(c["full_batch_speedup"] > 0 and c["spec_spent"]["depth 2"]["tokens"] > 0 for c in run["details"]["cases"])


def test_engine_kernels_named_from_the_optimized_hlo(tmp_path):
    from benchmarks.engine_metrics import hlo_names

    (tmp_path / "module_0040.jit_decode_steps.sm_9.0a_gpu_after_optimizations.txt").write_text("""\
%fused_computation.83 (param_0.1: u32[2,320]) -> u32[2,320] {
  %param_0.1 = u32[2,320]{1,0} parameter(0)
  %broadcast.1 = u32[2,320]{1,0} broadcast(u32[] %c), dimensions={}
  ROOT %add.1 = u32[2,320]{1,0} add(%param_0.1, %broadcast.1)
}

ENTRY %main.1 (p: u32[2,320]) -> u32[2,320] {
  %p = u32[2,320]{1,0} parameter(0)
  ROOT %broadcast_add_fusion.5 = u32[2,320]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.83, metadata={op_name="jit(decode_steps)/while/body/add" stack_frame_id=576}
}
""")
    want = "kLoop u32[2,320]{1,0} [broadcastx1,addx1] <- jit(decode_steps)/while/body/add"
    assert hlo_names(str(tmp_path), ["broadcast_add_fusion_5", "broadcast_add_fusion_5__1", "moe_gmm"]) == {
        "broadcast_add_fusion_5": want, "broadcast_add_fusion_5__1": want}
    assert hlo_names(str(tmp_path / "none"), ["x"]) == {}


def test_near_tie_gaps_measure_plain_decodings_lead_at_a_divergence():
    """A row made to differ at token j by plain decoding's second choice there: its gap is the
    logprob lead of the first choice (>= 0); a token outside the top 5 and a row whose plain
    tokens the re-run does not reproduce are named, not measured."""
    import kimik3
    from benchmarks.speculative import gap_note, near_tie_gaps
    from serve import Engine, SamplingParams
    model = kimik3.init(kimik3.Config.preset("tiny"), seed=0)
    prompts = [[3, 5, 7, 9], [11, 2, 4]]
    params = [SamplingParams(max_new_tokens=6, stop_tokens=(), return_logprobs=True, top_logprobs=5)] * 2
    eng = Engine(model, max_batch=2, max_seq_len=32, page_size=64, prefill_chunk=256, decode_steps=8,
                 prefix_cache=False)
    ref = eng.generate(prompts, params=params)
    j = 2
    second, third = list(ref[0].top_logprobs[j])[1:3]
    ours = [list(ref[0][:j]) + [second], list(ref[1])]
    plain = [list(ref[0]), list(ref[1])]
    gaps = near_tie_gaps(model, prompts, params, 32, plain, ours, {0: j})
    assert gaps[0] == pytest.approx(ref[0].logprobs[j] - ref[0].top_logprobs[j][second], abs=1e-4) and gaps[0] >= 0
    far = min(range(model.cfg.vocab_size), key=lambda t: t in ref[0].top_logprobs[j])  # outside the top 5
    assert near_tie_gaps(model, prompts, params, 32, plain, [list(ref[0][:j]) + [far]] + plain[1:], {0: j}) == {
        0: "not in top 5"}
    wrong = [[(t + 1) % model.cfg.vocab_size for t in plain[0]], plain[1]]
    assert near_tie_gaps(model, prompts, params, 32, wrong, [[third] * 6, plain[1]], {0: 0}) == {0: "rerun differs"}
    assert gap_note({"cold": {0: 0.012, 3: "not in top 5"}, "warm": {}}) == " (plain's lead there: 0.012 nats, not in top 5)"
    assert gap_note({"cold": {}, "warm": {}}) == ""
