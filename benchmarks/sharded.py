"""Multi-GPU measurements for issue 8 on a reduced K3, over all n visible devices (TPn = a
`make_mesh(tensor=n)` mesh; DCPn = the MLA cache positions split over that same tensor axis,
`dcp_axes=("tensor",)`).

Run on a machine with 8, 4 or 2 GPUs (all visible devices are used):

    python -m benchmarks sharded [--sections dcp,moe_dedup] [--contexts 32768,131072]
    python -m benchmarks sharded --smoke     # CPU: 8 fake devices, tiny config (the tests run it)

NVLink multicast stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are set (setdefault) before JAX starts a backend.

The model: K3's real per-layer shapes (hidden 7168, 96 KDA heads, 96 MLA heads with the 576-wide
latent cache, dense layer 0 at 33792, latent MoE: 896 MXFP4 experts of 3072 in a 3584 latent, 2
shared experts, vocab 163840), cut to --layers layers (default kda,kda,mla as in
the engine benchmark: a dense KDA layer, a KDA + MoE layer, an MLA + MoE layer); random weights, seed 0.
About 38 GB of weights in bf16 (the fp32 check: ~19 GB with 64 experts); the one-device
references of the correctness section hold a whole copy on device 0. Smoke: the tiny preset cut to kda,mla with 8
KDA / MLA heads and a MoE intermediate of 256 (everything splits 8 ways), fp32.

Sections, in the JSON's details (OUT/sharded.json, rewritten after every section and every
measured row):
  machine      device count, device_kind, platform, jax version, the NCCL variables.
  correctness  (item 1) greedy tokens and logits of one device vs TPn vs TPn + DCPn, 4 prompts of
               different lengths (one shorter than n), prefill + 7 decode steps (kimik3.prefill
               and decode_step; each run feeds its own argmax). Verdict pass ("equal"): fp32
               compute, the plain-JAX kernels (--check-backend, default "reference"), matmuls
               at "highest", 64 of the 896 experts (--check-experts; the plain-JAX MoE
               dequantises all experts at once: ~40 GB per fp32 weight at 896); equal = identical
               tokens and logits within 1e-3 of the largest |logit| (compared up to a row's first
               differing token). Informational pass (GPU only, run last): the config as timed
               (bf16, 896 experts, default backend: Pallas kernels); bf16 TP sums in another order
               may flip near-tied random-weight greedy tokens.
  owned_rows   (item 4) per-GPU parameter bytes with Config.moe_dedup True and False, from the
               placed arrays' addressable shards and from kimik3.memory_report; the bytes dedup
               frees and what they buy in MLA cache tokens per GPU (freed / cache bytes per token
               per GPU, model dtype and fp8, DCP1 and DCPn); the same arithmetic for the full K3.
  dcp          (item 2) per context (--contexts, default 32K, 64K, 128K) and variant (dcp1 =
               TPn with the cache replicated, dcpN = TPn + DCPn; --dcp-ref adds dcp1-ref,
               dcp1 on the plain-JAX backend): per-GPU MLA cache bytes from the cache arrays'
               addressable shards and from memory_report (model dtype and fp8), per-GPU KDA state
               bytes (actual and memory_report), and the decode step time at batch --batch:
               the cache is allocated for ctx + a few steps, filled with random latents and set to
               length ctx (no prefill), then one jitted lax.fori_loop of --steps greedy decode
               steps (tokens fed back on device) is compiled ahead (lower().compile(), compile
               time reported apart), called once to warm up, then called --reps times back to
               back; step time = wall time of those calls up to block_until_ready / (reps *
               steps). The MLA attention that ran is recorded (under DCP: the flash-decoding kernel
               on each shard's positions in shard_map plus a log-sum-exp merge). "summary": per context
               the cache ratio, both step times, the speedup, the time saved per MLA layer.
  moe_dedup    (item 3) one MoE layer (the model's first, weights placed by place_moe_params)
               with Config.moe_dedup True vs False under TPn: per-layer time (a jitted fori_loop
               of --steps layer calls, output RMS-normalised and fed back, same timing
               protocol) for --moe-tokens tokens, and the collectives of one layer
               (kimik3.layers.moe.moe_layer_tp compiled; counts by sharding.moe.count_collectives, and each
               op's result type and bytes per device parsed from the same HLO text); then the
               whole decode step at context --moe-ctx with the model placed each way (time,
               and the static collective count of the compiled decode loop: per step while
               hlo_has_while_loop is true).
  skipped      what the budget (--budget-s) left out.
Order of work: correctness (verdict), owned_rows, dcp at the first context, moe_dedup, dcp at the
other contexts (a tight budget drops the longest contexts first), the informational correctness
pass. A failing measurement is recorded as an "error" entry and the run goes on; where the
default backend fails on the mesh, the row is retried with backend="reference" and says so.

"""
from __future__ import annotations

import os

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

import contextlib
import functools
import gc
import math
import re
import time
import traceback

import numpy as np

import kimik3  # applies its XLA workarounds before JAX starts a client
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import sharding
from kernels_pallas import resolve_backend
from kimik3.layers.common import F32, rms_normalize
from kimik3.layers.mla import CACHE_DIM
from kimik3.layers.moe import moe_layer_tp, moe_sharded, moe_weight_axes
from kimik3.runtime import mesh_context
from sharding.moe import count_collectives, per_device_param_bytes
from .common import ints_arg, names_arg

SECTION_NAMES = ("correctness", "owned_rows", "dcp", "moe_dedup", "timed_check")
CHECK_SEQ, CHECK_NEW, CHECK_TOL = 64, 8, 1e-3


def add_args(p):
    p.add_argument("--sections", type=names_arg, default=list(SECTION_NAMES),
                   help="comma list of " + ", ".join(SECTION_NAMES) + " (a re-run can skip what an earlier run measured)")
    p.add_argument("--contexts", type=ints_arg, default=None, help="DCP contexts (32768,65536,131072)")
    p.add_argument("--batch", type=int, default=None, help="decode batch (8)")
    p.add_argument("--steps", type=int, default=None, help="decode steps or layer calls a timed loop (8)")
    p.add_argument("--reps", type=int, default=None, help="timed calls after the warm-up (3)")
    p.add_argument("--moe-tokens", type=ints_arg, default=None, help="MoE layer token counts (8,256)")
    p.add_argument("--moe-ctx", type=int, default=None, help="context of the dedup decode step (4096)")
    p.add_argument("--layers", type=names_arg, default=None, help="layer types (kda,kda,mla)")
    p.add_argument("--backend", default=None, help="kernel backend of the timed runs (default: the library's)")
    p.add_argument("--check-backend", default="reference", help="backend of the verdict pass")
    p.add_argument("--check-experts", type=int, default=None,
                   help="experts in the verdict pass (64; 0: all): its plain-JAX MoE dequantises "
                        "every expert to fp32 at once, ~40 GB per weight at 896")
    p.add_argument("--dcp-ref", action="store_true", help="also time dcp1 with the plain-JAX backend")


def prepare_env(args):
    """NVLink multicast off before NCCL starts; on the CPU smoke run 8 devices and cheaper LLVM
    compiles (its timings mean nothing)."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if args.smoke:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            flags += " --xla_force_host_platform_device_count=8"
        os.environ["XLA_FLAGS"] = (flags + " --xla_backend_optimization_level=0"
                                   " --xla_llvm_disable_expensive_passes=true").strip()


def configure(args):
    """The run's settings as module globals (the functions below read them)."""
    global SMOKE, BUDGET_S, CONTEXTS, BATCH, STEPS, REPS, MOE_TOKENS, MOE_CTX, LAYERS, BACKEND
    global CHECK_BACKEND, DCP1_REFERENCE, SECTIONS, CHECK_EXPERTS, SLACK, BUDGET
    SMOKE = args.smoke
    BUDGET_S = args.budget_s or (math.inf if SMOKE else 480.0)
    CONTEXTS = args.contexts or ([64, 128] if SMOKE else [32768, 65536, 131072])
    BATCH = args.batch or (2 if SMOKE else 8)
    STEPS = args.steps or (2 if SMOKE else 8)
    REPS = args.reps or (1 if SMOKE else 3)
    MOE_TOKENS = args.moe_tokens or ([8] if SMOKE else [8, 256])
    MOE_CTX = args.moe_ctx or (64 if SMOKE else 4096)
    LAYERS = tuple(args.layers or (["kda", "mla"] if SMOKE else ["kda", "kda", "mla"]))
    BACKEND = args.backend
    CHECK_BACKEND = args.check_backend
    DCP1_REFERENCE = args.dcp_ref
    SECTIONS = set(args.sections)
    # the verdict pass keeps K3's expert shapes but fewer of them
    check = args.check_experts if args.check_experts is not None else (0 if SMOKE else 64)
    CHECK_EXPERTS = check or None
    SLACK = 64 * math.ceil((REPS + 1) * STEPS / 64)  # cache positions past ctx for the timed steps
    BUDGET = Budget(BUDGET_S)


FP8 = "float8_e4m3fn"


def bench_config():
    if SMOKE:
        return kimik3.Config.preset("tiny").replace(
            name="tiny-smoke", num_layers=len(LAYERS), layer_types=LAYERS, kda_num_heads=8, mla_num_heads=8,
            moe_intermediate_size=256, num_shared_experts=2)
    return kimik3.Config.preset("kimi-k3").replace(
        name=f"k3-{len(LAYERS)}L", num_layers=len(LAYERS), layer_types=LAYERS, attn_res_block_size=2)


def log(*a):
    print(*a, flush=True)


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds, self.skipped = time.perf_counter(), seconds, []

    def elapsed(self):
        return time.perf_counter() - self.t0

    def allows(self, what, estimate=0.0):
        """Start `what` only if it should end (by `estimate` seconds) within the budget, and no
        device fault has left the GPU context unusable."""
        if FAULT:
            self.skipped.append(what)
            log(f"  skipped (device fault earlier: {FAULT[0][:120]}): {what}")
            return False
        if self.elapsed() + estimate <= self.seconds:
            return True
        self.skipped.append(what)
        log(f"  skipped (budget {self.seconds:.0f}s, {self.elapsed():.0f}s used, ~{estimate:.0f}s needed): {what}")
        return False


RESULTS: dict = {}   # the record's details
REC = None           # the run's Record (set by `run`)


def save():
    RESULTS["skipped"] = BUDGET.skipped
    RESULTS["elapsed_s"] = round(BUDGET.elapsed(), 1)
    if REC is not None:
        REC.data["details"] = RESULTS
        REC.data["skipped"] = BUDGET.skipped
        REC.save()


# A CUDA fault (illegal address, ...) poisons the process's GPU context: every later call fails
# with the same error, so the first one is kept and everything after it is skipped, not run.
FAULT: list = []
_FAULT_MARKERS = ("CUDA_ERROR_ILLEGAL", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED", "hipErrorIllegal")


def guarded(record: dict, fn, *args, **kw):
    """Run fn; on an exception record it (type, message, last frames) in `record` and return None."""
    if FAULT:
        record["error"] = f"not run: device fault earlier ({FAULT[0][:300]})"
        return None
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001  (one bad measurement must not end a one-shot GPU run)
        record["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        record["traceback"] = traceback.format_exc()[-4000:]
        log(f"  ERROR: {record['error'][:300]}")
        if any(m in record["error"] for m in _FAULT_MARKERS):
            FAULT.append(record["error"])
            RESULTS["device_fault"] = record["error"]
        return None


def device_bytes(tree) -> dict:
    """Bytes each device holds of these arrays, from their addressable shards: max and min over devices."""
    per: dict = {}
    for a in jax.tree.leaves(tree):
        for s in a.addressable_shards:
            per[s.device.id] = per.get(s.device.id, 0) + s.data.nbytes
    return {"max": max(per.values()), "min": min(per.values())}


def _b(x) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:8.2f} {unit}"
    return f"{x:8d} B  "


def replicated(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P()))


# ---------------------------------------------------------------- HLO collectives
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")


def _nbytes(dt, dims):
    return math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dt, 1 if dt.startswith("f8") else 4)


def collectives(hlo: str) -> dict:
    """Counts (sharding.moe.count_collectives) and the result type of each op with its bytes per
    device, parsed from the same compiled HLO text: `%x = f32[8,64]{1,0} all-reduce(%y), ...`
    (operand types are not printed). Bytes: the op's result (all-reduce: the reduced buffer, a
    combined one summed; all-gather: the gathered buffer); of an async -start op's tuple, all
    results for all-reduce, the largest (the output buffer) for the other kinds."""
    counts = count_collectives(hlo)
    each = {op: [] for op in counts}
    for line in hlo.splitlines():
        eq = line.find("=")
        for op in counts:
            for tag in (f" {op}(", f" {op}-start("):
                i = line.find(tag)
                if eq < 0 or i < eq:
                    continue
                result = line[eq + 1:i]
                sizes = [_nbytes(dt, dims) for dt, dims in _SHAPE.findall(result)]
                nbytes = sum(sizes) if op == "all-reduce" or "start" not in tag else max(sizes, default=0)
                each[op].append({"result": " ".join(result.split()), "bytes": nbytes})
    return {"counts": counts, "total": sum(counts.values()),
            "bytes": {op: sum(e["bytes"] for e in v) for op, v in each.items() if v},
            "total_bytes": sum(e["bytes"] for v in each.values() for e in v),
            "ops": {op: v for op, v in each.items() if v}}


# ---------------------------------------------------------------- 1. correctness
def check_prompts(cfg, n):
    rng = np.random.RandomState(0)
    lengths = [max(1, n - 1), 23, 1, 13]  # the first is shorter than the n DCP shards
    return [[int(t) for t in rng.randint(0, cfg.vocab_size, size=k)] for k in lengths]


def greedy(model, prompts, backend, mesh=None, dcp_axes=()):
    """Prefill + CHECK_NEW - 1 decode steps, each run feeding its own argmax: tokens [B, new], logits [B, new, V]."""
    last, cache = kimik3.prefill(model, prompts, CHECK_SEQ, backend=backend, mesh=mesh, dcp_axes=dcp_axes)
    logits = [np.asarray(last)]
    for _ in range(CHECK_NEW - 1):
        step, cache = kimik3.decode_step(model, cache, logits[-1].argmax(-1).astype(np.int32), backend=backend)
        logits.append(np.asarray(step))
    logits = np.stack(logits, 1)
    return logits.argmax(-1), logits


def compare(ref, got, tol):
    (rt, rl), (gt, gl) = ref, got
    first_diff, err = [], 0.0
    for b in range(rt.shape[0]):
        d = np.nonzero(rt[b] != gt[b])[0]
        first_diff.append(int(d[0]) if d.size else None)
        upto = int(d[0]) + 1 if d.size else rt.shape[1]  # logits comparable while the fed tokens agree
        err = max(err, float(np.abs(rl[b, :upto] - gl[b, :upto]).max()))
    rel = err / float(np.abs(rl).max())
    same = bool((rt == gt).all())
    return {"equal": bool(same and rel < tol), "tokens_equal": same, "logits_rel_err": rel,
            "first_differing_step": first_diff, "tokens": gt.tolist()}


def correctness_pass(cfg, backend, mesh, tol, precision=None):
    n = mesh.size
    prompts = check_prompts(cfg, n)
    ctx = jax.default_matmul_precision(precision) if precision else contextlib.nullcontext()
    out = {"dtype": cfg.dtype, "num_experts": cfg.num_experts, "backend": backend or resolve_backend(None),
           "matmul_precision": precision or "default",
           "prompt_lengths": [len(p) for p in prompts], "new_tokens": CHECK_NEW, "tolerance": tol}
    with ctx:
        t0 = time.perf_counter()
        single = kimik3.init(cfg, seed=0)
        ref = greedy(single, prompts, backend)
        out["one_device_tokens"] = ref[0].tolist()
        placed = sharding.place_model(single, mesh)
        del single
        gc.collect()
        for name, dcp_axes in ((f"tp{n}", ()), (f"tp{n}_dcp{n}", ("tensor",))):
            out[name] = rec = {"dcp_axes": list(dcp_axes)}
            r = guarded(rec, greedy, placed, prompts, backend, mesh, dcp_axes)
            if r is not None:
                rec.update(compare(ref, r, tol))
                log(f"  {cfg.dtype} {out['backend']:9s} {name:10s}: tokens {'equal' if rec['tokens_equal'] else 'DIFFER'}"
                    f", logits rel err {rec['logits_rel_err']:.2e}")
            else:
                rec["equal"] = False
        out["seconds"] = round(time.perf_counter() - t0, 1)
    return out, placed


def check_config(cfg):
    """The verdict pass's config: the timed one in fp32, with CHECK_EXPERTS experts if set."""
    return cfg.replace(dtype="float32", param_dtype="float32", num_experts=CHECK_EXPERTS or cfg.num_experts)


def timed_is_checked(cfg):
    """Whether the verdict pass already ran the timed config (smoke / CPU)."""
    return check_config(cfg) == cfg and resolve_backend(BACKEND) == resolve_backend(CHECK_BACKEND)


def correctness(cfg, mesh, sec):
    """The verdict pass (fp32, plain JAX, highest precision). Returns its placed model when that is
    the timed config, else None."""
    n = mesh.size
    res, placed = correctness_pass(check_config(cfg), CHECK_BACKEND, mesh, CHECK_TOL, precision="highest")
    sec["verdict_pass"] = res
    sec["equal"] = all(res[k].get("equal", False) for k in (f"tp{n}", f"tp{n}_dcp{n}"))
    return placed if timed_is_checked(cfg) else None


def correctness_timed_config(cfg, mesh, info):
    """Informational pass, run last: the timed config as it is timed (bf16, default backend)."""
    info["note"] = ("informational: in bf16 the TP partial sums are reduced in another order, so near-tied "
                    "random-weight logits may flip a greedy token; the verdict is the fp32 pass")
    info.update(correctness_pass(cfg, BACKEND, mesh, 2e-2)[0])


# ---------------------------------------------------------------- decode loop (sections 2, 3)
def _decode_loop(model, cache, tokens, steps, backend):
    """`steps` greedy decode steps on device: (last tokens [B], cache). Rows all active."""
    active = jnp.ones_like(cache.lengths)

    def body(_, carry):
        cache, tok = carry
        logits, layers = kimik3.KimiLM(model.cfg).apply(
            {"params": model.params}, tok[:, None], cache.layers, cache.lengths, active, backend=backend,
            page_table=cache.page_table, dcp_axes=cache.dcp_axes)
        return cache.replace(lengths=cache.lengths + active, layers=layers), jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

    cache, tok = jax.lax.fori_loop(0, steps, body, (cache, tokens))
    return tok, cache


def filled_cache(cfg, mesh, dcp_axes, batch, ctx):
    """A cache of ctx + SLACK positions (ctx rounded to the DCP size), latents random, lengths ctx."""
    cache = kimik3.init_cache(cfg, batch, ctx + SLACK, mesh=mesh, dcp_axes=dcp_axes)
    layers = []
    for i, e in enumerate(cache.layers):
        if "latent" in e:
            a = e["latent"]
            fill = jax.jit(lambda k, shape=a.shape, dt=a.dtype: jax.random.normal(k, shape, F32).astype(dt),
                           out_shardings=a.sharding)
            e = {"latent": fill(jax.random.key(100 + i))}
        layers.append(e)
    return cache.replace(lengths=replicated(mesh, jnp.full((batch,), ctx, jnp.int32)), layers=tuple(layers))


def timed(compiled, args, feed_back):
    """Warm-up call, then REPS calls back to back; seconds per call (wall, to block_until_ready)."""
    out = compiled(*args)
    jax.block_until_ready(out)
    if feed_back:
        args = feed_back(args, out)
    t0 = time.perf_counter()
    for _ in range(REPS):
        out = compiled(*args)
        if feed_back:
            args = feed_back(args, out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / REPS


def mla_path(cfg, backend, dcp_axes):
    kernel = resolve_backend(backend) != "reference" and cfg.mla_cache_dim == CACHE_DIM
    if dcp_axes:
        return (f"{resolve_backend(backend)} flash-decoding kernel" if kernel else "jnp absorbed attention") + (
            " per DCP shard (shard_map) + log-sum-exp merge")
    if kernel:
        return f"{resolve_backend(backend)} flash-decoding kernel on each rank's heads (shard_map)"
    return "jnp absorbed attention (XLA-partitioned)"


def decode_measure(model, mesh, dcp_axes, batch, ctx, want_hlo, backend):
    cfg, n = model.cfg, mesh.size
    dcp = math.prod(mesh.shape[a] for a in dcp_axes)
    cache = filled_cache(cfg, mesh, dcp_axes, batch, ctx)
    S = cache.max_seq_len
    latents = [e["latent"] for e in cache.layers if "latent" in e]
    states = [e for e in cache.layers if "latent" not in e]
    row = {"ctx": ctx, "batch": batch, "max_seq_len": S, "dcp": dcp, "backend": backend or resolve_backend(None),
           "mla_attention": mla_path(cfg, backend, dcp_axes),
           "mla_cache_bytes_per_gpu": device_bytes(latents)["max"] if latents else 0,
           "kda_state_bytes_per_gpu": device_bytes(states)["max"] if states else 0}
    rep = kimik3.memory_report(cfg, tensor=n, dcp=dcp, tokens=S, batch=batch)
    row["memory_report"] = {"mla_cache": rep["mla_cache"], "kda_state": rep["kda_state"],
                            "mla_cache_fp8": kimik3.memory_report(cfg, tensor=n, dcp=dcp, tokens=S, batch=batch,
                                                                    cache_dtype=FP8)["mla_cache"]}
    tok = replicated(mesh, jnp.zeros((batch,), jnp.int32))
    shardings = jax.tree.map(lambda a: a.sharding, (tok, cache))
    fn = jax.jit(_decode_loop, static_argnames=("steps", "backend"), donate_argnames=("cache",),
                 out_shardings=shardings)
    with mesh_context(mesh):
        t0 = time.perf_counter()
        compiled = fn.lower(model, cache, tok, steps=STEPS, backend=backend).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        per_call = timed(compiled, (model, cache, tok), lambda a, out: (a[0], out[1], out[0]))
    row["step_ms"] = per_call / STEPS * 1e3
    row["timing"] = f"{REPS} calls x {STEPS} steps (jitted fori_loop, after 1 warm-up call)"
    if want_hlo:
        hlo = compiled.as_text()
        row["collectives_in_decode_loop"] = collectives(hlo)
        row["hlo_has_while_loop"] = " while(" in hlo
    del cache, compiled
    return row


_RUN_BACKEND = object()  # measure's default: the run's --backend


def measure(fn, *args, backend=_RUN_BACKEND):
    """fn(*args, backend) -> a row (backend: the run's --backend unless given); where that fails and the backend is not the reference, again
    with "reference" (the row says so). A failure is returned as a row with "error"."""
    backend = BACKEND if backend is _RUN_BACKEND else backend
    rec: dict = {}
    row = guarded(rec, fn, *args, backend)
    if row is None and resolve_backend(backend) != "reference":
        gc.collect()
        fallback: dict = {}
        row = guarded(fallback, fn, *args, "reference")
        if row is not None:
            row["backend"] = "reference (fallback: the default backend failed)"
            row["default_backend_error"] = rec["error"]
        else:
            rec["fallback_error"] = fallback["error"]
    gc.collect()
    return row if row is not None else rec


# ---------------------------------------------------------------- 2. DCP
def dcp_context(model, mesh, ctx, sec, est):
    n = mesh.size
    rows = sec.setdefault("rows", [])
    variants = [("dcp1", (), BACKEND), (f"dcp{n}", ("tensor",), BACKEND)]
    if DCP1_REFERENCE:
        variants.append(("dcp1-ref", (), "reference"))
    got = {}
    for name, dcp_axes, backend in variants:
        if not BUDGET.allows(f"dcp: ctx {ctx} {name}", est):
            continue
        t0 = time.perf_counter()
        row = got[name] = {"variant": name, "ctx": ctx, "dcp": math.prod(mesh.shape[a] for a in dcp_axes),
                           **measure(decode_measure, model, mesh, dcp_axes, BATCH, ctx, False, backend=backend)}
        est = max(est, time.perf_counter() - t0)
        rows.append(row)
        if "step_ms" in row:
            log(f"  ctx {ctx:7d} {name:8s}: MLA cache/GPU {_b(row['mla_cache_bytes_per_gpu'])} "
                f"(report {_b(row['memory_report']['mla_cache'])})  step {row['step_ms']:8.3f} ms  "
                f"(compile {row['compile_s']:.1f}s)")
        save()
    one, split = got.get("dcp1", {}), got.get(f"dcp{n}", {})
    if "step_ms" in one and "step_ms" in split:
        sec.setdefault("summary", {})[str(ctx)] = {
            "mla_cache_per_gpu_dcp1_over_dcpn": one["mla_cache_bytes_per_gpu"] / split["mla_cache_bytes_per_gpu"],
            "step_ms_dcp1": one["step_ms"], "step_ms_dcpn": split["step_ms"],
            "step_speedup_dcpn": one["step_ms"] / split["step_ms"],
            "step_ms_saved_per_mla_layer": (one["step_ms"] - split["step_ms"]) / len(model.cfg.mla_layers)}
        save()
    return est


# ---------------------------------------------------------------- 3. MoE dedup
def _moe_loop(cfg, mesh, steps, backend, p, x):
    def body(_, x):  # one MoE layer; its output, RMS-normalised, is the next input
        return rms_normalize(moe_sharded(cfg, p, x, backend, mesh).astype(F32), 1e-6).astype(x.dtype)

    return jax.lax.fori_loop(0, steps, body, x)


def moe_layer_measure(cfg, moe_params, mesh, tokens, dedup, backend):
    c = cfg.replace(moe_dedup=dedup)
    placed = sharding.place_moe_params(c, moe_params, mesh, moe_weight_axes(cfg))
    x = replicated(mesh, jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), F32).astype(cfg.jnp_dtype))
    hlo = moe_layer_tp(cfg, mesh, dedup=dedup, backend=backend).lower(placed, x).compile().as_text()
    loop = jax.jit(functools.partial(_moe_loop, c, mesh, STEPS, backend), out_shardings=x.sharding)
    t0 = time.perf_counter()
    compiled = loop.lower(placed, x).compile()
    compile_s = time.perf_counter() - t0
    per_call = timed(compiled, (placed, x), None)
    return {"tokens": tokens, "dedup": dedup, "backend": backend or resolve_backend(None),
            "layer_us": per_call / STEPS * 1e6, "compile_s": round(compile_s, 2),
            "collectives_per_layer": collectives(hlo),
            "layer_param_bytes_per_gpu": device_bytes(placed)["max"],
            "layer_param_bytes_per_gpu_rules": per_device_param_bytes(c, moe_params, mesh, moe_weight_axes(cfg)),
            "timing": f"{REPS} calls x {STEPS} layers (jitted fori_loop, after 1 warm-up call)"}


def moe_dedup(model, mesh, sec, decode_est):
    cfg = model.cfg
    layer = next(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    moe_params = model.params[f"layers_{layer}"]["block_sparse_moe"]
    sec["layer"] = f"layers_{layer}"
    rows = sec.setdefault("layer_rows", [])
    est = 0.0
    for tokens in MOE_TOKENS:
        for dedup in (True, False):
            if not BUDGET.allows(f"moe_dedup: layer, {tokens} tokens, dedup={dedup}", est):
                continue
            t0 = time.perf_counter()
            row = {"tokens": tokens, "dedup": dedup, **measure(moe_layer_measure, cfg, moe_params, mesh, tokens, dedup)}
            rows.append(row)
            est = max(est, time.perf_counter() - t0)
            if "layer_us" in row:
                c = row["collectives_per_layer"]
                log(f"  MoE layer, {tokens:4d} tokens, dedup={dedup!s:5s}: {row['layer_us']:9.1f} us  "
                    f"collectives {c['total']} ({c['total_bytes']} B/device): {c['counts']}")
            save()
    steps = sec.setdefault("decode_rows", [])
    est = decode_est
    for dedup in (True, False):
        if not BUDGET.allows(f"moe_dedup: decode step, ctx {MOE_CTX}, dedup={dedup}", est):
            continue
        t0 = time.perf_counter()
        m = model if dedup == cfg.moe_dedup else sharding.place_model(model.replace(cfg=cfg.replace(moe_dedup=dedup)), mesh)
        row = {"dedup": dedup, "ctx": MOE_CTX, **measure(decode_measure, m, mesh, (), BATCH, MOE_CTX, True)}
        del m
        est = max(est, time.perf_counter() - t0)
        steps.append(row)
        if "step_ms" in row:
            c = row["collectives_in_decode_loop"]
            log(f"  decode step, ctx {MOE_CTX}, B={BATCH}, dedup={dedup!s:5s}: {row['step_ms']:8.3f} ms  "
                f"collectives in the loop {c['total']}: {c['counts']}")
        save()


# ---------------------------------------------------------------- 4. owned rows
def cache_bytes_per_token(cfg, n, dcp, cache_dtype):
    """MLA cache bytes per token per GPU (memory_report over a long context, divided out)."""
    tokens = 1 << 20
    return kimik3.memory_report(cfg, tensor=n, dcp=dcp, tokens=tokens, cache_dtype=cache_dtype)["mla_cache"] / tokens


def per_token_bytes(cfg, n):
    """MLA cache bytes per token per GPU for the model dtype (K3: bfloat16) and fp8, DCP1 and DCPn."""
    return {f"{name}_dcp{d}": cache_bytes_per_token(cfg, n, d, dt)
            for name, dt in ((cfg.dtype, None), ("fp8", FP8)) for d in sorted({1, n})}


def tokens_bought(cfg, n, freed):
    return {k: int(freed // v) for k, v in per_token_bytes(cfg, n).items()}


def owned_rows(model, mesh, sec):
    cfg, n = model.cfg, mesh.size
    other = sharding.place_model(model.replace(cfg=cfg.replace(moe_dedup=not cfg.moe_dedup)), mesh)
    placed = {cfg.moe_dedup: model, not cfg.moe_dedup: other}
    for dedup in (True, False):
        rep = kimik3.memory_report(cfg, tensor=n, dedup=dedup)
        sec[f"dedup_{dedup}"] = {"param_bytes_per_gpu": device_bytes(placed[dedup].params),
                                 "memory_report_params": rep["params"], "memory_report_dedup_saved": rep["dedup_saved"]}
    del other, placed
    gc.collect()
    freed = sec["dedup_False"]["param_bytes_per_gpu"]["max"] - sec["dedup_True"]["param_bytes_per_gpu"]["max"]
    sec["freed_bytes_per_gpu"] = freed
    sec["mla_cache_bytes_per_token_per_gpu"] = per_token_bytes(cfg, n)
    sec["mla_tokens_bought_per_gpu"] = tokens_bought(cfg, n, freed)
    log(f"  params/GPU: dedup {_b(sec['dedup_True']['param_bytes_per_gpu']['max'])}, "
        f"without {_b(sec['dedup_False']['param_bytes_per_gpu']['max'])}: freed {_b(freed)} "
        f"= MLA cache tokens/GPU {sec['mla_tokens_bought_per_gpu']}")
    save()
    if not SMOKE:  # the full K3 (93 layers, 24 MLA), by memory_report alone
        k3 = kimik3.Config.preset("kimi-k3")
        full = {d: kimik3.memory_report(k3, tensor=n, dedup=d)["params"] for d in (True, False)}
        sec["full_k3"] = {"params_per_gpu_dedup": full[True], "params_per_gpu_no_dedup": full[False],
                          "freed_bytes_per_gpu": full[False] - full[True],
                          "mla_tokens_bought_per_gpu": tokens_bought(k3, n, full[False] - full[True])}
        save()


# ---------------------------------------------------------------- main
def _pass_line(p):
    return "  ".join(f"{k}: tokens {'=' if r.get('tokens_equal') else '!='}, logits rel err "
                     f"{r.get('logits_rel_err', float('nan')):.1e}" + (" (error)" if "error" in r else "")
                     for k, r in p.items() if isinstance(r, dict) and "dcp_axes" in r)


def _rows(rows, done_key, fmt, label):
    """One table line per row: fmt(row) where it was measured, else its label and error."""
    return [fmt(r) if done_key in r else f"{label(r)}: error: {r.get('error', '')[:100]}" for r in rows]


def _dcp_line(r):
    mr = r["memory_report"]
    return (f"{r['ctx']:7d} {r['variant']:>8} {_b(r['mla_cache_bytes_per_gpu']):>14} {_b(mr['mla_cache']):>14} "
            f"{_b(mr['mla_cache_fp8']):>13} {_b(r['kda_state_bytes_per_gpu'])} ({_b(mr['kda_state']).strip()}) "
            f"{r['step_ms']:9.3f}  {r['backend']}")


def _moe_line(r):
    c = r["collectives_per_layer"]
    return f"{r['tokens']:10d} {r['dedup']!s:>6} {r['layer_us']:9.1f} {c['total']:11d} {c['total_bytes']:13d}  {c['bytes']}"


def _decode_line(r):
    c = r["collectives_in_decode_loop"]
    return (f"decode step, ctx {r['ctx']}, B={r['batch']}, dedup={r['dedup']!s:5s}: {r['step_ms']:.3f} ms; "
            f"collectives in the loop: {c['total']}, {c['total_bytes']} B/device")


def table():
    m = RESULTS["machine"]
    lines = [f"== sharded: {m['device_count']} x {m['device_kind']}, config {RESULTS['config']['name']}, "
             f"{RESULTS['elapsed_s']}s"]
    c = RESULTS.get("correctness", {})
    v = c.get("verdict_pass", {})
    if "correctness" in SECTIONS:
        lines.append(f"correctness (fp32, {v.get('backend')}): {'EQUAL' if c.get('equal') else 'NOT EQUAL'}  {_pass_line(v)}")
    else:
        lines.append("correctness: not run (--sections)")
    if c.get("timed_config_pass"):
        t = c["timed_config_pass"]
        lines.append(f"  timed config ({t['dtype']}, {t['backend']}; informational): {_pass_line(t)}")
    o = RESULTS.get("owned_rows", {})
    if "freed_bytes_per_gpu" in o:
        lines.append(f"owned rows: params/GPU {_b(o['dedup_True']['param_bytes_per_gpu']['max']).strip()} (dedup) vs "
                     f"{_b(o['dedup_False']['param_bytes_per_gpu']['max']).strip()}; freed {_b(o['freed_bytes_per_gpu']).strip()}"
                     f" -> MLA cache tokens/GPU {o['mla_tokens_bought_per_gpu']}")
        if "full_k3" in o:
            lines.append(f"  full K3: freed {_b(o['full_k3']['freed_bytes_per_gpu']).strip()}/GPU -> MLA cache tokens/GPU "
                         f"{o['full_k3']['mla_tokens_bought_per_gpu']}")
    lines.append(f"{'ctx':>7} {'variant':>8} {'MLA cache/GPU':>14} {'memory_report':>14} {'report fp8':>13} "
                 f"{'KDA state/GPU (report)':>24} {'step ms':>9}  backend")
    lines += _rows(sorted(RESULTS.get("dcp", {}).get("rows", []), key=lambda r: (r["ctx"], r["dcp"])), "step_ms",
                   _dcp_line, lambda r: f"{r['ctx']:7d} {r['variant']:>8}")
    md = RESULTS.get("moe_dedup", {})
    lines.append(f"{'MoE tokens':>10} {'dedup':>6} {'layer us':>9} {'collectives':>11} {'bytes/device':>13}  kinds")
    lines += _rows(md.get("layer_rows", []), "layer_us", _moe_line, lambda r: f"{r['tokens']:10d} {r['dedup']!s:>6}")
    lines += _rows(md.get("decode_rows", []), "step_ms", _decode_line, lambda r: f"decode step, dedup={r['dedup']}")
    if RESULTS.get("device_fault"):
        lines.append("DEVICE FAULT (everything after it was skipped): " + RESULTS["device_fault"][:300])
    if RESULTS.get("skipped"):
        lines.append("skipped (budget or device fault): " + "; ".join(RESULTS["skipped"]))
    errors = [k for k, s in RESULTS.items() if isinstance(s, dict) and "error" in s]
    errors += ["correctness.timed_config_pass"] * ("error" in c.get("timed_config_pass", {}))
    if errors:
        lines.append("sections with errors: " + ", ".join(errors))
    return "\n".join(lines)


def run(rec, args):
    global REC
    REC = rec
    configure(args)
    RESULTS.clear()
    FAULT.clear()
    main()
    REC.data["errors"].update({k: v["error"] for k, v in RESULTS.items() if isinstance(v, dict) and "error" in v})
    table_rows(jax.device_count())


def table_rows(n):
    """BENCHMARKS.md rows: the decode step with DCP against without, and with MoE dedup
    against without (the peer is the same model on the same mesh without the feature)."""
    area = f"Decode step, {len(LAYERS)}-layer K3 on {n} GPUs, batch {BATCH}"
    for ctx, s in sorted(RESULTS.get("dcp", {}).get("summary", {}).items(), key=lambda kv: int(kv[0])):
        REC.row(area, f"TP{n} + DCP{n} vs TP{n}, ctx {ctx}", s["step_ms_dcpn"], "ms",
                peer=s["step_ms_dcp1"], peer_name=f"TP{n}",
                note=f"MLA cache per GPU / {s['mla_cache_per_gpu_dcp1_over_dcpn']:.2f}")
    rows = {r["dedup"]: r for r in RESULTS.get("moe_dedup", {}).get("decode_rows", []) if "step_ms" in r}
    if True in rows and False in rows:
        REC.row(area, f"TP{n}, MoE dedup on vs off, ctx {MOE_CTX}", rows[True]["step_ms"], "ms",
                peer=rows[False]["step_ms"], peer_name="dedup off")


def main():
    devices = jax.devices()
    n = len(devices)
    mesh = sharding.make_mesh(tensor=n)
    cfg = bench_config()
    RESULTS["machine"] = {"device_count": n, "device_kind": devices[0].device_kind, "platform": devices[0].platform,
                          "jax": jax.__version__, "process_count": jax.process_count(), "smoke": SMOKE,
                          "env": {k: os.environ.get(k) for k in NCCL_ENV}}
    RESULTS["config"] = {"name": cfg.name, "layer_types": list(cfg.layer_types), "hidden_size": cfg.hidden_size,
                         "kda_num_heads": cfg.kda_num_heads, "mla_num_heads": cfg.mla_num_heads,
                         "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
                         "expert_format": cfg.expert_format, "vocab_size": cfg.vocab_size, "dtype": cfg.dtype,
                         "mesh": dict(mesh.shape), "batch": BATCH, "steps": STEPS, "reps": REPS,
                         "contexts": CONTEXTS, "budget_s": BUDGET_S}
    log(f"sharded: {n} x {devices[0].device_kind} ({devices[0].platform}), config {cfg.name}, "
        f"budget {BUDGET_S:.0f}s")
    save()

    RESULTS["correctness"] = corr = {}
    model = None
    if "correctness" in SECTIONS:
        log(f"[1] correctness: one device vs TP{n} vs TP{n} + DCP{n}")
        model = guarded(corr, correctness, cfg, mesh, corr)
        corr.setdefault("equal", False)
        save()
        gc.collect()
    if model is None:
        model = kimik3.init(cfg, seed=0, mesh=mesh)
    jax.block_until_ready(model.params)

    if "owned_rows" in SECTIONS:
        log("[4] owned rows: parameter bytes per GPU with and without MoE dedup")
        RESULTS["owned_rows"] = sec = {}
        guarded(sec, owned_rows, model, mesh, sec)
        save()

    contexts = CONTEXTS if "dcp" in SECTIONS else []
    est = 0.0
    if contexts:
        log(f"[2] DCP: TP{n} vs TP{n} + DCP{n}, batch {BATCH}")
        RESULTS["dcp"] = dcp = {"batch": BATCH, "contexts": contexts}
        est = guarded(dcp, dcp_context, model, mesh, contexts[0], dcp, 0.0) or 0.0

    if "moe_dedup" in SECTIONS:
        log(f"[3] MoE dedup under TP{n}")
        RESULTS["moe_dedup"] = sec = {}
        guarded(sec, moe_dedup, model, mesh, sec, est)
        save()

    if len(contexts) > 1:
        log("[2] DCP, longer contexts")
    for ctx in contexts[1:]:
        est = guarded(dcp, dcp_context, model, mesh, ctx, dcp, est * 1.25) or est
    save()

    if "timed_check" in SECTIONS and not timed_is_checked(cfg):
        log("[1b] correctness of the timed config (informational)")
        del model
        gc.collect()
        if BUDGET.allows("correctness: timed config (bf16, default backend; informational)",
                         corr.get("verdict_pass", {}).get("seconds", 0.0)):
            info = corr["timed_config_pass"] = {"dtype": cfg.dtype, "backend": BACKEND or resolve_backend(None)}
            guarded(info, correctness_timed_config, cfg, mesh, info)
        save()
    log(table())


