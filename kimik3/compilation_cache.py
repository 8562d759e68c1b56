"""JAX's persistent compilation cache in a per-user directory: a second run loads the programs the
first one compiled instead of compiling them again.

The directory: $KIMIK3_COMPILATION_CACHE if set ("off" turns the cache off), else JAX's own
$JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/kimik3/jax, else ~/.cache/kimik3/jax. The CLI turns
it on (its --compilation-cache flag overrides the place); library users call enable() themselves.
JAX treats the cache as trusted code: keep it in a directory that only you can write.
"""
from __future__ import annotations

import os
import sys

import jax

ENV = "KIMIK3_COMPILATION_CACHE"
OFF = "off"


def default_dir() -> str | None:
    """Where the cache lives unless told otherwise; None when $KIMIK3_COMPILATION_CACHE is "off"."""
    chosen = os.environ.get(ENV) or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if chosen:
        return None if chosen.lower() == OFF else os.path.expanduser(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kimik3", "jax")


def enable(path: str | None = None) -> str | None:
    """Keep compiled programs in `path` (default: default_dir(); "off": no cache). Returns the
    directory in use, or None. Raises OSError when the directory cannot be made."""
    path = default_dir() if path is None else (None if path.lower() == OFF else os.path.expanduser(path))
    if path is None:
        jax.config.update("jax_compilation_cache_dir", None)
        return None
    os.makedirs(path, mode=0o700, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # every program, however quick to compile: a run compiles dozens of small ones, and together
    # they cost more than loading them
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def enable_for_cli(flag: str | None) -> str | None:
    """enable(flag); when the default place cannot be made, say so in one line and run without a
    cache (a directory the user named is an error)."""
    try:
        return enable(flag)
    except OSError as e:
        if flag is not None:
            raise OSError(f"--compilation-cache {flag}: {e.strerror or e}") from None
        print(f"kimik3: no compilation cache ({e.strerror or e}: {e.filename}); "
              f"set {ENV} to a writable directory", file=sys.stderr)
        return None
