"""Backend selection shared by every kernel entry point.

`backend=None` means: the Pallas kernel on GPU, the plain-JAX reference elsewhere (CPU tests).
"interpret" runs the Pallas kernel through the Pallas interpreter, which is how CPU tests check the
kernels themselves.
"""
from __future__ import annotations

import jax

BACKENDS = ("reference", "pallas", "interpret")


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    return backend


def triton_params(num_warps: int = 4, num_stages: int = 2):
    """Compiler params that select Pallas' Triton lowering explicitly (portable to ROCm)."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


H200_SMS = 132  # the default where no GPU is visible (CPU tests, offline lowering): an H200


def num_sms() -> int:
    """Streaming multiprocessors (compute units on AMD) of the first device, for the shape-based
    choices that aim at filling the GPU (split counts, tile widths)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or H200_SMS)
    except RuntimeError:  # no backend
        return H200_SMS


def kernel_platform(device=None) -> str:
    """Where a non-interpreted Pallas kernel runs: "cuda" (NVIDIA) or "rocm" (AMD) for a GPU,
    else the device's platform ("cpu", "tpu", ...). device: default jax.devices()[0], the device
    that jit places work on by default. jaxlib names both GPU kinds "gpu"; the client's
    platform_version says which (as jax's own dlpack and test utilities read it), else an
    "NVIDIA ..." device_kind means CUDA; a GPU neither names stays "gpu" (portable choices)."""
    dev = jax.devices()[0] if device is None else device
    plat = str(dev.platform).lower()
    if plat == "gpu":
        ver = str(getattr(dev.client, "platform_version", "")).lower()
        for name in ("cuda", "rocm"):
            if name in ver:
                return name
        if str(getattr(dev, "device_kind", "")).lower().startswith("nvidia"):
            return "cuda"
    return plat
