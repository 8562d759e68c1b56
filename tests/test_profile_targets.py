"""benchmarks/profile_targets.py (the Nsight Compute drivers) runs its targets at tiny shapes
(on CPU: the reference backends) and names the variants when given an unknown one."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import profile_targets  # noqa: E402


def test_targets_run_at_tiny_shapes(capsys):
    profile_targets.run_mla(["bf16", "fp8"], B=1, ctx=128)
    profile_targets.run_moe(G=4, K=64, N=32, tokens=2, topk=2)
    out = capsys.readouterr().out
    assert "mla bf16: 3 runs" in out and "mla fp8: 3 runs" in out and "moe: 3 runs" in out


def test_unknown_variant_is_named():
    with pytest.raises(SystemExit, match="fp8-tile"):
        profile_targets.run_mla(["fp9"], B=1, ctx=128)
