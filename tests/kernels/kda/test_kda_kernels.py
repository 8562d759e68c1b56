"""KDA Pallas kernels (interpret mode on CPU) against the plain-JAX reference: chunked prefill,
fused one-token decode, multi-token verify. Outputs and states are compared, on fresh random
inputs, with ragged lengths, zero and nonzero initial states, both gate forms, bf16 and fp32, with
and without the in-kernel q/k l2 norm."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.kda import (kda_chunk, kda_decode, kda_gate, kda_recurrent, kda_verify,
                                l2norm)
from kernels_pallas.kda.chunk_pallas import ChunkConfig

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


CHUNK_CASES = [
    # (B, T, H, K, lengths, dtype, bounded gate, nonzero h0, safe_gate, use_qk_l2norm)
    (3, 65, 2, 32, [1, 63, 65], F32, False, True, False, True),     # ragged: lengths 1, 63, 65
    (2, 64, 2, 32, None, jnp.bfloat16, True, False, False, True),   # exactly one chunk, bf16
    (1, 1000, 1, 32, None, F32, True, True, False, True),           # many chunks, partial last one
    (2, 130, 1, 32, [130, 70], jnp.bfloat16, False, True, False, True),
    (2, 130, 2, 32, [97, 130], F32, True, True, True, True),        # bounded gate, MMA diagonal path
    (1, 65, 1, 128, None, jnp.bfloat16, True, True, False, True),   # K = V = 128 (the model's size)
    (4, 65, 1, 32, [1, 63, 64, 65], jnp.bfloat16, True, True, False, False),  # no in-kernel norm
    (2, 130, 2, 64, [130, 64], F32, False, False, False, False),    # no norm, K = 64
]


# every key-tile loop unrolled (whole-row diagonal), and every one a device loop over several
# tiles (the default's pipelined form, with tiles narrower than these tests' heads)
UNROLLED = dict(diag_block_k=None, num_stages_inter=1, num_stages_wu=1, block_k_out=None,
                split_inverse=True)
DEVICE_LOOPS = dict(diag_block_k=16, num_stages_diag=2, num_stages_inter=2, num_stages_wu=2,
                    block_wu=16, block_k_out=16, block_k_inter=16)


@pytest.mark.parametrize("loops", [UNROLLED, DEVICE_LOOPS], ids=["unrolled", "device_loops"])
@pytest.mark.parametrize("B,T,H,K,lengths,dt,bounded,nz,safe,l2", CHUNK_CASES)
def test_chunk_vs_reference(B, T, H, K, lengths, dt, bounded, nz, safe, l2, loops):
    q, k, v, g, beta, h0 = make(T + K, B, T, H, K, K, dt, bounded, nz, unit_qk=not l2)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    bad = garbage_past(lens, T)
    o, s = kda_chunk(bad(q), bad(k), bad(v), bad(g), bad(beta), initial_state=h0, lengths=lens,
                     use_qk_l2norm=l2, safe_gate=safe, backend="interpret",
                     config=ChunkConfig(**loops))
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=l2)
    assert o.shape == ro.shape and o.dtype == v.dtype and s.dtype == F32
    assert rel(o, ro) < tol(dt), rel(o, ro)
    assert rel(s, rs) < tol(dt), rel(s, rs)
    if lens is not None:  # padding is ignored: outputs there are zero
        for b, n in enumerate(lengths):
            assert float(jnp.abs(o[b, n:].astype(F32)).max(initial=0.0)) == 0.0


@pytest.mark.parametrize("decay", [0.05, 3.0, 30.0])
def test_chunk_diag_paths(decay):
    """Sub-blocks whose decay spans <= 80 (natural log) use the matmul diagonal, larger spans the
    exact one; decay 30/token puts most sub-blocks on the exact path, 3/token mixes both (the
    span of 16 tokens straddles 80), 0.05 keeps all on the matmul path."""
    B, T, H, K = 2, 96, 2, 32
    q, k, v, _, beta, h0 = make(7, B, T, H, K, K, F32, True, True)
    g = -decay * jax.random.uniform(jax.random.key(8), (B, T, H, K), minval=0.5, maxval=1.5)
    lens = jnp.array([96, 50], jnp.int32)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True,
                     backend="interpret")
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True)
    assert rel(o, ro) < 1e-4 and rel(s, rs) < 1e-4, (rel(o, ro), rel(s, rs))


def decode_inputs(seed, B, H, K, dt):
    ks = jax.random.split(jax.random.key(seed), 10)
    P = H * K
    return dict(qkv=jax.random.normal(ks[0], (B, 3 * P)).astype(dt),
                conv_state=jax.random.normal(ks[1], (B, 3, 3 * P)).astype(dt),
                conv_w=jax.random.normal(ks[2], (3 * P, 4)) * 0.5,
                f=jax.random.normal(ks[3], (B, P)).astype(dt),
                A_log=jax.random.uniform(ks[4], (H + 4,)),          # longer than H, as in K3
                dt_bias=jax.random.normal(ks[5], (P,)),
                b=jax.random.normal(ks[6], (B, H)).astype(dt),
                gate=jax.random.normal(ks[7], (B, P)).astype(dt),
                o_norm_w=1 + 0.1 * jax.random.normal(ks[8], (K,)),
                state=jax.random.normal(ks[9], (B, H, K, K)) * 0.3)


@pytest.mark.parametrize("dt,lb,K", [(F32, None, 32), (jnp.bfloat16, -5.0, 128)])
def test_decode_vs_reference(dt, lb, K):
    a = decode_inputs(3, 3, 2, K, dt)
    ref = kda_decode(**{n: x.copy() for n, x in a.items()}, num_heads=2, lower_bound=lb,
                     eps=1e-5, backend="reference")
    out = kda_decode(**{n: x.copy() for n, x in a.items()}, num_heads=2, lower_bound=lb,
                     eps=1e-5, backend="interpret")
    for x, r in zip(out, ref):
        assert x.shape == r.shape and x.dtype == r.dtype
    assert rel(out[0], ref[0]) < tol(dt)
    assert rel(out[1], ref[1]) == 0.0  # conv state: exact shift
    assert rel(out[2], ref[2]) < 1e-5


def test_decode_early_state_load_variant():
    """The variant that requests the state first computes exactly what the default does."""
    from kernels_pallas.kda.decode import kda_decode_pallas
    a = decode_inputs(7, 3, 2, 32, jnp.bfloat16)
    run = lambda **kw: kda_decode_pallas(**{n: x.copy() for n, x in a.items()}, num_heads=2,
                                         lower_bound=-5.0, interpret=True, **kw)
    for x, y in zip(run(), run(early_state_load=True)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_decode_matches_recurrent_step():
    """The decode reference itself against an independent composition of reference.py pieces."""
    a = decode_inputs(5, 2, 2, 32, F32)
    o, conv, S = kda_decode(**{n: x.copy() for n, x in a.items()}, num_heads=2, lower_bound=-5.0,
                            backend="interpret")
    B, H, K = 2, 2, 32
    xx = jnp.concatenate([a["conv_state"], a["qkv"][:, None]], 1)
    y = jax.nn.silu(sum(xx[:, i] * a["conv_w"][:, i] for i in range(4)))
    q, k, v = (t.reshape(B, 1, H, K) for t in jnp.split(y, 3, -1))
    g = kda_gate(a["f"].reshape(B, 1, H, K), a["A_log"], a["dt_bias"], lower_bound=-5.0)
    ro, rS = kda_recurrent(q, k, v, g, jax.nn.sigmoid(a["b"])[:, None], initial_state=a["state"],
                           use_qk_l2norm=True)
    ro = ro.reshape(B, H, K)
    ro = ro / jnp.sqrt(jnp.mean(ro ** 2, -1, keepdims=True) + 1e-5) * a["o_norm_w"]
    ro = ro * jax.nn.sigmoid(a["gate"].reshape(B, H, K))
    assert rel(o, ro.reshape(B, H * K)) < 1e-4 and rel(S, rS) < 1e-5
    np.testing.assert_array_equal(conv[:, :2], a["conv_state"][:, 1:])
    np.testing.assert_array_equal(conv[:, 2], a["qkv"])


@pytest.mark.parametrize("B,T,H,K,lengths,dt,bounded", [
    (2, 4, 3, 32, [4, 2], F32, True),
    (2, 8, 1, 128, [8, 5], jnp.bfloat16, True),
])
def test_verify_vs_reference(B, T, H, K, lengths, dt, bounded):
    q, k, v, g, beta, h0 = make(11 + T, B, T, H, K, K, dt, bounded, True)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    o, hs = kda_verify(q, k, v, g, beta, h0, lengths=lens, use_qk_l2norm=True,
                       backend="interpret")
    ro, rhs = kda_verify(q, k, v, g, beta, h0, lengths=lens, use_qk_l2norm=True,
                         backend="reference")
    assert hs.shape == (B, T, H, K, K) and hs.dtype == F32
    assert rel(o, ro) < tol(dt)
    assert rel(hs, rhs) < 1e-5
    # rollback: the state after position t is the final state of the first t+1 tokens
    t = T // 2
    _, st = kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], initial_state=h0,
                          lengths=None if lens is None else jnp.minimum(lens, t),
                          use_qk_l2norm=True)
    assert rel(hs[:, t - 1], st) < 1e-5


@pytest.mark.parametrize("T,groups,dt,lengths", [
    (300, 2, F32, [300, 130]),          # 5 chunks -> padded to 6, ragged
    (520, 4, F32, None),                # 9 chunks -> 12, last group all padding
    (256, 0, jnp.bfloat16, [256, 1]),   # auto (tiny batch: picks > 1 only with >= 16 chunks)
])
def test_chunk_two_level_scan(T, groups, dt, lengths):
    """The grouped (two-level) state scan: each group's map in parallel, a short scan over the
    groups, a parallel replay; == the reference, outputs and final state."""
    from kernels_pallas.kda.chunk_pallas import auto_scan_groups
    B, H, K = 2, 2, 32
    q, k, v, g, beta, h0 = make(T + groups, B, T, H, K, K, dt, True, True)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True,
                     backend="interpret", config=ChunkConfig(scan_groups=groups))
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True)
    assert rel(o, ro) < tol(dt) and rel(s, rs) < tol(dt), (rel(o, ro), rel(s, rs))
    assert auto_scan_groups(1, 16, 128, 512) > 1 and auto_scan_groups(8, 96, 128, 64) == 1


@pytest.mark.parametrize("dt,lengths", [(F32, [200, 65]), (jnp.bfloat16, None)])
def test_chunk_split_inverse(dt, lengths):
    """Launch 2 split in two (off-diagonal blocks storing L in fp32, then the inverse) gives the
    fused launch's results exactly, and the reference's; so does the product form of the
    diagonal blocks' inverse (to rounding)."""
    B, T, H, K = 2, 200, 2, 64
    q, k, v, g, beta, h0 = make(T + 7, B, T, H, K, K, dt, True, True)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    run = lambda cfg: kda_chunk(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True,
                                backend="interpret", config=cfg)
    subst = dict(diag_inverse="substitution")
    o, s = run(ChunkConfig(split_inverse=True, **subst))
    fo, fs = run(ChunkConfig(split_inverse=False, num_warps_inter=2, **subst))
    assert jnp.array_equal(o, fo) and jnp.array_equal(s, fs)
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=True)
    assert rel(o, ro) < tol(dt) and rel(s, rs) < tol(dt), (rel(o, ro), rel(s, rs))
    for cfg in (ChunkConfig(split_inverse=True), ChunkConfig(),
                ChunkConfig(split_inverse=True, inverse_precision="ieee", num_warps_inverse=8),
                ChunkConfig(split_inverse=True, inverse_precision="tf32"),
                ChunkConfig(inverse_precision="tf32")):
        po, ps = run(cfg)  # the product form of the diagonal blocks' inverse; its precisions
        # (bf16 operands; fp32 ones always take "ieee". The interpreter computes "tf32" in fp32.)
        assert rel(po, ro) < tol(dt) and rel(ps, rs) < tol(dt), (cfg, rel(po, ro), rel(ps, rs))
        assert rel(po, fo) < (1e-5 if dt == F32 else 1e-2), rel(po, fo)


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_kda_kernels_lower_for_gpu(platform):
    """The chunk (plain and two-level scan), decode and verify kernels lower to Triton IR for an
    H200 / AMD target at K3's per-rank shapes (no GPU needed)."""
    from kernels_pallas.gpu_lowering import lower_for_gpu
    from kernels_pallas.kda.decode import kda_decode_pallas
    from kernels_pallas.kda.verify import kda_verify_pallas
    from kernels_pallas.kda.chunk_pallas import kda_chunk_pallas
    sd = jax.ShapeDtypeStruct
    B, T, H, K = 1, 8192, 16, 128
    args = (sd((B, T, H, K), jnp.bfloat16),) * 3 + (sd((B, T, H, K), F32), sd((B, T, H), jnp.bfloat16),
                                                     sd((B, H, K, K), F32))
    for cfg in (ChunkConfig(scan_groups=1), ChunkConfig(scan_groups=0),
                ChunkConfig(split_inverse=False, diag_inverse="substitution"),
                ChunkConfig(scan_groups=1, block_v_out=64),
                ChunkConfig(inverse_precision="ieee"), ChunkConfig(inverse_precision="tf32"),
                ChunkConfig(**UNROLLED), ChunkConfig(**DEVICE_LOOPS),
                ChunkConfig(split_inverse=True), ChunkConfig(num_stages_inter=1)):
        lower_for_gpu(lambda q, k, v, g, b, s, cfg=cfg: kda_chunk_pallas(
            q, k, v, g, b, initial_state=s, use_qk_l2norm=True, config=cfg), *args, platform=platform)
    P = H * K
    dec = [sd((4, 3 * P), jnp.bfloat16), sd((4, 3, 3 * P), jnp.bfloat16), sd((3 * P, 4), F32),
           sd((4, P), jnp.bfloat16), sd((H,), F32), sd((P,), F32), sd((4, H), jnp.bfloat16),
           sd((4, P), jnp.bfloat16), sd((K,), F32), sd((4, H, K, K), F32)]
    for early in (False, True):
        lower_for_gpu(lambda *a: kda_decode_pallas(*a, num_heads=H, lower_bound=-5.0, early_state_load=early),
                      *dec, platform=platform)
    ver = tuple(sd(s.shape[:1] + (4,) + s.shape[2:], s.dtype) for s in args[:5]) + (args[5],)
    lower_for_gpu(lambda q, k, v, g, b, s: kda_verify_pallas(q, k, v, g, b, s, use_qk_l2norm=True),
                  *ver, platform=platform)


def test_inverse_precision_bf16x3_close_to_fp32():
    """The bf16x3 products give the fp32 inverse to ~1e-5 before T is rounded to bf16: the
    outputs match the fp32-product ("ieee") run far inside bf16's rounding, and an unknown name
    is refused."""
    B, T, H, K = 1, 130, 2, 32
    q, k, v, g, beta, h0 = make(11, B, T, H, K, K, jnp.bfloat16, True, True)
    run = lambda p: kda_chunk(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True,
                              backend="interpret", config=ChunkConfig(inverse_precision=p))
    o, s = run("ieee")
    xo, xs = run("bf16x3")
    assert rel(xo, o) < 1e-3 and rel(xs, s) < 1e-3, (rel(xo, o), rel(xs, s))
    with pytest.raises(ValueError, match="inverse_precision"):
        run("fp16")
    with pytest.raises(ValueError, match="inverse_precision"):  # refused with fp32 inputs too
        kda_chunk(*(x.astype(F32) for x in (q, k, v)), g, beta.astype(F32), initial_state=h0,
                  backend="interpret", config=ChunkConfig(inverse_precision="fp16"))


def _max_block_span(g):
    """The largest decay span (G at a 16-row sub-block's first row minus G at its last) over
    the chunk-aligned sub-blocks of g [B, T, H, K]: > MATMUL_SPAN sends a block down the exact
    path."""
    B, T, H, K = g.shape
    Tp = -(-T // 16) * 16
    gb = jnp.pad(g, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp // 16, 16, H, K)
    return float(jnp.max(-jnp.sum(gb[:, :, 1:], axis=2)))


@pytest.mark.parametrize("dt,bounded,safe,l2,lengths,gscale", [
    (F32, False, False, True, [1, 130], 4.0),          # steep gate: blocks take the exact path
    (jnp.bfloat16, True, False, True, None, 1.0),      # bounded gate: the matmul path
    (jnp.bfloat16, True, True, False, [64, 70], 1.0),  # safe_gate, no l2 norm
])
def test_chunk_diag_block_k(dt, bounded, safe, l2, lengths, gscale):
    """The diagonal launch in key tiles (ChunkConfig.diag_block_k) matches the reference and the
    whole-row launch (products rounded per tile, so to rounding, not bit for bit), on the exact
    path too; NaN garbage past `lengths` reaches nothing; a tile that does not divide K is
    refused."""
    from kernels_pallas.kda.chunk_pallas import MATMUL_SPAN
    B, T, H, K = 2, 130, 2, 64
    q, k, v, g, beta, h0 = make(T + 5, B, T, H, K, K, dt, bounded, True, unit_qk=not l2)
    g = g * gscale
    assert (_max_block_span(g) > MATMUL_SPAN) == (gscale > 1), _max_block_span(g)
    lens = None if lengths is None else jnp.array(lengths, jnp.int32)
    bad = garbage_past(lens, T)
    run = lambda **kw: kda_chunk(*map(bad, (q, k, v, g, beta)), initial_state=h0, lengths=lens,
                                 use_qk_l2norm=l2, safe_gate=safe, backend="interpret",
                                 config=ChunkConfig(**kw))
    o, s = run(diag_block_k=None)
    ro, rs = kda_recurrent(q, k, v, g, beta, initial_state=h0, lengths=lens, use_qk_l2norm=l2)
    for bk in (16, 32):
        to, ts = run(diag_block_k=bk)
        assert rel(to, ro) < tol(dt) and rel(ts, rs) < tol(dt), (bk, rel(to, ro), rel(ts, rs))
        assert rel(to, o) < (1e-5 if dt == F32 else 1e-2), (bk, rel(to, o))
        assert bool(jnp.isfinite(to.astype(F32)).all())
    # a tile that does not divide the head, or is below Triton's 16, is refused by name
    for name, t in (("diag_block_k", 48), ("block_wu", 48), ("block_k_out", 48),
                    ("block_k_inter", 48), ("block_k_out", 8)):
        with pytest.raises(ValueError, match=f"{name}={t} .*must divide"):
            run(**{name: t})

