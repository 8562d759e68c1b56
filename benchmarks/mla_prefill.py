"""MLA prefill attention: our Pallas flash kernel against cuDNN flash attention.

Causal, expanded form (q, k 192 = 128 nope + 64 rope, v 128), one TP8 rank's heads (16) and all
128, ours (kernels_pallas.mla.mla_prefill, default blocks and `--config` alternatives) against
JAX's cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`, v padded to
192) on identical inputs; GPU kernel time from the profiler, FLOPs counted causal
(B x H x T^2 / 2 x 2 x (192 + 128)). First a ragged-length check against the fp32 reference.

A prefill chunk over its cached history (`--history BxTxHxS`: T new queries at positions S - T
.. S - 1 over all S keys, as the engine's chunked prefill runs it per key chunk) is timed against
cuDNN over the same T x S scores without a mask (cuDNN's causal mask aligns T != S differently);
TFLOP/s count each side's own query-key pairs.

    python -m benchmarks mla-prefill [--shapes 1x8192x16,1x32768x16] [--config q64w4s2:block_q=64,num_warps=4]
    python -m benchmarks mla-prefill --history 1x4096x16x32768
    python -m benchmarks mla-prefill --smoke     # CPU: interpret mode, tiny shapes, no peer
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.mla import PrefillConfig, mla_prefill, mla_prefill_reference
from .common import gpu_ms, rel, shapes_arg
from .config_strings import parse_overrides

SCALE = 1.0 / math.sqrt(192.0)


def add_args(p):
    p.add_argument("--shapes", type=shapes_arg, default=shapes_arg("1x8192x16,1x32768x16,4x4096x16,1x8192x128"),
                   help="BxTxH")
    p.add_argument("--history", type=shapes_arg, default=shapes_arg("1x4096x16x32768,1x8192x16x32768"),
                   help="BxTxHxS: a chunk of T queries after S - T cached positions")
    p.add_argument("--config", action="append", default=[], metavar="NAME:k=v,...",
                   help="block configuration timed beside the default, e.g. "
                        "q128w8s3:block_q=128,num_warps=8,num_stages=3 (repeatable)")


def inputs(B, T, H, seed):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, H, 192), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, H, 192), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, 128), jnp.bfloat16)
    return q, k, v


def cudnn(q, k, v):
    # JAX's cuDNN path needs v's head dim equal to q's: v is zero-padded to 192 and the output
    # sliced back, the way a JAX user would call it (the pad and slice kernels are in the
    # peer's total; its attention kernel alone is in the details).
    vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 192 - v.shape[-1])))
    return jax.nn.dot_product_attention(q, k, vp, scale=SCALE, is_causal=True,
                                        implementation="cudnn")[..., :v.shape[-1]]


def check_ragged(rec, backend, lengths):
    q, k, v = inputs(len(lengths), max(lengths), 4, 0)
    ln = jnp.asarray(lengths, jnp.int32)
    o = mla_prefill(q, k, v, ln, scale=SCALE, backend=backend)
    ro = mla_prefill_reference(q, k, v, ln, scale=SCALE)
    valid = (np.arange(q.shape[1])[None, :] < np.asarray(lengths)[:, None])[..., None, None]
    err = rel(np.where(valid, o, 0), np.where(valid, ro, 0))
    pad_zero = bool(np.all(np.where(valid, 0, np.asarray(o, np.float32)) == 0))
    rec.details["check"] = dict(lengths=lengths, rel_err=err, padding_rows_zero=pad_zero,
                                ok=err < 2e-2 and pad_zero)
    rec.log("check", rec.details["check"])
    if not rec.details["check"]["ok"]:
        rec.data["errors"]["check"] = f"ragged prefill disagrees with the reference: {rec.details['check']}"


def time_shape(rec, backend, smoke, B, T, H, configs):
    q, k, v = inputs(B, T, H, 1)
    ln = jnp.full((B,), T, jnp.int32)
    flops = B * H * T * T / 2 * 2 * (192 + 128)
    peer_ms = ref = None
    case = {"B": B, "T": T, "H": H}
    if not smoke:
        ref = cudnn(q, k, v)
        peer_ms, info = gpu_ms(jax.jit(cudnn), q, k, v, reps=5)
        case["cudnn"] = dict(ms=peer_ms, attn_kernel_ms=max(info["by_kernel_us"].values()) / 1e3,
                             tflops=flops / peer_ms / 1e9)
    fn = jax.jit(lambda q, k, v, ln, cfg: mla_prefill(q, k, v, ln, scale=SCALE, backend=backend,
                                                      config=PrefillConfig(**dict(cfg))),
                 static_argnames="cfg")
    for name, cfg in configs.items():
        key = tuple(sorted(cfg.items()))
        o = fn(q, k, v, ln, key)
        ms, info = gpu_ms(fn, q, k, v, ln, key, reps=5, smoke=smoke)
        case[name] = dict(cfg=cfg, ms=ms, tflops=flops / ms / 1e9, by_kernel_us=info.get("by_kernel_us"),
                          rel_vs_cudnn=None if ref is None else rel(o, ref))
        rec.log(f"B{B} T{T} H{H} {name}: {case[name]}")
    rec.details.setdefault("cases", []).append(case)
    rec.row("MLA prefill, causal (GPU kernel time)", f"B{B} T{T} H{H}", case["default"]["ms"], "ms",
            peer=peer_ms, peer_name="cuDNN flash attention",
            note=f"{case['default']['tflops']:.0f} TFLOP/s")


def time_history(rec, backend, smoke, B, T, H, S):
    q, _, _ = inputs(B, T, H, 2)
    _, k, v = inputs(B, S, H, 3)
    n_new, starts = jnp.full((B,), T, jnp.int32), jnp.full((B,), S - T, jnp.int32)
    pairs = B * H * (T * (S - T) + T * (T + 1) / 2)
    fn = jax.jit(lambda q, k, v, n, st: mla_prefill(q, k, v, n, starts=st, key_start=jnp.int32(0),
                                                     scale=SCALE, backend=backend))
    o = fn(q, k, v, n_new, starts)
    m = min(64, T)  # the last queries against the dense oracle (all T x S scores would not fit)
    ro = mla_prefill_reference(q[:, -m:], k, v, n_new * 0 + m, starts + T - m, jnp.int32(0), scale=SCALE)
    case = {"B": B, "T": T, "H": H, "S": S, "rel_err_last_queries": rel(o[:, -m:], ro)}
    if case["rel_err_last_queries"] > 2e-2:
        rec.data["errors"][f"history {B}x{T}x{H}x{S}"] = f"disagrees with the reference: {case}"
    ms, _ = gpu_ms(fn, q, k, v, n_new, starts, reps=5, smoke=smoke)
    case["ours"] = dict(ms=ms, tflops=pairs * 2 * 320 / ms / 1e9)
    peer_ms = None
    if not smoke:
        full = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, 64))), scale=SCALE,
            implementation="cudnn")[..., :128]
        peer_ms, _ = gpu_ms(jax.jit(full), q, k, v, reps=5)
        case["cudnn_no_mask"] = dict(ms=peer_ms, tflops=B * H * T * S * 2 * 320 / peer_ms / 1e9)
    rec.details.setdefault("history_cases", []).append(case)
    rec.log(f"history B{B} T{T} H{H} S{S}: {case}")
    rec.row("MLA prefill, a chunk over its cached history (GPU kernel time)", f"B{B} T{T} after {S - T} H{H}",
            ms, "ms", peer=peer_ms, peer_name="cuDNN flash attention over T x S, no mask",
            note=f"{case['ours']['tflops']:.0f} TFLOP/s" + (
                f" (cuDNN {case['cudnn_no_mask']['tflops']:.0f})" if peer_ms else ""))


def run(rec, args):
    backend = "interpret" if args.smoke else "pallas"
    configs = {"default": {}}
    for item in args.config:
        name, _, kv = item.partition(":")
        configs[name] = parse_overrides(kv)
    shapes = args.shapes
    if args.smoke:
        shapes, configs = [(1, 200, 2)], {"default": dict(block_q=32, block_k=32)}
    rec.guard("check", check_ragged, rec, backend, [1, 77, 200] if args.smoke else [1, 77, 300, 256])
    for B, T, H in shapes:
        rec.guard(f"B{B} T{T} H{H}", time_shape, rec, backend, args.smoke, B, T, H, configs)
    for B, T, H, S in ([(1, 40, 2, 100)] if args.smoke else args.history):
        rec.guard(f"history B{B} T{T} H{H} S{S}", time_history, rec, backend, args.smoke, B, T, H, S)
