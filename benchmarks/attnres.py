"""AttnRes mix + RMSNorm: GPU time of the fused Pallas kernel against XLA's fusion of the plain-JAX
path (the model's reference backend) at K3 shapes, after a correctness check of every shape.

    python -m benchmarks attnres [--tokens 1,16,64,256,8192] [--bank 8,4] [--hidden 7168]
    python -m benchmarks attnres --smoke      # CPU: interpret mode, tiny shapes, no timings

One aggregation point: the residual stream s = residual + delta (the pending sublayer output),
the softmax over depth of `bank` stored block rows and s, the RMSNorm of the mixture. K3's hidden
is not split by TP (every TP8 rank holds whole rows), so a rank's shape is [tokens, 7168]; decode
batches 1-256 tokens and an 8192-token prefill chunk; 8 bank rows is the largest the model has
(its last block and output), 4 a block mid-model. Correctness: s bitwise, y against the reference
within bf16 rounding. Time: the GPU kernels of one call (profiler). Bytes: rows read (bank,
residual, delta) + rows written (y, s), bf16; % of the JAX copy bandwidth of this run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.attnres import attn_res_norm
from .common import gpu_ms, ints_arg, jax_copy_Bps

EPS = 1e-5
BF16 = jnp.bfloat16
Y_TOL = 3 * 2.0 ** -7  # three bf16 steps relative: the roundings of the mixture, the norm, the gain
Y_ATOL = 1e-3  # fp32 summation noise, relative to y's RMS of about 1, where an element cancels


def add_args(p):
    p.add_argument("--tokens", type=ints_arg, default=[1, 16, 64, 256, 8192],
                   help="tokens a call (decode batches and a prefill chunk)")
    p.add_argument("--bank", type=ints_arg, default=[8, 4], help="stored block rows")
    p.add_argument("--hidden", type=int, default=7168)


def inputs(T, n, H, seed=0):
    ks = jax.random.split(jax.random.key(seed), n + 6)
    bank = [(jax.random.normal(ks[i], (T, H)) * (1 + i)).astype(BF16) for i in range(n)]
    r, d = (jax.random.normal(k, (T, H)).astype(BF16) for k in ks[n:n + 2])
    g, gain = ((1 + 0.1 * jax.random.normal(k, (H,))).astype(BF16) for k in ks[n + 2:n + 4])
    w = jax.random.normal(ks[n + 4], (H,)).astype(BF16)  # the pseudo-query: a real mix
    return bank, r, d, g, w, gain


def fn(backend):
    return jax.jit(lambda bank, r, d, g, w, gain: attn_res_norm(bank, r, d, g, w, gain, eps=EPS,
                                                               backend=backend))


def check(ours, peer, args) -> dict:
    """s bitwise against the reference op by op and against XLA's fusion of it; y against the
    reference op by op, whose rounding points (the residual add, the mixture, the normalised
    value) the kernel keeps. XLA's fusion may skip the rounding of s before the mix (excess
    precision), so its y can differ by a bf16 step of the mixture: recorded, not asserted."""
    y, s = ours(*args)
    ry, rs = attn_res_norm(*args, eps=EPS, backend="reference")
    xy, xs = peer(*args)
    bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731
    if not (np.array_equal(bits(s), bits(rs)) and np.array_equal(bits(s), bits(xs))):
        raise AssertionError("the residual stream differs from the reference's")
    y, ry, xy = (np.asarray(a, np.float32) for a in (y, ry, xy))
    err = np.abs(y - ry) - Y_TOL * np.abs(ry)
    if err.max() > Y_ATOL:
        raise AssertionError(f"y off the reference by {err.max():.3g} past the tolerance")
    return {"y_mismatch_frac": float(np.mean(y != ry)),
            "xla_y_max_abs_diff": float(np.abs(xy - ry).max())}


def case(rec, args, T, n, H, ours, peer, copy_Bps):
    x = inputs(T, n, H)
    info = {"check": check(ours, peer, x)}
    t_ours, info["ours"] = gpu_ms(ours, *x, smoke=args.smoke)
    t_peer, info["xla"] = gpu_ms(peer, *x, smoke=args.smoke)
    nbytes = (n + 2 + 2) * T * H * 2
    rec.details[f"T{T}_bank{n}"] = info
    rec.row("AttnRes mix + RMSNorm", f"T{T} bank{n} H{H}", t_ours * 1e3, "us", peer=t_peer * 1e3,
            peer_name="XLA (plain JAX)",
            limit_pct=None if args.smoke else 100 * nbytes / (t_ours * 1e-3) / copy_Bps,
            note="of JAX copy")
    rec.log(f"T{T} bank{n}: ours {t_ours * 1e3:.1f} us, XLA {t_peer * 1e3:.1f} us, "
            f"{info['check']}")


def run(rec, args):
    if args.smoke:
        args.tokens, args.bank, args.hidden = [1, 5, 37], [3, 0], 256
    ours, peer = fn("interpret" if args.smoke else "pallas"), fn("reference")
    copy_Bps = jax_copy_Bps(args.smoke)
    rec.details["copy_GBps"] = copy_Bps / 1e9
    for n in args.bank:
        for T in args.tokens:
            rec.guard(f"T{T}_bank{n}", case, rec, args, T, n, args.hidden, ours, peer, copy_Bps)
