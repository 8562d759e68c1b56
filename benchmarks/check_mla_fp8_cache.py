"""The model's fp8 MLA cache (Config.mla_cache_dtype="fp8") on a GPU: a tiny model at K3's cache
width (512 + 64, bf16) decodes through the Pallas kernels ("pallas") and through plain JAX
("reference") with a bf16 and an fp8 cache; prints the largest relative logit difference of
each pair over a prefill and 4 decode steps, and the MLA function names in the host side of a
profiler trace of the fp8 run (PjitFunction(_mla_decode_pallas) there: the decode step went
through the Pallas decode kernel with the words cache).

    PYTHONPATH=. python3 benchmarks/check_mla_fp8_cache.py        # on the GPU machine
"""
import glob
import gzip
import json

import jax
import numpy as np

import kimik3
from kernels_pallas._backend import kernel_platform


def run(model, backend, prompts):
    last, cache = kimik3.prefill(model, prompts, max_seq_len=512, backend=backend)
    logits = [last]
    for t in range(4):
        step, cache = kimik3.decode_step(model, cache, np.array([3 + t, 8 + t, 11 + t], np.int32),
                                         backend=backend)
        logits.append(step)
    return [np.asarray(x, np.float32) for x in logits]


def rel(a, b):
    return max(float(np.linalg.norm(x - y) / np.linalg.norm(x)) for x, y in zip(a, b))


def main():
    print(jax.devices()[0].device_kind, kernel_platform())
    cfg = kimik3.Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64,
                                               dtype="bfloat16", param_dtype="bfloat16")
    base = kimik3.init(cfg, seed=0)
    prompts = [list(range(1, 40)), [5, 6, 7], [i % 300 for i in range(100, 400)]]  # vocab 320
    models = {dt: base.replace(cfg=cfg.replace(mla_cache_dtype=dt, mla_cache_scale=0.05
                                               if dt == "fp8" else 1.0)) for dt in ("auto", "fp8")}
    res = {(dt, be): run(m, be, prompts) for dt, m in models.items()
           for be in ("reference", "pallas")}
    for a, b in [(("fp8", "reference"), ("fp8", "pallas")), (("auto", "reference"), ("auto", "pallas")),
                 (("auto", "reference"), ("fp8", "reference")), (("auto", "pallas"), ("fp8", "pallas"))]:
        print(f"{a} vs {b}: max relative logit difference {rel(res[a], res[b]):.2e}")
    with jax.profiler.trace("/tmp/fp8_cache_trace"):
        _, cache = kimik3.prefill(models["fp8"], prompts, max_seq_len=512)
        step, _ = kimik3.decode_step(models["fp8"], cache, np.array([1, 2, 3], np.int32))
        step.block_until_ready()
    names = set()
    for f in glob.glob("/tmp/fp8_cache_trace/**/*.trace.json.gz", recursive=True):
        names |= {e["name"] for e in json.load(gzip.open(f))["traceEvents"]
                  if "mla" in str(e.get("name", ""))}
    print("MLA kernels in the fp8 run:", sorted(names))


if __name__ == "__main__":
    main()
