"""GPU time of the grouped matmul's tile plan: XLA's `tile_metadata` (4 kernels) against the
one-launch Pallas `tile_plan` at (tiles per program, warps) configs, checked equal first.
896 experts, top-16, the bench's random routing at 64 and 512 tokens, block_m 16.

  PYTHONPATH=. python3 benchmarks/probe_moe_tile_plan.py            # H200: $OUT/tile_plan.json
  PROBE_TILE_CONFIGS="16,4;8,4;4,4;2,2" PYTHONPATH=. python3 benchmarks/probe_moe_tile_plan.py
  (on a CPU machine: the interpreter, equality checks only)
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_moe_gmm import routing  # noqa: E402
from kernel_timer import kernel_times  # noqa: E402
from kernels_pallas.moe.gmm import tile_metadata  # noqa: E402
from kernels_pallas.moe.tiles import tile_plan  # noqa: E402


def main():
    spec = os.environ.get("PROBE_TILE_CONFIGS", "16,4;16,8;8,4;32,8;4,4;2,4;1,4;4,2;2,2;4,1")
    configs = [tuple(int(v) for v in item.split(",")) for item in spec.split(";") if item]
    interpret = jax.default_backend() == "cpu"  # here: the interpreter, equality only
    out = {}
    for tokens in (64, 512):
        gs = jnp.asarray(routing(np.random.default_rng(0), tokens, 896, 16))
        m = tokens * 16
        xla = jax.jit(lambda g, m=m: tile_metadata(g, m, 16))
        ref = np.asarray(xla(gs))
        cands = {"xla": xla}
        for c, w in configs:
            cands[f"chunk{c}_w{w}"] = jax.jit(
                lambda g, m=m, c=c, w=w: tile_plan(g, m, 16, interpret, chunk=c, warps=w))
        for name, f in cands.items():
            equal = bool((np.asarray(f(gs)) == ref).all())
            kt = kernel_times(f, gs, reps=20)
            us = None if kt is None else round(kt["total_us"], 2)
            out[f"{tokens} {name}"] = {"equal": equal, "us": us,
                                       "by_kernel": None if kt is None else kt["by_kernel"]}
            print(f"{tokens} tokens {name:12s} {'equal' if equal else 'DIFFERS'} {us} us", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "tile_plan.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
