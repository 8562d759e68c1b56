"""Parity with HF transformers' KimiLinearForCausalLM (an independent PyTorch implementation).

Fixtures: tests/make_hf_fixtures.py (transformers 5.24.0, torch 2.13.0 CPU, fp32) saved three small
random models with save_pretrained plus their logits and greedy generate() outputs. We load the
directories with kimik3.load and must reproduce them: logits within max|err|/max|logit| <= 1e-4
(fp32 over a whole stack, two implementations), greedy continuations token for token."""
import os

import numpy as np
import pytest

import kimik3
from tests import paths

HERE = str(paths.FIXTURES / "hf_kimi_linear")
CASES = sorted(d for d in os.listdir(HERE) if os.path.isdir(os.path.join(HERE, d)))


@pytest.fixture(scope="module", params=CASES)
def case(request):
    d = os.path.join(HERE, request.param)
    return kimik3.load(d), dict(np.load(os.path.join(d, "expected.npz")))


def test_fixtures_exist():
    assert len(CASES) >= 3


def test_logits_match_hf(case):
    model, exp = case
    ours = np.asarray(kimik3.forward(model, exp["input_ids"].astype(np.int32)))
    ref = exp["logits"]
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < 1e-4, err


def test_prefill_and_decode_match_hf_greedy_generate(case):
    model, exp = case
    prompts = [list(map(int, p)) for p in exp["prompt_ids"]]
    P = len(prompts[0])
    want = [list(map(int, g[P:])) for g in exp["generate_ids"]]
    got = kimik3.generate(model, prompts, max_new_tokens=len(want[0]), stop_tokens=[])
    assert got == want
