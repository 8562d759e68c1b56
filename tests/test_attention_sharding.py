"""Attention layers under tensor parallelism run per rank's heads in shard_map: KDA
(sharding/kda.py: the recurrent state stays split over `tensor`) and the MLA kernels; the results
are the one-device ones, with the plain-JAX paths and with the Pallas kernels (interpret mode)
inside the shard_map."""
import jax.numpy as jnp
import numpy as np
import pytest

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
