"""Lower Pallas-Triton kernels for a GPU target on any machine (no GPU needed): the check that a
kernel and its block configuration get through Pallas' Triton lowering for an H200 (platform
"cuda") or AMD ("rocm"), and the Triton IR it produces. Pallas asks for the device's description
while lowering; it is patched to an H200's for the duration of one call and restored after."""
from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def _h200_gpu_info():
    from jax._src.pallas.triton import gpu_info, pallas_call_registration as pcr

    info = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
    orig = pcr.gpu_info_lib.get_gpu_info
    pcr.gpu_info_lib.get_gpu_info = lambda: info
    try:
        yield pcr
    finally:
        pcr.gpu_info_lib.get_gpu_info = orig


def _export(fn, args, platform):
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)


def lower_for_gpu(fn, *args, platform: str = "cuda"):
    """jax.export of jit(fn)(*args) for `platform` (args may be ShapeDtypeStructs); raises what
    the lowering raises."""
    with _h200_gpu_info():
        return _export(fn, args, platform)


def triton_ir(fn, *args, platform: str = "cuda") -> list[str]:
    """The Triton IR text of every pallas_call in fn(*args), lowered for `platform`."""
    with _h200_gpu_info() as pcr:
        captured, orig = [], pcr.lowering.lower_jaxpr_to_triton_module

        def hook(*a, **kw):
            r = orig(*a, **kw)
            captured.append(r.module.operation.get_asm(enable_debug_info=False))
            return r
        pcr.lowering.lower_jaxpr_to_triton_module = hook
        try:
            _export(fn, args, platform)
        finally:
            pcr.lowering.lower_jaxpr_to_triton_module = orig
    return captured
