"""MLA decode sweep (one device call): copy bandwidth, a few GPU correctness checks, then a few
kernel configurations x (16 heads; B 1 / 16 / 64; 32K / 128K; bf16 and fp8 cache).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mla_decode.py   # on the H200
    (about 150 s: give the device call timeout_s 300. MLA_BENCH_BUDGET_S (default 140) stops
    starting new cases once that many seconds have passed since the start; the JSON lists the
    cases it skipped. MLA_BENCH_SHAPES="16x131072,1x32768" runs only those B x ctx shapes and
    MLA_BENCH_CHECKS="0,3" runs only those checks (indices into CHECKS);
    MLA_BENCH_SKIP_CHECKS=1 leaves out the correctness checks, for a second call.)
    MLA_BENCH_DRY=1 ...     tiny interpret-mode run on CPU (checks the script, no timings)
    MLA_BENCH_LOWER=1 ...   lower every swept (shape, config) for CUDA on CPU through
                            kernels_pallas/gpu_lowering.py (Pallas -> Triton IR with an H200 gpu_info)
    Results and their reading: benchmarks/results_mla.md.

1. Copy bandwidth of this GPU, in this run: torch `dst.copy_(src)` (2 GiB bf16, CUDA events, in a
   subprocess before JAX takes the GPU) and a JAX elementwise copy (x * 2); bytes = read + written.
2. Correctness on the GPU: the new default configs and each variant (page / token loads, fp8
   mixed / tile / operand upcasts, per-token and per-tensor scales, Tq 4, ragged lengths, 12
   heads) against the fp32 plain-JAX reference.
3. The sweep. Configs (CONFIGS below): "old" is the 2026-11-29 kernel (token load, "fill"
   splits, fp8 "operand" upcast, block_k 64, 4 warps, 2 stages); "default" is default_config;
   the rest are alternatives that compile for sm_90 without spilling much. Bytes = cache bytes
   read (B x L x 576 x itemsize, + 4 B a token for the fp8 per-token scale); time = the GPU
   time of the whole op (the Pallas kernel, the split merge, the q cast), summed from the
   profiler's kernel durations (benchmarks/kernel_timer.py; the host's launches, which bound
   every batch-1 row of 2026-11-29, are not in it: the wall clock of the old method is kept as
   wall_us), each call running n_inner (2-4) decodes over different page tables of one 9.7 GB
   page pool (page size 64, pages shuffled), so no case is served from L2. Then 12 heads (one
   TP8 rank, padded to 16 rows) and 128 heads at a few shapes.
   MLA_BENCH_CONFIGS="bf16:default,fp8:tile-f16" keeps only the named configurations;
   MLA_BENCH_EXTRA="bf16:p16:partials=bfloat16;bf16:sp66:num_splits=66" adds configurations
   (dtype:name:key=value,...; ints where they parse). The head-count rows: MLA_BENCH_HEADS=
   "16x32768x128,1x131072x96" (B x ctx x heads) and MLA_BENCH_HEAD_CONFIGS="default,bk64s2"
   (names from CONFIGS; default "default,mixed-bf16"); MLA_BENCH_SHAPE_CONFIGS="default,p16": the
   names the 16-head shapes run (default: all).
   Each case also reports the rate of a JAX copy moving the same bytes (profiler time, as for
   the decode): at B1 a decode reads 19-76 MB, where a copy too pays launch and fill. JAX's
   x * 2 is slower than torch's copy at every size, so that ratio flatters the decode.
Writes $OUT/bench_mla.json after every case and $OUT/bench_mla.log; prints a table last
(% of the torch copy bandwidth; best config per shape).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

DRY = os.environ.get("MLA_BENCH_DRY") == "1"
LOWER = os.environ.get("MLA_BENCH_LOWER") == "1"
OUT = os.environ.get("OUT", "/tmp/bench_mla_out")
os.makedirs(OUT, exist_ok=True)
T_START = time.time()
BUDGET_S = float(os.environ.get("MLA_BENCH_BUDGET_S", "140"))
LOG = open(os.path.join(OUT, "bench_mla.log"), "w")

PAGE = 64
HEADS = 16
SCALE = 1.0 / math.sqrt(192.0)
SHAPES = [(16, 32768), (64, 131072), (1, 131072), (64, 32768), (16, 131072), (1, 32768),
          (1, 4096), (16, 4096), (64, 4096)]
if DRY:
    SHAPES = [(2, 512), (1, 1024)]
if os.environ.get("MLA_BENCH_SHAPES"):     # e.g. "16x131072,1x32768": only these (B x ctx)
    SHAPES = [tuple(int(v) for v in s.split("x"))
              for s in os.environ["MLA_BENCH_SHAPES"].split(",")]
SKIP_CHECKS = os.environ.get("MLA_BENCH_SKIP_CHECKS") == "1"
# "fp8w": the fp8 cache in the words form (uint16 [..., 288], the same bytes; kernels_pallas.mla
# fp8_to_words), read by the "words" upcasts
DTYPES = ("bf16", "fp8", "fp8w")
_OLD = dict(block_k=64, num_warps=4, num_stages=2, load="token", num_splits="fill",
            fp8_upcast="operand")
CONFIGS = {
    "bf16": {
        "default": {},
        "xla-merge": dict(merge="xla"),
        "bk32w4s3": dict(block_k=32, num_warps=4, num_stages=3),
    },
    "fp8": {
        "default": {},
        "mixed-bf16": dict(fp8_upcast="mixed", fp8_dot="bf16"),
        "op-f16-bk64s2": dict(num_stages=2),
        "op-f16-bk32w8s2": dict(block_k=32, num_warps=8, num_stages=2),
        "tile-f16-s1": dict(fp8_upcast="tile", num_stages=1),
    },
    "fp8w": {
        "default": {},
        "int": dict(fp8_upcast="words_int"),
        "pairs": dict(fp8_upcast="words_pairs"),
        "w8": dict(num_warps=8),
        "s4": dict(num_stages=4),
        "bk32s4": dict(block_k=32, num_stages=4),
    },
}
CACHE_WIDTH = {"bf16": 576, "fp8": 576, "fp8w": 288}


def _parse_value(v):
    try:
        return int(v)
    except ValueError:
        return v


for _item in filter(None, os.environ.get("MLA_BENCH_EXTRA", "").split(";")):
    _dt, _name, _kv = _item.split(":")
    CONFIGS[_dt][_name] = {k: _parse_value(v) for k, v in
                           (kv.split("=") for kv in _kv.split(",") if kv)}
if os.environ.get("MLA_BENCH_CONFIGS"):    # e.g. "bf16:default,fp8:default": only these
    _keep = {tuple(c.split(":")) for c in os.environ["MLA_BENCH_CONFIGS"].split(",")}
    CONFIGS = {dt: {n: c for n, c in cs.items() if (dt, n) in _keep} for dt, cs in CONFIGS.items()}


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


DEVICE_NAME, TORCH_BW = (None, None) if (DRY or LOWER) else torch_copy_bw()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)
# Load kernels_pallas.mla without running kernels_pallas/__init__.py (which imports the other
# kernel families): this benchmark then does not depend on their state.
_pkg = types.ModuleType("kernels_pallas")
_pkg.__path__ = [os.path.join(_ROOT, "kernels_pallas")]
sys.modules.setdefault("kernels_pallas", _pkg)
from kernels_pallas.mla import fp8_to_words, mla_decode, mla_decode_reference  # noqa: E402
from kernels_pallas.mla.decode import resolve_config, smem_bytes  # noqa: E402
from kernel_timer import kernel_times  # noqa: E402

BACKEND = "interpret" if DRY else "pallas"
F8 = jnp.float8_e4m3fn
CACHE_DTYPE = {"bf16": jnp.bfloat16, "fp8": F8, "fp8w": jnp.uint16}


def shape_structs(B, ctx, dtype, pool_pages):
    q = jax.ShapeDtypeStruct((B, 1, HEADS, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((pool_pages, PAGE, CACHE_WIDTH[dtype]), CACHE_DTYPE[dtype])
    pt = jax.ShapeDtypeStruct((B, ctx // PAGE), jnp.int32)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    cs = None if dtype == "bf16" else jax.ShapeDtypeStruct((pool_pages, PAGE), jnp.float32)
    return q, cache, pt, ln, cs


POOL_TOKENS = 4096 if DRY else 64 * 131072       # 8.4M tokens: 9.7 GB bf16, 4.8 GB fp8
POOL_PAGES = POOL_TOKENS // PAGE


def full_cfg(B, ctx, dtype, cfg, heads=HEADS):
    kw = {k: v for k, v in cfg.items() if k not in ("merge", "partials")}
    # partials: mla_decode's default for the bench's bf16 output
    return dict(resolve_config((B, 1, heads, 576), (POOL_PAGES, PAGE, CACHE_WIDTH[dtype]),
                               CACHE_DTYPE[dtype], (B, ctx // PAGE), **kw),
                merge=cfg.get("merge", "pallas"), partials=cfg.get("partials", "bfloat16"))


# ---------------------------------------------------------------- lowering check (CPU)
if LOWER:
    from kernels_pallas.gpu_lowering import lower_for_gpu  # noqa: E402

    n_ok = n_bad = 0
    for dtype in DTYPES:
        for B, ctx in SHAPES:
            for name, cfg in CONFIGS[dtype].items():
                q, cache, pt, ln, cs = shape_structs(B, ctx, dtype, POOL_PAGES)
                fc = full_cfg(B, ctx, dtype, cfg)
                try:
                    if cs is None:
                        lower_for_gpu(lambda q, c, p, l: mla_decode(
                            q, c, p, l, scale=SCALE, backend="pallas", **cfg), q, cache, pt, ln)
                    else:
                        lower_for_gpu(lambda q, c, p, l, s: mla_decode(
                            q, c, p, l, scale=SCALE, backend="pallas", cache_scale=s, **cfg),
                            q, cache, pt, ln, cs)
                    n_ok += 1
                    res = "OK"
                except Exception as e:  # noqa: BLE001
                    n_bad += 1
                    res = f"FAIL {type(e).__name__}: {str(e)[:300]}"
                smem = smem_bytes(fc["block_h"], fc["block_k"], fc["num_stages"],
                                  1 if dtype != "bf16" else 2, fc["fp8_upcast"])
                log(f"lower {dtype} B{B} {ctx // 1024}K {name:12s} {fc} smem~{smem // 1024}KiB: "
                    f"{res}")
    log(f"lowering: {n_ok} OK, {n_bad} failed")
    sys.exit(1 if n_bad else 0)


RESULTS = {"device": DEVICE_NAME or str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "torch_copy_Bps": TORCH_BW, "configs": CONFIGS, "correctness": [], "cases": [],
           "errors": [], "skipped": []}


def save():
    with open(os.path.join(OUT, "bench_mla.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def wall(fn, *args, reps=3, back_to_back=1, info=None):
    """Median over `reps` of the time per call of `back_to_back` calls issued without waiting
    (the host dispatch of one call overlaps the device work of the one before). info, a dict,
    gets the first call's time (compile included) as "first_call_s"."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    if info is not None:
        info["first_call_s"] = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(back_to_back)]
        jax.block_until_ready(outs)
        ts.append((time.perf_counter() - t0) / back_to_back)
    return statistics.median(ts)


def jax_copy_bw():
    n = 1 << (20 if DRY else 30)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    t = wall(jax.jit(lambda a: a * 2), x, reps=10)
    del x
    return 2 * n * 2 / t


JAX_BW = jax_copy_bw()
COPY_BW = TORCH_BW or JAX_BW
RESULTS.update(jax_copy_Bps=JAX_BW, copy_Bps_used=COPY_BW)
save()
log(f"device {RESULTS['device']}  jax {jax.__version__}  copy bandwidth: torch "
    f"{(TORCH_BW or 0) / 1e12:.2f} TB/s, jax x*2 {JAX_BW / 1e12:.2f} TB/s  "
    f"(fractions below are of {COPY_BW / 1e12:.2f} TB/s)")


def safe(fn, *a, **k):
    try:
        return fn(*a, **k)
    except Exception as e:  # noqa: BLE001
        msg = f"{fn.__name__}{a}{k}: {type(e).__name__}: {str(e)[:400]}"
        RESULTS["errors"].append(msg)
        log("ERROR", msg)
        save()
        return None


# ---------------------------------------------------------------- correctness
def correctness(B, Tq, H, lengths, dtype, scale_kind, cfg, seed, page=PAGE):
    rng = np.random.default_rng(seed)
    maxp = -(-max(lengths) // page) + 1
    num_pages = B * maxp + 5
    pt = jnp.asarray(rng.permutation(num_pages)[: B * maxp].reshape(B, maxp), jnp.int32)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    c32 = jax.random.normal(k1, (num_pages, page, 576), jnp.float32)
    cs = None
    if dtype == "bf16":
        cache = c32.astype(jnp.bfloat16)
    elif scale_kind == "token":      # |c / s| stays below e4m3's 448
        cs = jax.random.uniform(k3, (num_pages, page), jnp.float32, 0.02, 0.05)
        cache = (c32 / cs[..., None]).astype(F8)
    else:
        cs = jnp.float32(0.02)
        cache = (c32 / cs).astype(F8)
    if dtype == "fp8w":
        cache = fp8_to_words(cache)
    q = jax.random.normal(k2, (B, Tq, H, 576), jnp.float32).astype(jnp.bfloat16)
    ln = jnp.asarray(lengths, jnp.int32)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, cache_scale=cs, backend=BACKEND,
                        out_dtype=jnp.float32, **cfg)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    o, lse, ro, rlse = (np.asarray(x) for x in (o, lse, ro, rlse))
    fin = np.isfinite(rlse)
    rel = float(np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30))
    lse_err = float(np.max(np.abs(lse[fin] - rlse[fin]), initial=0))
    ok = (np.all(np.isfinite(o)) and np.array_equal(np.isneginf(lse), np.isneginf(rlse))
          and np.all(o[~fin] == 0) and rel < 1e-2 and lse_err < 1e-2)
    RESULTS["correctness"].append(dict(B=B, Tq=Tq, H=H, lengths=lengths, dtype=dtype,
                                       scale=scale_kind, page=page, cfg=cfg, rel_err=rel,
                                       lse_max_err=lse_err, ok=bool(ok)))
    save()
    log(f"check B{B} Tq{Tq} H{H} page{page} {dtype}/{scale_kind} {cfg}: rel {rel:.2e} "
        f"lse {lse_err:.1e} -> {'OK' if ok else 'FAIL'}")
    return ok


def _short(n):
    return min(n, 300) if DRY else n


CHECKS = [   # (B, Tq, H, lengths, dtype, scale kind, cfg, page size)
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, {}, PAGE),
    (4, 4, 16, [2, 4097, 64, 65], "bf16", None, {}, PAGE),
    (3, 1, 12, [5000, 129, 63], "bf16", None, dict(load="token"), 16),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8", "token", {}, PAGE),
    (2, 4, 16, [2000, 100], "fp8", "tensor", dict(fp8_upcast="tile", block_k=32,
                                                  num_stages=4), PAGE),
    (2, 1, 16, [2000, 100], "fp8", "token", _OLD, PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8", "token", dict(fp8_dot="fp16"), PAGE),
    (2, 4, 16, [2000, 100], "fp8", "tensor", dict(fp8_upcast="tile", fp8_dot="fp16"), PAGE),
    (3, 1, 12, [5000, 129, 63], "fp8", "token", dict(fp8_upcast="operand", fp8_dot="fp16"), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, dict(partials="bfloat16"), PAGE),
    (2, 1, 128, [5000, 77], "bf16", None, dict(block_k=64, num_stages=2), PAGE),
    (2, 1, 96, [5000, 77], "bf16", None, dict(block_h=32, block_k=64, num_warps=8,
                                                num_stages=3), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8w", "token", {}, PAGE),
    (2, 4, 16, [2000, 100], "fp8w", "tensor", dict(fp8_upcast="words_int"), PAGE),
    (3, 1, 12, [5000, 129, 63], "fp8w", "token", dict(load="token"), 16),
    (2, 1, 16, [5000, 77], "fp8w", "token", dict(num_warps=8, fp8_upcast="words_int"), PAGE),
    (2, 4, 16, [3001, 64], "fp8w", "token", dict(num_stages=4), PAGE),
    (2, 1, 128, [5000, 77], "fp8w", "token", {}, PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8w", "token", dict(fp8_upcast="words_pairs"), PAGE),
    (2, 4, 12, [3001, 64], "fp8w", "tensor", dict(fp8_upcast="words_pairs"), PAGE),
    (3, 1, 12, [5000, 129, 63], "fp8w", "token", dict(fp8_upcast="words_pairs", load="token"),
     16),
    (2, 1, 128, [5000, 77], "fp8w", "token", dict(fp8_upcast="words_pairs"), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8w", "token", dict(fp8_upcast="words_pairs", lat_chunks=2),
     PAGE),
    (2, 4, 12, [3001, 64], "fp8w", "tensor", dict(fp8_upcast="words_pairs", lat_chunks=4), PAGE),
    (2, 1, 128, [5000, 77], "fp8w", "token", dict(fp8_upcast="words_pairs", lat_chunks=2), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, dict(lat_chunks=2), PAGE),
    (2, 4, 12, [3001, 64], "bf16", None, dict(lat_chunks=4, load="token"), 16),
    (2, 1, 128, [5000, 77], "bf16", None, dict(lat_chunks=2), PAGE),
    # 64-row fp8 words blocks that spill less than the default's 376 bytes (offline, sm_90)
    (2, 1, 128, [5000, 77], "fp8w", "token", dict(block_k=16, num_stages=3), PAGE),
    (2, 4, 24, [3001, 64], "fp8w", "tensor", dict(block_k=64, num_stages=1), PAGE),
    (2, 4, 16, [3001, 64], "fp8w", "token", {}, PAGE),    # 64 rows at the default ("words")
]
# MLA_BENCH_CHECKS="0,3": only these checks (indices into CHECKS)
_CHECK_IDS = os.environ.get("MLA_BENCH_CHECKS")
for i, (B, Tq, H, lens, dt, sk, cfg, pg) in enumerate([] if SKIP_CHECKS else CHECKS):
    if _CHECK_IDS and str(i) not in _CHECK_IDS.split(","):
        continue
    safe(correctness, B, Tq, H, [_short(n) for n in lens], dt, sk, cfg, seed=100 + i, page=pg)

# ---------------------------------------------------------------- timing
_pool = {}


def pool(dtype):
    if dtype not in _pool:
        k = jax.random.key(7)
        if dtype == "bf16":
            _pool[dtype] = (jax.random.normal(k, (POOL_PAGES, PAGE, 576), jnp.bfloat16), None)
        else:
            p8 = jax.jit(lambda k: jax.random.normal(k, (POOL_PAGES, PAGE, 576), jnp.bfloat16)
                         .astype(F8))(k)
            cs = jax.random.uniform(k, (POOL_PAGES, PAGE), jnp.float32, 0.01, 0.03)
            _pool[dtype] = (p8, cs)
            if dtype == "fp8w":
                _pool[dtype] = (fp8_to_words(pool("fp8")[0]), pool("fp8")[1])
    return _pool[dtype]


PERM = np.random.default_rng(0).permutation(POOL_PAGES).astype(np.int32)


_SAME_SIZE_BW = {}


def same_size_copy_bw(nbytes):
    """GPU time (profiler) of a JAX elementwise copy moving `nbytes` in all (read + written), as
    bytes/s: the copy rate at the decode's own size, where launch and fill are not amortised (a
    B1 32K decode reads 38 MB; the main anchor above moves 4 GiB). None on CPU."""
    if DRY:
        return None
    if nbytes not in _SAME_SIZE_BW:
        n = max(1024, nbytes // 4)
        x = jax.random.normal(jax.random.key(5), (n,), jnp.bfloat16)
        kt = kernel_times(jax.jit(lambda a: a * 2), x, reps=10)
        _SAME_SIZE_BW[nbytes] = None if kt is None else 4 * n / (kt["total_us"] * 1e-6)
    return _SAME_SIZE_BW[nbytes]


def time_decode(B, ctx, dtype, name, cfg, heads=HEADS):
    pages = B * (ctx // PAGE)
    cache, cs = pool(dtype)
    itemsize = 1 if dtype != "bf16" else 2
    bytes_read = B * ctx * (576 * itemsize + (4 if dtype != "bf16" else 0))
    R = max(1, min(8, POOL_PAGES // pages))                     # distinct page tables
    # decodes per timed call: ~0.5 ms of work at 3 TB/s, 2 to 4 (each is one more kernel to
    # compile); five calls are issued back to back, so the dispatch is hidden too
    n_inner = 2 if DRY else int(min(4, max(2, math.ceil(5e-4 * 3e12 / bytes_read))))
    pts = tuple(jnp.asarray(PERM[(r * pages) % (POOL_PAGES - pages + 1):][:pages]
                            .reshape(B, ctx // PAGE)) for r in range(R))
    lens = jnp.full((B,), ctx, jnp.int32)
    # A different q for every inner call: identical calls would be merged by XLA's CSE.
    # Separate q and page-table arrays, not slices of stacked ones: a slice fed to the custom
    # call is a device copy of its own (~2.5 us at B1, 2026-11-30) that a model does not pay.
    qs = tuple(jax.random.normal(jax.random.key(1 + i), (B, 1, heads, 576), jnp.bfloat16)
               for i in range(n_inner))

    @jax.jit
    def run(qs, cache, pts, lens, cs):
        return [mla_decode(qs[i], cache, pts[i % R], lens, scale=SCALE, cache_scale=cs,
                           backend=BACKEND, **cfg) for i in range(n_inner)]

    info = {}
    t_wall = wall(run, qs, cache, pts, lens, cs, back_to_back=5, info=info) / n_inner
    # GPU time from the profiler: the kernels of one decode (the Pallas kernel + the merge and
    # q cast), without the host's launches; the wall clock is kept beside it.
    kt = None if DRY else kernel_times(run, qs, cache, pts, lens, cs, reps=5)
    if kt is not None:
        t = kt["total_us"] / n_inner / 1e6
        info.update(kernel_us=kt["total_us"] / n_inner,
                    mla_kernel_us=sum(v for k, v in kt["by_kernel"].items()
                                      if "mla_decode" in k) / n_inner,
                    span_us=kt["span_us"] / n_inner, by_kernel=kt["by_kernel"],
                    trace_lines=kt["lines"])
    else:
        t = t_wall
    fc = full_cfg(B, ctx, dtype, cfg, heads)
    same = same_size_copy_bw(bytes_read)
    if same is not None:
        info.update(same_size_copy_Bps=same, frac_same_size_copy=bytes_read / t / same)
    return dict(B=B, ctx=ctx, H=heads, dtype=dtype, name=name, cfg=fc, time_us=t * 1e6,
                wall_us=t_wall * 1e6, bytes=bytes_read, Bps=bytes_read / t,
                frac_copy=bytes_read / t / COPY_BW, n_inner=n_inner, R=R, **info)


def fmt(r):
    c = r["cfg"]
    cs = (f"bh{c['block_h']} bk{c['block_k']} w{c['num_warps']} st{c['num_stages']} "
          f"sp{c['num_splits']} {c['load']} {c['merge']}-merge {c['partials']}"
          + (f" {c['fp8_upcast']} {c['fp8_dot']}" if r["dtype"] != "bf16" else ""))
    same = (f" ({100 * r['frac_same_size_copy']:.1f}% of a same-size copy)"
            if r.get("frac_same_size_copy") else "")
    ker = (f" (kernel {r['mla_kernel_us']:.1f}, span {r['span_us']:.1f}, wall "
           f"{r['wall_us']:.1f} us)" if "mla_kernel_us" in r else "")
    return (f"{r['dtype']:>4} H{r['H']:<3d} B{r['B']:<3d} {r['ctx'] // 1024:>4d}K "
            f"{r['name']:15s} {r['time_us']:9.1f} us {r['Bps'] / 1e12:5.2f} TB/s "
            f"{100 * r['frac_copy']:5.1f}%{same}  [{cs}]{ker}")


_SHAPE_CONFIGS = os.environ.get("MLA_BENCH_SHAPE_CONFIGS")   # names for the main loop only
for B, ctx in SHAPES:
    for dtype in DTYPES:
        for name, cfg in CONFIGS[dtype].items():
            if _SHAPE_CONFIGS is not None and name not in _SHAPE_CONFIGS.split(","):
                continue
            if elapsed() > BUDGET_S:
                RESULTS["skipped"].append(dict(B=B, ctx=ctx, dtype=dtype, name=name))
                continue
            r = safe(time_decode, B, ctx, dtype, name, cfg)
            if r is not None:
                RESULTS["cases"].append(r)
                save()
                log("case", fmt(r), f"(first call {r['first_call_s']:.1f} s)")

# Head counts: 12 (one TP8 rank, padded to 16 rows) and 128 (all of K3's heads on one GPU,
# compute-bound: TFLOP/s in the JSON), default configs.
# (left out when MLA_BENCH_SHAPES names the shapes)
_HEAD_SHAPES = [(16, 32768, 12), (16, 32768, 128), (64, 32768, 128), (1, 131072, 128)]
if os.environ.get("MLA_BENCH_HEADS") is not None:
    _HEAD_SHAPES = [tuple(int(v) for v in s.split("x"))
                    for s in os.environ["MLA_BENCH_HEADS"].split(",") if s]
elif DRY or os.environ.get("MLA_BENCH_SHAPES"):
    _HEAD_SHAPES = []
_HEAD_CONFIGS = os.environ.get("MLA_BENCH_HEAD_CONFIGS", "default,mixed-bf16").split(",")
for B, ctx, heads in _HEAD_SHAPES:
    for dtype, name in [(dt, n) for dt in DTYPES for n in _HEAD_CONFIGS if n in CONFIGS[dt]]:
        if elapsed() > BUDGET_S:
            RESULTS["skipped"].append(dict(B=B, ctx=ctx, dtype=dtype, name=name, H=heads))
            continue
        r = safe(time_decode, B, ctx, dtype, name, CONFIGS[dtype][name], heads=heads)
        if r is not None:
            r["tflops"] = B * heads * ctx * (576 + 512) * 2 / (r["time_us"] * 1e-6) / 1e12
            RESULTS["cases"].append(r)
            save()
            log("case", fmt(r), f"{r['tflops']:.0f} TFLOP/s")

# ---------------------------------------------------------------- summary
RESULTS["elapsed_s"] = elapsed()
save()
log("\n==== % of copy bandwidth "
    f"({COPY_BW / 1e12:.2f} TB/s {'torch' if TORCH_BW else 'jax'} copy; jax x*2 "
    f"{JAX_BW / 1e12:.2f} TB/s) ====")
log(f"checks {sum(r['ok'] for r in RESULTS['correctness'])}/{len(RESULTS['correctness'])} OK; "
    f"errors {len(RESULTS['errors'])}; skipped cases {len(RESULTS['skipped'])}; "
    f"elapsed {elapsed():.0f} s")
for dtype in DTYPES:
    names = list(CONFIGS[dtype])
    log(f"{dtype:>4} {'shape':10s} " + " ".join(f"{n:>13s}" for n in names) + "   best (TB/s)")
    for B, ctx in SHAPES:
        rows = {r["name"]: r for r in RESULTS["cases"]
                if (r["B"], r["ctx"], r["dtype"], r["H"]) == (B, ctx, dtype, HEADS)}
        if not rows:
            continue
        cells = " ".join(f"{100 * rows[n]['frac_copy']:12.1f}%" if n in rows else f"{'-':>13s}"
                         for n in names)
        best = min(rows.values(), key=lambda r: r["time_us"])
        log(f"{dtype:>4} B{B:<3d}{ctx // 1024:>4d}K  {cells}   {best['name']} "
            f"({best['Bps'] / 1e12:.2f})")
