"""MLA decode benchmark (one device call): correctness on the GPU, then achieved cache bandwidth.

    python3 benchmarks/bench_mla_decode.py            # on the GPU machine; writes under $OUT
    (about 150-300 s on an H200: give the device call timeout_s 400; MLA_BENCH_BUDGET_S gates
    the later sections; MLA_BENCH_DRY=1 runs a tiny interpret-mode version on CPU.)
    Results and their reading: benchmarks/results_mla.md.

1. Copy bandwidth of this GPU, measured in this run: torch `dst.copy_(src)` (2 GiB bf16, CUDA
   events, in a subprocess before JAX takes the GPU) and a JAX elementwise copy (x * 2).
   Bytes = read + written.
2. Correctness: the Pallas kernel vs the plain-JAX reference (fp32, HIGHEST) on ragged batches,
   16 / 128 / 12 heads, 1 and 4 query tokens, bf16 and fp8 (per-token and per-tensor scale).
3. A short sweep of block configurations at 32K context (16 and 128 heads), then the grid:
   contexts 4K, 32K, 128K x batch 1, 16, 64 x 16 and 128 query heads, bf16 cache, each with the
   best swept configuration for its head count; fp8 at two points; the head-padding effect.
   Achieved bandwidth = cache bytes read (B x L x 576 x itemsize, + 4 B per token for per-token
   fp8 scales) / time of the whole op (kernel + split merge). Each timed call runs several
   decodes over different page tables of one large page pool so small cases do not sit in L2.
Prints a short table last; full results in $OUT/bench_mla.json and the log in $OUT/bench_mla.log.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

OUT = os.environ.get("OUT", "/tmp/bench_mla_out")
os.makedirs(OUT, exist_ok=True)
T_START = time.time()
BUDGET_S = float(os.environ.get("MLA_BENCH_BUDGET_S", "300"))
LOG = open(os.path.join(OUT, "bench_mla.log"), "w")


def log(*a):
    s = f"[{time.time() - T_START:5.0f}s] " + " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def elapsed():
    return time.time() - T_START


TORCH_COPY = r"""
import torch, statistics
n = 1 << 30                                   # 2 GiB of bf16
src = torch.randn(n, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
for _ in range(3): dst.copy_(src)
ts = []
for _ in range(20):
    a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 1e3)
t = statistics.median(ts)
print(torch.cuda.get_device_name(0), 2 * n * 2 / t)
"""


def torch_copy_bw():
    try:
        r = subprocess.run([sys.executable, "-c", TORCH_COPY], capture_output=True, text=True,
                           timeout=90)
        name, bw = r.stdout.strip().splitlines()[-1].rsplit(" ", 1)
        return name, float(bw)
    except Exception as e:  # noqa: BLE001
        log("torch copy failed:", repr(e)[:200])
        return None, None


DEVICE_NAME, TORCH_BW = torch_copy_bw()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
# Load kernels_pallas.mla without running kernels_pallas/__init__.py (which imports the other
# kernel families): this benchmark then does not depend on their state.
import types  # noqa: E402

_pkg = types.ModuleType("kernels_pallas")
_pkg.__path__ = [os.path.join(_ROOT, "kernels_pallas")]
sys.modules.setdefault("kernels_pallas", _pkg)
from kernels_pallas.mla import mla_decode, mla_decode_reference  # noqa: E402
from kernels_pallas.mla.decode import default_config  # noqa: E402

PAGE = 64
# MLA_BENCH_DRY=1: a tiny CPU dry run of the whole script in interpret mode (no GPU numbers).
DRY = os.environ.get("MLA_BENCH_DRY") == "1"
BACKEND = "interpret" if DRY else "pallas"
CTXS = (256, 512, 1024) if DRY else (4096, 32768, 131072)
BATCHES = (1, 2, 3) if DRY else (1, 16, 64)
SW_B, SW_CTX = (2, 512) if DRY else (16, 32768)
SCALE = 1.0 / math.sqrt(192.0)
RESULTS = {"device": DEVICE_NAME or str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "torch_copy_Bps": TORCH_BW, "correctness": [], "sweep": [], "grid": [], "fp8": [],
           "padding": [], "errors": []}


def wall(fn, *args, reps=7):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def jax_copy_bw():
    n = 1 << (20 if os.environ.get("MLA_BENCH_DRY") == "1" else 30)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 2)
    t = wall(f, x, reps=20)
    del x
    return 2 * n * 2 / t


JAX_BW = jax_copy_bw()
COPY_BW = TORCH_BW or JAX_BW
RESULTS["jax_copy_Bps"] = JAX_BW
RESULTS["copy_Bps_used"] = COPY_BW
log(f"device {RESULTS['device']}  jax {jax.__version__}  copy bandwidth: torch "
    f"{(TORCH_BW or 0) / 1e12:.2f} TB/s, jax x*2 {JAX_BW / 1e12:.2f} TB/s  "
    f"(fractions below are of {COPY_BW / 1e12:.2f} TB/s)")


# ---------------------------------------------------------------- correctness
def correctness(B, Tq, H, lengths, dtype, scale_kind, cfg, seed):
    rng = np.random.default_rng(seed)
    maxp = -(-max(lengths) // PAGE) + 1
    num_pages = B * maxp + 5
    pt = jnp.asarray(rng.permutation(num_pages)[: B * maxp].reshape(B, maxp), jnp.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    c32 = jax.random.normal(k1, (num_pages, PAGE, 576), jnp.float32)
    cs = None
    if dtype == "bf16":
        cache = c32.astype(jnp.bfloat16)
    else:
        if scale_kind == "token":
            cs = jax.random.uniform(k3, (num_pages, PAGE), jnp.float32, 0.02, 0.05)
            cache = (c32 / cs[..., None]).astype(jnp.float8_e4m3fn)
        else:
            cs = jnp.float32(0.02)
            cache = (c32 / cs).astype(jnp.float8_e4m3fn)
    q = jax.random.normal(k2, (B, Tq, H, 576), jnp.float32).astype(jnp.bfloat16)
    ln = jnp.asarray(lengths, jnp.int32)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, cache_scale=cs, backend=BACKEND,
                        out_dtype=jnp.float32, **cfg)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    o, lse, ro, rlse = (np.asarray(x) for x in (o, lse, ro, rlse))
    fin = np.isfinite(rlse)
    rel = float(np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30))
    ok = (np.all(np.isfinite(o)) and np.array_equal(np.isneginf(lse), np.isneginf(rlse))
          and np.all(o[~fin] == 0) and rel < 1e-2
          and float(np.max(np.abs(lse[fin] - rlse[fin]), initial=0)) < 1e-2)
    row = dict(B=B, Tq=Tq, H=H, lengths=lengths, dtype=dtype, scale=scale_kind, cfg=cfg,
               rel_err=rel, max_abs_err=float(np.max(np.abs(o - ro))),
               lse_max_err=float(np.max(np.abs(lse[fin] - rlse[fin]), initial=0)), ok=bool(ok))
    RESULTS["correctness"].append(row)
    log(f"check B{B} Tq{Tq} H{H} {dtype}/{scale_kind} {cfg}: rel {rel:.2e} "
        f"lse {row['lse_max_err']:.1e} -> {'OK' if ok else 'FAIL'}")
    return ok


def safe(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # noqa: BLE001
        msg = f"{fn.__name__}{a}{k}: {type(e).__name__}: {str(e)[:400]}"
        RESULTS["errors"].append(msg)
        log("ERROR", msg)
        return None


CHECKS = [
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, {}),
    (4, 4, 16, [2, 4097, 64, 65], "bf16", None, {}),
    (3, 1, 12, [5000, 129, 63], "bf16", None, {}),
    (2, 1, 128, [4100, 777], "bf16", None, {}),
    (2, 4, 12, [3000, 3], "bf16", None, dict(block_h=16)),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8", "token", {}),
    (2, 1, 16, [2000, 100], "fp8", "tensor", {}),
]
for i, c in enumerate(CHECKS):
    if DRY:
        c = (*c[:3], [min(n, 300) for n in c[3]], *c[4:])
    safe(correctness, *c, seed=100 + i)

# ---------------------------------------------------------------- timing setup
POOL_TOKENS = 4096 if DRY else 64 * 131072       # 8.4M tokens: 9.7 GB bf16, 4.8 GB fp8
POOL_PAGES = POOL_TOKENS // PAGE
_pool = {}


def pool(dtype):
    if dtype not in _pool:
        k = jax.random.key(7)
        if dtype == "bf16":
            _pool[dtype] = (jax.random.normal(k, (POOL_PAGES, PAGE, 576), jnp.bfloat16), None)
        else:
            p8 = jax.jit(lambda k: jax.random.normal(k, (POOL_PAGES, PAGE, 576), jnp.bfloat16)
                         .astype(jnp.float8_e4m3fn))(k)
            cs = jax.random.uniform(k, (POOL_PAGES, PAGE), jnp.float32, 0.01, 0.03)
            _pool[dtype] = (p8, cs)
    return _pool[dtype]


PERM = np.random.default_rng(0).permutation(POOL_PAGES).astype(np.int32)


def time_decode(B, ctx, H, Tq=1, dtype="bf16", scale_kind="token", cfg=None, reference=False):
    cfg = dict(cfg or {})
    pages = B * (ctx // PAGE)
    if pages > POOL_PAGES:
        raise MemoryError("does not fit the pool")
    cache, cs = pool(dtype)
    if dtype == "fp8" and scale_kind == "tensor":
        cs = jnp.float32(0.02)
    itemsize = 1 if dtype == "fp8" else 2
    bytes_read = B * ctx * (576 * itemsize + (4 if (dtype == "fp8" and scale_kind == "token")
                                              else 0))
    R = max(1, min(16, POOL_PAGES // pages))                    # distinct page tables
    n_inner = max(R, 32 if bytes_read < 64e6 else (8 if bytes_read < 1e9 else 2))
    pts = jnp.asarray(np.stack([PERM[(r * pages) % (POOL_PAGES - pages + 1):][:pages]
                                for r in range(R)]).reshape(R, B, ctx // PAGE))
    lens = jnp.full((B,), ctx, jnp.int32)
    # A different q for every inner call: identical calls would be merged by XLA's CSE (seen on
    # the 2026-11-29 run, where R = 1 made the two inner calls identical and halved the time).
    qs = jax.random.normal(jax.random.key(1), (n_inner, B, Tq, H, 576), jnp.bfloat16)

    if reference:
        def one(q, cache, pt, lens, cs):
            return mla_decode_reference(q, cache, pt, lens, scale=SCALE, cache_scale=cs,
                                        out_dtype=jnp.bfloat16)
    else:
        def one(q, cache, pt, lens, cs):
            return mla_decode(q, cache, pt, lens, scale=SCALE, cache_scale=cs, backend=BACKEND,
                              **cfg)

    @jax.jit
    def run(qs, cache, pts, lens, cs):
        return [one(qs[i], cache, pts[i % R], lens, cs) for i in range(n_inner)]

    t = wall(run, qs, cache, pts, lens, cs, reps=5) / n_inner
    full_cfg = default_config(B, Tq * H, ctx, None)
    full_cfg.update(cfg)
    flops = 2.0 * B * Tq * H * ctx * (576 + 512)
    row = dict(B=B, ctx=ctx, H=H, Tq=Tq, dtype=dtype,
               scale=scale_kind if dtype == "fp8" else None,
               cfg=None if reference else full_cfg, impl="xla-reference" if reference else "pallas",
               time_us=t * 1e6, bytes=bytes_read, Bps=bytes_read / t,
               frac_copy=bytes_read / t / COPY_BW, tflops=flops / t / 1e12, n_inner=n_inner, R=R)
    return row


def fmt(r):
    c = r["cfg"] or {}
    cs = (f"bh{c.get('block_h')} bk{c.get('block_k')} w{c.get('num_warps')} "
          f"st{c.get('num_stages')} sp{c.get('num_splits')}") if c else r["impl"]
    return (f"{r['dtype']:>4} B{r['B']:<3d} ctx{r['ctx'] // 1024:>4d}K H{r['H']:<4d} Tq{r['Tq']} "
            f"{r['time_us']:9.1f} us  {r['Bps'] / 1e12:5.2f} TB/s  {100 * r['frac_copy']:5.1f}%  "
            f"{r['tflops']:6.1f} TFLOP/s  [{cs}]")


def record(section, row):
    if row is not None:
        RESULTS[section].append(row)
        log(f"{section:8s}", fmt(row))
        with open(os.path.join(OUT, "bench_mla.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


# ---------------------------------------------------------------- sweep
SWEEP = {
    16: [dict(block_h=16, block_k=64, num_warps=4, num_stages=2),
         dict(block_h=16, block_k=32, num_warps=4, num_stages=3),
         dict(block_h=16, block_k=128, num_warps=4, num_stages=1),
         dict(block_h=16, block_k=64, num_warps=8, num_stages=2)],
    128: [dict(block_h=64, block_k=32, num_warps=8, num_stages=2),
          dict(block_h=32, block_k=32, num_warps=4, num_stages=2),
          dict(block_h=64, block_k=64, num_warps=8, num_stages=2),
          dict(block_h=32, block_k=64, num_warps=4, num_stages=2)],
}
best = {}
for H, cfgs in SWEEP.items():
    rows = []
    for cfg in cfgs:
        if elapsed() > BUDGET_S * 0.55:
            break
        r = safe(time_decode, SW_B, SW_CTX, H, cfg=cfg)
        record("sweep", r)
        if r:
            rows.append(r)
    if rows:
        best[H] = min(rows, key=lambda r: r["time_us"])["cfg"]
        best[H] = {k: best[H][k] for k in ("block_h", "block_k", "num_warps", "num_stages")}
# splits at batch 1
for mult in (0.5, 2.0):
    if elapsed() > BUDGET_S * 0.6 or 16 not in best:
        break
    sp = default_config(1, 16, SW_CTX, None)["num_splits"]
    record("sweep", safe(time_decode, 1, SW_CTX, 16, cfg=dict(best[16],
                                                              num_splits=max(1, int(sp * mult)))))
log("best configs:", best)
for H, cfg in best.items():        # the configs used for timing must pass the check too
    if cfg != {k: default_config(2, H, 8192, None)[k] for k in cfg}:
        safe(correctness, 2, 1, H, [800 if DRY else 8000, 123], "bf16", None, cfg, seed=7)

# ---------------------------------------------------------------- grid
for H in (16, 128):
    for ctx in CTXS:
        for B in BATCHES:
            if elapsed() > BUDGET_S * 0.85:
                break
            record("grid", safe(time_decode, B, ctx, H, cfg=best.get(H)))

# ---------------------------------------------------------------- fp8
for B, ctx, sk in ((SW_B, SW_CTX, "token"), (BATCHES[-1], CTXS[-1], "token"),
                  (SW_B, SW_CTX, "tensor")):
    if elapsed() > BUDGET_S * 0.9:
        break
    record("fp8", safe(time_decode, B, ctx, 16, dtype="fp8", scale_kind=sk, cfg=best.get(16)))

# ---------------------------------------------------------------- head padding
for kw in (dict(H=12), dict(H=16), dict(H=12, Tq=4, cfg=dict(block_h=64, block_k=32,
                                                             num_warps=8, num_stages=2)),
           dict(H=12, Tq=4, cfg=dict(block_h=16, **{k: v for k, v in best.get(16, {}).items()
                                                     if k != "block_h"})),
           dict(H=12, reference=True)):
    if elapsed() > BUDGET_S:
        break
    kw = dict(kw)
    if "cfg" not in kw and not kw.get("reference"):
        kw["cfg"] = best.get(16)
    record("padding", safe(time_decode, SW_B, SW_CTX, **kw))

# ---------------------------------------------------------------- summary
with open(os.path.join(OUT, "bench_mla.json"), "w") as f:
    json.dump(RESULTS, f, indent=1)
log("\n==== summary (fractions of the copy bandwidth measured above) ====")
log(f"copy: torch {(TORCH_BW or 0) / 1e12:.2f} TB/s, jax {JAX_BW / 1e12:.2f} TB/s; "
    f"checks {sum(r['ok'] for r in RESULTS['correctness'])}/{len(RESULTS['correctness'])} OK; "
    f"errors {len(RESULTS['errors'])}; elapsed {elapsed():.0f} s")
for sec in ("grid", "fp8", "padding"):
    for r in RESULTS[sec]:
        log(f"{sec:8s}", fmt(r))
