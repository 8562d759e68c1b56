"""Small drivers that run one kernel a few times, for Nsight Compute on the H200 (the lent
machine's runtime lets ncu read the hardware counters; give it --clock-control none):

  ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
      --section SchedulerStats --section Occupancy --section LaunchStats --section SourceCounters \\
      --kernel-name regex:mla_decode --launch-skip 2 --launch-count 2 -o $OUT/mla \\
      python3 benchmarks/profile_targets.py mla bf16 fp8
  ncu --import $OUT/mla.ncu-rep --print-summary none               # the sections, as text
  ncu --import $OUT/mla.ncu-rep --page raw | grep issue_stalled    # stall reasons per warp

Targets: `mla LABEL...` (MLA decode at B16 32K, 16 heads (128 for labels ending -h128),
64-token pages; labels in MLA_VARIANTS),
`moe` (MXFP4 decode: one TP8 rank's gate+up slice, 896 experts, top-16, 64 tokens, the default
config; name it `--kernel-name regex:^moe_gmm$`: each call also launches the tile plan,
`moe_gmm_tiles`). Each target runs 3 times (compile, then 2 profiled launches with --launch-skip 2).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))   # bench_moe_gmm

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# MLA variants: cache dtype and mla_decode keyword overrides
MLA_VARIANTS = {
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "fp8-tile": ("fp8", dict(fp8_upcast="tile")),
    "fp8w": ("fp8w", {}),
    "fp8w-pairs": ("fp8w", dict(fp8_upcast="words_pairs")),
    "bf16-h128": ("bf16", {}),
}


def run_mla(labels, B=16, ctx=32768, page=64):
    from kernels_pallas.mla import fp8_to_words
    from kernels_pallas.mla.decode import mla_decode
    npg = B * ctx // page
    key = jax.random.key(0)
    pt = jnp.arange(npg, dtype=jnp.int32).reshape(B, ctx // page)
    ln = jnp.full((B,), ctx, jnp.int32)
    cache = {"bf16": jax.random.normal(key, (npg, page, 576), jnp.bfloat16)}
    cache["fp8"] = cache["bf16"].astype(jnp.float8_e4m3fn)
    cache["fp8w"] = fp8_to_words(cache["fp8"])
    cs = jnp.full((npg, page), 0.02, jnp.float32)
    for label in labels:
        if label not in MLA_VARIANTS:
            raise SystemExit(f"unknown MLA variant {label!r}: one of {sorted(MLA_VARIANTS)}")
        dt, kw = MLA_VARIANTS[label]
        heads = 128 if label.endswith("-h128") else 16
        q = jax.random.normal(key, (B, 1, heads, 576), jnp.bfloat16)
        f = jax.jit(lambda q, c, s, kw=kw: mla_decode(q, c, pt, ln, scale=0.07, cache_scale=s,
                                                      **kw))
        for _ in range(3):
            jax.block_until_ready(f(q, cache[dt], cs if dt != "bf16" else None))
        print(f"mla {label}: 3 runs", flush=True)


def run_moe(G=896, K=3584, N=768, tokens=64, topk=16):
    from bench_moe_gmm import random_mxfp4, routing
    from kernels_pallas.moe.gmm import moe_gmm
    w = random_mxfp4(jax.random.key(0), G, N, K)
    gs = jnp.asarray(routing(np.random.default_rng(0), tokens, G, topk))
    x = jax.random.normal(jax.random.key(1), (tokens * topk, K), jnp.bfloat16)
    f = jax.jit(lambda x, w, gs: moe_gmm(x, w, gs))
    for _ in range(3):
        jax.block_until_ready(f(x, w, gs))
    print("moe: 3 runs", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("mla", "moe"):
        raise SystemExit(__doc__)
    if sys.argv[1] == "mla":
        run_mla(sys.argv[2:] or ["bf16"])
    else:
        run_moe()
