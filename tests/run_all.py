"""Run the test suite one file per process: `python tests/run_all.py [pytest args]`.

Why not one `pytest tests` process: with jaxlib 0.11.2, XLA:CPU's compiler crashed (SIGSEGV /
SIGABRT inside backend_compile_and_load) in a mesh test late in one long session that had
compiled many 8-fake-device programs, at a test that passes on its own (2026-11-29, see the
README). One process per file keeps each XLA client small. A file whose process dies from a
signal is run once more and reported as such; test failures are never retried.
"""
from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def run(path: pathlib.Path, extra: list[str]) -> int:
    t = time.time()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(path), *extra], cwd=HERE.parent)
    print(f"== {path.name}: exit {rc} in {time.time() - t:.0f} s", flush=True)
    return rc


def crashed(rc: int) -> bool:
    """Killed by a signal (negative on POSIX) or the shell convention 128 + signal."""
    sigs = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS)
    return rc in [-s for s in sigs] or rc in [128 + s for s in sigs]


def main(extra: list[str]) -> int:
    failed, retried = [], []
    for path in sorted(HERE.glob("test_*.py")):
        rc = run(path, extra)
        if crashed(rc):
            retried.append(path.name)
            print(f"== {path.name}: the process died from a signal (exit {rc}); running it once more",
                  flush=True)
            rc = run(path, extra)
        if rc not in (0, 5):  # 5: no tests collected (e.g. a -k filter)
            failed.append(f"{path.name} (exit {rc})")
    if retried:
        print("== crashed and re-run: " + ", ".join(retried))
    print("== all test files passed" if not failed else "== FAILED: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
