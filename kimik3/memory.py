"""Per-device memory of a config on a mesh of given axis sizes: sharding's accounting
(`sharding.memory.memory_report`) over this config's abstract parameter tree."""
from __future__ import annotations

from sharding.memory import memory_report as _memory_report
from .params import abstract


def memory_report(cfg, **kw) -> dict:
    """Bytes per device: params, mla_cache, kda_state, total, routed_experts, dedup_saved.
    Keywords (tensor, dcp, expert, tokens, batch, cache_dtype, dedup): sharding.memory.memory_report.
    The placement options do not change the tree, so one abstract tree serves them all."""
    return _memory_report(cfg, abstract(cfg.replace(moe_dedup=True, moe_placement="auto")), **kw)
