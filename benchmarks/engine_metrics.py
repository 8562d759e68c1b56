"""What `python -m benchmarks engine` counts: the kernel-name classifier and the profiles of a
decode token and of a prefill, the FLOPs of a prefill and the dense bf16 matmul peak they are compared with."""
from __future__ import annotations

import glob
import os
import re
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp

from .common import wall_ms
from .kernel_timer import trace_events

# profile categories, in table order; "host_gap" (wall - GPU busy) is added by decode_profile
CATEGORIES = ("dense_matmul", "moe", "kda", "mla", "norms_attnres", "routing_sort", "other_fusions")
# first match wins: the Pallas kernels by their launch names (kernels_pallas/*: kda_decode,
# kda_chunk_*, kda_verify, mla_decode_*, mla_prefill, mla_merge_splits, moe_gmm, moe_gmm_tiles,
# attn_res_norm, route_top_k, skinny_matmul_m*_k*_n*), then library GEMMs and XLA's GEMM
# fusions, sorts / top-k of the router
_RULES = (("kda", ("kda_",)), ("mla", ("mla_",)), ("moe", ("moe_gmm",)),
          ("norms_attnres", ("attn_res", "rms_norm", "rmsnorm", "layernorm", "layer_norm")),
          ("routing_sort", ("sort", "topk", "top_k")),
          ("dense_matmul", ("gemm", "xmma", "nvjet", "cublas", "cutlass", "matmul", "dot")))


def classify(kernel: str) -> str:
    """The profile category of a GPU kernel's name. XLA's own fusions (`fusion_12`,
    `loop_reduce_fusion`, `input_scatter_fusion`: norms XLA fused, the AttnRes mix where the
    Pallas kernel is off, the router's softmax and gathers/scatters, cache writes) carry no op in
    their names and count as other_fusions."""
    n = kernel.lower()
    for cat, keys in _RULES:
        if any(k in n for k in keys):
            return cat
    return "other_fusions"


def busy_ns(events) -> int:
    """Time at least one kernel ran: the union of [start, start + duration) over `events`."""
    total, end = 0, None
    for _, _, t0, dur in sorted(events, key=lambda e: e[2]):
        t1 = t0 + dur
        if end is None or t0 >= end:
            total += dur
            end = t1
        elif t1 > end:
            total += t1 - end
            end = t1
    return total


def _breakdown(events, per: float, top: int):
    """GPU kernel time of `events` over `per` (tokens or prefills) in us: by category, busy (the
    union of kernel spans), summed, and the `top` kernels."""
    cats = dict.fromkeys(CATEGORIES, 0.0)
    by_kernel = defaultdict(float)
    for _, name, _, dur in events:
        cats[classify(name)] += dur / 1e3 / per
        by_kernel[name] += dur / 1e3 / per
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return dict(cats=cats, busy=busy_ns(events) / 1e3 / per, kernels=sum(by_kernel.values()),
                top={k[:90]: round(v, 1) for k, v in top})


def decode_profile(eng, step_us: float, reps: int = 4, top: int = 12):
    """Where a decode token's GPU time goes: `reps` engine decode calls under the profiler, kernel
    time per token by category (us), launches per token, and host_gap = step_us (the untraced
    wall time a token) - GPU busy time a token. None where the trace has no GPU plane (CPU)."""
    rows, fed = eng.running, []

    def call():  # an engine step and the call it queued ahead, so each traced call's tokens count
        before = sum(r.fed for r in rows)
        eng.step()
        eng.drain()
        fed.append(sum(r.fed for r in rows) - before)

    events = trace_events(call, reps=reps, sync=lambda _: None)
    if events is None:
        return None
    tokens = sum(fed[1:]) / len(rows)  # the first call is trace_events' untraced warm-up
    b = _breakdown(events, tokens, top)
    b["cats"]["host_gap"] = max(step_us - b["busy"], 0.0)
    return dict(us_per_token=b["cats"], gpu_busy_us=b["busy"], kernel_us=b["kernels"],
                launches_per_token=len(events) / tokens, top_kernels_us=b["top"])


def prefill_profile(prefill_once, wall_us: float, reps: int = 1, top: int = 12):
    """Where one prefill's GPU time goes: `reps` calls of prefill_once() (each a whole prompt to
    its first token, waited for) under the profiler, kernel time per prefill by category (us),
    launches, and host_gap = wall_us (its untraced time) - GPU busy time. None on the CPU."""
    events = trace_events(prefill_once, reps=reps, sync=lambda _: None)
    if events is None:
        return None
    b = _breakdown(events, reps, top)
    b["cats"]["host_gap"] = max(wall_us - b["busy"], 0.0)
    return dict(us_per_prefill=b["cats"], gpu_busy_us=b["busy"], kernel_us=b["kernels"],
                launches=len(events) / reps, top_kernels_us=b["top"])


def hlo_names(dump_dir: str, kernels) -> dict:
    """What XLA fusion each GPU kernel name is, from the newest decode program in an
    `--xla_dump_to` folder (optimized HLO text): {kernel: "kind shape [its ops] <- jax op"}. A
    kernel name is its fusion's HLO name with "." as "_" (a "__N" suffix: its N-th copy)."""
    files = glob.glob(os.path.join(dump_dir, "*decode_steps*after_optimizations.txt"))
    if not files:
        return {}
    text = open(max(files, key=os.path.getmtime)).read()
    computations, fusions, current = {}, {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = computations.setdefault(head.group(1), [])
            continue
        inst = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if inst and current is not None:
            name, shape, op = inst.groups()
            current.append(op)
            calls, op_name = re.search(r"calls=%?([\w.\-]+)", line), re.search(r'op_name="([^"]+)"', line)
            kind = re.search(r"kind=(\w+)", line)
            fusions.setdefault(re.sub(r"[.\-]", "_", name), (
                kind.group(1) if kind else op, shape, calls and calls.group(1), op_name and op_name.group(1)))
    out = {}
    for k in kernels:
        hit = fusions.get(re.sub(r"__\d+$", "", k))
        if hit:
            kind, shape, calls, op_name = hit
            ops = Counter(o for o in computations.get(calls, []) if o != "parameter")
            body = ",".join(f"{o}x{n}" for o, n in ops.most_common(5))
            out[k] = f"{kind} {shape} [{body}] <- {(op_name or '?')[-120:]}"
    return out


def profile_note(prof) -> str:
    """The compact line of a row's note: us a token (decode) or ms a prefill, by category (those
    with no kernels left out)."""
    short = dict(dense_matmul="mm", moe="moe", kda="kda", mla="mla", norms_attnres="norm",
                 routing_sort="sort", other_fusions="other", host_gap="host")
    if "us_per_prefill" in prof:
        return "ms/prefill " + " ".join(f"{short[k]} {v / 1e3:.1f}" for k, v in prof["us_per_prefill"].items() if v)
    return "us/token " + " ".join(f"{short[k]} {v:.0f}" for k, v in prof["us_per_token"].items() if v)


def _key(path) -> list[str]:
    return [str(getattr(k, "key", k)) for k in path]


def prefill_flops(cfg, params, T: int, kda_chunk: int = 64) -> dict:
    """FLOPs of prefilling one T-token prompt, 2 per multiply-add:
    linear: every projection matrix (the leaves named `kernel`, the router `gate`) on every token,
    the routed experts' three matrices times num_experts_per_token (MXFP4 bytes hold 2 weights;
    scales not counted), lm_head on the last token only (the one the first token is sampled from);
    mla: causal attention, T(T+1)/2 query-key pairs a head, QK^T over qk_nope + qk_rope and PV over
    v_head_dim; kda: the chunked delta rule a token and head with chunks of C and K = V = head dim:
    A_qk and A_kk (2 x 2CK), the WY products w = A k and u = A v (2C(K + V)), v_new = u - w h, q h
    and the state update k^T v_new (3 x 2KV), A_qk v_new (2CV); the triangular inverse of A_kk
    (C^2/3 a token) and the gates / norms are not counted."""
    linear = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = _key(path)
        if keys[0] == "lm_head":
            linear += 2 * x.size
        elif "experts" in keys and not keys[-1].endswith("_scale"):
            per_expert = x.size // x.shape[0] * (2 if x.dtype == jnp.uint8 else 1)
            linear += 2 * T * cfg.num_experts_per_token * per_expert
        elif keys[-1] == "kernel" or (keys[-1] == "gate" and x.ndim == 2):
            linear += 2 * T * x.size
    pairs = T * (T + 1) // 2
    mla = len(cfg.mla_layers) * cfg.mla_num_heads * pairs * 2 * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    C, K = kda_chunk, cfg.kda_head_dim
    kda = len(cfg.kda_layers) * cfg.kda_num_heads * T * (2 * C * (3 * K + 2 * K) + 6 * K * K)
    return dict(linear=linear, mla=mla, kda=kda, total=linear + mla + kda)


def jax_matmul_flops(smoke=False) -> float:
    """FLOP/s of a large bf16 jnp.dot (8192^3; 256^3 with smoke): the dense peak of this run."""
    n = 256 if smoke else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    ms = wall_ms(jax.jit(jnp.dot), a, b, n=2 if smoke else 20, reps=1 if smoke else 5,
                 warm_s=0 if smoke else 0.3)
    return 2 * n ** 3 / (ms * 1e-3)
