"""KDA kernels on the GPU in one process: correctness against the plain-JAX reference, then ours
against FLA's chunk_kda / fused_recurrent_kda on identical inputs (agreement and GPU kernel time
from the profiler), and the verify kernel's time.

    python -m benchmarks kda [--sections correctness,prefill,decode,verify] [--prefill 8x4096x12]
    python -m benchmarks kda --smoke      # CPU: interpret-mode correctness and verify, tiny shapes

FLA is not on the device machine's image: install its wheel first (`pip install --no-deps
fla_core-*.whl`). Rows: prefill and decode against FLA (GPU kernel time), verify (no peer).
"""
import sys
import time

import jax
import jax.numpy as jnp

from kernels_pallas.kda import (kda_chunk, kda_chunk_reference, kda_decode, kda_gate,
                                kda_verify)
from kernels_pallas.kda.decode import kda_decode_pallas, kda_decode_reference
from .common import from_torch, names_arg, rel, shapes_arg, to_torch, wall_ms
from .config_strings import chunk_config, parse_overrides
from .kernel_timer import kernel_times

F32, BF16 = jnp.float32, jnp.bfloat16
SECTIONS = ("correctness", "prefill", "decode", "verify")
A = None      # the parsed options of this run (set by `run`)
REC = None    # its Record


def add_args(p):
    p.add_argument("--sections", type=names_arg, default=list(SECTIONS),
                   help="comma list of " + ", ".join(SECTIONS) + " (run in this order)")
    p.add_argument("--checks", type=names_arg, default=["chunk", "decode"],
                   help="correctness: which kernels (chunk, decode)")
    p.add_argument("--check-cases", type=names_arg, default=None,
                   help="correctness: indices of the chunk cases to run (compile time)")
    p.add_argument("--decode", type=shapes_arg, default=shapes_arg("256x96,1x12,64x12,256x12,1x96,64x96"),
                   help="decode shapes BxH")
    p.add_argument("--prefill", type=shapes_arg, default=shapes_arg("8x4096x12,1x8192x96,1x32768x16"),
                   help="prefill shapes BxTxH")
    p.add_argument("--verify", type=shapes_arg, default=shapes_arg("4x1,8x1,8x2,16x2"),
                   help="verify launch configs block_v x num_warps")
    p.add_argument("--chunk-config", action="append", default=[], metavar="k=v,...",
                   help="a ChunkConfig with these fields replaced, checked and timed beside the "
                        "default (repeatable)")
    p.add_argument("--decode-variant", action="append", default=[], metavar="k=v,...",
                   help="kda_decode_pallas keywords timed beside the default (repeatable)")
    p.add_argument("--stages", action="store_true",
                   help="prefill: also time each launch alone by wall clock")


def tjax(f, *args, n=20):
    """Wall-clock ms per call (the first timing in a process can read high: prefill re-times)."""
    return wall_ms(f, *args, n=n, reps=1)


def make(seed, B, T, H, K, dt, bounded=True, h0=True):
    ks = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(ks[0], (B, T, H, K), F32).astype(dt)
    k = jax.random.normal(ks[1], (B, T, H, K), F32).astype(dt)
    v = jax.random.normal(ks[2], (B, T, H, K), F32).astype(dt)
    f = jax.random.normal(ks[3], (B, T, H, K), F32)
    A_log = jax.random.uniform(ks[4], (H,), minval=-1.0, maxval=1.0)
    dtb = jax.random.normal(ks[5], (H * K,)) * 0.5
    g = jax.jit(lambda f: kda_gate(f, A_log, dtb, lower_bound=-5.0 if bounded else None))(f)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H))).astype(dt)
    s0 = jax.random.normal(ks[7], (B, H, K, K), F32) * 0.1 if h0 else None
    return q, k, v, g, beta, s0


# ------------------------------------------------------------------------------------------
def correctness():
    cases = [  # B, T, H, K, dtype, bounded, safe, lengths
        (2, 1000, 4, 128, BF16, True, False, [1000, 333]),
        (2, 1000, 4, 128, BF16, True, True, [1000, 333]),
        (2, 257, 3, 128, F32, False, False, [257, 65]),
        (1, 4096, 2, 64, BF16, False, False, None),
    ] if not A.smoke else [(2, 40, 1, 32, BF16, True, True, [40, 17])]
    if A.check_cases:
        cases = [cases[int(i)] for i in A.check_cases]
    ref = jax.jit(kda_chunk_reference, static_argnames=("use_qk_l2norm",))
    cfgs = chunk_configs()
    for (B, T, H, K, dt, bounded, safe, lens) in cases:
        q, k, v, g, beta, s0 = make(T + H, B, T, H, K, dt, bounded)
        L = None if lens is None else jnp.array(lens, jnp.int32)
        # the oracle in fp32 from the same (rounded) inputs
        up = lambda x: x.astype(F32)
        ro, rs = ref(up(q), up(k), up(v), g, up(beta), initial_state=s0, lengths=L,
                     use_qk_l2norm=True)
        for ci, cfg in enumerate(cfgs):  # every BENCH_CHUNK_CONFIGS entry (cfg0: the default)
            o, s = kda_chunk(q, k, v, g, beta, initial_state=s0, lengths=L, use_qk_l2norm=True,
                             safe_gate=safe, backend=A.backend, config=cfg)
            key = f"chunk B{B} T{T} H{H} K{K} {jnp.dtype(dt).name} {'bounded' if bounded else 'softplus'}{' safe' if safe else ''}{f' cfg{ci}' if ci else ''}"
            REC.details["checks"][key] = {"o_rel": rel(o, ro), "state_rel": rel(s, rs),
                                  "finite": bool(jnp.isfinite(o.astype(F32)).all())}
            print(key, REC.details["checks"][key], flush=True)
    if "decode" not in A.checks:
        return
    # decode
    for (B, H, dt, lb) in [(4, 12, BF16, -5.0), (3, 8, BF16, None), (2, 4, F32, None)][:3 - 2 * A.smoke]:
        a = decode_inputs(B, H, 128, dt)
        r = jax.jit(kda_decode_reference, static_argnames=("num_heads", "lower_bound"))(
            **a, num_heads=H, lower_bound=lb)
        p = kda_decode(**jax.tree.map(jnp.copy, a), num_heads=H, lower_bound=lb,
                       backend=A.backend)
        key = f"decode B{B} H{H} {jnp.dtype(dt).name} lb={lb}"
        REC.details["checks"][key] = {"o_rel": rel(p[0], r[0]), "conv_rel": rel(p[1], r[1]),
                              "state_rel": rel(p[2], r[2])}
        print(key, REC.details["checks"][key], flush=True)
    # verify
    for (B, T, H, dt, lens) in [(1, 4, 12, BF16, None), (3, 8, 4, F32, [8, 3, 5])][:2 - A.smoke]:
        q, k, v, g, beta, s0 = make(5, B, T, H, 128, dt)
        L = None if lens is None else jnp.array(lens, jnp.int32)
        o, hs = kda_verify(q, k, v, g, beta, s0, lengths=L, use_qk_l2norm=True, backend=A.backend)
        ro, rhs = kda_verify(q, k, v, g, beta, s0, lengths=L, use_qk_l2norm=True,
                             backend="reference")
        key = f"verify B{B} T{T} H{H} {jnp.dtype(dt).name}"
        REC.details["checks"][key] = {"o_rel": rel(o, ro), "states_rel": rel(hs, rhs)}
        print(key, REC.details["checks"][key], flush=True)


def decode_inputs(B, H, K, dt, seed=0):
    ks = jax.random.split(jax.random.key(seed), 10)
    P = H * K
    return dict(qkv=tuple(jax.random.normal(ks[0], (3, B, P)).astype(dt)),
                conv_state=jax.random.normal(ks[1], (B, 3, 3 * P)).astype(dt),
                conv_w=tuple(jax.random.normal(ks[2], (3, P, 4)) * 0.5),
                f=jax.random.normal(ks[3], (B, P)).astype(dt),
                A_log=jax.random.uniform(ks[4], (128,)),
                dt_bias=jax.random.normal(ks[5], (P,)),
                b=jax.random.normal(ks[6], (B, H)).astype(dt),
                gate=jax.random.normal(ks[7], (B, P)).astype(dt),
                o_norm_w=1 + 0.1 * jax.random.normal(ks[8], (K,)),
                state=jax.random.normal(ks[9], (B, H, K, K)) * 0.1)


# ------------------------------------------------------------------------------------------
def fla():
    import torch  # noqa: F401
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    from triton.testing import do_bench
    return chunk_kda, fused_recurrent_kda, do_bench


def fla_autotuned() -> dict:
    """The configs FLA's autotuners chose so far in this process, by kernel: what our launch
    parameters are held against (FLA tunes warps, stages and key tiles per GPU)."""
    from triton.runtime.autotuner import Autotuner
    seen = {}
    for mod in list(sys.modules.values()):
        if not getattr(mod, "__name__", "").startswith("fla."):
            continue
        for name, obj in list(vars(mod).items()):
            for _ in range(4):  # heuristics / jit wrappers around the autotuner, a few deep
                if obj is None or isinstance(obj, (Autotuner, type)):
                    break
                try:
                    obj = getattr(obj, "fn", None)
                except Exception:  # a module attribute whose `fn` is a property that raises
                    obj = None
            if isinstance(obj, Autotuner) and getattr(obj, "cache", None):
                seen[f"{mod.__name__}.{name}"] = {str(k): str(v) for k, v in obj.cache.items()}
    return seen


def chunk_configs():
    """The default ChunkConfig (cfg0: the tuned configuration), then each --chunk-config
    ("block_k_inter=32,num_warps_inter=2": those fields over the tuned ones). Every config is
    checked against the reference (correctness) and timed (prefill)."""
    from kernels_pallas.kda import ChunkConfig
    cfgs = [ChunkConfig()] + [chunk_config(item) for item in A.chunk_config]
    REC.details["chunk_configs"] = [str(c) for c in cfgs]
    return cfgs


def stage_times(q, k, v, g, beta, s0, safe, cfg):
    """Each of kda_chunk's launches timed alone on its real inputs (ms)."""
    from kernels_pallas.kda.chunk_pallas import chunk_stages
    stages, _ = chunk_stages(q, k, v, g, beta, initial_state=s0, use_qk_l2norm=True,
                             safe_gate=safe, config=cfg, interpret=A.smoke)
    return {name: tjax(fn, *args, n=10) for name, fn, args in stages}


def prefill(shapes):
    chunk_kda, _, do_bench = fla()
    cfgs = chunk_configs()
    for (B, T, H) in shapes:
        if REC.left() < 60:
            REC.data["skipped"].append(f"prefill B{B} T{T} H{H}")
            continue
        K = 128
        q, k, v, g, beta, s0 = make(B * T + H, B, T, H, K, BF16, bounded=True)
        rec = {}
        outs = {}
        for ci, cfg in enumerate(cfgs):  # every config: total and per-launch times
            f = jax.jit(lambda q, k, v, g, b, s, cfg=cfg: kda_chunk(
                q, k, v, g, b, initial_state=s, use_qk_l2norm=True, backend=A.backend, config=cfg))
            outs["ours", ci] = f(q, k, v, g, beta, s0)
            rec[f"ours_cfg{ci}_ms"] = tjax(f, q, k, v, g, beta, s0, n=20)
            # each launch alone, wall clock (--stages; the profiler's per-kernel times below
            # cover the same launches without recompiling each one)
            rec[f"ours_cfg{ci}_stages_ms"] = (stage_times(q, k, v, g, beta, s0, False, cfg)
                                              if A.stages else None)
            kt = None if A.smoke else kernel_times(f, q, k, v, g, beta, s0, reps=5)
            rec[f"ours_cfg{ci}_kernel_ms"] = kt and kt["total_us"] / 1e3  # GPU kernels (profiler)
            rec[f"ours_cfg{ci}_span_ms"] = kt and kt["span_us"] / 1e3  # first kernel start to last end
            rec[f"ours_cfg{ci}_kernels_ms"] = kt and {n_: t / 1e3 for n_, t in kt["by_kernel"].items()}
            print(f"  cfg{ci} {rec[f'ours_cfg{ci}_ms']:.3f} ms, kernels {rec[f'ours_cfg{ci}_kernel_ms']} ms",
                  rec[f"ours_cfg{ci}_stages_ms"], rec[f"ours_cfg{ci}_kernels_ms"], flush=True)
        best = min(range(len(cfgs)), key=lambda ci: rec[f"ours_cfg{ci}_ms"])
        rec["ours_ms"], rec["ours_best_cfg"] = rec[f"ours_cfg{best}_ms"], str(cfgs[best])
        rec["ours_kernel_ms"] = rec[f"ours_cfg{best}_kernel_ms"]
        rec["ours_kernels_ms"] = rec[f"ours_cfg{best}_kernels_ms"]
        f = jax.jit(lambda q, k, v, g, b, s, cfg=cfgs[best]: kda_chunk(
            q, k, v, g, b, initial_state=s, use_qk_l2norm=True, safe_gate=True, backend=A.backend,
            config=cfg))
        outs["ours_safe", best] = f(q, k, v, g, beta, s0)
        rec["ours_safe_ms"] = tjax(f, q, k, v, g, beta, s0, n=20)
        # the best config's wall clock again, after the safe-gate run (order effects)
        f0 = jax.jit(lambda q, k, v, g, b, s, cfg=cfgs[best]: kda_chunk(
            q, k, v, g, b, initial_state=s, use_qk_l2norm=True, backend=A.backend, config=cfg))
        rec["ours_ms_again"] = tjax(f0, q, k, v, g, beta, s0, n=20)
        tq, tk, tv, tg, tb, ts = map(to_torch, (q, k, v, g, beta, s0))
        ts = ts.clone()
        for safe in (False, True):
            kw = dict(initial_state=ts, output_final_state=True, use_qk_l2norm_in_kernel=True)
            if safe:
                kw.update(safe_gate=True, lower_bound=-5.0)
            fn = lambda kw=kw: chunk_kda(tq, tk, tv, tg, tb, **kw)
            fo, fs = fn()
            fo, fs = from_torch(fo), from_torch(fs)
            tag = "fla_safe" if safe else "fla"
            for (name, ci), (o, st) in outs.items():
                if (name == "ours_safe") == safe:
                    rec[f"agree_{tag}_cfg{ci}"] = {"o_rel": rel(o, fo), "state_rel": rel(st, fs)}
            rec[f"{tag}_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            if not safe:
                import torch
                kt = kernel_times(fn, reps=5, sync=lambda r: torch.cuda.synchronize())
                rec["fla_kernel_ms"] = kt and kt["total_us"] / 1e3
                rec["fla_kernels_ms"] = kt and {n_: t / 1e3 for n_, t in kt["by_kernel"].items()}
        rec["fla_autotuned"] = fla_autotuned()
        REC.details.setdefault("prefill", {})[f"B{B} T{T} H{H}"] = rec
        REC.log(f"prefill B{B} T{T} H{H}", rec)
        REC.row("KDA prefill (GPU kernel time)", f"B{B} T{T} H{H}", rec["ours_kernel_ms"], "ms",
                peer=rec["fla_kernel_ms"], peer_name="FLA chunk_kda")


def decode_loop_us(a, H, n, **kernel_kw):
    """Microseconds per step of n decode steps inside one jitted fori_loop (after a warm-up call)."""
    @jax.jit
    def loop(a):
        def body(i, c):
            _, cs, st = kda_decode_pallas(**dict(a, conv_state=c[0], state=c[1]), num_heads=H,
                                          lower_bound=-5.0, **kernel_kw)
            return cs, st
        return jax.lax.fori_loop(0, n, body, (a["conv_state"], a["state"]))
    jax.block_until_ready(loop(a))
    t = time.perf_counter()
    jax.block_until_ready(loop(a))
    return (time.perf_counter() - t) / n * 1e6


def decode(shapes):
    _, fused_recurrent_kda, do_bench = fla()
    import torch
    for (B, H) in shapes:
        if REC.left() < 25:
            REC.data["skipped"].append(f"decode B{B} H{H}")
            continue
        K = 128
        a = decode_inputs(B, H, K, BF16, seed=B + H)
        # ours, per call (Python dispatch included, state/conv donated and updated in place)
        f = lambda a: kda_decode_pallas(**a, num_heads=H, lower_bound=-5.0)
        cur = dict(a, conv_state=a["conv_state"].copy(), state=a["state"].copy())
        for _ in range(3):
            o, cs, st = f(cur)
            cur = dict(cur, conv_state=cs, state=st)
        jax.block_until_ready(st)
        n = 50
        t = time.perf_counter()
        for _ in range(n):
            o, cs, st = f(cur)
            cur = dict(cur, conv_state=cs, state=st)
        jax.block_until_ready(st)
        us_call = (time.perf_counter() - t) / n * 1e6

        us_dev = decode_loop_us(a, H, n)  # ours, device loop (no host dispatch)
        # GPU kernel time per call from the profiler (no host, no loop): ours and FLA's
        kt_ours = kernel_times(jax.jit(f), cur, reps=20)

        # agreement: FLA's recurrence on the same post-conv / gated inputs, then the same norm
        if "correctness" in A.sections:
            ref_o, _, ref_s = jax.jit(kda_decode_reference,
                                      static_argnames=("num_heads", "lower_bound"))(
                **a, num_heads=H, lower_bound=-5.0)
        o1, _, s1 = kda_decode_pallas(**jax.tree.map(jnp.copy, a), num_heads=H,
                                      lower_bound=-5.0)
        P = H * K
        qkv, conv_w = jnp.concatenate(a["qkv"], -1), jnp.concatenate(a["conv_w"])
        xx = jnp.concatenate([a["conv_state"].astype(F32), qkv.astype(F32)[:, None]], 1)
        y = jax.nn.silu(jnp.einsum("bwc,cw->bc", xx, conv_w)).astype(BF16)
        q, k, v = (z.reshape(B, 1, H, K) for z in jnp.split(y, 3, -1))
        g = kda_gate(a["f"].reshape(B, 1, H, K), a["A_log"], a["dt_bias"], lower_bound=-5.0)
        beta = jax.nn.sigmoid(a["b"].astype(F32)).reshape(B, 1, H)
        tq, tk, tv, tg, tb = map(to_torch, (q, k, v, g, beta.astype(BF16)))
        th = to_torch(a["state"]).clone()
        fn = lambda: fused_recurrent_kda(tq, tk, tv, tg, tb, initial_state=th,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        fo, fs = fn()
        fo, fs = from_torch(fo), from_torch(fs)
        us_fla = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
        kt_fla = kernel_times(fn, reps=20, sync=lambda r: torch.cuda.synchronize())
        us_fla_graph = None
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(20):
                    fn()
            gr.replay()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(5):
                gr.replay()
            e1.record()
            torch.cuda.synchronize()
            us_fla_graph = e0.elapsed_time(e1) / 100 * 1e3
        except Exception as e:
            REC.data["errors"][f"fla graph B{B} H{H}"] = repr(e)[:300]
        fo = fo.reshape(B, H, K)
        fo = fo * jax.lax.rsqrt(jnp.mean(fo * fo, -1, keepdims=True) + 1e-5) * a["o_norm_w"]
        fo = (fo * jax.nn.sigmoid(a["gate"].astype(F32).reshape(B, H, K))).reshape(B, P)
        state_bytes = 2 * B * H * K * K * 4
        variants = {}
        for item in A.decode_variant:
            kw = parse_overrides(item)
            us_v = decode_loop_us(a, H, n, **kw)
            vo, _, vs = kda_decode_pallas(**jax.tree.map(jnp.copy, a), num_heads=H,
                                          lower_bound=-5.0, **kw)
            fv = lambda a, kw=kw: kda_decode_pallas(**a, num_heads=H, lower_bound=-5.0, **kw)
            kt_v = kernel_times(jax.jit(fv), cur, reps=20)
            variants[item] = {"us_device_loop": us_v,
                              "kernel_us": kt_v and sum(t for n_, t in kt_v["by_kernel"].items()
                                                        if n_.startswith("kda_decode")),
                              "vs_default": {"o_rel": rel(vo, o1), "state_rel": rel(vs, s1)}}
        rec = {"ours_us_per_call": us_call, "ours_us_device_loop": us_dev, "fla_us": us_fla,
               "fla_us_cuda_graph": us_fla_graph,
               # the decode kernel alone: jit(f) without donation adds a copy of the state
               "ours_kernel_us": kt_ours and sum(t for n_, t in kt_ours["by_kernel"].items()
                                                 if n_.startswith("kda_decode")),
               "ours_kernels": kt_ours and kt_ours["by_kernel"],
               "fla_kernel_us": kt_fla and kt_fla["total_us"],
               "fla_kernels": kt_fla and kt_fla["by_kernel"],
               "ours_state_TBps_device": state_bytes / (us_dev * 1e-6) / 1e12,
               "agree_fla": {"o_rel": rel(o1, fo), "state_rel": rel(s1, fs)}, "variants": variants}
        if "correctness" in A.sections:
            rec["vs_reference"] = {"o_rel": rel(o1, ref_o), "state_rel": rel(s1, ref_s)}
        REC.details.setdefault("decode", {})[f"B{B} H{H}"] = rec
        REC.log(f"decode B{B} H{H}", rec)
        # ours: conv + norms + gates + state + gated norm in one launch; FLA: the recurrence
        REC.row("KDA decode (GPU kernel time)", f"B{B} H{H}", rec["ours_kernel_us"], "us",
                peer=rec["fla_kernel_us"], peer_name="FLA fused_recurrent_kda")


def verify():
    B, T, H, K = 1, 4, 12, 128
    q, k, v, g, beta, s0 = make(9, B, T, H, K, BF16)
    rec = {}
    n = 2 if A.smoke else 100
    for bv, nw in A.verify if not A.smoke else [(8, 2)]:
        if True:
            f = lambda s: kda_verify(q, k, v, g, beta, s, use_qk_l2norm=True, backend=A.backend,
                                     block_v=bv, num_warps=nw)

            @jax.jit
            def loop(s):
                def body(i, s):
                    return f(s)[1][:, -1]
                return jax.lax.fori_loop(0, n, body, s)
            jax.block_until_ready(loop(s0))
            t = time.perf_counter()
            jax.block_until_ready(loop(s0))
            rec[f"bv{bv} w{nw} us_device"] = (time.perf_counter() - t) / n * 1e6
            rec[f"bv{bv} w{nw} us_call"] = tjax(jax.jit(f), s0, n=2 if A.smoke else 50) * 1e3
            kt = None if A.smoke else kernel_times(jax.jit(f), s0, reps=20)
            if kt is not None:     # GPU time of one verify call, no loop or host in it
                rec[f"bv{bv} w{nw} us_kernel"] = kt["total_us"]
                rec[f"bv{bv} w{nw} kernels"] = kt["by_kernel"]
    REC.details["verify"] = {"B1 H12 T4": rec}
    REC.log("verify", rec)
    key = "bv8 w2 " + ("us_device" if A.smoke else "us_kernel")  # the kernel's default launch
    if key in rec:
        REC.row("KDA verify (GPU kernel time)", "B1 H12 T4", rec[key], "us", note="target < 10 us")


def run(rec, args):
    """The sections `args.sections` names, in that order; smoke: correctness and verify only
    (no FLA, no profiler)."""
    global A, REC
    A, REC = args, rec
    A.backend = "interpret" if A.smoke else "pallas"
    REC.details["checks"] = {}
    runners = {"correctness": correctness, "verify": verify, "decode": lambda: decode(A.decode),
               "prefill": lambda: prefill(A.prefill)}
    for name in A.sections:
        if A.smoke and name not in ("correctness", "verify"):
            continue
        REC.guard(name, runners[name])
