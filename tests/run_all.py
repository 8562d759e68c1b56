"""Run the test suite one file per process, as many at once as there are cores:
`python tests/run_all.py [pytest args]` (every tests/**/test_*.py) (`--jobs N` first to choose; 1 runs them in turn).

Why not one `pytest tests` process: with jaxlib 0.11.2, XLA:CPU's compiler crashed (SIGSEGV /
SIGABRT inside backend_compile_and_load) in a mesh test late in one long session that had
compiled many 8-fake-device programs, at a test that passes on its own (2026-11-29, see the
README). One process per file keeps each XLA client small. A file whose process dies from a
signal is run once more and reported as such; test failures are never retried.

The processes share one persistent compilation cache, made fresh for the run (unless
$JAX_COMPILATION_CACHE_DIR names one): the tiny models' programs that many files compile are
compiled once. The tiny models are initialised once too: the first file to need one saves it,
the others load it. Each file's output is printed whole when it ends, longest-running files first.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
# the files that take longest start first, so the last ones to finish are short
SLOW_FIRST = ("test_engine.py", "test_cli.py", "test_attention_sharding.py", "test_multiprocess.py", "test_api.py",
              "test_model.py", "test_dcp.py", "test_prefix_cache.py", "test_mla_kernels.py", "test_kernel_integration.py",
              "test_speculative.py", "test_kda_kernels.py", "test_moe_sharding.py", "test_batch.py", "test_moe_gmm.py",
              "test_notebook.py", "test_benchmarks.py", "test_hf_parity.py", "test_kda_reference.py", "test_tiny_code.py")


def crashed(rc: int) -> bool:
    """Killed by a signal (negative on POSIX) or the shell convention 128 + signal."""
    sigs = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
    return rc in [-s for s in sigs] or rc in [128 + s for s in sigs]


def start(path: pathlib.Path, extra: list[str], env: dict):
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *extra],
                            cwd=HERE.parent, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, log, time.time()


def order(paths: list[pathlib.Path]) -> list[pathlib.Path]:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    return sorted(paths, key=lambda p: (rank.get(p.name, len(SLOW_FIRST)), p.name))


def main(argv: list[str]) -> int:
    jobs = os.cpu_count() or 1
    if argv[:1] == ["--jobs"]:
        jobs, argv = max(1, int(argv[1])), argv[2:]
    env = dict(os.environ)
    own_cache = "JAX_COMPILATION_CACHE_DIR" not in env
    if own_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="kimik3-tests-xla-")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["KIMIK3_TEST_MODELS"] = models = tempfile.mkdtemp(prefix="kimik3-tests-models-")  # conftest's tiny models
    todo = order(list(HERE.rglob("test_*.py")))
    running, failed, retried, tries = {}, [], [], {}
    t0 = time.time()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                path = todo.pop(0)
                tries[path] = tries.get(path, 0) + 1
                running[path] = start(path, argv, env)
            time.sleep(0.2)
            for path, (proc, log, t) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[path]
                log.seek(0)
                sys.stdout.write(log.read())
                log.close()
                print(f"== {path.relative_to(HERE)}: exit {rc} in {time.time() - t:.0f} s", flush=True)
                if crashed(rc) and tries[path] == 1:
                    retried.append(path.name)
                    print(f"== {path.name}: the process died from a signal (exit {rc}); running it once more",
                          flush=True)
                    todo.insert(0, path)
                elif rc not in (0, 5):  # 5: no tests collected (e.g. a -k filter)
                    failed.append(f"{path.name} (exit {rc})")
    finally:
        for proc, _, _ in running.values():
            proc.kill()
        if own_cache:
            shutil.rmtree(env["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
        shutil.rmtree(models, ignore_errors=True)
    if retried:
        print("== crashed and re-run: " + ", ".join(retried))
    print(f"== {time.time() - t0:.0f} s with {jobs} at once")
    print("== all test files passed" if not failed else "== FAILED: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
