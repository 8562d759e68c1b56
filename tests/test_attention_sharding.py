"""Attention layers under tensor parallelism run per rank's heads in shard_map: KDA
(sharding/kda.py: the recurrent state stays split over `tensor`) and the MLA kernels; the results
are the one-device ones, with the plain-JAX paths and with the Pallas kernels (interpret mode)
inside the shard_map."""
import jax.numpy as jnp
import numpy as np

import kimik3
import sharding


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


def test_pallas_kda_kernels_inside_the_shard_map(tiny_models):
    """backend="interpret": the chunk kernel (prefill > 8 tokens) and the fused decode kernel run
    on one rank's heads; greedy tokens and logits equal the one-device run of the same kernels."""
    model = tiny_models["tiny"]
    prompts = [list(range(3, 23)), [7, 8, 9]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="interpret")
    want_last, _ = kimik3.prefill(model, prompts, 32, backend="interpret")
    mesh = sharding.make_mesh(tensor=2)
    placed = sharding.place_model(model, mesh)
    last, _ = kimik3.prefill(placed, prompts, 32, mesh=mesh, backend="interpret")
    assert np.max(np.abs(np.asarray(last - want_last))) / np.max(np.abs(np.asarray(want_last))) < 1e-5
    got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                          backend="interpret")
    assert got == want


def test_mla_kernels_per_rank_heads():
    """The MLA decode kernel (real 576-wide cache) under TP2 without DCP runs per rank's heads in
    shard_map (kimik3/layers/mla.py per_head_shards); greedy tokens equal one device's."""
    cfg = kimik3.Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64)
    model = kimik3.init(cfg, seed=0)
    prompts = [list(range(3, 13)), [7, 8, 9]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="interpret")
    mesh = sharding.make_mesh(tensor=2)
    placed = sharding.place_model(model, mesh)
    got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                          backend="interpret")
    assert got == want


def test_mla_kernel_under_dcp(monkeypatch):
    """Under DCP the MLA decode kernel runs on each rank's slice of the positions and the slices'
    (o, lse) merge exactly: greedy tokens equal one device's, for TP2 x DCP4 and DCP over the
    tensor axis itself, with a prompt shorter than the number of DCP shards."""
    import kimik3.layers.mla as mla_layer

    slices, real = [], mla_layer.mla_decode
    monkeypatch.setattr(mla_layer, "mla_decode", lambda q, cache, *a, **k: slices.append(cache.shape) or real(
        q, cache, *a, **k))
    cfg = kimik3.Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64)
    model = kimik3.init(cfg, seed=0)
    prompts = [list(range(3, 13)), [7, 8]]
    want = kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32,
                           backend="interpret")
    for axes, dcp_axes in ((dict(tensor=2, dcp=4), ("dcp",)), (dict(tensor=4), ("tensor",))):
        mesh = sharding.make_mesh(**axes)
        placed = sharding.place_model(model, mesh)
        got = kimik3.generate(placed, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32, mesh=mesh,
                              dcp_axes=dcp_axes, backend="interpret")
        assert got == want, (axes, dcp_axes)
        assert (2, 8, 576) in slices, "the kernel ran on each rank's 8 of the 32 positions"
        slices.clear()


def test_dcp_attention_kernel_equals_plain_jax():
    """The kernel path of dcp_attention (each rank's slice through the Pallas kernel, (o, lse)
    merged) against its plain-JAX path, fp32 random inputs: lengths that leave whole shards empty
    (3 of 64 positions over 4 shards), end mid-shard, fill the cache, and an idle row (n_new 0)."""
    import jax

    from kimik3.layers.mla import dcp_attention

    B, H, S, R = 4, 16, 64, 512
    ks = jax.random.split(jax.random.key(7), 3)
    q_lat = jax.random.normal(ks[0], (B, 1, H, R), jnp.float32)
    q_rope = jax.random.normal(ks[1], (B, 1, H, 64), jnp.float32)
    cache = jax.random.normal(ks[2], (B, S, 576), jnp.float32)
    start = jnp.array([2, 37, 63, 20], jnp.int32)
    n_new = jnp.array([1, 1, 1, 0], jnp.int32)
    mesh = sharding.make_mesh(tensor=2, dcp=4)
    with jax.set_mesh(mesh):
        args = (q_lat, q_rope, cache, start, n_new, 0.05, ("dcp",))
        want = dcp_attention(*args, backend="reference")
        got = dcp_attention(*args, backend="interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


def test_dcp_attention_on_pages():
    """DCP over a page pool (each rank holds a quarter of every page's positions): the kernel path
    and the plain-JAX path both equal one device's paged attention (mla_decode_reference on the
    whole pool), with shuffled pages, a row ending mid-page, one ending on a page boundary and a
    row shorter than a page."""
    import jax

    from kernels_pallas.mla.reference import mla_decode_reference
    from kimik3.layers.mla import dcp_attention

    B, H, R, Pg, npg = 3, 16, 512, 16, 4
    ks = jax.random.split(jax.random.key(3), 4)
    q_lat = jax.random.normal(ks[0], (B, 1, H, R), jnp.float32)
    q_rope = jax.random.normal(ks[1], (B, 1, H, 64), jnp.float32)
    pool = jax.random.normal(ks[2], (B * npg + 2, Pg, 576), jnp.float32)
    table = jax.random.permutation(ks[3], B * npg + 2)[:B * npg].reshape(B, npg).astype(jnp.int32)
    start = jnp.array([40, 31, 5], jnp.int32)
    n_new = jnp.ones((B,), jnp.int32)  # lengths 41, 32 (a page boundary), 6
    q = jnp.concatenate([q_lat, q_rope], -1)
    want, _ = mla_decode_reference(q, pool, table, start + n_new, scale=0.05)
    mesh = sharding.make_mesh(tensor=2, dcp=4)
    with jax.set_mesh(mesh):
        for backend in ("reference", "interpret"):
            got = dcp_attention(q_lat, q_rope, pool, start, n_new, 0.05, ("dcp",), backend=backend,
                                page_table=table)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5, err_msg=backend)
