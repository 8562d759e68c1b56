"""MLA kernels: the Pallas decode / prefill kernels (interpret mode on CPU) against the plain-JAX
references, and the exact log-sum-exp merge of partial results."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas.mla import (DecodeConfig, PrefillConfig, fp8_to_words, merge_partials,
                                merge_stacked, mla_decode, mla_decode_reference, mla_prefill,
                                mla_prefill_reference, words_to_fp8)
from kernels_pallas.mla.fp8_words import PAIR_ASM, WORD_ASM, e4m3_word_halves, e4m3_word_pairs
from kernels_pallas.mla.tuning import WORD_UPCASTS
from tests.ptx_emulator import emulate_ptx  # noqa: E402

SCALE = 1.0 / np.sqrt(192.0)


def _paged_cache(rng, lengths, page_size, max_pages, dtype, fill_unused=np.nan):
    """A page pool with each sequence's pages at random places; unused slots hold `fill_unused`."""
    B = len(lengths)
    num_pages = B * max_pages + 3
    perm = rng.permutation(num_pages)
    page_table = perm[: B * max_pages].reshape(B, max_pages).astype(np.int32)
    cache = np.full((num_pages, page_size, 576), fill_unused, np.float32)
    for b, L in enumerate(lengths):
        for pos in range(L):
            cache[page_table[b, pos // page_size], pos % page_size] = rng.standard_normal(576)
    return jnp.asarray(cache, dtype), jnp.asarray(page_table), jnp.asarray(lengths, jnp.int32)


def _q(rng, B, Tq, H, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal((B, Tq, H, 576)), jnp.float32).astype(dtype)


def _check(o, lse, ro, rlse, atol):
    o, lse, ro, rlse = (np.asarray(x, np.float32) for x in (o, lse, ro, rlse))
    assert np.all(np.isfinite(o)), "non-finite output"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(rlse))
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], atol=2e-3, rtol=1e-4)
    np.testing.assert_allclose(o, ro, atol=atol, rtol=0)
    assert np.all(o[~fin] == 0), "rows without keys must be 0"


@pytest.mark.parametrize("H,Tq,out", [(12, 1, jnp.float32), (16, 1, jnp.float32),
                                       (12, 4, jnp.bfloat16), (16, 4, jnp.bfloat16)])
def test_decode_bf16_edges(H, Tq, out):
    """Three splits merged; a bf16 output: the splits' partials stored in bf16 (half the merge's
    traffic), within bf16 rounding of the reference."""
    rng = np.random.default_rng(H * 10 + Tq)
    ps = 16
    # 0 (masked), 1, Tq-1 (fewer keys than queries), page boundaries, a longer one
    lengths = [0, 1, max(Tq - 1, 0), ps - 1, ps, ps + 1, 2 * ps, 150]
    cache, pt, ln = _paged_cache(rng, lengths, ps, 10, jnp.bfloat16)
    q = _q(rng, len(lengths), Tq, H)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, out_dtype=jnp.float32)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret", out_dtype=out,
                        config=DecodeConfig(num_splits=3))
    assert o.shape == (len(lengths), Tq, H, 512) and lse.shape == (len(lengths), Tq, H)
    assert o.dtype == out
    _check(o, lse, ro, rlse, atol=2e-2 if out == jnp.float32 else 3e-2)


def test_decode_long_ragged_fp32_exact():
    rng = np.random.default_rng(1)
    ps, maxp = 32, 24
    lengths = [700, 33, 0, 511, 768]
    cache, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.float32)
    q = _q(rng, len(lengths), 2, 16, jnp.float32)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE)
    for splits, bk in ((1, 64), (7, 32)):
        o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret",
                            config=DecodeConfig(num_splits=splits, block_k=bk))
        _check(o, lse, ro, rlse, atol=2e-5)


def _fp8_cache(rng, lengths, ps, maxp, per_token):
    """(fp32 cache, its e4m3 copy with NaN in unused slots, scale, page table, lengths)."""
    cache32, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.float32, fill_unused=0.0)
    if per_token:   # c / scale must stay inside e4m3's range (448), else the cast gives NaN
        cs = jnp.asarray(rng.uniform(0.02, 0.05, cache32.shape[:2]), jnp.float32)
        cache8 = (cache32 / cs[..., None]).astype(jnp.float8_e4m3fn)
    else:
        cs = jnp.float32(0.02)
        cache8 = (cache32 / cs).astype(jnp.float8_e4m3fn)
    used = np.zeros(cache8.shape[:2], bool)
    for b, L in enumerate(lengths):
        for pos in range(L):
            used[int(pt[b, pos // ps]), pos % ps] = True
    # NaN in unused slots must not leak: fp8 e4m3fn has a NaN encoding.
    cache8 = jnp.where(jnp.asarray(used)[..., None], cache8,
                       jnp.asarray(np.nan, jnp.float8_e4m3fn))
    return cache32, cache8, cs, pt, ln


def _check_fp8(rng, lengths, ps, maxp, per_token, Tq, H, **kw):
    """The fp8 kernel against the reference on the same fp8 cache, and near the fp32 result."""
    cache32, cache8, cs, pt, ln = _fp8_cache(rng, lengths, ps, maxp, per_token)
    q = _q(rng, len(lengths), Tq, H)
    ro, rlse = mla_decode_reference(q, cache8, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    words = kw.get("fp8_upcast") in WORD_UPCASTS
    o, lse = mla_decode(q, fp8_to_words(cache8) if words else cache8, pt, ln, scale=SCALE,
                        backend="interpret", cache_scale=cs, out_dtype=jnp.float32,
                        config=DecodeConfig(**kw))
    _check(o, lse, ro, rlse, atol=2e-2)
    r32, _ = mla_decode_reference(q, cache32, pt, ln, scale=SCALE, out_dtype=jnp.float32)
    rel = float(jnp.linalg.norm(o - r32) / jnp.linalg.norm(r32))
    assert rel < 0.1, rel


@pytest.mark.parametrize("per_token", [False, True])
def test_decode_fp8(per_token):
    # 16-token pages, default 64-key blocks: the "token" load
    _check_fp8(np.random.default_rng(2 + per_token), [0, 1, 17, 100], 16, 8, per_token, 4, 12,
               num_splits=2)


def test_decode_default_config_and_reference_backend():
    rng = np.random.default_rng(4)
    lengths = [5, 64, 65]
    cache, pt, ln = _paged_cache(rng, lengths, 64, 2, jnp.bfloat16)
    q = _q(rng, 3, 1, 16)
    o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret")
    ro, rlse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="reference")
    assert o.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    _check(o, lse, ro, rlse, atol=3e-2)


@pytest.mark.parametrize("Tq,H", [(1, 16), (4, 12)])
def test_decode_page_and_token_loads(Tq, H):
    """The "page" load (one page id per step, page ids read per chunk of 32 steps) against the
    reference and the "token" load: lengths 0 / 1 / < Tq, page and block boundaries, and one
    sequence of 38 blocks, which crosses a chunk when it is not split; the QK^T dots summed in
    one accumulator chain or each scaled first (split_qk_acc)."""
    rng = np.random.default_rng(20 + Tq)
    ps, maxp = 32, 20
    lengths = [0, 1, max(Tq - 1, 0), 15, 16, 17, 31, 32, 33, 600]
    cache, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.bfloat16)
    q = _q(rng, len(lengths), Tq, H)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE, out_dtype=jnp.float32)
    outs = {}
    for load, splits, acc in (("page", 1, False), ("page", 4, False), ("token", 4, False),
                              ("token", 1, True)):
        o, lse = mla_decode(q, cache, pt, ln, scale=SCALE, backend="interpret",
                            out_dtype=jnp.float32,
                            config=DecodeConfig(load=load, num_splits=splits, block_k=16,
                                                block_h=16, split_qk_acc=acc))
        _check(o, lse, ro, rlse, atol=2e-2)
        outs[load, splits, acc] = np.asarray(o)
    np.testing.assert_allclose(outs["page", 4, False], outs["token", 4, False], atol=1e-5, rtol=0)


@pytest.mark.parametrize("per_token,Tq,acc", [(True, 4, False), (False, 1, False),
                                              (True, 1, True)])
def test_decode_fp8_operand(per_token, Tq, acc):
    """A float8 cache ("operand", fp16 dots) on the "page" load: lengths 0 / 1, page boundaries,
    ragged, 2 chunks of page ids."""
    _check_fp8(np.random.default_rng(30 + Tq + per_token), [0, 1, 16, 17, 100, 530], 16, 34,
               per_token, Tq, 16, num_splits=1, block_k=16, split_qk_acc=acc)


@pytest.mark.parametrize("upcast,per_token,Tq,H,load,acc", [
    ("words", True, 1, 16, "page", False), ("words", False, 4, 12, "token", False),
    ("words_int", True, 1, 16, "page", False), ("words_int", False, 4, 12, "token", False),
    ("words_pairs", True, 1, 16, "page", True), ("words_pairs", False, 4, 12, "token", False),
    ("words", True, 1, 12, "token", True)])
def test_decode_fp8_words(upcast, per_token, Tq, H, load, acc):
    """The fp8 cache in the words form: lengths 0 / 1 / page boundaries / ragged, 2 chunks of
    page ids, one split and several, the conversions, both loads, 12 and 16 heads (16 rows: q
    scaled and its columns loaded in the kernel; 64 rows: before it), split QK^T accumulators
    on and off."""
    for splits in (1, 3):
        _check_fp8(np.random.default_rng(50 + Tq + per_token + splits), [0, 1, 16, 17, 100, 530],
                   16, 34, per_token, Tq, H, num_splits=splits, block_k=16, load=load,
                   fp8_upcast=upcast, split_qk_acc=acc)


def test_fp8_words_form():
    """fp8_to_words / words_to_fp8 are inverse on every byte in both halves of a word; the
    reference reads a words cache as the fp8 cache it holds."""
    b = np.arange(256, dtype=np.uint8)
    f8 = jnp.asarray(np.concatenate([b, b[::-1], b[:64]]).view(jnp.float8_e4m3fn)[None])
    w = fp8_to_words(f8)
    assert w.dtype == jnp.uint16 and w.shape == (1, 288)
    np.testing.assert_array_equal(np.asarray(w[0, 0]), 1 << 8)        # bytes 0, 1 -> word 0
    np.testing.assert_array_equal(np.asarray(words_to_fp8(w)).view(np.uint8),
                                  np.asarray(f8).view(np.uint8))
    rng = np.random.default_rng(60)
    _, cache8, cs, pt, ln = _fp8_cache(rng, [5, 40], 16, 4, True)
    q = _q(rng, 2, 1, 16)
    for a, b_ in zip(mla_decode_reference(q, cache8, pt, ln, scale=SCALE, cache_scale=cs),
                     mla_decode_reference(q, fp8_to_words(cache8), pt, ln, scale=SCALE,
                                          cache_scale=cs)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b_, np.float32))
    for bad in (jnp.zeros((2, 576), jnp.bfloat16), jnp.zeros((2, 575), jnp.float8_e4m3fn)):
        with pytest.raises(ValueError, match="fp8_to_words"):
            fp8_to_words(bad)
    with pytest.raises(ValueError, match="words_to_fp8"):
        words_to_fp8(jnp.zeros((2, 288), jnp.int16))


def test_word_conversions_every_word():
    """Every uint16 word: the "cvt" conversion gives the e4m3 values of its two bytes (NaN
    included), "int" the same values times 2^-8 (NaN bytes aside), and both PTX texts (run by the
    numpy emulator on registers of two words) give the jnp path's bits."""
    w = np.arange(1 << 16, dtype=np.uint16)
    want = w.view(np.uint8).view(jnp.float8_e4m3fn).astype(np.float32).reshape(-1, 2)
    nan = np.isnan(want)
    halves = {c: [np.asarray(h) for h in e4m3_word_halves(jnp.asarray(w), c, ptx=False)]
              for c in ("cvt", "int")}
    for i in (0, 1):
        got = halves["cvt"][i].astype(np.float32)
        np.testing.assert_array_equal(np.isnan(got), nan[:, i])
        np.testing.assert_array_equal(got[~nan[:, i]], want[~nan[:, i], i])
        got = halves["int"][i].astype(np.float32) * 256.0
        np.testing.assert_array_equal(got[~nan[:, i]], want[~nan[:, i], i])
    regs = np.random.default_rng(61).permutation(w).astype(np.uint32)
    regs = regs[0::2] | (regs[1::2] << np.uint32(16))               # two words a register
    for conv in ("cvt", "int"):
        for i, asm in enumerate(WORD_ASM[conv]):
            [out] = emulate_ptx(asm, [regs], 1)
            bits = halves[conv][i].view(np.uint16)
            for k in (0, 1):        # the register's word k -> the output's half k
                words = ((regs >> np.uint32(16 * k)) & np.uint32(0xFFFF)).astype(np.int64)
                np.testing.assert_array_equal((out >> np.uint32(16 * k)) & np.uint32(0xFFFF),
                                              bits[words])
    # pairs: a register's word k -> output k, its low / high byte in the output's half 0 / 1,
    # as the jnp path pairs adjacent words
    seq = np.asarray(jax.random.permutation(jax.random.key(63), w), np.uint16)
    pair_jnp = [np.asarray(h).view(np.uint16) for h in e4m3_word_pairs(jnp.asarray(seq), False)]
    regs = seq[0::2].astype(np.uint32) | (seq[1::2].astype(np.uint32) << np.uint32(16))
    outs = [emulate_ptx(asm, [regs], 1)[0] for asm in PAIR_ASM]
    for k in (0, 1):
        for half in (0, 1):
            np.testing.assert_array_equal((outs[k] >> np.uint32(16 * half)) & np.uint32(0xFFFF),
                                          pair_jnp[k][half::2])
        lo_hi = np.stack([want[seq[k::2]][:, i] for i in (0, 1)], axis=1).reshape(-1)
        got = pair_jnp[k].view(np.float16).astype(np.float32)
        ok = ~np.isnan(lo_hi)
        np.testing.assert_array_equal(got[ok], lo_hi[ok])


def test_decode_fp8_words_errors():
    """A words cache runs the words upcasts and a float8 cache "operand", a 16-bit cache none,
    each with a message that names the fix."""
    rng = np.random.default_rng(62)
    _, cache8, cs, pt, ln = _fp8_cache(rng, [5, 40], 16, 4, True)
    q = _q(rng, 2, 1, 16)
    kw = dict(scale=SCALE, backend="interpret", cache_scale=cs)
    with pytest.raises(ValueError, match="fp8_to_words"):
        mla_decode(q, cache8, pt, ln, config=DecodeConfig(fp8_upcast="words"), **kw)
    with pytest.raises(ValueError, match="words form"):
        mla_decode(q, fp8_to_words(cache8), pt, ln, config=DecodeConfig(fp8_upcast="operand"),
                   **kw)
    with pytest.raises(ValueError, match="only an fp8 cache"):
        mla_decode(q, cache8.astype(jnp.bfloat16), pt, ln,
                   config=DecodeConfig(fp8_upcast="operand"), **kw)
    with pytest.raises(ValueError, match="cache_scale"):
        mla_decode(q, fp8_to_words(cache8), pt, ln, scale=SCALE, backend="interpret")
    with pytest.raises(ValueError, match="288"):
        mla_decode(q, fp8_to_words(cache8)[..., :200], pt, ln, **kw)


@pytest.mark.parametrize("upcast", ["operand", "words"])
def test_decode_fp8_fp16_dots_keep_large_q(upcast):
    """fp16 dots divide each q row by its max |q|: rows far outside fp16's range (1e6) and an
    all-zero row give the reference's result, not inf / NaN."""
    rng = np.random.default_rng(40)
    lengths = [5, 40, 17]
    cache32, cache8, cs, pt, ln = _fp8_cache(rng, lengths, 16, 4, True)
    q = np.asarray(rng.standard_normal((3, 1, 16, 576)), np.float32) * 0.01
    q[0, 0, 3] *= 1e8                    # |q| ~ 1e6: inf in fp16
    q[1, 0, 5] = 0.0
    q = jnp.asarray(q).astype(jnp.bfloat16)
    ro, rlse = mla_decode_reference(q, cache8, pt, ln, scale=SCALE, cache_scale=cs,
                                    out_dtype=jnp.float32)
    c = fp8_to_words(cache8) if upcast == "words" else cache8
    for block_h in (16, 64):        # q rows scaled in the kernel / before it
        o, lse = mla_decode(q, c, pt, ln, scale=SCALE, backend="interpret", cache_scale=cs,
                            out_dtype=jnp.float32,
                            config=DecodeConfig(num_splits=2, block_k=16, fp8_upcast=upcast,
                                                block_h=block_h))
        _check(o, lse, ro, rlse, atol=2e-2)


def test_split_policy_and_config():
    from kernels_pallas.mla.merge import MERGE_CHUNK
    from kernels_pallas.mla.tuning import (choose_num_splits, decode_config, programs_per_sm,
                                           smem_bytes)
    # B x splits programs fill whole waves of 264 slots
    for B, cap in ((16, 32768), (64, 131072), (16, 131072)):
        s = choose_num_splits(B, 1, cap, 32, rows_p=16, slots=264)
        waves = -(-B * s // 264)
        assert B * s >= 0.9 * 264 * waves, (B, cap, s)
    # ... but at most the merge's one-load chunk of splits (a second chunk costs more)
    assert choose_num_splits(1, 1, 131072, 32, rows_p=16, slots=264) == MERGE_CHUNK == 128
    assert choose_num_splits(2, 1, 100, 64, rows_p=16, slots=264) == 2       # <= key blocks
    # every default fits the H200's 227 KiB of shared memory a program
    for dt in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint16):
        for heads in (12, 16, 32, 48, 128):
            c = decode_config((8, 1, heads, 576), (100, 64, 288 if dt == jnp.uint16 else 576),
                              dt, (8, 1024), num_sms=132, platform="cuda")
            isz = 2 if dt == jnp.bfloat16 else 1
            assert smem_bytes(c.block_h, c.block_k, c.num_stages, isz) <= 227 * 1024
            assert programs_per_sm(c.block_h, c.block_k, c.num_warps, c.num_stages, isz) >= 1
    q, cache, pt = (8, 1, 16, 576), (100, 16, 576), (8, 12)
    c = decode_config(q, cache, jnp.bfloat16, pt, DecodeConfig(block_k=32))
    assert c.load == "token"                          # 16-token pages, 32-token steps
    assert decode_config(q, cache, jnp.bfloat16, pt, DecodeConfig(block_k=16)).load == "page"
    assert decode_config(q, cache, jnp.bfloat16, pt, DecodeConfig(num_splits=5)).num_splits == 5
    for bad in (dict(load="page", block_k=32), dict(load="x"), dict(block_k=48),
                dict(block_h=8), dict(fp8_upcast="words")):
        with pytest.raises(ValueError):
            decode_config(q, cache, jnp.bfloat16, pt, DecodeConfig(**bad))
    with pytest.raises(ValueError, match="not one of"):
        decode_config(q, cache, jnp.float8_e4m3fn, pt, DecodeConfig(fp8_upcast="x"))


def test_default_config_is_the_measured_winner():
    """The tuning table's rows as measured on the H200: bf16, 16 rows: 64-key blocks, 4 warps,
    3 stages, page load, with the split counts the sweep ran at; 16-token pages: 64-key "token"
    loads with 2 stages; float8: 64-key blocks, 8 warps, 3 stages ("operand"); the words form:
    "words_pairs" with split QK^T accumulators at 16 rows, "words" at 64; bf16 64-row blocks
    (96 / 128 heads): 64-key blocks, 2 stages; fp32 and 32-row blocks: the fallback."""
    from kernels_pallas.mla.tuning import decode_config

    pool = (131072, 64, 576)
    for (B, ctx), splits in {(16, 32768): 8, (64, 131072): 2, (1, 131072): 128}.items():
        c = decode_config((B, 1, 16, 576), pool, jnp.bfloat16, (B, ctx // 64), num_sms=132)
        assert c == DecodeConfig(block_h=16, block_k=64, num_warps=4, num_stages=3,
                                 num_splits=splits, load="page", fp8_upcast=None,
                                 split_qk_acc=False), (B, ctx, c)
        c8 = decode_config((B, 1, 16, 576), pool, jnp.float8_e4m3fn, (B, ctx // 64),
                           num_sms=132)
        assert (c8.block_k, c8.num_warps, c8.num_stages, c8.fp8_upcast) == (64, 8, 3, "operand")
        cw = decode_config((B, 1, 16, 576), (131072, 64, 288), jnp.uint16, (B, ctx // 64),
                           num_sms=132, platform="cuda")
        assert (cw.block_k, cw.num_warps, cw.num_stages, cw.fp8_upcast, cw.load,
                cw.split_qk_acc) == (64, 4, 3, "words_pairs", "page", True)
        c128 = decode_config((B, 1, 128, 576), (131072, 64, 288), jnp.uint16, (B, ctx // 64),
                             num_sms=132, platform="cuda")
        assert (c128.block_h, c128.fp8_upcast, c128.split_qk_acc, c128.block_k,
                c128.num_warps, c128.num_stages) == (64, "words", False, 64, 8, 2)
        assert cw.num_splits == {16: 16, 64: 4, 1: 128}[B]
    c = decode_config((16, 1, 12, 576), (100, 16, 576), jnp.bfloat16, (16, 2048), num_sms=132)
    assert (c.block_k, c.num_warps, c.num_stages, c.load) == (64, 4, 2, "token")
    for dt, heads in ((jnp.float32, 16), (jnp.bfloat16, 32)):
        c = decode_config((8, 1, heads, 576), pool, dt, (8, 1024), num_sms=132)
        assert (c.block_k, c.num_warps, c.num_stages) == (32, 8, 3), (dt, heads)
    for heads in (96, 128):
        c = decode_config((16, 1, heads, 576), pool, jnp.bfloat16, (16, 512), num_sms=132)
        assert (c.block_h, c.block_k, c.num_warps, c.num_stages) == (64, 64, 8, 2)


@pytest.mark.parametrize("dtype,kw", [
    ("bf16", {}), ("bf16", dict(load="token")), ("bf16", dict(Tq=4, H=12)), ("fp8", {}),
    ("fp8", dict(per_token=False, H=128)), ("fp8w", {}),
    ("fp8w", dict(fp8_upcast="words_int", per_token=False)), ("fp8w", dict(Tq=4, H=12)),
    ("fp8w", dict(H=128)), ("fp8w", dict(fp8_upcast="words_pairs", H=128))])
def test_decode_lowers_for_h200(dtype, kw):
    """Each path lowers to Triton IR for an H200 (no GPU needed), with a > 4 GiB cache."""
    from kernels_pallas.gpu_lowering import lower_for_gpu
    kw = dict(kw)
    Tq, H, per_token = kw.pop("Tq", 1), kw.pop("H", 16), kw.pop("per_token", True)
    B, ctx, pages = 16, 32768, 64 * 2048
    sd = jax.ShapeDtypeStruct
    q = sd((B, Tq, H, 576), jnp.bfloat16)
    cache = {"bf16": sd((pages, 64, 576), jnp.bfloat16),
             "fp8": sd((pages, 64, 576), jnp.float8_e4m3fn),
             "fp8w": sd((pages, 64, 288), jnp.uint16)}[dtype]
    pt, ln = sd((B, ctx // 64), jnp.int32), sd((B,), jnp.int32)
    if dtype == "bf16":
        lower_for_gpu(lambda q, c, p, l: mla_decode(q, c, p, l, scale=SCALE, backend="pallas",
                                                   config=DecodeConfig(**kw)), q, cache, pt, ln)
    else:
        cs = sd((pages, 64) if per_token else (), jnp.float32)
        lower_for_gpu(lambda q, c, p, l, s: mla_decode(q, c, p, l, scale=SCALE, cache_scale=s,
                                                       backend="pallas",
                                                       config=DecodeConfig(**kw)),
                      q, cache, pt, ln, cs)


def test_merge_partials_over_random_shards():
    """Decode over disjoint page ranges of the history, merged, equals the unsplit decode."""
    rng = np.random.default_rng(5)
    ps, maxp = 16, 12
    lengths = [150, 1, 0, 97]
    cache, pt, ln = _paged_cache(rng, lengths, ps, maxp, jnp.float32)
    q = _q(rng, len(lengths), 1, 16, jnp.float32)
    ro, rlse = mla_decode_reference(q, cache, pt, ln, scale=SCALE)
    for trial in range(3):
        cuts = np.sort(rng.choice(np.arange(1, maxp), size=3, replace=False))
        bounds = [0, *cuts.tolist(), maxp]
        os_, ls_ = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            sub_pt = jnp.zeros_like(pt).at[:, : b - a].set(pt[:, a:b])
            sub_len = jnp.clip(ln - a * ps, 0, (b - a) * ps)
            backend = "interpret" if trial == 0 else "reference"
            o_s, l_s = mla_decode(q, cache, sub_pt, sub_len, scale=SCALE, backend=backend,
                                  config=DecodeConfig(num_splits=2))
            os_.append(o_s)
            ls_.append(l_s)
        o, lse = merge_partials(os_, ls_)
        _check(o, lse, ro, rlse, atol=2e-5)
    # all-empty shards: lse -inf, o 0
    o, lse = merge_partials([jnp.ones((2, 3, 8))] * 2, [jnp.full((2, 3), -jnp.inf)] * 2)
    assert np.all(np.isneginf(np.asarray(lse))) and np.all(np.asarray(o) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill(dtype):
    rng = np.random.default_rng(6)
    B, T, H = 4, 80, 2
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, 192)), jnp.float32).astype(dtype)
            for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, 128)), jnp.float32).astype(dtype)
    ln = jnp.asarray([0, 1, 33, 80], jnp.int32)     # 0, 1, block+1, full (T not a block multiple)
    ro, rlse = mla_prefill_reference(q, k, v, ln, scale=SCALE, return_lse=True)
    atol = 2e-5 if dtype == jnp.float32 else 3e-2
    for backend in ("interpret", "reference"):
        o, lse = mla_prefill(q, k, v, ln, scale=SCALE, backend=backend, return_lse=True,
                             config=PrefillConfig(block_q=32, block_k=16), chunk=32)
        assert o.shape == (B, T, H, 128) and o.dtype == dtype
        _check(o, lse, ro, rlse, atol=atol)


@pytest.mark.parametrize("key_start", [0, 24, 70])
def test_prefill_chunk_over_its_history(key_start):
    """Queries at ragged positions over a chunk of keys at another offset (a prefill chunk over a
    chunk of its cached history): the kernel and the chunked form == the dense oracle. Rows: a
    fresh prompt, one deep in its history, one with nothing new, one that sees every key of the
    chunk; S is not a block multiple; at key_start 70 the first two rows see no key here."""
    rng = np.random.default_rng(key_start)
    B, T, S, H = 4, 20, 45, 2
    q = jnp.asarray(rng.standard_normal((B, T, H, 192)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, S, H, 192)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, H, 128)), jnp.float32)
    starts = jnp.asarray([0, 50, 9, 120], jnp.int32)
    n_new = jnp.asarray([20, 13, 0, 20], jnp.int32)
    ro, rlse = mla_prefill_reference(q, k, v, n_new, starts, jnp.int32(key_start), scale=SCALE,
                                     return_lse=True)
    for backend in ("interpret", "reference"):
        o, lse = mla_prefill(q, k, v, n_new, starts=starts, key_start=jnp.int32(key_start), scale=SCALE,
                             backend=backend, return_lse=True, config=PrefillConfig(block_q=16, block_k=16),
                             chunk=16)
        assert o.shape == (B, T, H, 128)
        _check(o, lse, ro, rlse, atol=2e-5)
    seen = np.isfinite(np.asarray(rlse))
    assert seen[3].all() and not seen[2].any() and seen[1].any() == (key_start < 70)
    with pytest.raises(ValueError, match="give starts"):
        mla_prefill(q, k, v, n_new, scale=SCALE, backend="reference")


@pytest.mark.parametrize("B,S,R,rows", [(2, 5, 16, 12), (1, 33, 16, 16), (3, 1, 16, 16),
                                        (1, 200, 16, 16)])
def test_merge_kernel_matches_merge_stacked(B, S, R, rows):
    """The one-launch Pallas merge == the plain-JAX merge: split counts that are not powers of
    two and span several 128-split chunks (200), padded rows left out, empty splits, a row with
    no keys."""
    from kernels_pallas.mla.merge import merge_splits_pallas
    rng = np.random.default_rng(S)
    o = jnp.asarray(rng.standard_normal((B, S, R, 512)), jnp.float32)
    lse = rng.standard_normal((B, S, R)).astype(np.float32) * 3
    lse[0, :, 0] = -np.inf                  # row 0 of sequence 0 saw no key in any split
    lse[-1, 0, 1] = -np.inf                 # one empty split
    lse = jnp.asarray(lse)
    o_m, lse_m = merge_splits_pallas(o, lse, rows=rows, out_dtype=jnp.float32, interpret=True)
    ro, rlse = merge_stacked(o[:, :, :rows], lse[:, :, :rows], axis=1, out_dtype=jnp.float32)
    assert o_m.shape == (B, rows, 512) and lse_m.shape == (B, rows)
    _check(o_m, lse_m, ro, rlse, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.uint16])
def test_rocm_default_fits_mi300x_and_lowers(dtype, monkeypatch):
    """On ROCm the defaults are 32-key blocks, 4 warps, 1 stage (the H200's bk64 st3 needs 147 KiB
    of LDS; MI300X has 64 KiB), and that configuration lowers for an AMD target; an fp8 cache in
    the words form (uint16) takes "words_int" there, without PTX."""
    from kernels_pallas.gpu_lowering import lower_for_gpu
    from kernels_pallas.mla import decode
    from kernels_pallas.mla.tuning import decode_config, smem_bytes
    B, ctx, pages = 16, 32768, 8192
    width = 288 if dtype == jnp.uint16 else 576
    c = decode_config((B, 1, 16, 576), (pages, 64, width), dtype, (B, ctx // 64),
                      num_sms=304, platform="rocm")
    assert (c.block_k, c.num_warps, c.num_stages, c.load) == (32, 4, 1, "page")
    assert smem_bytes(c.block_h, c.block_k, c.num_stages,
                      1 if dtype == jnp.uint16 else jnp.dtype(dtype).itemsize) <= 64 * 1024
    sd = jax.ShapeDtypeStruct
    if dtype == jnp.uint16:
        assert c.fp8_upcast == "words_int" and not c.split_qk_acc
        with pytest.raises(ValueError, match="words_int"):    # "words" is NVIDIA PTX
            decode_config((B, 1, 16, 576), (pages, 64, width), dtype, (B, ctx // 64),
                          DecodeConfig(fp8_upcast="words"), num_sms=304, platform="rocm")
        monkeypatch.setattr(decode, "kernel_platform", lambda: "rocm")   # the jnp bits, no PTX
    args = (sd((B, 1, 16, 576), jnp.bfloat16), sd((pages, 64, width), dtype),
            sd((B, ctx // 64), jnp.int32), sd((B,), jnp.int32))
    if dtype == jnp.bfloat16:
        lower_for_gpu(lambda q, ca, p, l: mla_decode(q, ca, p, l, scale=SCALE, backend="pallas",
                                                    config=c), *args, platform="rocm")
    else:
        lower_for_gpu(lambda q, ca, p, l, s: mla_decode(q, ca, p, l, scale=SCALE, cache_scale=s,
                                                       backend="pallas", config=c),
                      *args, sd((pages, 64), jnp.float32), platform="rocm")
