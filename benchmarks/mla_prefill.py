"""MLA prefill attention on the GPU (one device call): our Pallas flash kernel
(kernels_pallas/mla/prefill.py) vs JAX's cuDNN flash attention (`jax.nn.dot_product_attention`,
implementation="cudnn") on identical inputs, causal, expanded form (q, k 192 = 128 nope + 64
rope, v 128), one TP8 rank's heads (16) and all 128.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mla_prefill.py    # on the H200
    MLA_PREFILL_DRY=1 ...   tiny interpret-mode run on CPU (checks the script)

1. Correctness on the GPU: ragged lengths (incl. 1 and a length that is not a block multiple)
   against the dense fp32 reference; every timed shape against cuDNN on the same inputs.
2. Timing: GPU kernel time from the profiler (benchmarks/kernel_timer.py), FLOPs counted as
   causal (B x H x T^2 / 2 x 2 x (192 + 128)), a few block configurations of ours.
Writes $OUT/bench_mla_prefill.json; prints a table.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernel_timer import kernel_times  # noqa: E402
from kernels_pallas.mla import mla_prefill, mla_prefill_reference  # noqa: E402

DRY = os.environ.get("MLA_PREFILL_DRY") == "1"
OUT = os.environ.get("OUT", "/tmp/bench_mla_prefill_out")
os.makedirs(OUT, exist_ok=True)
BACKEND = "interpret" if DRY else "pallas"
SCALE = 1.0 / math.sqrt(192.0)
SHAPES = [(1, 8192, 16), (1, 32768, 16), (4, 4096, 16), (1, 8192, 128)]
CONFIGS = {"default": {}, "q64w4s2": dict(block_q=64, num_warps=4, num_stages=2),
           "q128w8": dict(block_q=128, num_warps=8, num_stages=2),
           "q128w8s3": dict(block_q=128, num_warps=8, num_stages=3),
           "q128w8s4": dict(block_q=128, num_warps=8, num_stages=4),
           "q64s3": dict(block_q=64, num_warps=4, num_stages=3),
           "k32s3": dict(block_q=64, block_k=32, num_warps=4, num_stages=3)}
if DRY:
    SHAPES = [(1, 200, 2)]
    CONFIGS = {"default": dict(block_q=32, block_k=32)}
T0 = time.time()
RESULTS = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "checks": [],
           "cases": [], "errors": []}


def log(*a):
    print(f"[{time.time() - T0:5.0f}s]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "bench_mla_prefill.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def inputs(B, T, H, seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, H, 192), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, H, 192), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, 128), jnp.bfloat16)
    return q, k, v


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cudnn(q, k, v):
    # JAX's cuDNN path needs v's head dim equal to q's (jax 0.11.2: "value shape should be
    # [..., 192]"): v is zero-padded to 192 and the output sliced back, the way a JAX user
    # would call it. The pad and slice kernels are in the peer's total; its attention kernel
    # alone is reported as well (peer_attn_us).
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 192 - v.shape[-1])))
    return jax.nn.dot_product_attention(q, k, vp, scale=SCALE, is_causal=True,
                                        implementation="cudnn")[..., :v.shape[-1]]


# ---------------------------------------------------------------- correctness (ragged)
lengths = [1, 77, 300, 256] if not DRY else [1, 77, 200]
q, k, v = inputs(len(lengths), max(lengths), 4, 0)
ln = jnp.asarray(lengths, jnp.int32)
o = mla_prefill(q, k, v, ln, scale=SCALE, backend=BACKEND)
ro = mla_prefill_reference(q, k, v, ln, scale=SCALE)
valid = (np.arange(q.shape[1])[None, :] < np.asarray(lengths)[:, None])[..., None, None]
err = rel(np.where(valid, o, 0), np.where(valid, ro, 0))
pad_zero = bool(np.all(np.where(valid, 0, np.asarray(o, np.float32)) == 0))
RESULTS["checks"].append(dict(lengths=lengths, rel_err=err, padding_rows_zero=pad_zero,
                              ok=err < 2e-2 and pad_zero))
log(f"check ragged {lengths}: rel {err:.2e}, rows past the length zero: {pad_zero}")
save()

# ---------------------------------------------------------------- timing
fn_ours = jax.jit(lambda q, k, v, ln, cfg: mla_prefill(q, k, v, ln, scale=SCALE,
                                                      backend=BACKEND, **dict(cfg)),
                  static_argnames="cfg")
for B, T, H in SHAPES:
    q, k, v = inputs(B, T, H, 1)
    ln = jnp.full((B,), T, jnp.int32)
    flops = B * H * T * T / 2 * 2 * (192 + 128)
    peer = ref = None
    if not DRY:
        try:
            ref = cudnn(q, k, v)
            kt = kernel_times(jax.jit(cudnn), q, k, v, reps=5)
            peer = kt["total_us"]
            attn = max(kt["by_kernel"].values())
            RESULTS["cases"].append(dict(B=B, T=T, H=H, name="cudnn", us=peer,
                                         peer_attn_us=attn, tflops=flops / peer / 1e6,
                                         by_kernel=kt["by_kernel"]))
            log(f"B{B} T{T} H{H} cudnn (v padded to 192): {peer:.1f} us "
                f"{flops / peer / 1e6:.0f} TFLOP/s (its attention kernel alone {attn:.1f} us, "
                f"{flops / attn / 1e6:.0f} TFLOP/s)")
        except Exception as e:  # noqa: BLE001
            ref = None
            RESULTS["errors"].append(f"cudnn B{B} T{T} H{H}: {type(e).__name__}: {str(e)[:300]}")
            log("cudnn failed:", str(e)[:200])
    for name, cfg in CONFIGS.items():
        try:
            key = tuple(sorted(cfg.items()))
            o = fn_ours(q, k, v, ln, key)
            r = dict(B=B, T=T, H=H, name=name, cfg=cfg)
            if ref is not None and not DRY:
                r["rel_err_vs_cudnn"] = rel(o, ref)
            kt = None if DRY else kernel_times(fn_ours, q, k, v, ln, key, reps=5)
            if kt is not None:
                r.update(us=kt["total_us"], tflops=flops / kt["total_us"] / 1e6,
                         by_kernel=kt["by_kernel"],
                         vs_cudnn=(peer / kt["total_us"]) if peer else None)
                log(f"B{B} T{T} H{H} {name}: {r['us']:.1f} us {r['tflops']:.0f} TFLOP/s "
                    f"cudnn/ours {r['vs_cudnn'] or float('nan'):.2f}x "
                    f"rel vs cudnn {r.get('rel_err_vs_cudnn', float('nan')):.1e}")
            RESULTS["cases"].append(r)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"ours {name} B{B} T{T} H{H}: {type(e).__name__}: "
                                     f"{str(e)[:300]}")
            log(f"ours {name} failed:", str(e)[:200])
        save()
log(f"done: {len(RESULTS['cases'])} cases, {len(RESULTS['errors'])} errors")
