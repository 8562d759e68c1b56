"""Shared memory (LDS) and registers of our Pallas-Triton kernels, compiled offline on a CPU
machine for the H200 (sm_90) and for MI300X / MI355X (gfx942 / gfx950).

Pallas lowers each kernel to Triton IR (jax.export with the target platform; the GPU description
Pallas asks for is patched to an H200); the `triton` package (pip, the version the GPU image's
torch uses: 3.6) then compiles that IR for each target, as XLA's Triton pipeline would. Figures
are therefore those of upstream Triton 3.6, not of the Triton bundled in jaxlib; close, not
identical.

  python3 -m pip install triton==3.6.0     # CPU machine; no GPU needed
  python -m benchmarks resources [kda] [mla] [--targets sm_90,gfx942,gfx950]
  python -m benchmarks resources kda --sass   # + SASS opcode mix (sm_90)
  python -m benchmarks resources kda --sass --targets sm_90 \
      --kda-config num_warps_inter=2 --kda-config num_warps_inter=4,block_k_inter=32
"""
from __future__ import annotations

import collections
import os
import re
import tempfile

import jax
import jax.numpy as jnp

from kernels_pallas.gpu_lowering import triton_ir

SD = jax.ShapeDtypeStruct


def compile_ttir(ttir: str, target: str, num_warps: int, num_stages: int):
    """One kernel's Triton IR compiled by upstream Triton for `target` ("sm_90", "gfx942", ...):
    the compiled kernel (metadata, asm["cubin"] / asm["amdgcn"])."""
    from triton._C.libtriton import ir, passes
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as tcompile

    ctx = ir.context()
    ir.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ttir")
        with open(src, "w") as fh:
            fh.write(ttir)
        mod = ir.parse_mlir_module(src, ctx)
        pm = ir.pass_manager(ctx)  # the make_ttir passes (compiling from a .ttir file skips them)
        for add in (passes.common.add_inliner, passes.ttir.add_rewrite_tensor_pointer,
                    passes.common.add_canonicalizer, passes.ttir.add_combine,
                    passes.ttir.add_reorder_broadcast, passes.common.add_cse,
                    passes.common.add_symbol_dce, passes.ttir.add_loop_unroll):
            add(pm)
        pm.run(mod, "make_ttir")
        opt = os.path.join(d, "k.opt.ttir")
        with open(opt, "w") as fh:
            fh.write(str(mod))
        if target.startswith("sm_"):
            gpu = GPUTarget("cuda", int(target[3:]), 32)
        else:
            gpu = GPUTarget("hip", target, 64)
        return tcompile(opt, target=gpu, options={"num_warps": num_warps,
                                                  "num_stages": num_stages})


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """`cuobjdump <flag>` on a cubin, with the cuobjdump that the triton package ships."""
    import subprocess

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([tool, flag, fh.name], capture_output=True, text=True).stdout


SASS_OPS = ("HMMA", "HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "BAR", "LDS", "STS", "SHFL", "F2FP",
            "LDL", "STL")


def sass_mix(cubin: bytes, loop_trips: int) -> collections.Counter:
    """Opcode counts of a kernel's SASS, each instruction inside a loop (a backward branch's
    span) counted `loop_trips` times: a rough per-warp dynamic count for kernels whose only
    loop is the key-tile loop. Multiplied by the warps it says what a program issues, which
    is where 4 warps redoing a 16x16 product shows. Loops
    the trip count does not describe (the exact path's column loop, wu's second loop) are
    weighted the same: read the counts as a comparison between configs, not a profile."""
    ins, loops = [], []
    for line in _cuobjdump(cubin, "-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*?);", line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        ins.append((addr, m.group(2)))
        back = re.search(r"BRA(?:\.\w+)*\s+0x([0-9a-f]+)", m.group(2) + m.group(3))
        if back and int(back.group(1), 16) < addr:
            loops.append((int(back.group(1), 16), addr))
    mix = collections.Counter()
    for addr, op in ins:
        mix[op] += loop_trips if any(lo <= addr <= hi for lo, hi in loops) else 1
    return mix


def _compile(ttir: str, target: str, num_warps: int, num_stages: int):
    """-> dict(smem bytes, registers, spill) for one kernel's Triton IR on one target."""
    k = compile_ttir(ttir, target, num_warps, num_stages)
    out = {"smem": k.metadata.shared, "kernel": k}
    if target.startswith("sm_"):  # registers / spill from the cubin (triton ships cuobjdump)
        usage = _cuobjdump(k.asm["cubin"], "-res-usage")
        out["regs"] = int((re.findall(r"REG:(\d+)", usage) or [-1])[0])
        out["spill"] = int((re.findall(r"STACK:(\d+)", usage) or [-1])[0])  # bytes of stack
    else:
        gcn = k.asm.get("amdgcn", "")
        out["regs"] = int((re.findall(r"\.vgpr_count:\s+(\d+)", gcn) or [-1])[0])
        out["spill"] = int((re.findall(r"\.vgpr_spill_count:\s+(\d+)", gcn) or [-1])[0])
    return out


KDA_CONFIGS: list[str] = []  # --kda-config: more chunk configs (config_strings.chunk_config)


def kda_kernels():
    """(name, fn, args, [(num_warps, num_stages[, loop trips]) per pallas_call]) at one TP8
    rank's K3 shapes; the chunk's default and any --kda-configs."""
    from kernels_pallas.kda import tuning
    from kernels_pallas.kda.chunk_pallas import ChunkConfig, kda_chunk_pallas
    from kernels_pallas.kda.decode import kda_decode_pallas
    from kernels_pallas.kda.verify import kda_verify_pallas

    B, T, H, K = 8, 4096, 12, 128
    chunk_args = (SD((B, T, H, K), jnp.bfloat16),) * 3 + (
        SD((B, T, H, K), jnp.float32), SD((B, T, H), jnp.bfloat16), SD((B, H, K, K), jnp.float32))

    def chunk(cfg):  # safe_gate: as the K3 layer calls it (bounded gate)
        cfg = tuning.chunk_config(B, T, H, K, K, jnp.bfloat16, cfg)
        fn = lambda q, k, v, g, b, s: kda_chunk_pallas(q, k, v, g, b, initial_state=s,
                                                       use_qk_l2norm=True, config=cfg,
                                                       safe_gate=True)
        # (num_warps, num_stages, trips of the launch's loop: for --sass)
        launches = [(cfg.num_warps_diag, cfg.num_stages_diag, K // cfg.diag_block_k),
                    (cfg.num_warps_inter, cfg.num_stages_inter, K // cfg.block_k_inter),
                    (cfg.num_warps_wu, cfg.num_stages_wu, K // cfg.block_wu),
                    (cfg.num_warps_state, cfg.num_stages_state, T // 64),
                    (cfg.num_warps_out, cfg.num_stages_out, K // cfg.block_k_out)]
        return fn, chunk_args, launches

    P, Bd = H * K, 64
    dec_args = [SD((Bd, 3 * P), jnp.bfloat16), SD((Bd, 3, 3 * P), jnp.bfloat16),
                SD((3 * P, 4), jnp.float32), SD((Bd, P), jnp.bfloat16), SD((H,), jnp.float32),
                SD((P,), jnp.float32), SD((Bd, H), jnp.bfloat16), SD((Bd, P), jnp.bfloat16),
                SD((K,), jnp.float32), SD((Bd, H, K, K), jnp.float32)]
    dec = lambda *a: kda_decode_pallas(*a, num_heads=H, lower_bound=-5.0)
    ver_args = (SD((1, 4, H, K), jnp.bfloat16),) * 3 + (
        SD((1, 4, H, K), jnp.float32), SD((1, 4, H), jnp.bfloat16), SD((1, H, K, K), jnp.float32))
    ver = lambda q, k, v, g, b, s: kda_verify_pallas(q, k, v, g, b, s, use_qk_l2norm=True)
    label = lambda name: f"kda_chunk {name} [diag, inter, wu, state, out]"
    from .config_strings import chunk_config
    extra = [(label(item), *chunk(chunk_config(item))) for item in KDA_CONFIGS]
    return [(label("default"), *chunk(ChunkConfig())), *extra,
            ("kda_decode B64 H12", dec, dec_args, [(4, 1)]),
            ("kda_verify B1 T4 H12", ver, ver_args, [(2, 1)])]


def mla_kernels():
    """MLA decode at B16 32K, 16 heads, 64-token pages: the bf16 and float8 defaults and the fp8
    words form's three conversions ("words_pairs", the default; "words"; "words_int") at its
    default blocks (64 keys, 4 warps, 3 stages); #1 is the split merge (merge.py). The words
    form's kernels hold PTX: compiled for sm_90 only (its ROCm form, "words_int" in jnp, is not
    compiled here)."""
    from kernels_pallas.mla import DecodeConfig, mla_decode
    from kernels_pallas.mla.tuning import decode_config

    B, ctx, pages = 16, 32768, 8192
    q = SD((B, 1, 16, 576), jnp.bfloat16)
    pt, ln = SD((B, ctx // 64), jnp.int32), SD((B,), jnp.int32)
    out = []
    variants = [("bf16", {}), ("fp8", {})]
    variants += [("fp8w", dict(fp8_upcast=u)) for u in ("words_pairs", "words", "words_int")]
    for dt, kw in variants:
        cdt = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "fp8w": jnp.uint16}[dt]
        cache = SD((pages, 64, 288 if dt == "fp8w" else 576), cdt)
        cfg = decode_config(q.shape, cache.shape, cdt, pt.shape, DecodeConfig(**kw), num_sms=132)
        args = (q, cache, pt, ln) + ((SD((pages, 64), jnp.float32),) if dt != "bf16" else ())
        fn = (lambda *a, cfg=cfg: mla_decode(*a[:4], scale=0.07, backend="pallas",
                                             cache_scale=a[4] if len(a) > 4 else None,
                                             config=cfg))
        name = f"mla_decode {dt} " + " ".join(f"{k}={v}" for k, v in kw.items())
        merge = [(4, 2)] if cfg.num_splits > 1 else []     # merge.py's launch
        out.append((name, fn, args, [(cfg.num_warps, cfg.num_stages)] + merge))
    return out


GROUPS = {"kda": kda_kernels, "mla": mla_kernels}


def add_args(ap):
    ap.add_argument("groups", nargs="*", default=list(GROUPS), help="kernel groups: kda, mla")
    ap.add_argument("--targets", default="sm_90,gfx942,gfx950")
    ap.add_argument("--sass", action="store_true",
                    help="also print each sm_90 kernel's SASS opcode mix (loop bodies weighted "
                         "by the launch's trip count where the group gives one, else once)")
    ap.add_argument("--kda-config", action="append", default=[], metavar="k=v,...",
                    help="another KDA ChunkConfig, e.g. num_warps_inter=2 (repeatable)")


def main(a):
    KDA_CONFIGS.extend(a.kda_config)
    targets = a.targets.split(",")
    print(f"{'kernel':<58} {'target':<7} {'smem/LDS':>9} {'regs':>5} {'spill':>5}")
    for group in a.groups:
        for name, fn, args, launches in GROUPS[group]():
            by_platform = {}  # lowered once per platform (jax caches the lowering)
            for target in targets:
                platform = "cuda" if target.startswith("sm_") else "rocm"
                if platform == "rocm" and " fp8w " in name:     # PTX inside: NVIDIA only
                    print(f"{name:<58} {target:<7} (skipped: the words form's PTX is NVIDIA's)")
                    continue
                if platform not in by_platform:
                    by_platform[platform] = triton_ir(fn, *args, platform=platform)
                irs = by_platform[platform]
                assert len(irs) == len(launches), (name, len(irs))
                for i, (ttir, (nw, ns, *trips)) in enumerate(zip(irs, launches)):
                    r = _compile(ttir, target, nw, ns)
                    label = f"{name} #{i} (w{nw} s{ns})" if len(irs) > 1 else f"{name} (w{nw} s{ns})"
                    print(f"{label:<58} {target:<7} {r['smem']:>9} {r['regs']!s:>5} {r['spill']!s:>5}",
                          flush=True)
                    if a.sass and target.startswith("sm_"):
                        mix = sass_mix(r["kernel"].asm["cubin"], trips[0] if trips else 1)
                        total = sum(mix.values())
                        print(f"    SASS per warp {total}, x {nw} warps = {total * nw}: "
                              + " ".join(f"{op}:{mix[op]}" for op in SASS_OPS if mix[op]),
                              flush=True)

