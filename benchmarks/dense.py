"""Dense projections at decode widths: GPU time of the skinny-matmul kernel (one launch per group
of weights sharing an input) against XLA's dots (one per weight, the model's reference path), at a
K3 TP8 rank's shapes, after a check of every case.

    python -m benchmarks dense [--rows 1,16,64] [--groups kda_in,moe_in,...] [--sweep]
    python -m benchmarks dense --smoke      # CPU: interpret mode, tiny shapes, no timings

A group is the weights one input meets in a layer (KDA: q, k, v, g, f_a, b from the normalised
hidden; the MoE: the router, the latent down-projection and the shared experts' gate and up;
...; the router's logits are fp32 in the model, bf16 here: the same weight bytes). Time: the
GPU kernels of one call (profiler). Bytes: the weights,
read once; % of the JAX copy bandwidth (read + write) of this run. --sweep also times column
tiles of 32 to 128, K steps of 64 to 256 and 3 or 4 pipeline stages (details only), to choose
the defaults from."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.dense import SkinnyConfig, skinny_matmul
from kernels_pallas.dense.ops import on_kernel
from kernels_pallas.dense.tuning import skinny_config
from .common import gpu_ms, ints_arg, jax_copy_Bps, names_arg

BF16 = jnp.bfloat16
# name -> (K, output widths): one TP8 rank of K3 (12 KDA heads of 128, 12 MLA heads, latent MoE
# of width 3584, two shared experts of 3072 / 8, vocabulary 163840 / 8). TABLE: the groups whose
# rows go to BENCHMARKS.md (the projections of the hidden state, most of the bytes); the others
# are logged and kept in the details.
TABLE = ("kda_in", "mla_in", "moe_in")
GROUPS = {
    "kda_in": (7168, (1536, 1536, 1536, 1536, 128, 12)),
    "kda_out": (1536, (7168,)),
    "kda_f_b": (128, (1536,)),  # below the kernel's MIN_K: XLA's dot on both sides
    "mla_in": (7168, (1536, 576, 1536)),
    "mla_q_b": (1536, (2304,)),
    "moe_in": (7168, (896, 3584, 768, 768)),
    "moe_latent_up": (3584, (7168,)),
    "shared_down": (768, (7168,)),
    "lm_head": (7168, (20480,)),
}
SMOKE_GROUPS = {"kda_in": (256, (64, 64, 12)), "out": (128, (256,))}


def add_args(p):
    p.add_argument("--rows", type=ints_arg, default=[1, 16, 64], help="rows a call (decode batch)")
    p.add_argument("--groups", type=names_arg, default=list(GROUPS), help=", ".join(GROUPS))
    p.add_argument("--sweep", action="store_true", help="also time other tiles and pipeline depths")


def inputs(m, k, ns, seed=0):
    ks = jax.random.split(jax.random.key(seed), len(ns) + 1)
    x = jax.random.normal(ks[0], (m, k)).astype(BF16)
    return x, tuple((0.02 * jax.random.normal(kk, (k, n))).astype(BF16) for kk, n in zip(ks[1:], ns))


def check(x, ws, ys, refs, strict=True):
    """Each output against the exact product (float64): within one bf16 step of the element, or
    of the output's RMS where it cancels (one rounding of an fp32 sum), where `strict` (ours is
    the kernel, not XLA's dot). XLA's error is recorded: its GEMV at one row rounds further."""
    worst, xla = 0.0, 0.0
    x64 = np.asarray(x, np.float64)
    for w, y, r in zip(ws, ys, refs):
        exact = x64 @ np.asarray(w, np.float64)
        rms = float(np.sqrt(np.mean(exact * exact))) or 1.0
        bound = 2.0 ** -8 * np.abs(exact) + 2.0 ** -9 * rms
        worst = max(worst, float((np.abs(np.asarray(y, np.float64) - exact) / bound).max()))
        xla = max(xla, float((np.abs(np.asarray(r, np.float64) - exact) / bound).max()))
    if strict and worst > 1:
        raise AssertionError(f"off the exact product by {worst:.3g} x one bf16 step")
    return {"err_in_bf16_steps": round(worst, 3), "xla_err_in_bf16_steps": round(xla, 3)}


def fn(backend, config=None):
    return jax.jit(lambda x, ws: skinny_matmul(x, ws, backend=backend, config=config))


def case(rec, args, name, k, ns, m, ours, peer, copy_Bps):
    x, ws = inputs(m, k, ns)
    strict = on_kernel(m, k, "interpret" if args.smoke else "pallas")  # else ours is XLA's dot too
    info = {"check": check(x, ws, ours(x, ws), peer(x, ws), strict),
            "config": skinny_config(m, k).__dict__}
    t_ours, info["ours"] = gpu_ms(ours, x, ws, smoke=args.smoke)
    t_peer, info["xla"] = gpu_ms(peer, x, ws, smoke=args.smoke)
    nbytes = sum(w.nbytes for w in ws)
    pct = lambda t: None if args.smoke else 100 * nbytes / (t * 1e-3) / copy_Bps  # noqa: E731
    if args.sweep and not args.smoke:
        variants = {f"bn{bn}_bk{bk}_st{st}": SkinnyConfig(block_n=bn, block_k=bk, num_stages=st)
                    for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4)
                    if k % bk == 0}
        info["sweep_pct_of_copy"] = {}
        for label, cfg in variants.items():
            t, _ = gpu_ms(fn("pallas", cfg), x, ws)
            info["sweep_pct_of_copy"][label] = round(pct(t), 1)
    rec.details[f"{name}_M{m}"] = info
    shape = f"{name} K{k} N{sum(ns)}, M={m}"
    if name in TABLE:
        rec.row("Dense projections, skinny matmul (GPU kernel time)", shape, t_ours * 1e3, "us",
                peer=t_peer * 1e3, peer_name="XLA dots", limit_pct=pct(t_ours))
    rec.log(f"{shape}: ours {t_ours * 1e3:.1f} us ({pct(t_ours) or 0:.0f}%), XLA "
            f"{t_peer * 1e3:.1f} us ({pct(t_peer) or 0:.0f}%) {info['check']}"
            + (f" sweep {info['sweep_pct_of_copy']}" if "sweep_pct_of_copy" in info else ""))


def run(rec, args):
    groups = SMOKE_GROUPS if args.smoke else {g: GROUPS[g] for g in args.groups}
    rows = [1, 5, 37] if args.smoke else args.rows
    ours, peer = fn("interpret" if args.smoke else "pallas"), fn("reference")
    copy_Bps = jax_copy_Bps(args.smoke)
    rec.details["copy_GBps"] = copy_Bps / 1e9
    for name, (k, ns) in groups.items():
        for m in rows:
            rec.guard(f"{name}_M{m}", case, rec, args, name, k, ns, m, ours, peer, copy_Bps)
