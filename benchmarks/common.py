"""What every benchmark shares: the run record (its JSON: date, device, commit, command, the table
rows and the details), the time budget, error capture, wall-clock and GPU timers, the copy
ceiling and the JAX <-> torch bridges for peers that run in the same process."""
from __future__ import annotations

import argparse

import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from .kernel_timer import kernel_times

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def git_commit() -> str:
    """The checked-out commit (short hash, "+dirty" with uncommitted changes), or "unknown"."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def device_name() -> str:
    devs = jax.devices()
    name = getattr(devs[0], "device_kind", str(devs[0]))
    return f"{len(devs)} x {name}" if len(devs) > 1 else name


class Record:
    """One benchmark run: `rows` for BENCHMARKS.md's table, `details` for everything else,
    written to OUT/<name>.json after every case (a killed run keeps what it measured)."""

    def __init__(self, name: str, args, argv=None):
        self.name, self.args = name, args
        self.t0 = time.perf_counter()
        self.budget_s = args.budget_s or (math.inf if args.smoke else 480.0)
        argv = sys.argv[1:] if argv is None else argv
        self.data = {"benchmark": name, "date": datetime.date.today().isoformat(),
                     "device": device_name(), "commit": git_commit(), "jax": jax.__version__,
                     "command": "python -m benchmarks " + shlex.join(argv),
                     "smoke": bool(args.smoke), "rows": [], "details": {}, "errors": {},
                     "skipped": []}
        os.makedirs(args.out, exist_ok=True)
        self.path = os.path.join(args.out, f"{name}.json")

    @property
    def details(self) -> dict:
        return self.data["details"]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def log(self, *parts):
        print(f"[{self.elapsed():5.0f}s] " + " ".join(str(p) for p in parts), flush=True)

    def row(self, area: str, shape: str, ours: float, unit: str, *, peer: float | None = None,
            peer_name: str = "", limit_pct: float | None = None, note: str = ""):
        """One line of the table. `unit` of a time ("us", "ms", "s") means lower is better, any
        other unit (tokens/s, TB/s) higher; `limit_pct`: ours as a percentage of the device's
        limit for this work (copy bandwidth for memory-bound work, the dense matmul peak for
        compute-bound work), where the benchmark measured one."""
        clean = lambda v: None if v is None or not math.isfinite(v) else float(v)  # noqa: E731
        self.data["rows"].append({"area": area, "shape": shape, "ours": clean(ours), "unit": unit,
                                  "peer": clean(peer), "peer_name": peer_name,
                                  "limit_pct": clean(limit_pct), "note": note})
        self.save()

    def skip(self, case: str) -> bool:
        """True (and the case listed as skipped) once the time budget is spent."""
        if self.left() > 0:
            return False
        self.data["skipped"].append(case)
        return True

    def guard(self, case: str, fn, *args, **kw):
        """fn(*args, **kw), its exception recorded under `case` instead of ending the run."""
        if self.skip(case):
            return None
        try:
            return fn(*args, **kw)
        except Exception:  # noqa: BLE001 - one failing case must not lose the others
            self.data["errors"][case] = traceback.format_exc()[-3000:]
            self.log(f"[{case}] FAILED\n{self.data['errors'][case]}")
            return None
        finally:
            self.save()

    def save(self):
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        with open(self.path, "w") as fh:
            json.dump(self.data, fh, indent=1, default=str)


def rel(a, b) -> float:
    """|a - b| / |b| in fp32 (Frobenius norms)."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def wall_ms(fn, *args, n=20, reps=5, warm_s=0.3) -> float:
    """Median over `reps` of the mean wall-clock time of n back-to-back calls, after warming up
    for `warm_s` of calls (the first calls in a process can read high)."""
    t = time.perf_counter()
    while True:
        jax.block_until_ready(fn(*args))
        if time.perf_counter() - t > warm_s:
            break
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(out)


def gpu_ms(fn, *args, reps=10, sync=jax.block_until_ready, smoke=False):
    """(ms, info): the per-call sum of GPU kernel durations from the profiler (kernel_timer)
    and its breakdown; on a trace without a GPU plane (CPU) the wall clock, info["timer"]
    saying which."""
    kt = None if smoke else kernel_times(fn, *args, reps=reps, sync=sync)
    if kt is None:
        t = time.perf_counter()
        sync(fn(*args))
        return (time.perf_counter() - t) * 1e3, {"timer": "wall"}
    top = sorted(kt["by_kernel"].items(), key=lambda kv: -kv[1])[:8]
    return kt["total_us"] / 1e3, {"timer": "gpu kernels", "span_ms": kt["span_us"] / 1e3,
                                  "kernels_per_call": kt["n_events"],
                                  "by_kernel_us": dict(kt["by_kernel"]),
                                  "top_kernels_us": {k[:90]: round(v, 1) for k, v in top}}


def jax_copy_Bps(smoke=False) -> float:
    """Bytes/s (read + written) of a JAX elementwise copy (x * 2) of 1 GiB of bf16."""
    x = jnp.ones((1 << (20 if smoke else 29),), jnp.bfloat16)
    ms = wall_ms(jax.jit(lambda a: a * 2), x, n=2 if smoke else 10, reps=1 if smoke else 3,
                 warm_s=0 if smoke else 0.3)
    return 2 * x.nbytes / (ms * 1e-3)


def has_cuda_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def torch_wall_ms(fn, n=20, reps=5) -> float:
    import torch
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / n * 1e3)
    return statistics.median(out)


def torch_copy_Bps() -> float:
    """Bytes/s (read + written) of torch's device-to-device copy of 2 GiB: the copy ceiling."""
    import torch
    x = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    ms = torch_wall_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / (ms * 1e-3)


_TORCH_COPY = r"""
import torch, statistics
n = 1 << 30                                   # 2 GiB of bf16
src = torch.randn(n, dtype=torch.bfloat16, device="cuda"); dst = torch.empty_like(src)
for _ in range(3): dst.copy_(src)
ts = []
for _ in range(20):
    a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 1e3)
t = statistics.median(ts)
print(torch.cuda.get_device_name(0), 2 * n * 2 / t)
"""


def torch_copy_Bps_subprocess(timeout=90) -> float | None:
    """torch_copy_Bps's ceiling (2 GiB, CUDA events) measured in a subprocess, for a benchmark's
    prepare_env: before this process's JAX takes the GPU (it preallocates most of its memory);
    None where it fails (no torch, no CUDA)."""
    try:
        r = subprocess.run([sys.executable, "-c", _TORCH_COPY], capture_output=True, text=True,
                           timeout=timeout)
        return float(r.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    except Exception as e:  # noqa: BLE001 - the caller falls back on the JAX copy
        print("torch copy failed:", repr(e)[:200], flush=True)
        return None


def torch_sync(_=None):
    import torch
    torch.cuda.synchronize()


def to_torch(x):
    """A JAX device array as a torch CUDA tensor (dlpack, else a host copy)."""
    import torch
    jax.block_until_ready(x)
    try:
        return torch.utils.dlpack.from_dlpack(x)
    except Exception:  # noqa: BLE001 - dlpack refuses some layouts
        a = np.asarray(x)
        if x.dtype == jnp.bfloat16:
            return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).cuda()
        return torch.from_numpy(a.copy()).cuda()


def from_torch(t):
    import torch
    if t.dtype == torch.bfloat16:
        t = t.float()
    return jnp.asarray(t.detach().cpu().numpy())


def shapes_arg(text: str) -> list[tuple[int, ...]]:
    """"8x4096x12,1x8192x96" -> [(8, 4096, 12), (1, 8192, 96)] (argparse type)."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def ints_arg(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def names_arg(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def choices_arg(*choices: str):
    """An argparse type: comma-separated names, each one of `choices` (else a usage error)."""
    def parse(text: str) -> list[str]:
        names = names_arg(text)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {','.join(unknown)}; choose from {','.join(choices)}")
        return names
    return parse
