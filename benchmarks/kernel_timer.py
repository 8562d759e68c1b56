"""GPU kernel time of a jitted call, read from the JAX profiler (no wall clock, no host).

Wall-clock timing of a small op measures the host: XLA launches each kernel from the host, and a
decode of a few microseconds of GPU work per kernel is dispatch-bound (batch-1 MLA decodes timed by
wall clock read the same whatever their context or configuration). Here the call runs `reps` times
under `jax.profiler.trace`, and the kernels' own durations are read back from the trace's device
plane (`jax.profiler.ProfileData`, in jaxlib: nothing to install).

    from benchmarks.kernel_timer import kernel_times
    r = kernel_times(fn, *args, reps=10)
    r["total_us"]     # sum of all kernel durations per call
    r["by_kernel"]    # {kernel name: us per call}
    r["span_us"]      # first kernel start to last kernel end, per call (includes launch gaps)
Returns None where the trace has no GPU plane (CPU runs).
"""
from __future__ import annotations

import glob
import os
import statistics
import tempfile
from collections import defaultdict

import jax

_SKIP_LINES = ("XLA Modules", "XLA Ops", "Steps", "Source", "Framework", "Launch Stats")


def _device_events(path: str):
    """[(line name, kernel name, start ns, duration ns)] of the first GPU plane of a trace."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_file(path)
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if any(line.name.startswith(s) for s in _SKIP_LINES):
                continue
            for e in line.events:
                out.append((line.name, e.name, e.start_ns, e.duration_ns))
        break
    return out


def trace_events(fn, *args, reps: int = 10, sync=jax.block_until_ready):
    """[(line, kernel name, start ns, duration ns)] of `reps` calls of fn(*args) (compiled and run
    once before the trace), or None where the trace has no GPU plane."""
    sync(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                sync(fn(*args))                      # calls do not overlap: spans stay apart
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        events = _device_events(files[0]) if files else None
    return events or None


def kernel_times(fn, *args, reps: int = 10, sync=jax.block_until_ready):
    """Per-call GPU kernel times of fn(*args) (compiled and run once before the trace). `sync`
    waits for a call's result: for PyTorch peers pass e.g. `lambda r: torch.cuda.synchronize()`
    (the profiler's CUPTI session sees every kernel of the process, not only JAX's)."""
    events = trace_events(fn, *args, reps=reps, sync=sync)
    if events is None:
        return None
    by_kernel = defaultdict(float)
    for _, name, _, dur in events:
        by_kernel[name] += dur / reps / 1e3
    # Spans: split the time-sorted events into `reps` calls at the largest gaps.
    events.sort(key=lambda e: e[2])
    gaps = sorted(range(1, len(events)),
                  key=lambda i: events[i][2] - (events[i - 1][2] + events[i - 1][3]))
    cuts = sorted(gaps[-(reps - 1):]) if reps > 1 else []
    spans, lo = [], 0
    for hi in cuts + [len(events)]:
        chunk = events[lo:hi]
        spans.append((max(e[2] + e[3] for e in chunk) - chunk[0][2]) / 1e3)
        lo = hi
    return dict(total_us=sum(by_kernel.values()), by_kernel=dict(by_kernel),
                span_us=statistics.median(spans), n_events=len(events) / reps,
                lines=sorted({e[0] for e in events}))
