"""Attention layers under tensor parallelism run per rank's heads in shard_map: KDA
(sharding/kda.py: the recurrent state stays split over `tensor`) and the MLA kernels; the results
are the one-device ones, with the plain-JAX paths and with the Pallas kernels (interpret mode)
inside the shard_map."""
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
import sharding


def one_layer_model(kind, **kw):
    """The tiny model cut to one `kind` layer with a dense MLP: in interpret mode every kernel of
    a whole model runs through the interpreter, so a test of one kernel family keeps only it."""
    cfg = kimik3.Config.preset("tiny").replace(num_layers=1, layer_types=(kind,),
                                               mlp_layer_types=("dense",), **kw)
    return kimik3.init(cfg, seed=0)


def test_kda_heads_split_over_tensor(tiny_greedy):
    model, prompts = tiny_greedy.model, tiny_greedy.prompts
    cfg = model.cfg
    mesh = sharding.make_mesh(tensor=2)  # tiny has 2 KDA heads: one per rank
    placed = sharding.place_model(model, mesh)
    last, cache = kimik3.prefill(placed, prompts, 64, mesh=mesh)
    assert jnp.max(jnp.abs(last - tiny_greedy.last)) / jnp.max(jnp.abs(tiny_greedy.last)) < 1e-5
    kda = cache.layers[cfg.layer_types.index("kda")]
    assert kda["state"].addressable_shards[0].data.shape[1] == cfg.kda_num_heads // 2
    conv = kda["conv"]
    assert conv.addressable_shards[0].data.shape[-1] == conv.shape[-1] // 2
    got = kimik3.generate(placed, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64, mesh=mesh)
    assert got == tiny_greedy.tokens


def test_pallas_kda_kernels_inside_the_shard_map():
    """backend="interpret": the chunk kernel (prefill > 8 tokens) and the fused decode kernel run
    on one rank's heads; greedy tokens and logits equal one device's plain-JAX run (the kernels
    themselves are checked against it in tests/kernels/kda; interpreting them twice doubles the
    cost)."""
    model = one_layer_model("kda")
    prompts = [list(range(3, 23)), [7, 8, 9]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="reference")
    want_last, _ = kimik3.prefill(model, prompts, 32, backend="reference")
    mesh = sharding.make_mesh(tensor=2)
    placed = sharding.place_model(model, mesh)
    last, _ = kimik3.prefill(placed, prompts, 32, mesh=mesh, backend="interpret")
    assert np.max(np.abs(np.asarray(last - want_last))) / np.max(np.abs(np.asarray(want_last))) < 1e-4
    got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                          backend="interpret")
    assert got == want


def test_mla_kernels_per_rank_heads():
    """The MLA decode kernel (real 576-wide cache) under TP2 without DCP runs per rank's heads in
    shard_map (kimik3/layers/mla.py per_head_shards); greedy tokens equal one device's plain-JAX
    run."""
    model = one_layer_model("mla", kv_lora_rank=512, qk_rope_head_dim=64)
    prompts = [list(range(3, 13)), [7, 8, 9]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="reference")
    mesh = sharding.make_mesh(tensor=2)
    placed = sharding.place_model(model, mesh)
    got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                          backend="interpret")
    assert got == want


def test_mla_kernel_under_dcp(monkeypatch):
    """Under DCP the MLA decode kernel runs on each rank's slice of the positions and the slices'
    (o, lse) merge exactly: greedy tokens equal one device's plain-JAX run, for TP2 x DCP4 and DCP over the
    tensor axis itself, with a prompt shorter than the number of DCP shards."""
    import kimik3.layers.mla as mla_layer

    slices, real = [], mla_layer.mla_decode
    monkeypatch.setattr(mla_layer, "mla_decode", lambda q, cache, *a, **k: slices.append(cache.shape) or real(
        q, cache, *a, **k))
    model = one_layer_model("mla", kv_lora_rank=512, qk_rope_head_dim=64)
    prompts = [list(range(3, 13)), [7, 8]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="reference")
    for axes, dcp_axes in ((dict(tensor=2, dcp=4), ("dcp",)), (dict(tensor=4), ("tensor",))):
        mesh = sharding.make_mesh(**axes)
        placed = sharding.place_model(model, mesh)
        got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                              dcp_axes=dcp_axes, backend="interpret")
        assert got == want, (axes, dcp_axes)
        assert (2, 8, 576) in slices, "the kernel ran on each rank's 8 of the 32 positions"
        slices.clear()


@pytest.mark.parametrize("paged", [False, True])
def test_dcp_attention_equals_one_device(paged):
    """dcp_attention, kernel path and plain-JAX path, against one device's attention
    (mla_decode_reference on the whole cache), fp32 random inputs. Contiguous [B, 64, C]: lengths
    that leave whole shards empty (3 of 64 positions over 4 shards), end mid-shard, fill the cache,
    and an idle row. Paged (each rank holds a quarter of every 16-position page): shuffled pages, a
    row ending mid-page, one on a page boundary, one shorter than a page."""
    import jax

    from kernels_pallas.mla.reference import mla_decode_reference
    from kimik3.layers.mla import dcp_attention

    B, H, R = (3, 16, 512) if paged else (4, 16, 512)
    ks = jax.random.split(jax.random.key(3 if paged else 7), 4)
    q_lat = jax.random.normal(ks[0], (B, 1, H, R), jnp.float32)
    q_rope = jax.random.normal(ks[1], (B, 1, H, 64), jnp.float32)
    if paged:
        cache = jax.random.normal(ks[2], (B * 4 + 2, 16, 576), jnp.float32)
        table = jax.random.permutation(ks[3], B * 4 + 2)[:B * 4].reshape(B, 4).astype(jnp.int32)
        start, n_new = jnp.array([40, 31, 5], jnp.int32), jnp.ones((B,), jnp.int32)
    else:
        cache = jax.random.normal(ks[2], (B, 64, 576), jnp.float32)
        table = jnp.arange(B, dtype=jnp.int32)[:, None]
        start, n_new = jnp.array([2, 37, 63, 20], jnp.int32), jnp.array([1, 1, 1, 0], jnp.int32)
    want, _ = mla_decode_reference(jnp.concatenate([q_lat, q_rope], -1), cache, table, start + n_new,
                                   scale=0.05)
    with jax.set_mesh(sharding.make_mesh(tensor=2, dcp=4)):
        for backend in ("reference", "interpret"):
            got = dcp_attention(q_lat, q_rope, cache, start, n_new, 0.05, ("dcp",), backend=backend,
                                page_table=table if paged else None)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5, err_msg=backend)


def _causal_oracle(q_lat, q_rope, keys, start, n_new, scale):
    """Absorbed attention over the whole history at once, fp32: query t of row b sees
    positions s <= start + t and s < start + n_new."""
    R = q_lat.shape[-1]
    s = (jnp.einsum("bthc,bsc->bhts", q_lat, keys[..., :R])
         + jnp.einsum("bthr,bsr->bhts", q_rope, keys[..., R:])) * scale
    pos = jnp.arange(keys.shape[1])
    qpos = start[:, None] + jnp.arange(q_lat.shape[1])[None, :]
    ok = (pos[None, None, :] <= qpos[..., None]) & (pos[None, None, :] < (start + n_new)[:, None, None])
    p = _masked_softmax(s, ok[:, None])
    return jnp.einsum("bhts,bsc->bthc", p, keys[..., :R])


def _masked_softmax(s, ok):
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(den > 0, den, 1.0)


@pytest.mark.parametrize("paged,fp8", [(False, False), (True, False), (True, True)])
def test_dcp_prefill_walks_the_history_in_chunks(monkeypatch, paged, fp8):
    """T > 1 under DCP (a prefill chunk or a verify): each rank walks its slice of the history a
    few positions at a time (HISTORY_CHUNK made small here, so 3-8 chunks a rank) and the ranks
    merge exactly; equal to attention over the whole history at once. Ragged: a fresh prompt,
    one across pages, a history with nothing new, one filling the cache, an empty row."""
    import jax

    import kimik3.layers.mla as mla
    from kernels_pallas.mla.reference import dequant_cache, quantize_words

    monkeypatch.setattr(mla, "HISTORY_CHUNK", 4)
    B, T, H, R, DR, n = 5, 6, 3, 32, 8, 4
    ks = jax.random.split(jax.random.key(11 + paged + 2 * fp8), 4)
    q_lat = jax.random.normal(ks[0], (B, T, H, R), jnp.float32)
    q_rope = jax.random.normal(ks[1], (B, T, H, DR), jnp.float32)
    start = jnp.array([0, 13, 20, 58, 0], jnp.int32)
    n_new = jnp.array([T, T, 0, T, 0], jnp.int32)
    if paged:   # 16-position pages, each rank holding 4 of every page; pages shuffled
        values = jax.random.normal(ks[2], (B * 4 + 3, 16, R + DR), jnp.float32)
        table = jax.random.permutation(ks[3], B * 4 + 3)[:B * 4].reshape(B, 4).astype(jnp.int32)
        keys = lambda c: c[table].reshape(B, 64, R + DR)
    else:       # contiguous [B, 64, C]: rank r holds positions 16 r .. 16 r + 15
        values = jax.random.normal(ks[2], (B, 64, R + DR), jnp.float32)
        table, keys = None, lambda c: c
    cache = quantize_words(values, 0.05) if fp8 else values
    plain = dequant_cache(cache, 0.05).astype(jnp.float32) if fp8 else cache
    want = _causal_oracle(q_lat, q_rope, keys(plain), start, n_new, 0.07)
    with jax.set_mesh(sharding.make_mesh(tensor=2, dcp=n)):
        got = jax.jit(lambda *a: mla.dcp_attention(*a, 0.07, ("dcp",), backend="reference",
                                                   page_table=table, cache_scale=0.05 if fp8 else None)
                      )(q_lat, q_rope, cache, start, n_new)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)
    assert np.all(np.asarray(got)[4] == 0), "a row with no key attends nothing"


def test_dcp_prefill_memory_does_not_grow_with_the_history():
    """The compiled DCP prefill's scratch (XLA's memory analysis, per device) is the same for a
    4x longer history: each rank walks its slice in chunks. Attending the whole slice at once,
    as before 2026-12-03, held [B, H, T, S / n] scores (B8 T1024 H12 DCP8: 3.75 GiB a device at
    32K positions, 15.25 GiB at 128K; chunked: 1.33 GiB at both)."""
    import jax

    from kimik3.layers.mla import dcp_attention

    B, T, H, P = 2, 256, 4, 16

    def scratch(S):
        sd = jax.ShapeDtypeStruct
        args = (sd((B, T, H, 512), jnp.bfloat16), sd((B, T, H, 64), jnp.bfloat16),
                sd((B * S // P, P, 576), jnp.bfloat16), sd((B, S // P), jnp.int32),
                sd((B,), jnp.int32), sd((B,), jnp.int32))
        f = jax.jit(lambda q, r, c, t, s, n: dcp_attention(q, r, c, s, n, 0.07, ("dcp",),
                                                           backend="reference", page_table=t))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    with jax.set_mesh(sharding.make_mesh(dcp=8)):
        short, long = scratch(8192), scratch(32768)
    assert long <= 1.1 * short, (short, long)
