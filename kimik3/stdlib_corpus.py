"""The tiny-code model's text: the Python standard library's own source, which every machine with
Python has, with a deterministic held-out split of files; and bits per byte on it.

Corpus: every `*.py` file under `sysconfig.get_paths()["stdlib"]` except those under
`site-packages`. A file is held out when the SHA-256 of its relative path (POSIX separators, e.g.
`json/decoder.py`) read as a big-endian integer is 0 mod 20 (about one file in twenty); the rest
is training text. The rule depends on the path alone, so the split is the same on every machine
and Python version (files one version lacks are simply absent).

Each file is one document: the BOS id, its bytes (token id = byte value), then the EOS id.
"""
from __future__ import annotations

import hashlib
import math
import os
import sysconfig

import numpy as np

HELDOUT_MODULUS = 20
# Directories of the test suite: some distributions ship the stdlib without them, so the fixed
# held-out sample that tests measure (`heldout_sample`) is drawn from the other files only.
TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_heldout(relpath: str) -> bool:
    """The split rule: sha256(relative POSIX path) mod 20 == 0."""
    return int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest(), "big") % HELDOUT_MODULUS == 0


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative POSIX paths of the corpus's files, sorted."""
    root = root or stdlib_root()
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(out)


def split_files(root: str | None = None) -> tuple[list[str], list[str]]:
    """(train, held-out) relative paths."""
    files = stdlib_files(root)
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read_bytes(relpath: str, root: str | None = None) -> bytes:
    with open(os.path.join(root or stdlib_root(), relpath), "rb") as f:
        return f.read()


def document_tokens(files: list[str], bos: int, eos: int, root: str | None = None) -> np.ndarray:
    """The files as one int32 stream of documents: BOS, bytes, EOS each."""
    parts = []
    for f in files:
        parts += [np.array([bos], np.int32), np.frombuffer(read_bytes(f, root), np.uint8).astype(np.int32),
                  np.array([eos], np.int32)]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def heldout_windows(window: int, max_windows: int, root: str | None = None,
                    exclude_test_dirs: bool = False) -> np.ndarray:
    """Held-out text as [N, window] byte arrays: consecutive non-overlapping windows of each
    held-out file in path order (a file's shorter tail is dropped), at most max_windows of them."""
    _, held = split_files(root)
    if exclude_test_dirs:
        held = [f for f in held if not TEST_DIRS & set(f.split("/")[:-1])]
    rows = []
    for f in held:
        data = np.frombuffer(read_bytes(f, root), np.uint8)
        for s in range(0, len(data) - window + 1, window):
            rows.append(data[s:s + window])
            if len(rows) == max_windows:
                return np.stack(rows).astype(np.int32)
    if not rows:
        raise ValueError(f"no held-out file under {root or stdlib_root()} has {window} bytes")
    return np.stack(rows).astype(np.int32)


def heldout_sample(window: int = 512, max_windows: int = 8, root: str | None = None) -> np.ndarray:
    """The fixed held-out sample the tests measure: the first windows of the held-out files outside
    the test-suite directories (present in every Python installation)."""
    return heldout_windows(window, max_windows, root, exclude_test_dirs=True)


def byte_nll(logits, windows) -> np.ndarray:
    """Per-byte negative log-likelihood in bits, [N, W]: logits [N, W, V] of the model run on
    BOS + windows[:, :-1] predict windows' bytes."""
    import jax

    logp = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(windows)[..., None], axis=-1)[..., 0]
    return nll / math.log(2)


def bits_per_byte(model, windows, backend=None, batch: int = 8) -> float:
    """Mean bits per byte of `model` on windows [N, W] of bytes, each read as a fresh document
    (BOS first, no context carried between windows)."""
    from .runtime import forward

    windows = np.asarray(windows, np.int32)
    bos = np.full((windows.shape[0], 1), model.cfg.bos_token_id, np.int32)
    inputs = np.concatenate([bos, windows[:, :-1]], axis=1)
    total = 0.0
    for s in range(0, len(windows), batch):
        logits = forward(model, inputs[s:s + batch], backend=backend)
        total += float(byte_nll(logits, windows[s:s + batch]).sum())
    return total / windows.size
