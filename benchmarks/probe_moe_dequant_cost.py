"""What the MXFP4 decode would gain from a cheaper nibble decode: times the default
"split_asm_t" kernel with its nibble PTX replaced by cheaper, WRONG stand-ins (the outputs are
not the weights; nothing here is checked for correctness, by design), on the H200:

  PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/probe_moe_dequant_cost.py

  real   the library's PTX: 14 instructions per 8 weights (2 prmt, 4 x and / mul / and)
  cheap  2 prmt + 2 and per 8 weights (a stand-in for a load-time re-encoding that decodes
         with a shift-free mask)
  none   two register moves (ptxas may drop them): no nibble decode at all; the scale multiply,
         the wgmma and the loads remain
  cheap2, none2  the same with different code for the low and high nibbles ("cheap" and "none"
         use one string for both, which the compiler merges into one operand for both dots)
PROBE_TOKENS="64" limits the token counts (default 64,512).

Shapes: 896 experts, top-16 random routing; the TP8 gate+up slice (K 3584, N 768) and the whole
layer's gate+up (N 6144) at 64 and 512 tokens; GPU kernel time of moe_gmm (kernel_timer.py),
% of the torch copy bandwidth measured in the same run, counted in packed weight bytes of the
experts that received rows. A probe (method: time a variant that leaves a stage out), not a
kernel: the stand-ins exist only in this script, monkeypatched over kernels_pallas.moe.gmm.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.moe import gmm  # noqa: E402
from kernel_timer import kernel_times  # noqa: E402

_REAL = gmm._asm_t
STAND_INS = {
    "real": _REAL,
    "cheap": lambda half: ("{\n.reg .b32 t;\nprmt.b32 t, $2, 0, 0x4140;\nand.b32 $0, t, 0x81C081C0;\n"
                           "prmt.b32 t, $2, 0, 0x4342;\nand.b32 $1, t, 0x81C081C0;\n}"),
    "none": lambda half: "mov.b32 $0, $2;\nmov.b32 $1, $2;",
    # the same costs with different low / high code, so the two are not merged into one operand
    "cheap2": lambda half: ("{\n.reg .b32 t;\n"
                            f"prmt.b32 t, $2, 0, {'0x4140' if half == 'lo' else '0x4041'};\n"
                            "and.b32 $0, t, 0x81C081C0;\n"
                            f"prmt.b32 t, $2, 0, {'0x4342' if half == 'lo' else '0x4243'};\n"
                            "and.b32 $1, t, 0x81C081C0;\n}"),
    "none2": lambda half: ("mov.b32 $0, $2;\nmov.b32 $1, $2;" if half == "lo" else
                           "not.b32 $0, $2;\nnot.b32 $1, $2;"),
}


def main():
    if jax.default_backend() != "gpu":
        raise SystemExit("a GPU probe: run it on the H200 (the stand-ins are inline PTX)")
    from bench_moe_gmm import rand_mxfp4_device, routing, torch_copy_tbps
    copy = torch_copy_tbps()
    print(f"torch copy {copy:.2f} TB/s", flush=True)
    G, K, topk = 896, 3584, 16
    rng = np.random.default_rng(0)
    for n in (768, 6144):
        w = rand_mxfp4_device(jax.random.key(n), G, n, K)
        for tokens in [int(t) for t in os.environ.get("PROBE_TOKENS", "64,512").split(",")]:
            gs_np = routing(rng, tokens, G, topk)
            gs = jnp.asarray(gs_np)
            x = jax.random.normal(jax.random.key(tokens), (tokens * topk, K), jnp.bfloat16)
            wbytes = int((gs_np > 0).sum()) * (K * n // 2 + K * n // 32)
            row = []
            for name, asm in STAND_INS.items():
                gmm._asm_t = asm
                try:
                    f = jax.jit(lambda a, b, g: gmm.moe_gmm(a, b, g))   # a fresh trace each
                    r = kernel_times(f, x, w, gs, reps=10)
                finally:
                    gmm._asm_t = _REAL
                us = r["by_kernel"].get("moe_gmm", r["total_us"])
                pct = wbytes / (us * 1e-6) / 1e12 / copy * 100
                row.append(f"{name} {us / 1e3:.3f} ms {pct:.1f}%")
            print(f"N {n} tokens {tokens}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
