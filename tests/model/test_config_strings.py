"""The benchmarks' configuration strings (benchmarks/config_strings.py)."""
import pytest

from benchmarks.config_strings import chunk_config, parse_overrides
from kernels_pallas.kda import ChunkConfig


def test_parse_overrides():
    assert parse_overrides("a=1,b=x,c=None,d=-2") == {"a": 1, "b": "x", "c": None, "d": -2}
    assert parse_overrides("") == {}
    assert parse_overrides("f=true", bools={"f"}) == {"f": True}
    with pytest.raises(ValueError, match="f='False0'"):
        parse_overrides("f=False0", bools={"f"})


def test_chunk_config():
    cfg = chunk_config("num_warps_inter=2,block_k_out=16,scan_groups=None")
    assert (cfg.num_warps_inter, cfg.block_k_out, cfg.scan_groups) == (2, 16, None)
    assert cfg == ChunkConfig(num_warps_inter=2, block_k_out=16)   # the other fields: tuned
    assert chunk_config("") == ChunkConfig()
    with pytest.raises(TypeError):
        chunk_config("no_such_field=1")
