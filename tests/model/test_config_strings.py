"""The benchmarks' configuration strings (benchmarks/config_strings.py)."""
import pytest

from benchmarks.config_strings import chunk_config, parse_overrides
from kernels_pallas.kda.chunk_pallas import ChunkConfig


def test_parse_overrides():
    assert parse_overrides("a=1,b=x,c=None,d=-2") == {"a": 1, "b": "x", "c": None, "d": -2}
    assert parse_overrides("") == {}
    assert parse_overrides("f=true", bools={"f"}) == {"f": True}
    with pytest.raises(ValueError, match="f='False0'"):
        parse_overrides("f=False0", bools={"f"})


def test_chunk_config():
    cfg = chunk_config("num_warps_inter=2,diag_block_k=None,split_inverse=1,inverse_precision=tf32")
    assert (cfg.num_warps_inter, cfg.diag_block_k, cfg.split_inverse, cfg.inverse_precision) == (
        2, None, True, "tf32")
    assert chunk_config("split_inverse=false").split_inverse is False
    assert chunk_config("") == ChunkConfig()
    with pytest.raises(ValueError, match="split_inverse"):
        chunk_config("split_inverse=False0")
    with pytest.raises(TypeError):
        chunk_config("no_such_field=1")
