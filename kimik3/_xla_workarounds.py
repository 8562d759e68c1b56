"""Workarounds for known XLA bugs, applied before JAX creates its backends.

XLA:CPU in jaxlib 0.11.x miscompiles some fused batched matmuls through its YNNPACK fusion: the
KDA chunk reference returned garbage outputs (different from run to run) inside jitted programs
whose final state was unused. tests/model/test_xla_workarounds.py reproduces
it. Turning that fusion off (`--xla_cpu_experimental_ynn_fusion_type=`) fixes it and only affects
CPU. Skipped when the user sets the flag, or on jaxlib versions other than 0.11 (the flag may not
exist there, and an unknown XLA flag is fatal).
"""
from __future__ import annotations

import os
from importlib import metadata

YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def apply() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" in flags:
        return
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return
    if version.startswith("0.11."):
        os.environ["XLA_FLAGS"] = f"{flags} {YNN_FLAG}".strip()
