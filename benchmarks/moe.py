"""MoE grouped matmul and the MoE layer at K3's shapes, against torch._grouped_mm and the copy
and dense-matmul ceilings measured in the same process.

    python -m benchmarks moe [--sections ceil,layer_gmm,layer] [--layouts k3,paired]
    python -m benchmarks moe --sections check          # MXFP4 exactness of every dequant variant
    python -m benchmarks moe --lower                   # CPU: lower every timed kernel for CUDA
    python -m benchmarks moe --sections router         # the router matmul, fp32 vs bf16 pieces
    python -m benchmarks moe --smoke                   # CPU: interpret mode, 8 experts top-2

Sections:
  ceil       torch copy bandwidth (read + write) and bf16 8192^3 matmul; JAX x*2 and matmul.
  check      every dequantisation variant on the device against exact values: expert 0 holds
             every byte value, scale bytes 16..142 and an all-zero group; x rows are one-hot, so
             out[i, n] must equal w0[n, c_i] exactly; plus a grouping with empty experts.
  layer_gmm  the layer's grouped matmuls at --gmm-tokens: gate_up (K 3584, N 6144: w1 | w3),
             down (K 3072, N 3584), one TP8 rank's slices gate_up_tp8 (K 3584, N 768), gate_tp8
             (K 3584, N 384: w1 or w3 alone, as the layer runs them) and down_tp8 (K 384,
             N 3584); MXFP4 (each --layouts; "mxfp4_paired_xsplit": x split outside the timed call, as the MoE layer hands it) and bf16, ours with the config
             moe_gmm picks (`--mxfp4-config` / `--bf16-config` add variants of it) against
             torch._grouped_mm on the exact bf16 dequantisation; gate_up also as the fused
             kernel (glu_*). Every row is checked against the peer and for run-to-run
             differences before it is timed.
  layer      the full MoE layer (kimik3.layers.moe.moe_apply: router, sort, gate/up + down,
             combine, latent down/up + norm, 2 shared experts) at K3 dims on one device, MXFP4
             experts then their exact bf16 dequantisation, checked on a few tokens against a
             per-token reference first.
  router     the router matmul at K3's shape (hidden 7168 x 896 experts, fp32 gate) at
             --router-tokens rows of bf16 activations: the gate's bf16 pieces on tensor cores
             against the fp32 matmul, after checking both choose the same experts (top 16).
Counted: FLOP = 2 * rows * K * N; weight bytes = the experts that received rows (bf16 2 B, MXFP4
0.5 + 1/32 B an element); % of copy = weight bytes / time over the copy ceiling; % of mm =
TFLOP/s over torch's bf16 matmul. Times are GPU kernel time from the profiler (every kernel of
the call). Rows: decode (64 / 512 tokens) against copy, prefill (8192 tokens) against the matmul.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time

import numpy as np
import jax
import jax.numpy as jnp

from kernels_pallas.moe import (GmmConfig, default_config, moe_gmm, moe_gmm_glu, mxfp4,
                                needs_split_x, split_x)
from kernels_pallas.moe.dequant import DEQUANT_VARIANTS
from kernels_pallas.moe.reference import MXFP4PairedWeight, MXFP4Weight, pair_mxfp4
from kernels_pallas.moe.reference import glu as moe_glu_ref
from sharding.rules import unboxed
from .common import (gpu_ms, has_cuda_torch, ints_arg, names_arg, rel, torch_copy_Bps,
                     torch_wall_ms, wall_ms)
from .config_strings import parse_overrides

C = GmmConfig
SECTIONS = ("ceil", "check", "layer_gmm", "layer", "router")
BOOL_FIELDS = {"transpose_small", "x_resident", "fuse_tail"}


def add_args(p):
    p.add_argument("--sections", type=names_arg, default=["ceil", "layer_gmm", "layer", "router"],
                   help="comma list of " + ", ".join(SECTIONS))
    p.add_argument("--gmm-tokens", type=ints_arg, default=None, help="layer_gmm token counts (64,512,8192)")
    p.add_argument("--gmm-shapes", type=names_arg, default=None,
                   help="layer_gmm shapes (gate_up, down, down_tp8, gate_up_tp8; default all)")
    p.add_argument("--layouts", type=names_arg, default=["k3", "paired"], help="MXFP4 byte layouts")
    p.add_argument("--only", type=names_arg, default=None,
                   help="layer_gmm: only the rows whose kind starts so (e.g. bf16)")
    p.add_argument("--mxfp4-config", action="append", default=[], metavar="NAME:k=v,...",
                   help="layer_gmm: also the MXFP4 rows with the default config's fields replaced")
    p.add_argument("--bf16-config", action="append", default=[], metavar="NAME:k=v,...",
                   help="layer_gmm: the same for the bf16 rows")
    p.add_argument("--layer-tokens", type=ints_arg, default=None, help="layer token counts (64,512,8192)")
    p.add_argument("--layer-formats", type=names_arg, default=["mxfp4", "bf16"],
                   help="layer expert formats (mxfp4, mxfp4_paired, bf16)")
    p.add_argument("--layer-glu", type=names_arg, default=["unfused"],
                   help="layer gate/up forms: unfused (the default), fused")
    p.add_argument("--router-tokens", type=ints_arg, default=None,
                   help="router section row counts (16,256,8192: a decode step, the pieces' "
                        "threshold, a prefill chunk)")
    p.add_argument("--lower", action="store_true",
                   help="only lower every kernel of layer_gmm / layer for CUDA (CPU, no GPU needed)")


def extra_configs(items):
    """[(name, GmmConfig field overrides)] from ["name:block_n=64,...", ...]."""
    return [(i.partition(":")[0], parse_overrides(i.partition(":")[2], BOOL_FIELDS)) for i in items]


def routing(rng, tokens, g, topk):
    choice = np.argsort(rng.random((tokens, g)), axis=1)[:, :topk]
    return np.bincount(choice.ravel(), minlength=g).astype(np.int32)



# ---- sections layer_gmm and layer: the whole layer's grouped matmuls, the full MoE layer ----
# (K, N) as moe_gmm sees them. "gate_up": w1 | w3 of the whole layer as one N = 2 x 3072 matmul (the
# layer runs the two halves as two products; the fused kernel on them: the "glu" rows); "down": w2; "down_tp8": one
# TP8 rank's slice of w2 (K = 3072 / 8); "gate_up_tp8": the TP8 gate+up slice of sections decode /
# prefill, here timed by GPU kernel time with every kernel of the call counted; "gate_tp8": one of
# the two products the layer runs there (w1 or w3, N = 384).
LAYER_GMM_SHAPES = {"gate_up": (3584, 6144), "down": (3072, 3584), "down_tp8": (384, 3584),
                    "gate_up_tp8": (3584, 768), "gate_tp8": (3584, 384)}
SMOKE_LAYER_GMM_SHAPES = {"gate_up": (128, 256), "down": (128, 128), "down_tp8": (32, 128),
                          "gate_up_tp8": (128, 64), "gate_tp8": (128, 32)}
GLU_ACT = "situ"  # K3's activation


def layer_cases(G=896, topk=16, tokens=(64, 512, 8192)):
    """(name, fn, args) of the kernels sections layer_gmm and layer run, with the config
    `default_config` picks on CUDA (what moe_gmm uses on the H200), as abstract shapes."""
    sd = jax.ShapeDtypeStruct
    out = []
    for sname, (K, N) in LAYER_GMM_SHAPES.items():
        for t in tokens:
            x = sd((t * topk, K), jnp.bfloat16)
            gs = sd((G,), jnp.int32)
            for quant, cls in ((True, MXFP4Weight), (True, MXFP4PairedWeight), (False, None)):
                w = (cls(sd((G, N, K // 2), jnp.uint8), sd((G, N, K // 32), jnp.uint8))
                     if quant else sd((G, K, N), jnp.bfloat16))
                lay = w.layout if quant else "k3"
                cfg = default_config(t * topk, G, K, N, quant, platform="cuda", layout=lay)
                kind = ("mxfp4_paired" if lay == "paired" else "mxfp4") if quant else "bf16"
                out.append((f"{sname} {kind} tokens {t} {cfg.name()}",
                            lambda a, b, c, cfg=cfg: moe_gmm(a, b, c, backend="pallas", config=cfg),
                            (x, w, gs)))
                if sname != "gate_up" or lay == "paired":
                    continue
                h = N // 2  # the layer's fused gate/up on the two halves
                w = (MXFP4Weight(sd((G, h, K // 2), jnp.uint8), sd((G, h, K // 32), jnp.uint8))
                     if quant else sd((G, K, h), jnp.bfloat16))
                cfg = default_config(t * topk, G, K, h, quant, True, platform="cuda")
                out.append((f"gate_up glu {kind} tokens {t} {cfg.name()}",
                            lambda a, b, c, d, cfg=cfg: moe_gmm_glu(
                                a, b, c, d, activation=GLU_ACT, backend="pallas", config=cfg,
                                fuse=True),
                            (x, w, w, gs)))
    return out



def lower_check(lower_cuda, log=print):
    """Lower every kernel sections layer_gmm and layer run, with their CUDA default configs,
    for CUDA (no GPU needed); returns the names that failed."""
    bad = []
    cases = layer_cases()
    for name, fn, args in cases:
        try:
            lower_cuda(fn, *args)
            log(f"lowered  {name}")
        except Exception as ex:  # noqa: BLE001
            bad.append(name)
            log(f"FAILED   {name}: {repr(ex)[:300]}")
    log(f"{len(cases) - len(bad)}/{len(cases)} kernels lower to Triton IR")
    return bad


def _chunk(g, want=32):
    """Experts per step of the chunked weight builders (a divisor of g)."""
    return math.gcd(g, want)


def rand_mxfp4_device(key, g, n, k, lo=117, hi=122):
    """Random MXFP4 weights [g, n, k/2] + [g, n, k/32] made on the device a chunk of experts at a
    time (no temporaries of the whole size): packed bytes uniform, scale bytes in [lo, hi)."""
    c = _chunk(g)

    def one(i):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        return (jax.random.bits(k1, (c, n, k // 2), jnp.uint8),
                jax.random.randint(k2, (c, n, k // 32), lo, hi, jnp.int32).astype(jnp.uint8))

    def f():
        p, s = jax.lax.map(one, jnp.arange(g // c))
        return p.reshape(g, n, k // 2), s.reshape(g, n, k // 32)
    return MXFP4Weight(*jax.block_until_ready(jax.jit(f)()))


def dequant_device(w, layout):
    """The exact bf16 dequantisation of MXFP4Weight `w`, a chunk of experts at a time: layout "nk"
    [G, N, K] (the checkpoint's [out, in]: torch's operand, transposed as a view) or "kn" [G, K, N]
    (moe_gmm's dense operand)."""
    g, n, half = w.packed.shape
    c = _chunk(g)

    def one(ps):
        d = mxfp4.dequantize(ps[0], ps[1], jnp.bfloat16)
        return d if layout == "nk" else jnp.swapaxes(d, 1, 2)

    def f(p, s):
        out = jax.lax.map(one, (p.reshape(g // c, c, n, half), s.reshape(g // c, c, n, -1)))
        return out.reshape(g, *out.shape[2:])
    return jax.block_until_ready(jax.jit(f)(w.packed, w.scales))



def gpu_time(fn, *args, cpu, reps=10, sync=jax.block_until_ready):
    """(ms, info): GPU kernel time of every kernel of the call (wall clock on CPU), and the
    moe_gmm kernels' share."""
    ms, info = gpu_ms(fn, *args, reps=2 if cpu else reps, sync=sync, smoke=cpu)
    if "by_kernel_us" in info:
        info["gmm_kernel_ms"] = sum(v for k, v in info.pop("by_kernel_us").items() if "moe_gmm" in k) / 1e3
    return ms, info


def _rates(ent, ms, flop, wbytes, ceil):
    copy, mm = ceil.get("copy_TBps", float("nan")), ceil.get("mm_TFLOPs", float("nan"))
    ent.update(TFLOPs=flop / ms / 1e9, weight_TBps=wbytes / ms / 1e9)
    ent["pct_mm"] = 100 * ent["TFLOPs"] / mm if mm == mm else None
    ent["pct_copy"] = 100 * ent["weight_TBps"] / copy if copy == copy else None
    return ent



def torch_gmm(x, w_nk, gs, cpu):
    """torch._grouped_mm on the same device buffers (dlpack, no copy): x [M, K], w_nk [G, N, K]
    as a transposed view; returns (kernel ms, info, output as a JAX array)."""
    import torch
    xt = torch.from_dlpack(x)
    wt = torch.from_dlpack(w_nk).transpose(-2, -1)
    offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))
    f = lambda: torch._grouped_mm(xt, wt, offs=offs)  # noqa: E731
    ms, info = gpu_time(f, cpu=cpu, sync=lambda r: torch.cuda.synchronize())
    y = f()
    torch.cuda.synchronize()
    try:
        yj = jnp.from_dlpack(y)
    except Exception:  # noqa: BLE001
        yj = jnp.asarray(y.float().cpu().numpy(), jnp.bfloat16)
    return ms, info, yj



def run_to_run_diffs(f, args, y, calls=3):
    """Elements of `calls` more calls of f(*args) that differ bitwise from y: a race or a read of
    uninitialised memory shows here even where the first call happened to be right (the K3-layout
    "split_asm_t" kernel with K blocks of 128 in the plain K loop did)."""
    y = np.asarray(y)
    return max(int(np.sum(np.asarray(f(*args)) != y)) for _ in range(calls))



def ours_case(fn, args, y_ref, flop, wbytes, ceil, cfg_name, cpu, tol=1e-2):
    """jit(fn)(*args): first call, relative error vs y_ref (before any timing), run-to-run
    differences, then GPU time."""
    try:
        f = jax.jit(fn)
        t = time.perf_counter()
        y = jax.block_until_ready(f(*args))
        first = time.perf_counter() - t
        err = rel(y, y_ref) if y_ref is not None else float("nan")
        diffs = run_to_run_diffs(f, args, y, 1 if cpu else 3)
        del y
        ms, info = gpu_time(f, *args, cpu=cpu)
        ent = _rates({"ms": ms, **info}, ms, flop, wbytes, ceil)
        ok = (bool(err < tol) if err == err else None) if diffs == 0 else False
        ent.update(rel_vs_peer=err, run_to_run_diffs=diffs, ok=ok, first_call_s=first,
                   config=cfg_name)
    except Exception as ex:  # noqa: BLE001
        ent = {"error": repr(ex)[:600], "config": cfg_name}
    return ent



def check_variants(run, backend, variants, cpu):
    """Device exactness of each dequant variant (one compile each: both calls share shapes)."""
    k, n, g = (128, 64, 3) if cpu else (512, 128, 4)
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)
    packed[0] = ((np.arange(n)[:, None] * (k // 2) + np.arange(k // 2)[None, :]) % 256)  # every byte
    sset = np.array([16, 17, 60, 100, 110, 117, 120, 122, 126, 127, 128, 130, 142], np.uint8)
    scales = rng.choice(sset, (g, n, k // 32)).astype(np.uint8)
    packed[0, 5, :16] = 0  # an all-zero group, with the scale byte the quantiser writes for it
    scales[0, 5, 0] = 0
    w = MXFP4Weight(jnp.asarray(packed), jnp.asarray(scales))
    want = np.asarray(mxfp4.dequantize(packed[0], scales[0], jnp.float32)).T  # [K, N]
    x_eye = jnp.eye(k, dtype=jnp.bfloat16)
    gs_eye = jnp.asarray([k] + [0] * (g - 1), jnp.int32)
    x = jnp.asarray(rng.standard_normal((k, k)), jnp.bfloat16)
    gs = jnp.asarray(np.array([k // 3, 0, k // 2, k // 8] if not cpu else [40, 0, 70], np.int32))
    tot = int(gs.sum())
    ref = moe_gmm(x, w, gs, backend="reference")
    checks = {}
    cfgs = [C(16, 64 if cpu else 128, 64 if cpu else 256, num_warps=4, num_stages=4, dequant=v)
            for v in variants]
    for v in ("split_asm_sub", "split_asm_t"):
        if v in variants:
            cfgs.append(C(16, 64 if cpu else 128, 64 if cpu else 256, num_warps=4, num_stages=4,
                          dequant=v, x_split="stride"))
    if "split_asm_t" in variants:  # x resident over 2 column blocks a program (K blocks of 128)
        cfgs.append(C(16, 32 if cpu else 64, 64 if cpu else 128, num_warps=4, num_stages=3,
                      dequant="split_asm_t", n_per_program=2, x_resident=True))
    for cfg in cfgs:
        name = cfg.name()
        if run.skip(f"check {name}"):
            continue
        try:
            f = jax.jit(lambda a, b, c, cfg=cfg: moe_gmm(a, b, c, backend=backend, config=cfg))
            t = time.perf_counter()
            y = np.asarray(f(x_eye, w, gs_eye), np.float32)
            compile_s = time.perf_counter() - t
            bad = int(np.sum(y != want))
            yr = f(x, w, gs)
            e = rel(yr, ref)
            tail = bool(jnp.all(yr[tot:] == 0))
            ok = bad == 0 and e < 1e-2 and tail
            checks[name] = {"exact_mismatches": bad, "rel_vs_reference": e, "tail_zero": tail,
                            "ok": ok, "compile_s": compile_s}
            if bad:
                idx = np.argwhere(y != want)[:4]
                checks[name]["first_mismatches"] = [
                    (int(i), int(j), float(y[i, j]), float(want[i, j]),
                     int(packed[0, j, i // 2]), int(scales[0, j, i // 32])) for i, j in idx]
        except Exception as ex:  # noqa: BLE001
            checks[name] = {"ok": False, "error": repr(ex)[:600]}
        run.details["check"] = checks
        run.log(f"check {name}: {json.dumps(checks[name])[:300]}")
        run.save()
    nbad = sum(not v["ok"] for v in checks.values())
    run.log(f"check: {len(checks) - nbad}/{len(checks)} variants exact and within tolerance")



def ceilings(run):
    import torch
    copy = torch_copy_Bps() / 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = 2 * 8192 ** 3 / torch_wall_ms(lambda: a @ b) / 1e9
    xa = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)
    jcopy = 2 * xa.size * 2 / wall_ms(jax.jit(lambda v: v * 2), xa) / 1e9
    del xa
    aj = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    jmm = 2 * 8192 ** 3 / wall_ms(jax.jit(lambda u: u @ u), aj) / 1e9
    c = {"copy_TBps": copy, "mm_TFLOPs": mm, "jax_x2_TBps": jcopy, "jax_mm_TFLOPs": jmm}
    run.details["ceilings"] = c
    run.log(f"ceilings: {c}")
    return c


def layer_gmm_section(run, ctx, token_list, shapes):
    """Whole-layer (and TP8 down-slice) grouped matmuls, bf16 and MXFP4, ours (moe_gmm with its
    default config) vs torch._grouped_mm on the dequantised weights, same inputs. Per shape the
    weights are made on the device, and at most the MXFP4 set plus one bf16 copy live at once:
    torch's [G, N, K] copy first (its outputs kept as the peer), then ours MXFP4, then moe_gmm's
    [G, K, N] bf16 copy (gate_up: then the two halves for the fused gate/up)."""
    G, TOPK, cpu, backend, ceil = ctx["G"], ctx["TOPK"], ctx["cpu"], ctx["backend"], ctx["ceil"]
    plat = "interpret" if backend == "interpret" else None
    only = tuple(ctx["only"] or ())  # only the rows whose kind starts so (bf16, bf16_NAME)
    res = run.details.setdefault("layer_gmm", {})
    rng = np.random.default_rng(5)
    routings = {t: routing(rng, t, G, TOPK) for t in token_list}  # one per token count, all shapes
    for si, (sname, (K, N)) in enumerate(shapes.items()):
        if run.skip(f"layer_gmm {sname} weights"):
            continue
        fused = sname == "gate_up"
        key = jax.random.key(100 + si)
        halves = None
        if fused:  # w1 | w3, generated as the halves the fused kernel takes
            halves = [rand_mxfp4_device(jax.random.fold_in(key, h), G, N // 2, K) for h in (0, 1)]
            cat = jax.jit(lambda a, b: jnp.concatenate([a, b], axis=1))
            wq = MXFP4Weight(cat(halves[0].packed, halves[1].packed),
                             cat(halves[0].scales, halves[1].scales))
        else:
            wq = rand_mxfp4_device(key, G, N, K)
        cases, peers = {}, {}
        for t in token_list:
            gs_np = routings[t]
            m, nonempty = t * TOPK, int((gs_np > 0).sum())
            cases[t] = {"x": jax.random.normal(jax.random.key(1000 * si + t), (m, K), jnp.bfloat16),
                        "gs": jnp.asarray(gs_np),
                        "ent": {"K": K, "N": N, "rows": m, "nonempty_experts": nonempty,
                                "max_rows_per_expert": int(gs_np.max()), "flop": 2 * m * K * N},
                        "wbytes": {"bf16": nonempty * K * N * 2,
                                   "mxfp4": nonempty * (K * N // 2 + K * N // 32)}}
            res.setdefault(sname, {})[str(t)] = cases[t]["ent"]
        run.log(f"layer_gmm {sname}: K {K} N {N}, MXFP4 weights on the device")
        run.save()

        # 1. the peer: torch on the dequantised [G, N, K] weights (the reference on CPU)
        w_nk = dequant_device(wq, "nk")
        for t, c in cases.items():
            if run.skip(f"layer_gmm {sname} {t} torch"):
                continue
            try:
                if ctx["has_torch"]:
                    ms, info, peers[t] = torch_gmm(c["x"], w_nk, c["gs"], cpu)
                    c["ent"]["torch_grouped_mm"] = _rates({"ms": ms, **info}, ms,
                                                          c["ent"]["flop"], c["wbytes"]["bf16"],
                                                          ceil)
                elif cpu:
                    peers[t] = jax.jit(lambda a, b, g: moe_gmm(a, jnp.swapaxes(b, 1, 2), g,
                                                               backend="reference"))(
                        c["x"], w_nk, c["gs"])
                    c["ent"]["torch_grouped_mm"] = {"note": "no torch: reference as the peer"}
            except Exception as ex:  # noqa: BLE001
                c["ent"]["torch_grouped_mm"] = {"error": repr(ex)[:400]}
            run.log(f"layer_gmm {sname} tokens {t} torch._grouped_mm: "
                    + json.dumps(c["ent"].get("torch_grouped_mm"))[:300])
            run.save()
        del w_nk

        def ours(t, kind, fn, args, cfg, y_ref, tol=1e-2):
            c = cases[t]
            label = f"layer_gmm {sname} {t} ours_{kind}"
            if only and not kind.startswith(only):
                return
            if run.skip(label):
                return
            wb = c["wbytes"]["mxfp4" if "mxfp4" in kind else "bf16"]
            ent = ours_case(fn, args, y_ref, c["ent"]["flop"], wb, ceil, cfg.name(), cpu, tol)
            c["ent"][f"ours_{kind}"] = ent
            run.log(f"{label} [{cfg.name()}]: " + json.dumps(ent)[:400])
            run.save()
            if "ms" in ent:
                decode = t * TOPK / G < 24   # the kernel's decode regime: few rows per expert
                run.row("MoE grouped matmul (GPU kernel time)", f"{sname} ({K} x {N}), {t} tokens, {kind}",
                        ent["ms"], "ms", peer=c["ent"].get("torch_grouped_mm", {}).get("ms"),
                        peer_name="torch._grouped_mm",
                        limit_pct=ent["pct_copy"] if decode else ent["pct_mm"],
                        note="of copy" if decode else "of bf16 matmul peak")

        def glu_ref(t):
            y = peers.get(t)
            return None if y is None else moe_glu_ref(y[:, : N // 2], y[:, N // 2:], GLU_ACT)

        wq_paired = pair_mxfp4(wq) if "paired" in ctx["layouts"] else None
        # 2. ours, MXFP4 (plain; gate_up: also fused on the halves); BENCH_LAYER_MXFP4_EXTRA
        #    ("name:block_n=64;...") also times the default config with those fields replaced
        for t, c in cases.items():
            m = t * TOPK
            base = default_config(m, G, K, N, True, platform=plat)
            ours(t, "mxfp4", lambda a, b, g: moe_gmm(a, b, g, backend=backend),
                 (c["x"], wq, c["gs"]), base, peers.get(t))
            if "paired" in ctx["layouts"]:
                pcfg = default_config(m, G, K, N, True, platform=plat, layout="paired")
                ours(t, "mxfp4_paired", lambda a, b, g: moe_gmm(a, b, g, backend=backend),
                     (c["x"], wq_paired, c["gs"]), pcfg, peers.get(t))
                if needs_split_x(pcfg):  # x split outside the timed call, as the layer does
                    ours(t, "mxfp4_paired_xsplit",
                         lambda a, b, g: moe_gmm(a, b, g, backend=backend),
                         (split_x(c["x"], pcfg), wq_paired, c["gs"]), pcfg, peers.get(t))
            for name, kw in ctx["mxfp4_extra"]:  # per layout timed (k3: mxfp4_NAME, mxfp4_paired_NAME)
                for lay, w_ in (("k3", wq), ("paired", wq_paired)):
                    if lay not in ctx["layouts"]:
                        continue
                    kind = f"mxfp4_{name}" if lay == "k3" else f"mxfp4_paired_{name}"
                    try:
                        cfg = dataclasses.replace(default_config(m, G, K, N, True, platform=plat,
                                                                 layout=lay), **kw)
                    except ValueError as ex:  # e.g. fuse_tail on a decode config (no tail block)
                        run.log(f"layer_gmm {sname} {t} {kind}: not applicable here ({ex})"[:300])
                        continue
                    ours(t, kind, lambda a, b, g, cfg=cfg: moe_gmm(
                        a, b, g, backend=backend, config=cfg), (c["x"], w_, c["gs"]), cfg,
                        peers.get(t))
            if fused:
                ours(t, "glu_mxfp4", lambda a, b1, b3, g: moe_gmm_glu(
                    a, b1, b3, g, activation=GLU_ACT, backend=backend, fuse=True),
                    (c["x"], halves[0], halves[1], c["gs"]),
                    default_config(m, G, K, N // 2, True, True, platform=plat), glu_ref(t), 2e-2)
        wq_paired = None
        # 3. ours, bf16 [G, K, N] (gate_up: then the halves, fused)
        if run.left() > 0:
            w_kn = dequant_device(wq, "kn")
            del wq
            for t, c in cases.items():
                base = default_config(t * TOPK, G, K, N, False, platform=plat)
                ours(t, "bf16", lambda a, b, g: moe_gmm(a, b, g, backend=backend),
                     (c["x"], w_kn, c["gs"]), base, peers.get(t))
                for name, kw in ctx["bf16_extra"]:  # rows bf16_NAME: the default with fields replaced
                    try:
                        cfg_x = dataclasses.replace(base, **kw)
                    except ValueError as ex:
                        run.log(f"layer_gmm {sname} {t} bf16_{name}: not applicable ({ex})"[:300])
                        continue
                    ours(t, f"bf16_{name}", lambda a, b, g, c_=cfg_x: moe_gmm(
                        a, b, g, backend=backend, config=c_), (c["x"], w_kn, c["gs"]), cfg_x,
                        peers.get(t))
            del w_kn
        if fused and run.left() > 0:
            h_kn = [dequant_device(h, "kn") for h in halves]
            for t, c in cases.items():
                ours(t, "glu_bf16", lambda a, b1, b3, g: moe_gmm_glu(
                    a, b1, b3, g, activation=GLU_ACT, backend=backend, fuse=True),
                    (c["x"], h_kn[0], h_kn[1], c["gs"]),
                    default_config(t * TOPK, G, K, N // 2, False, True, platform=plat),
                    glu_ref(t), 2e-2)
            del h_kn
        wq = halves = w_kn = h_kn = None  # noqa: F841  (free the weights before the next shape)
        cases.clear()
        peers.clear()
        run.save()



def smoke_layer_config():
    """K3's layer structure at tiny dims (bf16 like K3): latent MoE, MXFP4 experts, SiTU, norm."""
    from kimik3.config import Config
    return Config.preset("tiny").replace(dtype="bfloat16", param_dtype="bfloat16",
                                         router_dtype="bfloat16")


def layer_params(cfg, key):
    """moe_apply's parameter dict at cfg's dims, made on the device; routed experts as MXFP4
    (packed bytes uniform, scale bytes 119..121 as the module's init), the rest normal(0.02)."""
    D, E, I, L = (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                  cfg.expert_in_dim)
    S = I * cfg.num_shared_experts
    pdt = cfg.jnp_param_dtype
    keys = iter(jax.random.split(key, 16))
    nrm = jax.jit(lambda k, shape, std, dt: (jax.random.normal(k, shape, jnp.float32) * std
                                               ).astype(dt), static_argnums=(1, 2, 3))
    p = {"gate": nrm(next(keys), (D, E), 0.02, jnp.dtype(cfg.router_dtype)),
         "e_score_correction_bias": nrm(next(keys), (E,), 0.01, jnp.float32),
         "routed_expert_down_proj": {"kernel": nrm(next(keys), (D, L), 0.02, pdt)},
         "experts": {}}
    for name, (din, dout) in {"w1": (L, I), "w3": (L, I), "w2": (I, L)}.items():
        w = rand_mxfp4_device(next(keys), E, dout, din, 119, 122)
        p["experts"][f"{name}_packed"], p["experts"][f"{name}_scale"] = w.packed, w.scales
    if cfg.latent_moe_use_norm:
        p["routed_expert_norm"] = {"weight": jnp.ones((L,), pdt)}
    p["routed_expert_up_proj"] = {"kernel": nrm(next(keys), (L, D), 0.02, pdt)}
    if cfg.num_shared_experts:
        p["shared_experts"] = {n: {"kernel": nrm(next(keys), s, 0.02, pdt)} for n, s in
                               (("gate_proj", (D, S)), ("up_proj", (D, S)), ("down_proj", (S, D)))}
    return p


def layer_reference(cfg, p, x, sel):
    """moe_apply's math for the tokens `sel` of x, written per token: each token's k experts
    gathered (and dequantised), fp32 products; no sort, no grouped matmul, no Pallas. Not
    moe_apply(backend="reference"): that runs moe_gmm_reference, which dequantises all 896
    experts and expands ragged_dot (tens of GB, seconds) at K3 dims. Routing, GLU, norm and the
    shared experts are the model's own functions; only the expert combine is written here."""
    from kimik3.layers.common import glu, rms_normalize
    from kimik3.layers.moe import mlp_apply, route
    dt, f32, hi = cfg.jnp_dtype, jnp.float32, jax.lax.Precision.HIGHEST
    logits = jnp.dot(x.astype(f32), p["gate"].astype(f32), precision=hi)
    idx, wts = route(logits, p["e_score_correction_bias"], cfg)
    sel = jnp.asarray(sel)
    xs, idx, wts = x[sel], idx[sel], wts[sel]
    u = xs.astype(dt) @ p["routed_expert_down_proj"]["kernel"].astype(dt)
    ex = p["experts"]

    def expert_w(name, ids):  # [k, in, out] fp32
        if name in ex:
            return ex[name][ids].astype(f32)
        w = MXFP4Weight(ex[f"{name}_packed"][ids], ex[f"{name}_scale"][ids])
        if cfg.mxfp4_layout == "paired":
            w = MXFP4PairedWeight(*w)
        return jnp.swapaxes(mxfp4.dequantize(w.k3_packed(), w.scales, f32), -1, -2)

    def one(args):
        ui, ids, wi = args
        a = jnp.einsum("i,kio->ko", ui.astype(f32), expert_w("w1", ids), precision=hi)
        b = jnp.einsum("i,kio->ko", ui.astype(f32), expert_w("w3", ids), precision=hi)
        h = glu(cfg, a, b).astype(dt).astype(f32)
        y = jnp.einsum("ki,kio->ko", h, expert_w("w2", ids), precision=hi)
        return jnp.einsum("k,ko->o", wi, y, precision=hi)

    latent = jax.lax.map(one, (u, idx, wts)).astype(dt)
    if cfg.latent_moe_use_norm:
        latent = p["routed_expert_norm"]["weight"].astype(dt) * rms_normalize(latent,
                                                                              cfg.rms_norm_eps)
    up = latent @ p["routed_expert_up_proj"]["kernel"].astype(dt)
    if cfg.num_shared_experts:
        return mlp_apply(cfg, p["shared_experts"], xs) + up
    return up


def layer_counts(cfg, tokens, experts_hit, fmt):
    """(FLOP, weight bytes read) of one moe_apply call: router, latent down, the experts' three
    matmuls per (token, expert), latent up, shared experts; bytes: dense weights + hit experts."""
    D, E, k, I, L = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token,
                     cfg.moe_intermediate_size, cfg.expert_in_dim)
    S = I * cfg.num_shared_experts
    dense_elems = D * E + 2 * D * L + 3 * D * S
    flop = 2 * tokens * (dense_elems + k * 3 * L * I)
    per_expert = 3 * L * I * (2 if fmt == "bf16" else (0.5 + 1 / 32))
    return flop, dense_elems * 2 + experts_hit * per_expert


def layer_section(run, ctx, token_list, formats, glu_modes=("unfused",)):
    """The full MoE layer (kimik3.layers.moe.moe_apply: router, sort, gate/up + down grouped
    matmuls, combine, latent down/up + norm, shared experts) at K3 dims on one device, under
    jax.jit, MXFP4 experts then their exact bf16 dequantisation (dense experts). Each case is first
    checked against `layer_reference` on a few of its tokens, then timed: the GPU kernels' sum,
    their span, the wall clock; the moe_gmm kernels' share. glu_modes: "unfused" (gate/up as two
    products, the activation after: the layer's default) and/or "fused" (one gate/up +
    activation kernel, moe_apply(fuse_glu=True))."""
    from kimik3.config import Config
    from kimik3.layers.moe import MoE, moe_apply, route
    cpu, backend, ceil = ctx["cpu"], ctx["backend"], ctx["ceil"]
    plat = "interpret" if backend == "interpret" else None
    cfg = smoke_layer_config() if cpu else Config.preset("kimi-k3")
    res = run.details.setdefault("layer", {})
    if run.skip("layer weights"):
        return
    D, E, k, I, L = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_token,
                     cfg.moe_intermediate_size, cfg.expert_in_dim)
    p = layer_params(cfg, jax.random.key(3))
    # the parameter tree must be the module's (names, shapes, dtypes): checked abstractly
    want = unboxed(jax.eval_shape(lambda: MoE(cfg).init(
        jax.random.key(0), jnp.zeros((1, 2, D), cfg.jnp_dtype), backend="reference"))["params"])
    sig = lambda t: jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), t)  # noqa: E731
    if sig(want) != sig(p):
        run.data["errors"]["layer"] = f"parameter tree differs from MoE's: {sig(want)} vs {sig(p)}"
        run.log(run.data["errors"]["layer"][:600])
        run.save()
        return
    res.update(dims={"hidden": D, "experts": E, "topk": k, "expert_intermediate": I, "latent": L,
                     "shared_intermediate": I * cfg.num_shared_experts})
    run.log(f"layer: weights on the device (hidden {D}, {E} experts top-{k}, latent {L}, "
            f"intermediate {I}, shared {I * cfg.num_shared_experts})")
    run.save()
    hit_fn = jax.jit(lambda x, g, b: jnp.sum(jnp.bincount(route(  # experts that get tokens
        jnp.dot(x.astype(jnp.float32), g.astype(jnp.float32), precision="highest"), b,
        cfg)[0].reshape(-1),
        length=E) > 0))
    outs = {}
    p_k3 = p
    for fmt in formats:
        p = p_k3
        if fmt == "mxfp4_paired":  # the same experts re-encoded (Config.mxfp4_layout="paired")
            ex = p_k3["experts"]
            p = {**p_k3, "experts": {**ex, **{f"{n}_packed": pair_mxfp4(MXFP4Weight(
                ex[f"{n}_packed"], ex[f"{n}_scale"])).packed for n in ("w1", "w3", "w2")}}}
            del ex
        if fmt == "bf16":
            if run.left() <= 0:
                run.data["skipped"].append("layer bf16 weights")
                break
            ex = p["experts"]
            dense = {}
            for n in ("w1", "w3", "w2"):  # [E, in, out], exactly the MXFP4 values
                dense[n] = dequant_device(MXFP4Weight(ex[f"{n}_packed"], ex[f"{n}_scale"]), "kn")
                del ex[f"{n}_packed"], ex[f"{n}_scale"]
            p["experts"] = dense
            del ex, dense
        cfg_f = cfg.replace(expert_format="dense" if fmt == "bf16" else "mxfp4",
                            mxfp4_layout="paired" if fmt == "mxfp4_paired" else "k3")
        quant = fmt.startswith("mxfp4")
        for fused, t in [(g == "fused", t) for t in token_list for g in glu_modes]:
            name = f"{fmt}+fused_glu" if fused else fmt
            f = jax.jit(lambda p_, x_, c=cfg_f, fu=fused: moe_apply(c, p_, x_, backend,
                                                                    fuse_glu=fu))
            label = f"layer {name} {t}"
            if run.skip(label):
                continue
            m = t * k
            lay = cfg_f.mxfp4_layout
            gate_up = ({"gate_up_glu": default_config(m, E, L, I, quant, True, platform=plat,
                                                      layout=lay).name()} if fused else
                       {"gate_up (x2)": default_config(m, E, L, I, quant, platform=plat,
                                                       layout=lay).name()})
            cfgs = {**gate_up,
                    "down": default_config(m, E, I, L, quant, platform=plat, layout=lay).name()}
            try:
                x = jax.random.normal(jax.random.key(50 + t), (t, D), cfg.jnp_dtype)
                tt = time.perf_counter()
                y = jax.block_until_ready(f(p, x))
                first = time.perf_counter() - tt
                sel = tuple(int(i) for i in np.unique(np.linspace(0, t - 1, min(4, t)).astype(int)))
                yr = jax.jit(lambda p_, x_, c=cfg_f, s=sel: layer_reference(c, p_, x_, s))(p, x)
                err = rel(y[np.asarray(sel)], yr)
                other = {o: rel(y, yo) for o, yo in outs.get(t, {}).items()}
                ms, info = gpu_time(f, p, x, cpu=cpu, reps=5)
                wall_t = wall_ms(lambda: f(p, x), n=2 if cpu else 5, reps=2 if cpu else 3,
                                 warm_s=0 if cpu else 0.3)
                hit = int(hit_fn(x, p["gate"], p["e_score_correction_bias"]))
                flop, wb = layer_counts(cfg_f, t, hit, fmt)
                ent = _rates({"ms": ms, **info, "wall_ms": wall_t}, ms, flop, wb, ceil)
                ent.update(rel_vs_reference=err, reference_tokens=list(sel),
                           rel_vs_other_format=other, ok=bool(err < 2e-2), first_call_s=first,
                           gmm_configs=cfgs, flop=flop, weight_bytes=wb, experts_hit=hit)
                if ent.get("gmm_kernel_ms") is not None:
                    ent["gmm_share_pct"] = 100 * ent["gmm_kernel_ms"] / ms
                outs.setdefault(t, {})[name] = y
                del y, yr
            except Exception as ex:  # noqa: BLE001
                ent = {"error": repr(ex)[:600], "gmm_configs": cfgs}
            res.setdefault(name, {})[str(t)] = ent
            run.log(f"{label} [{cfgs}]: " + json.dumps(ent)[:500])
            run.save()
            if "ms" in ent:
                decode = t * k / E < 24
                run.row("MoE layer, moe_apply at K3 dims (GPU kernel time)", f"{t} tokens, {name} experts",
                        ent["ms"], "ms", limit_pct=ent["pct_copy"] if decode else ent["pct_mm"],
                        note="of copy (all weight bytes)" if decode else "of bf16 matmul peak")
    p = outs = None  # noqa: F841



ROUTER_AREA = "MoE router at K3's shape (7168 x 896 experts, k 16; GPU time)"


def err_f64(logits, x, gate, rows=256):
    """Largest error of router logits over their first `rows` rows against the float64 product,
    relative to the largest exact logit."""
    exact = np.asarray(x[:rows], np.float64) @ np.asarray(gate.astype(jnp.float32), np.float64)
    return float(np.abs(np.asarray(logits[:rows], np.float64) - exact).max() / np.abs(exact).max())


def router_section(run, tokens, cpu):
    from kimik3.layers.moe import ROUTER_SPLIT_ROWS, route, router_fp32, router_logits, router_pieces
    from kernels_pallas.dense import skinny_matmul
    from kernels_pallas.moe.topk import MAX_ROWS, top_k_scores
    import kimik3

    cfg = kimik3.Config.preset("kimi-k3")
    D, E = (256, 64) if cpu else (cfg.hidden_size, cfg.num_experts)
    kx, kg = jax.random.split(jax.random.key(0))
    gate = 0.02 * jax.random.normal(kg, (D, E), jnp.float32)
    fp32, pieces, bf16_gate = jax.jit(router_fp32), jax.jit(router_pieces), jax.jit(router_logits)
    backend = "interpret" if cpu else "pallas"
    route_cfg = cfg.replace(num_experts=E)
    ids = lambda logits: route(logits, jnp.zeros(E), route_cfg)[0]  # noqa: E731
    for n in tokens:
        x = jax.random.normal(jax.random.fold_in(kx, n), (n, D), jnp.float32).astype(jnp.bfloat16)
        want, got = fp32(x, gate), pieces(x, gate)
        same = float(jnp.mean(jnp.all(jnp.sort(ids(want)) == jnp.sort(ids(got)), -1)))
        rel_err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        # which of the two is off: both against the float64 product of up to 256 rows
        off = lambda y, g=gate: err_f64(y, x, g)  # noqa: E731
        ours, _ = gpu_time(pieces, x, gate, cpu=cpu)
        peer, _ = gpu_time(fp32, x, gate, cpu=cpu)
        run.details.setdefault("router", []).append(dict(rows=n, pieces_ms=ours, fp32_ms=peer, same_experts=same,
                                                         max_rel_err=rel_err, pieces_err_f64=off(got),
                                                         fp32_err_f64=off(want)))
        run.log(f"router {n} rows: error vs float64, pieces {off(got):.2e}, fp32 {off(want):.2e}")
        if off(got) > 1e-5:  # the pieces are exact: only the order of fp32 additions may differ
            raise AssertionError(f"the bf16-pieces router is off the float64 product by {off(got):.2e}")
        chosen = "pieces" if n >= ROUTER_SPLIT_ROWS else "fp32"
        run.row(ROUTER_AREA, f"fp32 gate on bf16 pieces, {n} rows", ours * 1e3, "us",
                peer=peer * 1e3, peer_name="fp32 matmul",
                note=f"model: {chosen}; same experts {100 * same:.1f}%")
        # K3 stores the gate in bf16: one bf16 matmul accumulating in fp32 (the model's path)
        g16 = gate.astype(jnp.bfloat16)
        got16, want16 = bf16_gate(x, g16), fp32(x, g16)
        err16 = err_f64(got16, x, g16)
        if err16 > 1e-5:
            raise AssertionError(f"the bf16-gate router is off the float64 product by {err16:.2e}")
        same16 = float(jnp.mean(jnp.all(jnp.sort(ids(want16)) == jnp.sort(ids(got16)), -1)))
        ours16, _ = gpu_time(bf16_gate, x, g16, cpu=cpu)
        peer16, _ = gpu_time(fp32, x, g16, cpu=cpu)
        run.details["router"][-1].update(bf16_gate_ms=ours16, bf16_gate_fp32_ms=peer16,
                                         bf16_gate_err_f64=err16, bf16_gate_same_experts=same16)
        # at decode widths the model computes these logits in the skinny-matmul launch of the
        # layer's input projections (fp32 out): the same products in the kernel's order
        grouped = jax.jit(lambda x, g: skinny_matmul(x, [g], out_dtypes=[jnp.float32], backend=backend)[0])
        got_g = grouped(x, g16)
        run.details["router"][-1].update(
            skinny_err_f64=err_f64(got_g, x, g16),
            skinny_same_experts=float(jnp.mean(jnp.all(jnp.sort(ids(want16)) == jnp.sort(ids(got_g)), -1))))
        # the choice of experts: the top-k kernel against XLA's top_k (a sort), same bits
        scores = jax.nn.sigmoid(got16)
        bias = 0.01 * jax.random.normal(jax.random.fold_in(kg, n), (E,), jnp.float32)
        kern = jax.jit(lambda s, b: top_k_scores(s, b, cfg.num_experts_per_token, backend=backend))
        xla = jax.jit(lambda s, b: top_k_scores(s, b, cfg.num_experts_per_token, backend="reference"))
        (i1, w1), (i0, w0) = kern(scores, bias), xla(scores, bias)
        if not (np.array_equal(i1, i0) and np.array_equal(np.asarray(w1), np.asarray(w0))):
            raise AssertionError("the top-k kernel chose other experts than top_k")
        t_kern, _ = gpu_time(kern, scores, bias, cpu=cpu)
        t_xla, _ = gpu_time(xla, scores, bias, cpu=cpu)
        if n <= MAX_ROWS:  # (past it the kernel's entry point is XLA's top_k)
            run.details["router"][-1]["top_k_us_by_warps"] = {  # the tuning of NUM_WARPS
                w: 1e3 * gpu_time(jax.jit(lambda s, b, w=w: top_k_scores(
                    s, b, cfg.num_experts_per_token, backend=backend, num_warps=w)), scores, bias, cpu=cpu)[0]
                for w in (1, 2, 4, 8)}
            run.row(ROUTER_AREA, f"top-k kernel, {n} rows", t_kern * 1e3, "us", peer=t_xla * 1e3,
                    peer_name="XLA top_k", note="same ids and scores")
        run.row(ROUTER_AREA, f"bf16 gate, one bf16 matmul, {n} rows", ours16 * 1e3, "us",
                peer=peer16 * 1e3, peer_name="fp32 matmul",
                note=f"same experts {100 * same16:.1f}%, "
                     f"{100 * run.details['router'][-1]['skinny_same_experts']:.1f}% from the projections' launch")


def run(rec, args):
    cpu = args.smoke
    if args.lower:
        from kernels_pallas.gpu_lowering import lower_for_gpu
        for name in lower_check(lower_for_gpu, log=rec.log):
            rec.data["errors"][f"lower {name}"] = "does not lower to Triton IR"
        return
    backend = "interpret" if cpu else "pallas"
    has_torch = not cpu and has_cuda_torch()
    ceil = {"copy_TBps": float("nan"), "mm_TFLOPs": float("nan")}
    if "ceil" in args.sections and has_torch:
        ceil = rec.guard("ceilings", ceilings, rec) or ceil
    if "check" in args.sections:
        rec.guard("check", check_variants, rec, backend, list(DEQUANT_VARIANTS), cpu)
    ctx = {"G": 8 if cpu else 896, "TOPK": 2 if cpu else 16, "cpu": cpu, "backend": backend,
           "ceil": ceil, "has_torch": has_torch, "layouts": args.layouts, "only": args.only,
           "mxfp4_extra": extra_configs(args.mxfp4_config),
           "bf16_extra": extra_configs(args.bf16_config)}
    if "layer_gmm" in args.sections:
        shapes = SMOKE_LAYER_GMM_SHAPES if cpu else LAYER_GMM_SHAPES
        # smoke: gate_up covers every kind of row (MXFP4 in both layouts, x split, fused, bf16)
        shapes = {n: shapes[n] for n in (args.gmm_shapes or (["gate_up"] if cpu else shapes))}
        tokens = args.gmm_tokens or ([4] if cpu else [64, 512, 8192])
        rec.guard("layer_gmm", layer_gmm_section, rec, ctx, tokens, shapes)
    if "router" in args.sections:
        rec.guard("router", router_section, rec, args.router_tokens or ([4, 300] if cpu else
                                                                          [16, 256, 8192]), cpu)
    if "layer" in args.sections:
        tokens = args.layer_tokens or ([8] if cpu else [64, 512, 8192])
        rec.guard("layer", layer_section, rec, ctx, tokens, args.layer_formats, args.layer_glu)
