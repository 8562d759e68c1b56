"""Pallas' Triton lowering must use 64-bit element offsets for 1-byte arrays of 2**31 to 2**32
elements (kernels_pallas/_triton_offsets.py): K3's MXFP4 expert weights of one TP2 rank are such an
array, and int32 offsets there read out of bounds on the GPU. Checked on the lowered Triton IR,
with abstract shapes (nothing is allocated)."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import MXFP4Weight, moe_gmm_glu
from kernels_pallas._backend import triton_params
from kernels_pallas.gpu_lowering import triton_ir

S = jax.ShapeDtypeStruct


def _tile_of_expert(w, i):
    def kernel(i_ref, w_ref, o_ref):
        o_ref[...] = plgpu.load(w_ref.at[i_ref[0], pl.ds(0, 64), pl.ds(0, 128)]).astype(jnp.float32)

    return pl.pallas_call(kernel, out_shape=S((64, 128), jnp.float32), compiler_params=triton_params())(i, w)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.float8_e4m3fn])
def test_large_one_byte_arrays_get_64bit_offsets(dtype):
    big = triton_ir(_tile_of_expert, S((896, 1536, 1792), dtype), S((1,), jnp.int32))[0]  # 2.47e9 B
    small = triton_ir(_tile_of_expert, S((64, 1536, 1792), dtype), S((1,), jnp.int32))[0]
    assert "i64" in big, "offsets into a 2.47e9-element array must be 64-bit"
    assert "i64" not in small, "small arrays keep 32-bit offsets (no extra cost)"


def test_unpatched_lowering_would_wrap():
    """The bug the patch works around is still in this jax (else the patch can go)."""
    from jax._src.pallas.triton import lowering

    patched = lowering._compute_offsets_from_indices
    lowering._compute_offsets_from_indices = patched.__wrapped__
    try:
        ir = triton_ir(_tile_of_expert, S((897, 1536, 1792), jnp.uint8), S((1,), jnp.int32))[0]
    finally:
        lowering._compute_offsets_from_indices = patched
    assert "i64" not in ir


def test_moe_kernel_at_k3_tp2_rank_shapes_uses_64bit_offsets():
    E, K, N = 896, 3584, 1536  # routed gate/up of one TP2 rank: [E, N, K/2] uint8 = 2.47e9 bytes

    for fuse in (True, False):  # the fused kernel, and the layer's default (two plain launches)
        def glu(x, p1, s1, p3, s3, sizes, fuse=fuse):
            return moe_gmm_glu(x, MXFP4Weight(p1, s1), MXFP4Weight(p3, s3), sizes,
                               backend="pallas", fuse=fuse)

        w = (S((E, N, K // 2), jnp.uint8), S((E, N, K // 32), jnp.uint8))
        ir = triton_ir(glu, S((128, K), jnp.bfloat16), *w, *w, S((E,), jnp.int32))
        gmm = [m for m in ir if m.startswith("module @moe_gmm {")]
        plans = [m for m in ir if m.startswith("module @moe_gmm_tiles {")]  # gate and up share it
        assert len(gmm) == (1 if fuse else 2) and len(plans) == 1 and len(ir) == len(gmm) + 1, fuse
        assert all("i64" in m for m in gmm), fuse
