"""MoE grouped matmul benchmark: ours (Pallas-Triton moe_gmm, bf16 and MXFP4 with each
dequantisation variant) vs torch._grouped_mm (and optionally jax.lax.ragged_dot), at K3 shapes, with
the copy-bandwidth and dense-matmul ceilings measured in the same process. One device call:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_moe_gmm.py  # H200: $OUT/moe_gmm.json
  PYTHONPATH=. python benchmarks/bench_moe_gmm.py --cpu-smoke    # here: tiny shapes, interpret
  PYTHONPATH=. python benchmarks/bench_moe_gmm.py --lower-check  # here: lower every swept kernel
                          # for CUDA (H200 gpu_info, kernels_pallas/gpu_lowering.py) to Triton IR
  PYTHONPATH=/tmp/tri:. python benchmarks/bench_moe_gmm.py --sass [variants]  # here: SASS of
                          # the K loop per dequantised weight, registers, spill of the 64-token
                          # MXFP4 sweep (upstream Triton 3.6 for sm_90, as kernel_resources.py;
                          # pip install triton==3.6.0 --target /tmp/tri)

Sections (env BENCH_SECTIONS, comma separated; default "ceil,decode,prefill"):
  ceil     torch copy bandwidth (read + write) and bf16 8192^3 matmul; JAX x*2 and matmul.
  decode   MXFP4 at BENCH_DECODE_TOKENS (default 64,512): the dequant-variant x block-config sweep,
           bf16 at its best known config, torch._grouped_mm on the dequantised bf16 weights. Every
           MXFP4 case is also checked bit-exact on the device with the same compiled kernel: expert 0
           of a second weight set holds every byte value, scale bytes 16..142 and an all-zero group
           with scale byte 0; x rows are one-hot, so out[i, n] must equal w0[n, c_i] exactly.
  prefill  bf16 at BENCH_PREFILL_TOKENS (default 8192): block-config sweep vs torch._grouped_mm.
  check    (opt-in) the exactness check per variant at small shapes, plus a grouping with empty
           experts and sum < M against the reference.
  dense    (opt-in) the older correctness grid: bf16 / fp32 / MXFP4 x 3 groupings, fused GLU.
  ragged   (opt-in) jax.lax.ragged_dot as a second peer (its dense expansion takes seconds).
  glu      (opt-in) fused gate/up + SiTU at the TP8 slice.
BENCH_VARIANTS: only these dequant variants in decode (default: all in the sweep). The two PTX
variants side by side (64 and 512 tokens, every MXFP4 row also checked bit-exact), one device call:
  BENCH_SECTIONS=ceil,decode BENCH_VARIANTS=split_asm_sub,split_asm_t PYTHONUNBUFFERED=1 \
    PYTHONPATH=. python3 benchmarks/bench_moe_gmm.py
BENCH_BUDGET_S (default 150): cases that would start after this many seconds are skipped (listed in
the JSON); a watchdog writes the JSON and exits if one case hangs for BENCH_CASE_LIMIT_S (default 90).
The JSON is rewritten after every case.

Shapes: 896 experts, top-16, latent K = 3584, expert intermediate 3072; one TP8 rank's slice of the
fused gate+up projection (N = 2 * 3072 / 8 = 768); rows = 16 x tokens, random routing (each token
picks 16 distinct experts uniformly). The bf16 weights are the exact dequantisation of the MXFP4 ones,
so every variant computes the same product. Counted: FLOP = 2 * rows * K * N; weight bytes = bytes of
the experts that received rows (bf16: 2 B/elem; MXFP4 packed: 0.5 + 1/32 B/elem), since an empty
expert's weights need not be read; % of copy = (weight bytes / time) / (copy bytes read + written /
copy time).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas.moe import mxfp4  # noqa: E402
from kernels_pallas.moe.gmm import (DEQUANT_VARIANTS, GmmConfig, default_config,  # noqa: E402
                                    moe_gmm, moe_gmm_glu)
from kernels_pallas.moe.reference import MXFP4Weight  # noqa: E402

# MXFP4 decode sweep. The first is the best config of the 2026-11-29 run (first dequantisation); the
# comments give SASS instructions per dequantised weight in the K loop (upstream Triton 3.6 for sm_90,
# compiled on a CPU machine; see the docstring of kernels_pallas/moe/gmm.py).
C = GmmConfig
DECODE_SWEEP = [
    C(16, 128, 128, num_warps=4, num_stages=4),                                   # interleave   9.5
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split"),                  # (a)          8.7
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_bf16"),             # (a)+(c)      7.9
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm"),              # PTX, normal  5.3
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm_sub"),          # PTX, subnorm 4.0
    C(16, 128, 512, num_warps=8, num_stages=3, dequant="split_asm"),
    C(16, 128, 512, num_warps=8, num_stages=3, dequant="split_asm_sub"),          # 4.2
    C(16, 64, 256, num_warps=4, num_stages=4, dequant="split_asm_sub"),           # 4.5
    C(16, 256, 128, num_warps=8, num_stages=4, dequant="split_asm_sub"),          # 4.2
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm_sub", x_split="stride"),  # 5.1
    # transposed product (wgmma, weights in registers), `_perm_t` order; 179 / 119 / 170 registers
    C(16, 128, 256, num_warps=4, num_stages=4, dequant="split_asm_t"),            # 3.18
    C(16, 128, 256, num_warps=8, num_stages=4, dequant="split_asm_t"),            # 3.48
    C(16, 256, 256, num_warps=8, num_stages=3, dequant="split_asm_t"),            # 3.14
]
# at 512 tokens (9 rows per expert): the baseline and the variants' best guesses only
DECODE_SWEEP_512 = [DECODE_SWEEP[i] for i in (0, 2, 3, 4, 6, 8, 10, 11)]
BF16_DECODE = {64: C(16, 256, 128, num_warps=8, num_stages=4),
               512: C(32, 128, 128, block_m_small=16, num_warps=4, num_stages=4)}
PREFILL_SWEEP = [
    C(128, 256, 64, block_m_small=32, num_warps=8, num_stages=3),  # best of 2026-11-29 (1.992 ms)
    C(128, 256, 64, block_m_small=32, num_warps=8, num_stages=4),  # deeper pipeline (192 KiB smem)
    C(128, 128, 128, block_m_small=32, num_warps=8, num_stages=3),
    C(128, 128, 64, block_m_small=32, num_warps=4, num_stages=4),
    C(64, 256, 64, block_m_small=32, num_warps=4, num_stages=4),   # 3 tiles per 146-row expert
]


def sweep_cases(G=896, K=3584, N=768, topk=16):
    """(name, fn, args) of every kernel the default sweep runs, as abstract shapes."""
    sd = jax.ShapeDtypeStruct
    wq = MXFP4Weight(sd((G, N, K // 2), jnp.uint8), sd((G, N, K // 32), jnp.uint8))
    wb = sd((G, K, N), jnp.bfloat16)
    gs = sd((G,), jnp.int32)
    out = []

    def add(tokens, w, cfg):
        x = sd((tokens * topk, K), jnp.bfloat16)
        kind = "mxfp4" if isinstance(w, MXFP4Weight) else "bf16"
        out.append((f"{kind} tokens {tokens} {cfg.name()}",
                    lambda a, b, c, cfg=cfg: moe_gmm(a, b, c, backend="pallas", config=cfg),
                    (x, w, gs)))
    for cfg in DECODE_SWEEP:
        add(64, wq, cfg)
    for cfg in DECODE_SWEEP_512:
        add(512, wq, cfg)
    for tokens, cfg in BF16_DECODE.items():
        add(tokens, wb, cfg)
    for cfg in PREFILL_SWEEP:
        add(8192, wb, cfg)
    return out


def lower_check(lower_cuda, log=print):
    """Lower every swept kernel for CUDA (no GPU needed); returns the names that failed."""
    bad = []
    for name, fn, args in sweep_cases():
        t = time.perf_counter()
        try:
            lower_cuda(fn, *args)
            log(f"lowered  {name}  ({time.perf_counter() - t:.2f} s)")
        except Exception as ex:  # noqa: BLE001
            bad.append(name)
            log(f"FAILED   {name}: {repr(ex)[:300]}")
    log(f"{len(sweep_cases()) - len(bad)}/{len(sweep_cases())} swept kernels lower to Triton IR")
    return bad


def sass_report(variants=None, log=print):
    """Compile the 64-token MXFP4 decode sweep for sm_90 with upstream Triton (no GPU needed) and
    count the SASS of the K loop (the longest backward branch): instructions per dequantised weight
    (per thread: block_n * block_k / threads), registers, spill bytes, the most frequent opcodes."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from kernel_resources import compile_ttir

    from kernels_pallas.gpu_lowering import triton_ir

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    rows = []
    for cfg, (name, fn, args) in zip(DECODE_SWEEP, sweep_cases()):  # the 64-token MXFP4 cases
        assert name == f"mxfp4 tokens 64 {cfg.name()}", name
        if variants and cfg.dequant not in variants:
            continue
        [ttir] = triton_ir(fn, *args)
        k = compile_ttir(ttir, "sm_90", cfg.num_warps, cfg.num_stages)
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as fh:
                fh.write(k.asm["cubin"])
            usage = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cubin],
                                   capture_output=True, text=True).stdout
            sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", cubin],
                                  capture_output=True, text=True).stdout
        labels, lines, pending = {}, [], None
        for ln in sass.splitlines():
            m = re.match(r"\s*\.L_x_(\d+):", ln)
            if m:
                pending = m.group(1)
                continue
            m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
            if m:
                addr = int(m.group(1), 16)
                if pending is not None:
                    labels[pending], pending = addr, None
                lines.append((addr, m.group(2).strip()))
        loops = [(labels[b.group(1)], a) for a, ins in lines
                 if (b := re.search(r"BRA.*\.L_x_(\d+)", ins))
                 and labels.get(b.group(1), a + 1) <= a]
        lo, hi = max(loops, key=lambda r: r[1] - r[0])
        body = [re.sub(r"^@!?U?P\w+\s+", "", ins) for a, ins in lines if lo <= a <= hi]
        ops = collections.Counter(ins.split()[0].split(".")[0] for ins in body)
        per_thread = cfg.block_n * cfg.block_k / (32 * cfg.num_warps)
        regs = int((re.findall(r"REG:(\d+)", usage) or [-1])[0])
        spill = int((re.findall(r"STACK:(\d+)", usage) or [-1])[0])
        row = (f"{cfg.name():<44} {len(body) / per_thread:5.2f} /weight  {len(body):5d} instr  "
               f"regs {regs:3d}  spill {spill}  "
               + ", ".join(f"{o} {c}" for o, c in ops.most_common(8)))
        rows.append(row)
        log(row)
    return rows


def rel(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def wall(f, n=20, reps=5):
    """Median over `reps` of the mean time of n back-to-back calls (ms); f() returns arrays."""
    jax.block_until_ready(f())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            r = f()
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / n * 1e3)
    return float(np.median(out))


def torch_wall(f, n=20, reps=5):
    import torch
    f()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n * 1e3)
    return float(np.median(out))


def routing(rng, tokens, g, topk):
    choice = np.argsort(rng.random((tokens, g)), axis=1)[:, :topk]
    return np.bincount(choice.ravel(), minlength=g).astype(np.int32)


def random_mxfp4(key, g, n, k):
    k1, k2 = jax.random.split(key)
    packed = jax.random.randint(k1, (g, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(k2, (g, n, k // 32), 117, 122, jnp.int32).astype(jnp.uint8)
    return MXFP4Weight(packed, scales)


class Run:
    """Results, log, time budget and the JSON written after every case."""

    def __init__(self, out_dir, budget_s, case_limit_s):
        self.res = {"date": time.strftime("%Y-%m-%d"), "jax": jax.__version__,
                    "device": str(jax.devices()[0]), "skipped": []}
        self.lines = []
        self.t0 = time.perf_counter()
        self.out_dir = out_dir
        os.makedirs(out_dir, exist_ok=True)
        self.budget = budget_s
        self.case_limit = case_limit_s
        self.case = None
        self.case_t = None
        self.lock = threading.Lock()

    def log(self, s):
        s = f"[{self.elapsed():5.0f}s] {s}"
        print(s, flush=True)
        self.lines.append(s)

    def elapsed(self):
        return time.perf_counter() - self.t0

    def save(self):
        with self.lock:
            with open(os.path.join(self.out_dir, "moe_gmm.json"), "w") as fh:
                json.dump(self.res, fh, indent=1, default=str)
            with open(os.path.join(self.out_dir, "moe_gmm_log.txt"), "w") as fh:
                fh.write("\n".join(self.lines) + "\n")

    def start(self, name):
        """False (and the case is listed as skipped) once the budget is spent."""
        if self.elapsed() > self.budget:
            self.res["skipped"].append(name)
            return False
        self.case, self.case_t = name, time.perf_counter()
        return True

    def done(self):
        self.case = None
        self.save()

    def watchdog(self):
        def loop():
            while True:
                time.sleep(2)
                c, t = self.case, self.case_t
                if c is not None and time.perf_counter() - t > self.case_limit:
                    self.res["stalled"] = f"{c} ran past {self.case_limit:.0f} s (compile or run)"
                    self.log(f"WATCHDOG: {self.res['stalled']}; writing results and exiting")
                    self.save()
                    os._exit(3)
        threading.Thread(target=loop, daemon=True).start()


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
    for cfg in cfgs:
        name = cfg.name()
        if not run.start(f"check {name}"):
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
        run.res["check"] = checks
        run.log(f"check {name}: {json.dumps(checks[name])[:300]}")
        run.done()
    nbad = sum(not v["ok"] for v in checks.values())
    run.log(f"check: {len(checks) - nbad}/{len(checks)} variants exact and within tolerance")


def dense_correctness(run, backend):
    """The older grid: bf16 / fp32 / MXFP4 x groupings x 2 configs, fused GLU (opt-in)."""
    rng = np.random.default_rng(1)
    checks = {}
    m, k, n, g = 300, 256, 192, 12
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wq = random_mxfp4(jax.random.key(5), g, n, k)
    wd = jnp.swapaxes(mxfp4.dequantize(wq.packed, wq.scales, jnp.float32), 1, 2)
    groupings = {
        "empty+short": np.array([40, 0, 0, 77, 5, 0, 60, 1, 0, 30, 0, 17], np.int32),
        "one_takes_all": np.eye(g, dtype=np.int32)[4] * m,
        "random": np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32),
    }
    cfgs = [C(16, 64, 128), C(64, 64, 64, block_m_small=16)]
    if not run.start("dense correctness"):
        return
    for gname, gs in groupings.items():
        gs = jnp.asarray(gs)
        tot = int(gs.sum())
        for wname, w, xx in [("bf16", wd.astype(jnp.bfloat16), x),
                             ("fp32", wd, x.astype(jnp.float32)), ("mxfp4", wq, x)]:
            ref = moe_gmm(xx, w, gs, backend="reference")
            for ci, cfg in enumerate(cfgs):
                name = f"{gname}/{wname}/cfg{ci}"
                try:
                    y = moe_gmm(xx, w, gs, backend=backend, config=cfg)
                    e = rel(y, ref)
                    tail_zero = bool(jnp.all(y[tot:] == 0))
                    tol = 1e-2 if xx.dtype == jnp.bfloat16 else 1e-4
                    checks[name] = {"rel": e, "tail_zero": tail_zero, "ok": e < tol and tail_zero}
                except Exception as ex:  # noqa: BLE001
                    checks[name] = {"ok": False, "error": repr(ex)[:400]}
        for act in ("swiglu", "situ"):
            w3 = random_mxfp4(jax.random.key(9), g, n, k)
            try:
                y = moe_gmm_glu(x, wq, w3, gs, activation=act, backend=backend,
                                config=C(64, 64, 64, block_m_small=16, dequant="split_asm_sub"))
                r = moe_gmm_glu(x, wq, w3, gs, activation=act, backend="reference")
                e = rel(y, r)
                checks[f"{gname}/glu_{act}/mxfp4"] = {"rel": e, "ok": e < 1e-2 and bool(
                    jnp.all(y[tot:] == 0))}
            except Exception as ex:  # noqa: BLE001
                checks[f"{gname}/glu_{act}/mxfp4"] = {"ok": False, "error": repr(ex)[:400]}
    bad = {k_: v for k_, v in checks.items() if not v["ok"]}
    run.res["dense_correctness"] = checks
    run.log(f"dense correctness: {len(checks) - len(bad)}/{len(checks)} ok"
            + (f"; failing: {json.dumps(bad)[:1500]}" if bad else ""))
    run.done()


def ceilings(run, cpu):
    if cpu or not run.start("ceilings"):
        return {"copy_TBps": float("nan"), "mm_TFLOPs": float("nan")}
    import torch
    x = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = torch_wall(lambda: y.copy_(x), n=20)
    copy = 2 * x.numel() * 2 / ms / 1e9
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = torch_wall(lambda: a @ b, n=20)
    mm = 2 * 8192 ** 3 / ms / 1e9
    del a, b
    xa = jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)
    f = jax.jit(lambda v: v * 2)
    jcopy = 2 * xa.size * 2 / wall(lambda: f(xa)) / 1e9
    del xa
    aj = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    g = jax.jit(lambda u: u @ u)
    jmm = 2 * 8192 ** 3 / wall(lambda: g(aj)) / 1e9
    c = {"copy_TBps": copy, "mm_TFLOPs": mm, "jax_x2_TBps": jcopy, "jax_mm_TFLOPs": jmm}
    run.res["ceilings"] = c
    run.log(f"ceilings: torch copy {copy:.2f} TB/s (r+w), torch bf16 mm {mm:.0f} TFLOP/s, "
            f"jax x*2 {jcopy:.2f} TB/s, jax mm {jmm:.0f} TFLOP/s")
    run.done()
    return c


def torch_peer(x, w_nk, gs, flop, wbytes_bf16):
    import torch
    xt = torch.from_dlpack(x)
    wt = torch.from_dlpack(w_nk).transpose(-2, -1)
    offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))
    f = lambda: torch._grouped_mm(xt, wt, offs=offs)  # noqa: E731
    y = f()
    ms = torch_wall(f)
    ent = {"ms": ms, "TFLOPs": flop / ms / 1e9, "weight_TBps_bf16": wbytes_bf16 / ms / 1e9}
    return ent, jnp.asarray(np.asarray(y.float().cpu()))


def exact_inputs(wq, m, k, n, g):
    """A copy of `wq` whose expert 0 holds every byte value and scale bytes 16..142 (plus an all-zero
    group with scale byte 0), one-hot x rows (column c_i of row i) and all rows on expert 0: the
    kernel's out[i, :] must equal the exact dequantised w0[:, c_i]."""
    rng = np.random.default_rng(11)
    p0 = ((np.arange(n)[:, None] * 7 + np.arange(k // 2)[None, :]) % 256).astype(np.uint8)
    sset = np.array([16, 17, 60, 100, 110, 117, 120, 122, 126, 127, 128, 130, 142], np.uint8)
    s0 = rng.choice(sset, (n, k // 32)).astype(np.uint8)
    p0[3, 16:32] = 0  # an all-zero group (columns 32..63 of row 3) with scale byte 0
    s0[3, 1] = 0
    w = MXFP4Weight(wq.packed.at[0].set(jnp.asarray(p0)), wq.scales.at[0].set(jnp.asarray(s0)))
    c = (np.arange(m) * 7 + np.arange(m) // k) % k  # both nibbles, every group offset
    x = np.zeros((m, k), np.float32)
    x[np.arange(m), c] = 1.0
    want = np.asarray(mxfp4.dequantize(p0, s0, jnp.float32))[:, c].T  # [m, n]
    gs = np.zeros(g, np.int32)
    gs[0] = m
    return jnp.asarray(x, jnp.bfloat16), w, jnp.asarray(gs), want


def time_ours(x, w, gs, cfg, backend, cpu, flop, wbytes, copy, y_peer, exact=None):
    try:
        f = jax.jit(lambda a, b, c, cfg=cfg: moe_gmm(a, b, c, backend=backend, config=cfg))
        t = time.perf_counter()
        y = jax.block_until_ready(f(x, w, gs))
        compile_s = time.perf_counter() - t
        err = rel(y, y_peer) if y_peer is not None else float("nan")
        ms = wall(lambda: f(x, w, gs), n=2 if cpu else 20)
        ent = {"ms": ms, "TFLOPs": flop / ms / 1e9, "weight_TBps": wbytes / ms / 1e9,
               "pct_copy": 100 * wbytes / ms / 1e9 / copy if copy == copy else None,
               "rel_vs_peer": err, "ok": bool(err < 1e-2) if err == err else None,
               "first_call_s": compile_s, "config": cfg.name()}
        if exact is not None:  # same shapes: the compiled kernel is reused
            xe, we, ge, want = exact
            ye = np.asarray(f(xe, we, ge), np.float32)
            ent["exact_mismatches"] = int(np.sum(ye != want))
            ent["ok"] = ent["ok"] is not False and ent["exact_mismatches"] == 0
        del y
    except Exception as ex:  # noqa: BLE001
        ent = {"error": repr(ex)[:600], "config": cfg.name()}
    return ent


def run_bench(args):
    cpu = args.cpu_smoke
    backend = "interpret" if cpu else "pallas"
    sections = set(os.environ.get("BENCH_SECTIONS", "ceil,decode,prefill").split(","))
    variants = os.environ.get("BENCH_VARIANTS")
    variants = variants.split(",") if variants else list(DEQUANT_VARIANTS)
    dec_tokens = [int(t) for t in os.environ.get(
        "BENCH_DECODE_TOKENS", "4,32" if cpu else "64,512").split(",") if t]
    pre_tokens = [int(t) for t in os.environ.get(
        "BENCH_PREFILL_TOKENS", "64" if cpu else "8192").split(",") if t]
    run = Run(os.environ.get("OUT", "/tmp"), float(os.environ.get("BENCH_BUDGET_S", "150")),
              float(os.environ.get("BENCH_CASE_LIMIT_S", "90")))
    run.res.update(sections=sorted(sections), variants=variants)
    run.watchdog()
    try:
        import torch
        run.res["torch"] = torch.__version__
        has_torch = (not cpu) and torch.cuda.is_available()
        if has_torch:
            run.res["device_name"] = torch.cuda.get_device_name()
    except ImportError:
        has_torch = False
    run.log(f"jax {jax.__version__} on {run.res['device']}; torch: {run.res.get('torch', 'missing')};"
            f" sections {sorted(sections)}")
    if "check" in sections:
        check_variants(run, backend, [v for v in DEQUANT_VARIANTS if v in variants], cpu)
    if "dense" in sections:
        dense_correctness(run, backend)
    ceil = ceilings(run, cpu) if "ceil" in sections else {"copy_TBps": float("nan")}
    copy = ceil["copy_TBps"]

    if cpu:
        G, TOPK, K, N = 8, 2, 128, 64
    else:
        G, TOPK, K, N = 896, 16, 3584, 768
    need_w = sections & {"decode", "prefill", "glu"}
    if need_w:
        wq = random_mxfp4(jax.random.key(42), G, N, K)
        w_nk = jax.jit(lambda p, s: mxfp4.dequantize(p, s, jnp.bfloat16))(wq.packed, wq.scales)
        w_kn = jax.jit(lambda a: jnp.swapaxes(a, 1, 2))(w_nk)
        jax.block_until_ready(w_kn)
        run.log("weights ready")
    rng = np.random.default_rng(0)
    run.res["cases"] = {}
    table = []

    def case_inputs(tokens):
        m = tokens * TOPK
        gs_np = routing(rng, tokens, G, TOPK)
        nonempty = int((gs_np > 0).sum())
        x = jax.random.normal(jax.random.key(tokens), (m, K), jnp.bfloat16)
        case = {"rows": m, "tokens": tokens, "nonempty_experts": nonempty,
                "max_rows_per_expert": int(gs_np.max()), "flop": 2 * m * K * N}
        wbytes = {"bf16": nonempty * K * N * 2, "mxfp4": nonempty * (K * N // 2 + K * N // 32)}
        return m, jnp.asarray(gs_np), x, case, wbytes

    def peers(tokens, x, gs, case, wbytes):
        y_peer = None
        if has_torch and run.start(f"torch {tokens}"):
            try:
                case["torch_grouped_mm"], y_peer = torch_peer(x, w_nk, gs, case["flop"],
                                                              wbytes["bf16"])
            except Exception as ex:  # noqa: BLE001
                case["torch_grouped_mm"] = {"error": repr(ex)[:400]}
            run.log(f"tokens {tokens} torch._grouped_mm: "
                    + json.dumps(case["torch_grouped_mm"])[:200])
            run.done()
        if "ragged" in sections and run.start(f"ragged_dot {tokens}"):
            rdf = jax.jit(lambda a, b, c: jax.lax.ragged_dot(
                a, b, c, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
            try:
                t = time.perf_counter()
                y_rd = jax.block_until_ready(rdf(x, w_kn, gs))
                first = (time.perf_counter() - t) * 1e3
                ms = first if first > 2000 else wall(lambda: rdf(x, w_kn, gs), n=3, reps=3)
                case["jax_ragged_dot"] = {"ms": ms, "note": "incl. compile" if first > 2000 else ""}
                y_peer = y_rd if y_peer is None else y_peer
            except Exception as ex:  # noqa: BLE001
                case["jax_ragged_dot"] = {"error": repr(ex)[:400]}
            run.done()
        if y_peer is None and run.start(f"reference {tokens}"):  # no torch: the plain-JAX reference
            y_peer = jax.jit(lambda a, b, c: moe_gmm(a, b, c, backend="reference"))(x, w_kn, gs)
            run.done()
        return y_peer

    def sweep(tokens, wname, w, cfgs, x, gs, case, wbytes, y_peer, exact=None):
        tt = case.get("torch_grouped_mm", {}).get("ms")
        for cfg in cfgs:
            key = f"ours_{wname}_{cfg.name()}"
            if not run.start(f"{tokens} {key}"):
                continue
            ent = time_ours(x, w, gs, cfg, backend, cpu, case["flop"], wbytes[wname], copy, y_peer,
                            exact)
            case[key] = ent
            run.log(f"tokens {tokens} {key}: " + json.dumps(ent)[:260])
            run.done()
            if "ms" in ent:
                table.append((wname, tokens, cfg.dequant if wname == "mxfp4" else "-", cfg.name(),
                              ent, tt))

    for section, token_list in (("decode", dec_tokens), ("prefill", pre_tokens)):
        if section not in sections:
            continue
        for tokens in token_list:
            m, gs, x, case, wbytes = case_inputs(tokens)
            run.res["cases"][str(tokens)] = case
            y_peer = peers(tokens, x, gs, case, wbytes)
            if section == "prefill":
                cfgs = PREFILL_SWEEP if not cpu else [C(32, 32, 64, block_m_small=16)]
                sweep(tokens, "bf16", w_kn, cfgs, x, gs, case, wbytes, y_peer)
                continue
            cfgs = DECODE_SWEEP if tokens <= 64 else DECODE_SWEEP_512
            cfgs = [c for c in cfgs if c.dequant in variants]
            if cpu:
                cfgs = list(dict.fromkeys(C(16, 32, 64, dequant=c.dequant, x_split=c.x_split)
                                          for c in cfgs))
            sweep(tokens, "mxfp4", wq, cfgs, x, gs, case, wbytes, y_peer,
                  exact_inputs(wq, m, K, N, G))
            bcfg = BF16_DECODE.get(tokens, BF16_DECODE[64]) if not cpu else C(16, 32, 64)
            sweep(tokens, "bf16", w_kn, [bcfg], x, gs, case, wbytes, y_peer)
            del x

    if "glu" in sections and not cpu:
        run.res["glu"] = {}
        w1 = MXFP4Weight(wq.packed[:, : N // 2], wq.scales[:, : N // 2])
        w3 = MXFP4Weight(wq.packed[:, N // 2:], wq.scales[:, N // 2:])
        for tokens in dec_tokens:
            if not run.start(f"glu {tokens}"):
                continue
            m = tokens * TOPK
            gs = jnp.asarray(routing(rng, tokens, G, TOPK))
            x = jax.random.normal(jax.random.key(tokens + 1), (m, K), jnp.bfloat16)
            try:
                f = jax.jit(lambda a, c: moe_gmm_glu(a, w1, w3, c, activation="situ",
                                                     backend=backend))
                ms = wall(lambda: f(x, gs))
                cfg = default_config(m, G, K, N // 2, True, True)
                run.res["glu"][str(tokens)] = {"ms": ms, "TFLOPs": 2 * m * K * N / ms / 1e9,
                                               "config": cfg.name()}
            except Exception as ex:  # noqa: BLE001
                run.res["glu"][str(tokens)] = {"error": repr(ex)[:400]}
            run.log(f"glu situ mxfp4 tokens {tokens}: {json.dumps(run.res['glu'][str(tokens)])}")
            run.done()

    # summary table
    rows = []
    hdr = ("weights tokens variant | config | ms | TFLOP/s | weight TB/s | % copy | torch ms | "
           "torch/ours | rel vs torch | exact")
    run.log(hdr)
    for wname, tokens, variant, cname, e, tt in table:
        pct = "-" if e.get("pct_copy") is None else "%.0f%%" % e["pct_copy"]
        peer = "- | -" if tt is None else "%.3f | %.2fx" % (tt, tt / e["ms"])
        line = (f"{wname} {tokens} {variant} | {cname} | {e['ms']:.3f} | {e['TFLOPs']:.0f} | "
                f"{e['weight_TBps']:.2f} | {pct} | {peer} | {e['rel_vs_peer']:.1e} | "
                + ("-" if "exact_mismatches" not in e else
                   "yes" if e["exact_mismatches"] == 0 else f"NO ({e['exact_mismatches']} differ)"))
        rows.append(line)
        run.log(line)
    run.res["table"] = rows
    if run.res["skipped"]:
        run.log(f"skipped (budget {run.budget:.0f} s): {run.res['skipped']}")
    run.log(f"total {run.elapsed():.0f} s")
    run.save()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--lower-check", action="store_true")
    ap.add_argument("--sass", nargs="*", default=None, metavar="VARIANT",
                    help="offline SASS counts of the 64-token MXFP4 sweep (optionally: variants)")
    a = ap.parse_args()
    if a.sass is not None:
        sass_report(a.sass or None)
        sys.exit(0)
    if a.lower_check:
        from kernels_pallas.gpu_lowering import lower_for_gpu as lower_cuda  # noqa: E402
        sys.exit(1 if lower_check(lower_cuda) else 0)
    run_bench(a)
