"""kimik3 (load + forward, fp32) against the independent float64 NumPy oracle, on tiny checkpoints
written in the official key names: K3 layout with MXFP4 experts, and Kimi Linear layout."""
import numpy as np
import pytest

import kimik3
from kimik3.checkpoint.hf_export import export_hf

from tests import numpy_oracle  # noqa: E402


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_model_matches_float64_oracle(tiny_models, tmp_path, name):
    export_hf(tiny_models[name], str(tmp_path), num_shards=2)
    model = kimik3.load(str(tmp_path))
    toks = np.random.RandomState(5).randint(0, 256, 40)
    ours = np.asarray(kimik3.forward(model, toks[None]))[0]
    ref = numpy_oracle.forward(str(tmp_path), toks)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err < 1e-4, err  # fp32 vs fp64 over the whole stack
    # greedy choices agree at every position
    assert np.argmax(ours, -1).tolist() == np.argmax(ref, -1).tolist()
