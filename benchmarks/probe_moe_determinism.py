"""Run-to-run determinism of the MXFP4 "split_asm_t" kernel, both layouts, K blocks of 256 and
128, on the H200: each config called 8 times on the same inputs (896 experts, top-16, 64 tokens;
K 3584 x N 768 and K 384 x N 3584), against moe_gmm on the exact bf16 weights.

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/probe_moe_determinism.py
  PROBE_CONFIGS="128,128,3,np4;128,256,3" PROBE_K=384 PROBE_TOKENS=512 PROBE_CALLS=12 ...
      # bn,bk,stages[,npN = n_per_program][,xr = x_resident]; K filter; tokens (default 64);
      # calls (default 8)

Prints per config: elements that differ between calls, the max error range, non-finite outputs,
the first rows that are wrong. Found (2026-12-02, results_moe.md run 8): some configs with K
blocks of 128 differ from call to call; the library's defaults avoid them.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_moe_gmm import dequant_device, rand_mxfp4_device, routing  # noqa: E402

from kernels_pallas.moe import GmmConfig, moe_gmm, pair_mxfp4  # noqa: E402

G, TOPK = 896, 16
CONFIGS = ((128, 256, 4), (128, 128, 4), (64, 128, 4), (128, 128, 3), (64, 128, 3))  # bn, bk, stages


def _configs():
    """PROBE_CONFIGS "bn,bk,stages[,npN][,xr];..." (npN: N column blocks per program; xr: x
    resident) or the default set."""
    env = os.environ.get("PROBE_CONFIGS")
    if not env:
        return [GmmConfig(16, bn, bk, num_warps=4, num_stages=st, dequant="split_asm_t")
                for bn, bk, st in CONFIGS]
    out = []
    for item in filter(None, env.split(";")):
        f = item.split(",")
        nps = [int(v[2:]) for v in f[3:] if v.startswith("np")]
        out.append(GmmConfig(16, int(f[0]), int(f[1]), num_warps=4, num_stages=int(f[2]),
                             dequant="split_asm_t", n_per_program=nps[0] if nps else 1,
                             x_resident="xr" in f[3:]))
    return out


def main(calls=int(os.environ.get("PROBE_CALLS", "8"))):
    if jax.default_backend() != "gpu":
        raise SystemExit("a GPU probe: the split_asm_t kernel is CUDA inline PTX")
    rng = np.random.default_rng(5)
    f32 = jnp.float32
    ks = [int(v) for v in os.environ.get("PROBE_K", "3584,384").split(",")]
    tokens = int(os.environ.get("PROBE_TOKENS", "64"))
    for k, n in [(k, n) for k, n in ((3584, 768), (384, 3584)) if k in ks]:
        w = rand_mxfp4_device(jax.random.key(k), G, n, k)
        wp = pair_mxfp4(w)
        wd = dequant_device(w, "kn")
        gs = jnp.asarray(routing(rng, tokens, G, TOPK))
        x = jax.random.normal(jax.random.key(64), (tokens * TOPK, k), jnp.bfloat16)
        ref = np.asarray(jax.jit(lambda a, b, g: moe_gmm(a, b, g, preferred_element_type=f32))(
            x, wd, gs))
        for cfg in _configs():
            for name, ww in (("k3", w), ("paired", wp)):
                f = jax.jit(lambda a, b, g, c=cfg: moe_gmm(a, b, g, config=c,
                                                           preferred_element_type=f32))
                outs = [np.asarray(f(x, ww, gs)) for _ in range(calls)]
                vary = max(int(np.sum(o != outs[0])) for o in outs)
                errs = [float(np.max(np.abs(o - ref))) for o in outs]
                nonfin = sum(int(np.sum(~np.isfinite(o))) for o in outs)
                wrong = np.abs(outs[0] - ref).max(1) > 1e-2 * np.abs(ref).max()
                print(f"T{tokens} K{k} N{n} {cfg.name()} {name}: run-to-run differing elements {vary}, "
                      f"max|err| {min(errs):.3g}..{max(errs):.3g}, non-finite {nonfin}, "
                      f"wrong rows {np.nonzero(wrong)[0][:8].tolist()}", flush=True)


if __name__ == "__main__":
    main()
