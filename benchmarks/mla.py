"""MLA decode: GPU time of the absorbed decode over a paged latent cache against the copy
bandwidth, bf16 and fp8 caches (float8 and the words form), after GPU correctness checks.

    python -m benchmarks mla [--shapes 16x32768,64x131072] [--configs bf16:default,fp8w:default]
    python -m benchmarks mla --heads 16x32768x128,1x131072x96 --head-configs default
    python -m benchmarks mla --lower      # CPU: lower every swept (shape, config) for CUDA
    python -m benchmarks mla --smoke      # CPU: interpret mode, tiny shapes, no timings

1. Copy bandwidth in this run: torch `dst.copy_(src)` (2 GiB bf16, CUDA events, in a subprocess
   before JAX takes the GPU) and a JAX elementwise copy (x * 2); bytes = read + written.
2. Correctness on the GPU (CHECKS): the default configs and each variant (page / token loads,
   fp8 upcasts, per-token and per-tensor scales, Tq 4, ragged lengths, 12 / 96 / 128 heads)
   against the fp32 plain-JAX reference.
3. Timing (CONFIGS; `--config dtype:name:k=v,...` adds one): bytes = cache bytes read
   (B x L x 576 x itemsize, + 4 B a token for the fp8 per-token scale); time = the GPU time of
   the whole op (the Pallas kernel, the split merge, the q cast) from the profiler, each call
   running 2-4 decodes over different page tables of one large shuffled page pool, so no case
   is served from L2. Each case also reports the rate of a JAX copy moving the same bytes (at
   B1 a decode reads tens of MB, where a copy too pays launch and fill). Then the head-count
   rows (`--heads`, compute-bound at 96-128 heads: TFLOP/s in the details).
Rows: the default configuration of each cache form, % of the torch copy bandwidth.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla import DecodeConfig, fp8_to_words, mla_decode, mla_decode_reference
from kernels_pallas.mla.tuning import decode_config, smem_bytes
from .common import jax_copy_Bps, names_arg, shapes_arg, torch_copy_Bps_subprocess, wall_ms
from .config_strings import parse_overrides
from .kernel_timer import kernel_times

PAGE = 64
HEADS = 16
SCALE = 1.0 / math.sqrt(192.0)
DTYPES = ("bf16", "fp8", "fp8w")   # "fp8w": the fp8 cache in the words form (uint16 [..., 288])
F8 = jnp.float8_e4m3fn
CACHE_DTYPE = {"bf16": jnp.bfloat16, "fp8": F8, "fp8w": jnp.uint16}
FORM = {"bf16": "bf16", "fp8w": "fp8 words", "fp8": "fp8 float8"}
A = None          # the parsed options of this run (set by `run`)
REC = None        # its Record
TORCH_BW = None   # torch's copy bandwidth, measured by prepare_env before JAX takes the GPU
CONFIGS = {
    "bf16": {
        "default": {},
        "bk32w4s3": dict(block_k=32, num_warps=4, num_stages=3),
    },
    "fp8": {
        "default": {},
        "op-f16-bk64s2": dict(num_stages=2),
        "op-f16-bk32w8s2": dict(block_k=32, num_warps=8, num_stages=2),
    },
    "fp8w": {
        "default": {},
        "int": dict(fp8_upcast="words_int"),
        "pairs": dict(fp8_upcast="words_pairs"),
        "words": dict(fp8_upcast="words", split_qk_acc=False),
        "w8": dict(num_warps=8),
        "s4": dict(num_stages=4),
        "bk32s4": dict(block_k=32, num_stages=4),
    },
}
CACHE_WIDTH = {"bf16": 576, "fp8": 576, "fp8w": 288}



def add_args(p):
    p.add_argument("--shapes", type=shapes_arg,
                   default=shapes_arg("16x32768,64x131072,1x131072,64x32768,16x131072,1x32768,1x4096,16x4096,64x4096"),
                   help="B x context, 16 heads")
    p.add_argument("--configs", type=names_arg, default=None,
                   help="keep only these dtype:name configurations (e.g. bf16:default,fp8w:int)")
    p.add_argument("--config", action="append", default=[], metavar="DTYPE:NAME:k=v,...",
                   help="add a configuration, e.g. bf16:bk32:block_k=32 (repeatable)")
    p.add_argument("--shape-configs", type=names_arg, default=None,
                   help="configuration names the 16-head shapes run (default: all)")
    p.add_argument("--heads", type=shapes_arg, default=shapes_arg("16x32768x12,16x32768x128,64x32768x128,1x131072x128"),
                   help="B x context x heads rows (empty: none)")
    p.add_argument("--head-configs", type=names_arg, default=["default"],
                   help="configuration names the head-count rows run")
    p.add_argument("--checks", type=names_arg, default=None,
                   help="indices into CHECKS to run (default all)")
    p.add_argument("--skip-checks", action="store_true", help="no correctness checks")
    p.add_argument("--lower", action="store_true",
                   help="only lower every swept (shape, config) for CUDA (CPU, no GPU needed)")


def prepare_env(args):
    """torch's copy bandwidth in a subprocess, before this process's JAX takes the GPU."""
    global TORCH_BW
    if args.smoke or args.lower:
        return
    TORCH_BW = torch_copy_Bps_subprocess()  # None: the JAX copy stands in


def pool_pages():
    return (4096 if A.smoke else 64 * 131072) // PAGE   # 8.4M tokens: 9.7 GB bf16, 4.8 GB fp8


def shape_structs(B, ctx, dtype):
    P = pool_pages()
    q = jax.ShapeDtypeStruct((B, 1, HEADS, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((P, PAGE, CACHE_WIDTH[dtype]), CACHE_DTYPE[dtype])
    pt = jax.ShapeDtypeStruct((B, ctx // PAGE), jnp.int32)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    cs = None if dtype == "bf16" else jax.ShapeDtypeStruct((P, PAGE), jnp.float32)
    return q, cache, pt, ln, cs


def full_cfg(B, ctx, dtype, cfg, heads=HEADS):
    return decode_config((B, 1, heads, 576), (pool_pages(), PAGE, CACHE_WIDTH[dtype]),
                         CACHE_DTYPE[dtype], (B, ctx // PAGE), DecodeConfig(**cfg)).as_dict()


def lower_all():
    """Lower every swept (shape, config) for CUDA on the CPU (kernels_pallas.gpu_lowering)."""
    from kernels_pallas.gpu_lowering import lower_for_gpu
    bad = 0
    for dtype in DTYPES:
        for B, ctx in A.shapes:
            for name, cfg in CONFIGS[dtype].items():
                q, cache, pt, ln, cs = shape_structs(B, ctx, dtype)
                fc = full_cfg(B, ctx, dtype, cfg)
                try:
                    lower_for_gpu(lambda q, c, p, l, s=None: mla_decode(
                        q, c, p, l, scale=SCALE, backend="pallas", cache_scale=s,
                        config=DecodeConfig(**cfg)),
                        q, cache, pt, ln, *([] if cs is None else [cs]))
                    res = "OK"
                except Exception as e:  # noqa: BLE001
                    bad += 1
                    res = f"FAIL {type(e).__name__}: {str(e)[:300]}"
                    REC.data["errors"][f"lower {dtype} B{B} {ctx} {name}"] = res
                smem = smem_bytes(fc["block_h"], fc["block_k"], fc["num_stages"],
                                  1 if dtype != "bf16" else 2)
                REC.log(f"lower {dtype} B{B} {ctx // 1024}K {name:12s} {fc} smem~{smem // 1024}KiB: {res}")
    return bad


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
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, cache_scale=cs, backend=A.backend,
                        out_dtype=jnp.float32, config=DecodeConfig(**cfg))
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    o, lse, ro, rlse = (np.asarray(x) for x in (o, lse, ro, rlse))
    fin = np.isfinite(rlse)
    rel = float(np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30))
    lse_err = float(np.max(np.abs(lse[fin] - rlse[fin]), initial=0))
    ok = (np.all(np.isfinite(o)) and np.array_equal(np.isneginf(lse), np.isneginf(rlse))
          and np.all(o[~fin] == 0) and rel < 1e-2 and lse_err < 1e-2)
    REC.details["correctness"].append(dict(B=B, Tq=Tq, H=H, lengths=lengths, dtype=dtype,
                                       scale=scale_kind, page=page, cfg=cfg, rel_err=rel,
                                       lse_max_err=lse_err, ok=bool(ok)))
    REC.save()
    REC.log(f"check B{B} Tq{Tq} H{H} page{page} {dtype}/{scale_kind} {cfg}: rel {rel:.2e} "
        f"lse {lse_err:.1e} -> {'OK' if ok else 'FAIL'}")
    return ok



CHECKS = [   # (B, Tq, H, lengths, dtype, scale kind, cfg, page size)
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, {}, PAGE),
    (4, 4, 16, [2, 4097, 64, 65], "bf16", None, {}, PAGE),
    (3, 1, 12, [5000, 129, 63], "bf16", None, dict(load="token"), 16),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8", "token", {}, PAGE),
    (2, 4, 16, [2000, 100], "fp8", "tensor", dict(block_k=32, num_stages=4), PAGE),
    (3, 1, 12, [5000, 129, 63], "fp8", "token", {}, PAGE),
    (2, 1, 128, [5000, 77], "bf16", None, dict(block_k=64, num_stages=2), PAGE),
    (2, 1, 96, [5000, 77], "bf16", None, dict(block_h=32, block_k=64, num_warps=8,
                                                num_stages=3), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "bf16", None, dict(split_qk_acc=True), PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8w", "token", {}, PAGE),
    (2, 4, 16, [2000, 100], "fp8w", "tensor", dict(fp8_upcast="words_int"), PAGE),
    (3, 1, 12, [5000, 129, 63], "fp8w", "token", dict(load="token"), 16),
    (2, 1, 16, [5000, 77], "fp8w", "token", dict(num_warps=8, fp8_upcast="words_int"), PAGE),
    (2, 4, 16, [3001, 64], "fp8w", "token", dict(num_stages=2), PAGE),  # (4 stages: 285 KiB, over an SM)
    (2, 1, 128, [5000, 77], "fp8w", "token", {}, PAGE),
    (4, 1, 16, [8191, 1, 0, 3000], "fp8w", "token", dict(fp8_upcast="words", split_qk_acc=False),
     PAGE),
    (2, 4, 12, [3001, 64], "fp8w", "tensor", dict(fp8_upcast="words_pairs"), PAGE),
    (2, 1, 128, [5000, 77], "fp8w", "token", dict(fp8_upcast="words_pairs"), PAGE),
    # 64-row fp8 words blocks that spill less than the default (offline, sm_90)
    (2, 1, 128, [5000, 77], "fp8w", "token", dict(block_k=16, num_stages=3), PAGE),
    (2, 4, 24, [3001, 64], "fp8w", "tensor", dict(block_k=64, num_stages=1), PAGE),
    (2, 4, 16, [3001, 64], "fp8w", "token", {}, PAGE),    # 64 rows at the default ("words")
]


_pool = {}


def pool(dtype):
    if dtype not in _pool:
        k = jax.random.key(7)
        P = pool_pages()
        if dtype == "bf16":
            _pool[dtype] = (jax.random.normal(k, (P, PAGE, 576), jnp.bfloat16), None)
        elif dtype == "fp8":
            p8 = jax.jit(lambda k: jax.random.normal(k, (P, PAGE, 576), jnp.bfloat16).astype(F8))(k)
            _pool[dtype] = (p8, jax.random.uniform(k, (P, PAGE), jnp.float32, 0.01, 0.03))
        else:
            _pool[dtype] = (fp8_to_words(pool("fp8")[0]), pool("fp8")[1])
    return _pool[dtype]


_SAME_SIZE_BW = {}


def same_size_copy_bw(nbytes):
    """GPU time (profiler) of a JAX elementwise copy moving `nbytes` in all (read + written), as
    bytes/s: the copy rate at the decode's own size, where launch and fill are not amortised (a
    B1 32K decode reads 38 MB; the main anchor above moves 4 GiB). None on CPU."""
    if A.smoke:
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
    R = max(1, min(8, pool_pages() // pages))                     # distinct page tables
    # decodes per timed call: ~0.5 ms of work at 3 TB/s, 2 to 4 (each is one more kernel to
    # compile); five calls are issued back to back, so the dispatch is hidden too
    n_inner = 1 if A.smoke else int(min(4, max(2, math.ceil(5e-4 * 3e12 / bytes_read))))
    perm = np.random.default_rng(0).permutation(pool_pages()).astype(np.int32)
    pts = tuple(jnp.asarray(perm[(r * pages) % (pool_pages() - pages + 1):][:pages]
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
                           backend=A.backend, config=DecodeConfig(**cfg))
                for i in range(n_inner)]

    info = {}
    n, reps = (1, 1) if A.smoke else (5, 3)
    t_wall = wall_ms(run, qs, cache, pts, lens, cs, n=n, reps=reps) * 1e-3 / n_inner
    # GPU time from the profiler: the kernels of one decode (the Pallas kernel + the merge and
    # q cast), without the host's launches; the wall clock is kept beside it.
    kt = None if A.smoke else kernel_times(run, qs, cache, pts, lens, cs, reps=5)
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
                frac_copy=bytes_read / t / REC.details["copy_Bps_used"], n_inner=n_inner, R=R, **info)



def fmt(r):
    c = r["cfg"]
    cs = (f"bh{c['block_h']} bk{c['block_k']} w{c['num_warps']} st{c['num_stages']} "
          f"sp{c['num_splits']} {c['load']}"
          + (f" {c['fp8_upcast']}" if r["dtype"] != "bf16" else "")
          + (" split-qk-acc" if c["split_qk_acc"] else ""))
    same = (f" ({100 * r['frac_same_size_copy']:.1f}% of a same-size copy)"
            if r.get("frac_same_size_copy") else "")
    ker = (f" (kernel {r['mla_kernel_us']:.1f}, span {r['span_us']:.1f}, wall "
           f"{r['wall_us']:.1f} us)" if "mla_kernel_us" in r else "")
    return (f"{r['dtype']:>4} H{r['H']:<3d} B{r['B']:<3d} {r['ctx'] // 1024:>4d}K "
            f"{r['name']:15s} {r['time_us']:9.1f} us {r['Bps'] / 1e12:5.2f} TB/s "
            f"{100 * r['frac_copy']:5.1f}%{same}  [{cs}]{ker}")



def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def add_configs():
    for item in A.config:
        dt, name, kv = item.split(":")
        CONFIGS[dt][name] = parse_overrides(kv)
    if A.configs:
        keep = {tuple(c.split(":")) for c in A.configs}
        for dt in CONFIGS:
            CONFIGS[dt] = {n: c for n, c in CONFIGS[dt].items() if (dt, n) in keep}


def run(rec, args):
    global A, REC
    A, REC = args, rec
    A.backend = "interpret" if A.smoke else "pallas"
    add_configs()
    if A.smoke:   # each code path once: a check and a default config per cache form
        A.shapes, A.heads, A.shape_configs = [(2, 512)], [], ["default"]
        # the words form at its defaults, the CUDA default's cache
        A.checks = A.checks or [str(next(i for i, c in enumerate(CHECKS)
                                         if c[4] == "fp8w" and not c[6]))]
    if A.lower:
        lower_all()
        return
    jbw = jax_copy_Bps(A.smoke)
    REC.details.update(configs=CONFIGS, correctness=[], cases=[], torch_copy_Bps=TORCH_BW,
                       jax_copy_Bps=jbw, copy_Bps_used=TORCH_BW or jbw)
    REC.log(f"copy bandwidth: torch {(TORCH_BW or 0) / 1e12:.2f} TB/s, jax x*2 {jbw / 1e12:.2f} TB/s")
    for i, (B, Tq, H, lens, dt, sk, cfg, pg) in enumerate([] if A.skip_checks else CHECKS):
        if A.checks and str(i) not in A.checks:
            continue
        lens = [min(n, 100) for n in lens] if A.smoke else lens
        REC.guard(f"check {i}", correctness, B, Tq, H, lens, dt, sk, cfg, seed=100 + i, page=pg)
    bad = [c for c in REC.details["correctness"] if not c["ok"]]
    if bad:
        REC.data["errors"]["correctness"] = f"{len(bad)} GPU checks failed: {bad}"[:3000]
    for B, ctx in A.shapes:
        for dtype in DTYPES:
            for name, cfg in CONFIGS[dtype].items():
                if A.shape_configs is not None and name not in A.shape_configs:
                    continue
                r = REC.guard(f"{dtype} B{B} {ctx} {name}", time_decode, B, ctx, dtype, name, cfg)
                if r is None:
                    continue
                REC.details["cases"].append(r)
                REC.log("case", fmt(r))
                if name == "default":
                    REC.row(f"MLA decode, {HEADS} heads (GPU time of the op)",
                            f"{FORM[dtype]} cache, B{B} {ctx_label(ctx)}", r["time_us"], "us",
                            limit_pct=100 * r["frac_copy"], note="of copy")
    for B, ctx, heads in A.heads:   # compute-bound at 96-128 heads
        for dtype, name in [(dt, n) for dt in DTYPES for n in A.head_configs if n in CONFIGS[dt]]:
            r = REC.guard(f"{dtype} B{B} {ctx} H{heads} {name}", time_decode, B, ctx, dtype, name,
                          CONFIGS[dtype][name], heads=heads)
            if r is None:
                continue
            r["tflops"] = B * heads * ctx * (576 + 512) * 2 / (r["time_us"] * 1e-6) / 1e12
            REC.details["cases"].append(r)
            REC.log("case", fmt(r), f"{r['tflops']:.0f} TFLOP/s")
            if name == "default":
                REC.row("MLA decode, 96-128 heads (compute-bound)",
                        f"{FORM[dtype]} cache, H{heads} B{B} {ctx_label(ctx)}", r["time_us"], "us",
                        note=f"{r['tflops']:.0f} TFLOP/s")
