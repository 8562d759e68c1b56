"""Prefix cache (issue 28): what a hit saves and what the cache costs when nothing hits.

1. nothing hits: unique prompts through the engine with the cache off and on; wall time of the
   prefill calls and of the decode calls (the cache's bookkeeping, chunk cuts and checkpoints).
2. a shared prefix of BENCH_PREFIX tokens: the time to first token of a request extending it, with
   the cache off (recompute), a device-tier hit, and a host-tier hit (every cached page and
   checkpoint moved to host first), plus the prefill tokens each computed.
3. synthetic agent sessions (a shared system prompt, every turn re-sends the conversation): the
   share of prompt tokens that hit.

Run (repo root): PYTHONUNBUFFERED=1 python3 benchmarks/bench_prefix_cache.py   [BENCH_TINY=1 on CPU]
Knobs: BENCH_PREFIX (default 32768; tiny: 256), BENCH_CHUNK (prefill chunk, default 2048; tiny 32),
BENCH_SESSIONS / BENCH_TURNS (default 16 x 6). Writes $OUT/bench_prefix_cache.json.
"""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

import kimik3
from serve import Engine, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
TINY = os.environ.get("BENCH_TINY") == "1"
PREFIX = int(os.environ.get("BENCH_PREFIX", "256" if TINY else "32768"))
CHUNK = int(os.environ.get("BENCH_CHUNK", "32" if TINY else "2048"))
SESSIONS = int(os.environ.get("BENCH_SESSIONS", "16"))
TURNS = int(os.environ.get("BENCH_TURNS", "6"))


def model():
    if TINY:
        return kimik3.init(kimik3.Config.preset("tiny"), seed=0)
    # one TP8 rank of K3 with 12 layers (the 3:1 KDA:MLA pattern), as bench_engine.py reduces it
    cfg = kimik3.Config.preset("kimi-k3")
    types = tuple(cfg.layer_types[:12])
    cfg = cfg.replace(name="k3-tp8-rank-12L", num_layers=12, layer_types=types, kda_num_heads=12,
                      mla_num_heads=12, intermediate_size=33792 // 8, moe_intermediate_size=3072 // 8,
                      vocab_size=163840 // 8)
    return kimik3.init(cfg, seed=0)


def engine(m, **kw):
    return Engine(m, max_batch=4, max_seq_len=PREFIX + 4 * CHUNK, page_size=64, prefill_chunk=CHUNK,
                  decode_steps=8, **kw)


def drain(eng):
    """Run the engine dry; returns wall seconds spent in prefill calls and in decode calls."""
    pre = dec = 0.0
    while eng.has_work():
        prefilling = any(r.fed < len(r.sequence) - 1 for r in eng.running) or eng.waiting
        t = time.perf_counter()
        eng.step()
        jax.block_until_ready(eng.layers)
        if prefilling:
            pre += time.perf_counter() - t
        else:
            dec += time.perf_counter() - t
    return pre, dec


def nothing_hits(m, rng):
    out = {}
    for on in (False, True, False, True):  # twice each: the first pass compiles
        eng = engine(m, prefix_cache=on)
        for _ in range(4):
            eng.submit(list(map(int, rng.randint(0, m.cfg.vocab_size, 4 * CHUNK))),
                       SamplingParams(max_new_tokens=64, stop_tokens=()))
        out["on" if on else "off"] = drain(eng)
    return {k: {"prefill_s": p, "decode_s": d} for k, (p, d) in out.items()}


def ttft(eng, prompt):
    r = eng.submit(prompt, SamplingParams(max_new_tokens=1, stop_tokens=()))
    t = time.perf_counter()
    while r.finished is None:
        eng.step()
    return time.perf_counter() - t, len(prompt) - (r.prefix_hit_tokens or 0)


def shared_prefix(m, rng):
    prefix = list(map(int, rng.randint(0, m.cfg.vocab_size, PREFIX)))
    ext = lambda: prefix + list(map(int, rng.randint(0, m.cfg.vocab_size, 16)))  # noqa: E731
    rows = {}
    for name, kw in (("off", dict(prefix_cache=False)), ("device", {}), ("host", dict(host_cache_bytes=1 << 36))):
        eng = engine(m, **kw)
        for _ in range(2):  # the second pass is the measured one (compiled)
            ttft(eng, ext())  # caches the prefix (or not)
            if name == "host":
                eng.prefix.offload()  # every cached page and checkpoint to host
                jax.block_until_ready(eng.layers)
            secs, computed = ttft(eng, ext())
        rows[name] = {"ttft_s": secs, "prefill_tokens_computed": computed, "stats": eng.stats()}
    return rows


def sessions(m, rng):
    eng = engine(m)
    system = list(map(int, rng.randint(0, m.cfg.vocab_size, PREFIX // 4)))
    hist = [list(system) for _ in range(SESSIONS)]
    for _ in range(TURNS):
        reqs = []
        for h in hist:
            h += list(map(int, rng.randint(0, m.cfg.vocab_size, int(rng.randint(8, CHUNK)))))
            reqs.append(eng.submit(list(h), SamplingParams(max_new_tokens=32, stop_tokens=())))
        drain(eng)
        for h, r in zip(hist, reqs):
            h += r.output
    return eng.stats()


def main():
    rng = np.random.RandomState(0)
    m = model()
    res = {"device": str(jax.devices()[0]), "prefix": PREFIX, "chunk": CHUNK}
    res["nothing_hits"] = nothing_hits(m, rng)
    print("nothing hits:", res["nothing_hits"])
    res["shared_prefix"] = shared_prefix(m, rng)
    for k, v in res["shared_prefix"].items():
        print(f"shared prefix {PREFIX}, {k}: ttft {v['ttft_s'] * 1e3:.1f} ms, "
              f"{v['prefill_tokens_computed']} tokens computed")
    res["sessions"] = sessions(m, rng)
    print("sessions:", res["sessions"])
    with open(os.path.join(OUT, "bench_prefix_cache.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
