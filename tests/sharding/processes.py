"""Starting and reaping the processes of a multi-process CPU test: a free coordinator port, the
environment of a process with N fake CPU devices, and a deadline after which every process of a
run is killed and the test fails (a hang must never block the suite)."""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from tests import paths


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(devices: int) -> dict:
    """This environment for a child process of `devices` fake CPU devices that imports this
    checkout's packages. Other XLA flags of this process (tests/conftest.py's) carry over: a child
    compiles as the tests' own process does."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
                PYTHONPATH=os.pathsep.join([str(paths.ROOT), os.environ.get("PYTHONPATH", "")]))


def process_flags(pid: int, n: int, port: int) -> list[str]:
    return ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(pid)]


def wait_for_health(url: str, procs, timeout_s: float) -> None:
    """Return once the server at `url` answers /health with 200, or a process exited, or after
    `timeout_s` (the test's requests then fail and say why)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)


def finish(procs, timeout_s: float) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; any still running at the deadline is killed and
    fails the test."""
    deadline, out = time.monotonic() + timeout_s, []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a worker process was still running after {timeout_s:.0f} s (hang)")
        out.append((p.returncode, err))
    return out
