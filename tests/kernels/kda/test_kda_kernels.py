"""KDA Pallas kernels (interpret mode on CPU) against the plain-JAX reference: chunked prefill,
fused one-token decode, multi-token verify; and the chunk's tuned configuration. Outputs and
states are compared, on fresh random inputs, with ragged lengths, zero and nonzero initial states,
both gate forms, bf16 and fp32, with and without the in-kernel q/k l2 norm.

Interpret-mode cost grows with each distinct compiled shape / configuration, so every chunk case
covers several behaviours at once, on the smallest shapes that reach them."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kda import decode_inputs
from kernels_pallas.kda import (ChunkConfig, kda_chunk, kda_decode, kda_gate, kda_recurrent,
                                kda_verify, l2norm)
from kernels_pallas.kda.chunk_common import MATMUL_SPAN
from kernels_pallas.kda.tuning import TUNED, auto_scan_groups, chunk_config

F32 = jnp.float32


def rel(a, b):
    a = np.asarray(jnp.asarray(a, F32), np.float64)
    b = np.asarray(jnp.asarray(b, F32), np.float64)
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tol(dt):
    return 1e-4 if dt == F32 else 1e-2


def make(seed, B, T, H, K, V, dt, bounded, nonzero_h0, unit_qk=False):
    """unit_qk: q and k l2-normalised before the cast (inputs for use_qk_l2norm=False; raw
    N(0, 1) keys make the delta rule's updates blow up)."""
    ks = jax.random.split(jax.random.key(seed), 8)
    unit = l2norm if unit_qk else lambda x: x
    q = unit(jax.random.normal(ks[0], (B, T, H, K))).astype(dt)
    k = unit(jax.random.normal(ks[1], (B, T, H, K))).astype(dt)
    v = jax.random.normal(ks[2], (B, T, H, V)).astype(dt)
    f = jax.random.normal(ks[3], (B, T, H, K))
    A_log = jax.random.uniform(ks[4], (H,), minval=-1.0, maxval=2.0)
    dt_bias = jax.random.normal(ks[5], (H * K,))
    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0 if bounded else None)
    beta = jax.nn.sigmoid(jax.random.normal(ks[6], (B, T, H))).astype(dt)
    h0 = (jax.random.normal(ks[7], (B, H, K, V)) * 0.3) if nonzero_h0 else None
    return q, k, v, g, beta, h0


def garbage_past(lengths, T):
    """x -> x with NaN in the rows past lengths[b] (garbage that must reach neither state nor
    outputs); the identity when lengths is None."""
    if lengths is None:
        return lambda x: x
    pad = jnp.arange(T)[None, :] >= jnp.asarray(lengths)[:, None]
    return lambda x: jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)), jnp.nan,
                               x).astype(x.dtype)


def block_spans(g, lengths):
    """[B] the largest decay span (natural log: G at a chunk-aligned 16-row sub-block's first row
    minus G at its last) of each row's valid tokens; > MATMUL_SPAN sends a block down the exact
    path of the diagonal launch."""
    B, T, H, K = g.shape
    Tp = -(-T // 16) * 16
    valid = (jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None])[..., None, None]
    gb = jnp.pad(jnp.where(valid, g, 0.0), ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    gb = gb.reshape(B, Tp // 16, 16, H, K)
    return np.asarray(jnp.max(-jnp.sum(gb[:, :, 1:], axis=2), axis=(1, 2, 3)))


CHUNK_CASES = {
    # lengths 0, 1, chunk-1, chunk, chunk+1 (NaN past them); softplus gate, fp32, in-kernel norm;
    # rows 2 and 4 with a steep gate (their diagonal blocks take the exact path), row 3 with a
    # gentle one (the matmul path); key tiles narrower than the head (device loops of several
    # trips)
    "ragged_exact_f32": dict(B=5, T=65, H=1, K=32, V=32, lengths=[0, 1, 63, 64, 65], dt=F32,
                             bounded=False, nz=True, safe=False, l2=True,
                             gscale=[1.0, 1.0, 8.0, 0.1, 8.0],
                             config=ChunkConfig(diag_block_k=16, block_k_inter=16, block_wu=16,
                                                block_k_out=16)),
    # one chunk exactly, bf16, two heads, bounded gate with safe_gate (no span check), q and k
    # normalised outside (no in-kernel norm), zero initial state
    "bf16_safe_no_norm": dict(B=1, T=64, H=2, K=32, V=32, lengths=None, dt=jnp.bfloat16,
                              bounded=True, nz=False, safe=True, l2=False),
    # K = V = 128, the model's size: the default tiles loop several times over the keys
    "bf16_k128": dict(B=2, T=65, H=1, K=128, V=128, lengths=[65, 40], dt=jnp.bfloat16,
                      bounded=True, nz=True, safe=False, l2=True),
    # the two-level scan: 5 chunks in 2 groups (one padded chunk), ragged; V != K, so the
    # transition maps and the state scan tile different widths
    "two_level_f32": dict(B=2, T=260, H=1, K=32, V=64, lengths=[260, 130], dt=F32,
                          bounded=True, nz=True, safe=False, l2=True,
                          config=ChunkConfig(scan_groups=2)),
}


@pytest.mark.parametrize("case", list(CHUNK_CASES))
def test_chunk_vs_reference(case):
    c = CHUNK_CASES[case]
    B, T, H, K, V, dt = c["B"], c["T"], c["H"], c["K"], c["V"], c["dt"]
    q, k, v, g, beta, h0 = make(T + K + B, B, T, H, K, V, dt, c["bounded"], c["nz"],
                                unit_qk=not c["l2"])
    lens = None if c["lengths"] is None else jnp.array(c["lengths"], jnp.int32)
    if "gscale" in c:
        g = g * jnp.array(c["gscale"])[:, None, None, None]
        exact = block_spans(g, lens) > MATMUL_SPAN
        assert exact.tolist() == [s > 1 for s in c["gscale"]], block_spans(g, lens)
    bad = garbage_past(lens, T)
    o, s = kda_chunk(bad(q), bad(k), bad(v), bad(g), bad(beta), initial_state=h0, lengths=lens,
                     use_qk_l2norm=c["l2"], safe_gate=c["safe"], backend="interpret",
                     config=c.get("config"))
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens,
                           use_qk_l2norm=c["l2"])
    assert o.shape == ro.shape and o.dtype == v.dtype and s.dtype == F32
    assert rel(o, ro) < tol(dt), rel(o, ro)
    assert rel(s, rs) < tol(dt), rel(s, rs)
    if lens is not None:  # padding is ignored: outputs there are zero
        for b, n in enumerate(c["lengths"]):
            assert float(jnp.abs(o[b, n:].astype(F32)).max(initial=0.0)) == 0.0


def test_chunk_config_table_rules_and_checks():
    """The tuned row where the table has one, the same row with tiles narrowed to the head
    elsewhere; the caller's fields over it; scan groups and value tiles by rule; bad tiles and
    group counts refused by name."""
    row = TUNED[("NVIDIA H200", 128, 128, "bfloat16")]
    h200 = chunk_config(8, 4096, 12, 128, 128, jnp.bfloat16, device_kind="NVIDIA H200", n_sm=132)
    fields = [f.name for f in dataclasses.fields(ChunkConfig)]
    assert all(getattr(h200, f) is not None for f in fields)
    assert all(getattr(h200, f) == getattr(row, f) for f in fields if getattr(row, f) is not None)
    assert (h200.scan_groups, h200.block_v_state) == (1, 64)
    # no row for this device, dtype or head: the H200 row, tiles no wider than K = 32
    other = chunk_config(1, 100, 1, 32, 32, F32, device_kind="AMD Instinct MI300X", n_sm=304)
    assert (other.diag_block_k, other.block_k_out, other.block_v_out) == (32, 32, 32)
    assert other.block_wu == row.block_wu and other.num_warps_inter == row.num_warps_inter
    mine = chunk_config(1, 100, 1, 32, 32, F32, ChunkConfig(num_warps_inter=2, scan_groups=5))
    assert mine.num_warps_inter == 2 and mine.scan_groups == 2     # at most one group a chunk
    # one long sequence leaves the GPU idle: the two-level scan; a full batch: the plain one
    assert auto_scan_groups(1, 16, 128, 512, n_sm=132) > 1
    assert auto_scan_groups(8, 96, 128, 64, n_sm=132) == 1
    assert chunk_config(1, 32768, 16, 128, 128, jnp.bfloat16, n_sm=132).scan_groups > 1
    for name, t in (("diag_block_k", 48), ("block_wu", 48), ("block_k_out", 48),
                    ("block_k_inter", 48), ("block_k_out", 8), ("block_v_state", 8)):
        with pytest.raises(ValueError, match=f"{name}={t} .*must divide"):
            chunk_config(1, 64, 1, 64, 64, F32, ChunkConfig(**{name: t}))
    with pytest.raises(ValueError, match="scan_groups=0"):
        chunk_config(1, 64, 1, 64, 64, F32, ChunkConfig(scan_groups=0))


def test_inverse_bf16x3_products():
    """The inverse's bf16x3 products (bf16 operands) are fp32-accurate to ~1e-5, far inside the
    bf16 rounding of the finished T and far better than one bf16 product."""
    from kernels_pallas.kda.chunk_intra import _dot_bf16x3
    a, b = (jax.random.normal(kk, (16, 16)) for kk in jax.random.split(jax.random.key(3)))
    exact = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
    one = jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=F32)
    assert rel(_dot_bf16x3(a, b), exact) < 1e-4 < rel(one, exact)


@pytest.mark.parametrize("dt,lb,K", [(F32, None, 32), (jnp.bfloat16, -5.0, 128)])
def test_decode_vs_reference(dt, lb, K):
    a = decode_inputs(3, 2, K, dt, seed=3)
    ref = kda_decode(**jax.tree.map(jnp.copy, a), num_heads=2, lower_bound=lb,
                     eps=1e-5, backend="reference")
    out = kda_decode(**jax.tree.map(jnp.copy, a), num_heads=2, lower_bound=lb,
                     eps=1e-5, backend="interpret")
    for x, r in zip(out, ref):
        assert x.shape == r.shape and x.dtype == r.dtype
    assert rel(out[0], ref[0]) < tol(dt)
    assert rel(out[1], ref[1]) == 0.0  # conv state: exact shift
    assert rel(out[2], ref[2]) < 1e-5


def test_decode_skips_idle_rows():
    """Rows with live = 0 (an engine's idle slots) keep both states bitwise and output 0; the
    others are the full step's, on both backends."""
    a = decode_inputs(3, 2, 32, F32, seed=4)
    live = jnp.array([1, 0, 1], jnp.int32)
    full = kda_decode(**jax.tree.map(jnp.copy, a), num_heads=2, backend="reference")
    for backend in ("reference", "interpret"):
        o, conv, S = kda_decode(**jax.tree.map(jnp.copy, a), live=live, num_heads=2,
                                backend=backend)
        np.testing.assert_array_equal(o[1], 0)
        np.testing.assert_array_equal(conv[1], a["conv_state"][1])
        np.testing.assert_array_equal(S[1], a["state"][1])
        for got, want in zip((o, conv, S), full):
            assert rel(got[::2], want[::2]) < 1e-5, backend


def test_decode_reference_matches_recurrent_step():
    """The decode reference itself against an independent composition of reference.py pieces."""
    B, H, K = 2, 2, 32
    a = decode_inputs(B, H, K, F32, seed=5)
    o, conv, S = kda_decode(**jax.tree.map(jnp.copy, a), num_heads=H, lower_bound=-5.0,
                            backend="reference")
    qkv, conv_w = jnp.concatenate(a["qkv"], -1), jnp.concatenate(a["conv_w"])
    xx = jnp.concatenate([a["conv_state"], qkv[:, None]], 1)
    y = jax.nn.silu(sum(xx[:, i] * conv_w[:, i] for i in range(4)))
    q, k, v = (t.reshape(B, 1, H, K) for t in jnp.split(y, 3, -1))
    g = kda_gate(a["f"].reshape(B, 1, H, K), a["A_log"], a["dt_bias"], lower_bound=-5.0)
    ro, rS = kda_recurrent(q, k, v, g, jax.nn.sigmoid(a["b"])[:, None], initial_state=a["state"],
                           use_qk_l2norm=True)
    ro = ro.reshape(B, H, K)
    ro = ro / jnp.sqrt(jnp.mean(ro ** 2, -1, keepdims=True) + 1e-5) * a["o_norm_w"]
    ro = ro * jax.nn.sigmoid(a["gate"].reshape(B, H, K))
    assert rel(o, ro.reshape(B, H * K)) < 1e-4 and rel(S, rS) < 1e-5
    np.testing.assert_array_equal(conv[:, :2], a["conv_state"][:, 1:])
    np.testing.assert_array_equal(conv[:, 2], qkv)


def test_verify_vs_reference():
    """The state after every position (bf16 inputs, ragged), and rollback: the state after
    position t is the final state of the first t+1 tokens."""
    B, T, H, K, dt = 2, 4, 2, 32, jnp.bfloat16
    q, k, v, g, beta, h0 = make(15, B, T, H, K, K, dt, True, True)
    lens = jnp.array([4, 2], jnp.int32)
    o, hs = kda_verify(q, k, v, g, beta, h0, lengths=lens, use_qk_l2norm=True,
                       backend="interpret")
    ro, rhs = kda_verify(q, k, v, g, beta, h0, lengths=lens, use_qk_l2norm=True,
                         backend="reference")
    assert hs.shape == (B, T, H, K, K) and hs.dtype == F32 and o.dtype == dt
    assert rel(o, ro) < tol(dt)
    assert rel(hs, rhs) < 1e-5
    for t in (1, 3):
        _, st = kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t],
                              initial_state=h0, lengths=jnp.minimum(lens, t), use_qk_l2norm=True)
        assert rel(hs[:, t - 1], st) < 1e-5
    assert float(jnp.abs(o[1, 2:].astype(F32)).max()) == 0.0      # past the length: zeros
    np.testing.assert_array_equal(hs[1, 2], hs[1, 1])               # ... and the state holds


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kda_kernels_lower_for_gpu(platform):
    """The chunk (plain and two-level scan), decode and verify kernels lower to Triton IR for an
    H200 / AMD target at K3's per-rank shapes (no GPU needed)."""
    from kernels_pallas.gpu_lowering import lower_for_gpu
    from kernels_pallas.kda.chunk_pallas import kda_chunk_pallas
    from kernels_pallas.kda.decode import kda_decode_pallas
    from kernels_pallas.kda.verify import kda_verify_pallas
    sd = jax.ShapeDtypeStruct
    B, T, H, K = 1, 8192, 16, 128
    args = (sd((B, T, H, K), jnp.bfloat16),) * 3 + (sd((B, T, H, K), F32),
                                                     sd((B, T, H), jnp.bfloat16),
                                                     sd((B, H, K, K), F32))
    assert chunk_config(B, T, H, K, K, jnp.bfloat16).scan_groups > 1   # the default: two-level
    for cfg in (ChunkConfig(scan_groups=1), None):
        lower_for_gpu(lambda q, k, v, g, b, s, cfg=cfg: kda_chunk_pallas(
            q, k, v, g, b, initial_state=s, use_qk_l2norm=True, config=cfg), *args,
            platform=platform)
    P = H * K
    dec = [(sd((4, P), jnp.bfloat16),) * 3, sd((4, 3, 3 * P), jnp.bfloat16), (sd((P, 4), F32),) * 3,
           sd((4, P), jnp.bfloat16), sd((H,), F32), sd((P,), F32), sd((4, H), jnp.bfloat16),
           sd((4, P), jnp.bfloat16), sd((K,), F32), sd((4, H, K, K), F32)]
    lower_for_gpu(lambda *a: kda_decode_pallas(*a, num_heads=H, lower_bound=-5.0), *dec,
                  platform=platform)
    ver = tuple(sd(s.shape[:1] + (4,) + s.shape[2:], s.dtype) for s in args[:5]) + (args[5],)
    lower_for_gpu(lambda q, k, v, g, b, s: kda_verify_pallas(q, k, v, g, b, s, use_qk_l2norm=True),
                  *ver, platform=platform)
