"""The benchmarks' configuration strings, parsed in one place: "a=1,b=x,c=None" -> keyword
arguments (the benchmarks' --chunk-config, --decode-variant, --config, resources'
--kda-config: one config a flag)."""
from __future__ import annotations

import dataclasses


def parse_overrides(item: str, bools=frozenset()) -> dict:
    """"a=1,b=x,c=None" -> {"a": 1, "b": "x", "c": None}: integers where they parse, None for
    "None" (fields whose None means something, e.g. scan_groups=None: chosen by rule), strings
    otherwise; names in `bools` take 0/1/false/true strictly (a string "False" would be truthy)."""
    kw = {}
    for pair in filter(None, item.split(",")):
        name, _, val = pair.partition("=")
        if name in bools:
            if val.lower() not in ("0", "1", "false", "true"):
                raise ValueError(f"{name}={val!r} is not 0/1/false/true")
            kw[name] = val.lower() in ("1", "true")
        else:
            kw[name] = (None if val.lower() == "none" else
                        int(val) if val.lstrip("-").isdigit() else val)
    return kw


def chunk_config(item: str):
    """The default KDA ChunkConfig with the fields of `item` replaced."""
    from kernels_pallas.kda.chunk_pallas import ChunkConfig
    bools = {f.name for f in dataclasses.fields(ChunkConfig) if isinstance(f.default, bool)}
    return ChunkConfig(**parse_overrides(item, bools))
