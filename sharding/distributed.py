"""Multi-process start-up: one JAX runtime over many processes (`jax.distributed`), so that one
mesh spans every process's devices and every jitted call runs as one SPMD program.

`initialize_distributed` is a thin layer over `jax.distributed.initialize` that turns the ways a
start-up goes wrong into one line on every process instead of an abort or a hang: a coordinator
that cannot be reached, processes that disagree on how many they are, a process that never joins.
`host_value` reads an array back to numpy on every process, however it is sharded;
`broadcast_json` sends process 0's value to all once, `Messages` a stream of them (a server's
step inputs, a replica's results); `announce_failure` / `watch_failures` end every process, with
one line each, when one of them fails.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
EXIT_STATUS = 2  # what a process that fails to join exits with (the CLI's status for user errors)


class DistributedError(ValueError):
    """A multi-process start-up the user can fix (address, counts, ids): one line, says what to do."""


def _env_int(name: str):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"${name}={raw!r} is not an integer") from None


def resolve_settings(coordinator_address=None, num_processes=None, process_id=None):
    """(address, num_processes, process_id, local_device_ids) from the arguments, else the
    environment ($JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID), else what JAX
    detects on SLURM / Open MPI / Kubernetes; all None when nothing asks for more than one process."""
    address = coordinator_address or os.environ.get(ENV["coordinator_address"]) or None
    n = num_processes if num_processes is not None else _env_int(ENV["num_processes"])
    pid = process_id if process_id is not None else _env_int(ENV["process_id"])
    local_ids = None
    if None in (address, n, pid):
        from jax._src import clusters  # JAX's own cluster detection, as jax.distributed.initialize does it

        address, n, pid, local_ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            address, n, pid, None, None, 60)
    if address is None and n is None and pid is None:
        return None, None, None, None
    _check_settings(address, n, pid)
    return address, n, pid, local_ids


def _check_settings(address, n, pid):
    missing = [flag for flag, v in (("--coordinator HOST:PORT", address), ("--num-processes N", n),
                                    ("--process-id I", pid)) if v is None]
    if missing:
        raise DistributedError(f"a multi-process run needs {', '.join(missing)} as well (or $JAX_COORDINATOR_ADDRESS, "
                               "$JAX_NUM_PROCESSES, $JAX_PROCESS_ID)")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"coordinator address {address!r} must be HOST:PORT (process 0's host and a free port)")
    if n < 1:
        raise DistributedError(f"the number of processes must be >= 1, got {n}")
    if not 0 <= pid < n:
        raise DistributedError(f"process id {pid} is outside 0..{n - 1} (one distinct id per process, "
                               f"--num-processes {n})")


def _split(address: str):
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float, process_id: int) -> None:
    """Return once something listens at `address`; DistributedError after `timeout_s` (JAX itself
    would abort the process without saying which address it could not reach)."""
    host, port = _split(address)
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=min(2.0, timeout_s)).close()
            return
        except OSError as e:
            last = e.strerror or type(e).__name__
            time.sleep(0.2)
    raise DistributedError(f"process {process_id}: cannot reach the coordinator at {address} within {timeout_s:g} s "
                           f"({last}): start process 0 there, and check the address, port and firewall")


def _check_port_free(address: str) -> None:
    """Process 0 serves the coordinator on `address`'s port: refuse a port already in use."""
    _, port = _split(address)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the coordinator's server: TIME_WAIT is fine
        try:
            s.bind(("0.0.0.0", port))
        except OSError as e:
            raise DistributedError(f"process 0 cannot serve the coordinator on port {port} ({e.strerror}): "
                                   "pick a free port in --coordinator HOST:PORT") from None


def _watchdog(timeout_s: float, n: int, pid: int, address: str) -> threading.Timer:
    """A timer that ends this process with one line if joining takes longer than `timeout_s`: a
    process that never joins makes JAX abort the others (after its own deadline) with a stack
    dump, or wait; this says what to check first."""
    def fire():
        print(f"kimik3: process {pid}: the {n} processes did not all join the coordinator at {address} within "
              f"{timeout_s:g} s: start all of them with the same --num-processes {n} and --coordinator, "
              f"each with its own --process-id in 0..{n - 1}", file=sys.stderr, flush=True)
        os._exit(EXIT_STATUS)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    return timer


def _check_counts(n: int, pid: int, timeout_s: float) -> None:
    """Every process must have been told the same number of processes: each publishes its count
    in the coordinator's key-value store and compares with everyone's (JAX itself starts with
    mismatched counts and fails later, or hangs, at the first collective)."""
    client = _client()
    client.key_value_set(f"kimik3/num_processes/{pid}", str(n))
    seen = jax.process_count()
    for other in range(min(n, seen)):
        theirs = int(client.blocking_key_value_get(f"kimik3/num_processes/{other}", int(timeout_s * 1000)))
        if theirs != n:
            raise DistributedError(f"process {pid} was started with --num-processes {n} but process {other} with "
                                   f"{theirs}: start every process with the same count")
    if seen != n:
        raise DistributedError(f"process {pid} was started with --num-processes {n} but {seen} processes joined: "
                               "start every process with the same count")


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, timeout_s: float = 120.0) -> bool:
    """Join this process to a multi-process JAX runtime (before any JAX computation); afterwards
    `jax.devices()` lists every process's devices and `make_mesh` builds one mesh over them.

    Settings missing from the arguments come from the environment ($JAX_COORDINATOR_ADDRESS,
    $JAX_NUM_PROCESSES, $JAX_PROCESS_ID) or JAX's cluster detection (SLURM, Open MPI, Kubernetes).
    Returns False (and does nothing) when nothing asks for more than one process, True once
    joined. Bad settings, an unreachable coordinator and mismatched process counts raise
    DistributedError (one line); if the processes have not all joined within `timeout_s`, this
    process prints one line and exits with status 2 (JAX would abort it)."""
    if jax.distributed.is_initialized():
        raise DistributedError("initialize_distributed was already called in this process (call it once, first)")
    address, n, pid, local_ids = resolve_settings(coordinator_address, num_processes, process_id)
    if address is None:
        return False
    if pid == 0:
        _check_port_free(address)
    else:
        wait_for_coordinator(address, timeout_s, pid)
    timer = _watchdog(timeout_s, n, pid, address)
    try:
        jax.distributed.initialize(address, n, pid, local_device_ids=local_ids,
                                   initialization_timeout=max(1, int(timeout_s) + 30))
        _check_counts(n, pid, timeout_s)
        jax.devices()  # the global device list: every process must be there before the timer stops
    except RuntimeError as e:
        raise DistributedError(f"process {pid}: jax.distributed.initialize failed: {str(e).splitlines()[0]} "
                               "(call initialize_distributed before anything runs on a device)") from None
    finally:
        timer.cancel()
    return True


def is_primary() -> bool:
    """True on the process that owns the input and writes the output (process 0; the only one
    without jax.distributed)."""
    return jax.process_index() == 0


def host_value(x) -> np.ndarray:
    """`x` as a numpy array on every process: directly when this process holds all of it (one
    process, or replicated), else gathered from the processes that hold its shards."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def broadcast_json(value):
    """Process 0's `value` (anything json can hold) on every process; `value` itself on one.
    The others pass anything (it is ignored)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    data = json.dumps(value).encode() if is_primary() else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(n, np.uint8)
    if is_primary():
        buf[:] = np.frombuffer(data, np.uint8)
    return json.loads(bytes(multihost_utils.broadcast_one_to_all(buf)).decode())


def _client():
    from jax._src import distributed as dist

    return dist.global_state.client


def _deadline_exceeded(e: Exception) -> bool:
    """The runtime's error for a blocking get that found nothing in time (only that means "not yet")."""
    return "DEADLINE_EXCEEDED" in str(e).upper()


class Messages:
    """`sender` (default process 0) `send`s JSON values, each of `receivers` (default every other
    process) `receive`s them in the same order: through the coordinator's key-value store, so no
    device program runs (nothing compiles, any length) and a receiver may wait as long as the
    sender has nothing to say. Each receiver deletes its copy once read."""

    def __init__(self, name: str, poll_s: float = 60.0, sender: int = 0, receivers=None):
        self.client, self.name, self.n, self.poll_ms = _client(), name, 0, int(poll_s * 1000)
        self.receivers = [p for p in range(jax.process_count()) if p != sender] if receivers is None else list(receivers)

    def _key(self, pid: int) -> str:
        return f"kimik3/{self.name}/{pid}/{self.n}"

    def send(self, value) -> None:
        data = json.dumps(value)
        for pid in self.receivers:
            self.client.key_value_set(self._key(pid), data)
        self.n += 1

    def receive(self, timeout_s: float | None = None):
        """The next value; with `timeout_s`, `None` once that passed without one."""
        key = self._key(jax.process_index())
        wait_ms = self.poll_ms if timeout_s is None else max(1, int(timeout_s * 1000))
        while True:
            try:
                data = self.client.blocking_key_value_get(key, wait_ms)
                break
            except Exception as e:  # the runtime's error type
                if not _deadline_exceeded(e):
                    raise
                if timeout_s is not None:
                    return None
        self.client.key_value_delete(key)
        self.n += 1
        return json.loads(data)


FAILED_KEY = "kimik3/failed"
_failing = threading.Event()  # this process announced its own failure: its watcher stays quiet


def announce_failure(line: str, status: int = 1, wait_s: float = 10.0) -> None:
    """Tell every other process that this one failed (`line`: what went wrong, one line); their
    `watch_failures` threads end them with `status`. Returns once they all saw it (or after
    `wait_s`: the coordinator lives in process 0, which may exit right after). Does nothing in a
    single-process run; never raises."""
    if jax.process_count() == 1:
        return
    _failing.set()
    me = jax.process_index()
    try:
        client = _client()
        client.key_value_set(FAILED_KEY, json.dumps([me, line, status]))
    except Exception:  # another process failed first (the key exists), or the coordinator is gone
        return
    deadline = time.monotonic() + wait_s
    for pid in range(jax.process_count()):
        left_ms = int((deadline - time.monotonic()) * 1000)
        if pid == me or left_ms <= 0:
            continue
        try:
            client.blocking_key_value_get(f"{FAILED_KEY}/seen/{pid}", left_ms)
        except Exception:
            pass


def watch_failures(poll_s: float = 1.0) -> threading.Thread | None:
    """A daemon thread that ends this process with one line on stderr as soon as another process
    `announce_failure`s: a process waiting in a collective, or for a message, of a process that
    failed would otherwise wait forever. It ends at exit, before JAX's own shutdown (a thread
    still inside the runtime's client then would abort the process). None in a single-process run."""
    if jax.process_count() == 1:
        return None
    client, me, done = _client(), jax.process_index(), threading.Event()

    def watch():
        while not done.is_set():
            try:
                who, line, status = json.loads(client.blocking_key_value_get(FAILED_KEY, int(poll_s * 1000)))
            except Exception as e:
                if _deadline_exceeded(e):
                    continue
                return  # the coordinator is gone (a normal shutdown, or process 0 died): JAX reports it
            if who == me:
                return
            if not _failing.is_set():
                print(f"kimik3: process {me}: stopping because process {who} failed: {line} (fix that and restart "
                      "every process)", file=sys.stderr, flush=True)
            try:
                client.key_value_set(f"{FAILED_KEY}/seen/{me}", "1")
            finally:
                if not _failing.is_set():  # else this process is already on its way out with its own line
                    os._exit(status)
            return

    thread = threading.Thread(target=watch, name="kimik3-failure-watch", daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join(timeout=2 * poll_s)
    atexit.register(stop)  # runs before jax.distributed's shutdown, registered when it joined
    return thread
