"""The model's layers on the Pallas kernels (interpret mode) equal their reference paths."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np

import kimik3
from kimik3.layers.mla import MLA


def test_mla_decode_layer_on_the_kernel():
    # Real MLA cache width (512 latent + 64 rope) on an otherwise tiny layer.
    cfg = kimik3.Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64)
    B, S, D = 3, 128, cfg.hidden_size
    layer = MLA(cfg)
    x = jax.random.normal(jax.random.key(0), (B, 1, D))
    params = layer.init(jax.random.key(1), x, None, jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.int32))
    cache = {"latent": jax.random.normal(jax.random.key(2), (B, S, 576))}
    start = jnp.array([0, 70, 127], jnp.int32)
    n_new = jnp.array([1, 1, 0], jnp.int32)  # the last row is an idle slot
    ref, ref_cache = layer.apply(params, x, cache, start, n_new, backend="reference")
    out, out_cache = layer.apply(params, x, cache, start, n_new, backend="interpret")
    # the written entries come from the projections, whose K sums the two paths order differently
    # (XLA:CPU's blocking follows the host's caches): close, and every other entry left as it was
    np.testing.assert_allclose(out_cache["latent"], ref_cache["latent"], rtol=1e-5, atol=1e-5)
    written = np.zeros((B, S), bool)
    written[0, 0] = written[1, 70] = True  # row 2 is idle
    for c in (ref_cache, out_cache):
        np.testing.assert_array_equal(np.asarray(c["latent"])[~written], np.asarray(cache["latent"])[~written])
        assert not np.array_equal(np.asarray(c["latent"])[written], np.asarray(cache["latent"])[written])
    err = jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))
    assert err < 1e-4, err


def test_kda_decode_layer_on_the_fused_kernel():
    from kimik3.layers.kda import KDA, kda_cache_shapes

    for name in ("tiny", "tiny-linear"):  # bounded + full-rank gate, softplus + low-rank gate
        cfg = kimik3.Config.preset(name)
        B, D = 3, cfg.hidden_size
        layer = KDA(cfg)
        x = jax.random.normal(jax.random.key(0), (B, 1, D))
        params = layer.init(jax.random.key(1), x, None, jnp.ones(B, jnp.int32))
        shapes = kda_cache_shapes(cfg, B)
        cache = {k: jax.random.normal(jax.random.key(i + 2), s).astype(d) for i, (k, (s, d)) in enumerate(shapes.items())}
        n_new = jnp.array([1, 0, 1], jnp.int32)  # the middle row is an idle slot
        ref, ref_cache = layer.apply(params, x, jax.tree.map(jnp.copy, cache), n_new, backend="reference")
        # the fused kernel updates the state in place (donated): hand it a copy
        out, out_cache = layer.apply(params, x, jax.tree.map(jnp.copy, cache), n_new, backend="interpret")
        for key in ("state", "conv"):
            assert jnp.max(jnp.abs(out_cache[key] - ref_cache[key])) < 1e-5, (name, key)
            np.testing.assert_array_equal(out_cache[key][1], cache[key][1])  # idle row untouched
        active = np.array([0, 2])
        assert jnp.max(jnp.abs(out[active] - ref[active])) / jnp.max(jnp.abs(ref[active])) < 1e-5, name


def test_kda_prefill_layer_on_the_chunk_kernel():
    """A prompt longer than RECURRENT_MAX_T takes the chunk kernel: with K3's bounded gate the
    layer passes safe_gate (the matmul diagonal blocks), with the softplus gate it does not; both
    equal the reference path, ragged rows included."""
    from kimik3.layers.kda import KDA, RECURRENT_MAX_T, kda_cache_shapes

    for name in ("tiny", "tiny-linear"):
        cfg = kimik3.Config.preset(name)
        B, T, D = 2, 70, cfg.hidden_size
        assert T > RECURRENT_MAX_T
        layer = KDA(cfg)
        x = jax.random.normal(jax.random.key(0), (B, T, D))
        n_new = jnp.array([T, 33], jnp.int32)
        params = layer.init(jax.random.key(1), x, None, n_new)
        shapes = kda_cache_shapes(cfg, B)
        cache = {k: jax.random.normal(jax.random.key(i + 2), s).astype(d) for i, (k, (s, d)) in enumerate(shapes.items())}
        ref, ref_cache = layer.apply(params, x, jax.tree.map(jnp.copy, cache), n_new, backend="reference")
        out, out_cache = layer.apply(params, x, jax.tree.map(jnp.copy, cache), n_new, backend="interpret")
        for key in ("state", "conv"):
            assert jnp.max(jnp.abs(out_cache[key] - ref_cache[key])) < 1e-4, (name, key)
        err = [jnp.max(jnp.abs(out[b, :n] - ref[b, :n])) / jnp.max(jnp.abs(ref[b, :n]))
               for b, n in enumerate(n_new.tolist())]
        assert max(err) < 1e-4, (name, err)


def test_moe_layer_on_the_grouped_matmul_kernel():
    from kimik3.layers.moe import MoE

    for name in ("tiny", "tiny-linear"):  # MXFP4 latent experts + SiTU; dense experts + SwiGLU
        cfg = kimik3.Config.preset(name)
        layer = MoE(cfg)
        x = jax.random.normal(jax.random.key(0), (2, 9, cfg.hidden_size))
        params = layer.init(jax.random.key(1), x)
        ref = layer.apply(params, x, backend="reference")
        out = layer.apply(params, x, backend="interpret")
        assert jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)) < 1e-5, name


def test_decode_moe_takes_its_pairs_unsorted(monkeypatch):
    """A decode step's few (token, expert) pairs go to the kernels in pair order (no sort): the
    layer's output is bitwise that of the sorted path on the same kernels (each pair's tile is
    the same), experts repeated across tokens included, and close to the reference."""
    import kimik3.layers.moe as moe_mod

    cfg = kimik3.Config.preset("tiny")  # MXFP4 latent experts, SiTU; 8 experts, k 2
    layer = moe_mod.MoE(cfg)
    x = jax.random.normal(jax.random.key(4), (5, 1, cfg.hidden_size))  # 10 pairs: a repeat
    params = layer.init(jax.random.key(5), x)
    monkeypatch.setattr(moe_mod, "expert_order", lambda *a: 1 / 0)
    pairs = layer.apply(params, x, backend="interpret")
    monkeypatch.undo()
    monkeypatch.setattr(moe_mod, "PAIR_ORDER_PAIRS", 0)
    sorted_path = layer.apply(params, x, backend="interpret")
    np.testing.assert_array_equal(np.asarray(pairs), np.asarray(sorted_path))
    ref = layer.apply(params, x, backend="reference")
    assert jnp.max(jnp.abs(pairs - ref)) / jnp.max(jnp.abs(ref)) < 1e-5


def test_unsorted_pairs_of_a_ranks_experts():
    """Expert parallelism's slice of the experts (ids first .. first + E_local - 1): on the
    unsorted pair path the pairs of experts held elsewhere are zero rows, and the rank's partial
    sum equals the reference's (and the two ranks' sum the whole)."""
    from kimik3.layers.moe import MoE, experts_combine, route

    cfg = kimik3.Config.preset("tiny")
    layer = MoE(cfg)
    x = jax.random.normal(jax.random.key(6), (4, 1, cfg.hidden_size))
    p = nn.unbox(layer.init(jax.random.key(7), x))["params"]
    u = jax.random.normal(jax.random.key(8), (4, cfg.routed_expert_hidden_size))
    idx, w = route(x[:, 0] @ p["gate"], p["e_score_correction_bias"], cfg, "reference")
    half = cfg.num_experts // 2
    parts = []
    for first in (0, half):
        mine = jax.tree.map(lambda a: a[first:first + half], p["experts"])
        got = experts_combine(cfg, mine, u, idx, w, "interpret", first)
        want = experts_combine(cfg, mine, u, idx, w, "reference", first)
        assert jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)) < 1e-5
        parts.append(got)
    whole = experts_combine(cfg, p["experts"], u, idx, w, "interpret")
    assert jnp.max(jnp.abs(parts[0] + parts[1] - whole)) / jnp.max(jnp.abs(whole)) < 1e-5


def test_bf16_router_rides_the_input_projections_launch(monkeypatch):
    """K3's bf16 gate with bf16 tokens: at decode widths the router's logits come out of the
    skinny-matmul launch of the layer's other input projections, in fp32 (not `router_logits`'s
    own dot), and the layer equals its reference path."""
    import kimik3.layers.moe as moe_mod

    cfg = kimik3.Config.preset("tiny").replace(dtype="bfloat16", router_dtype="bfloat16")
    layer = moe_mod.MoE(cfg)
    x = jax.random.normal(jax.random.key(2), (3, 1, cfg.hidden_size), jnp.bfloat16)
    params = layer.init(jax.random.key(3), x)
    ref = layer.apply(params, x, backend="reference")
    calls = []
    monkeypatch.setattr(moe_mod, "router_logits", lambda *a: calls.append(a) or 1 / 0)
    out = layer.apply(params, x, backend="interpret")
    assert not calls and out.dtype == ref.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))


def test_long_forward_uses_chunked_prefill_attention(monkeypatch):
    import kimik3.layers.mla as mla_mod
    from kimik3.layers.mla import MLA

    cfg = kimik3.Config.preset("tiny")
    layer = MLA(cfg)
    x = jax.random.normal(jax.random.key(0), (2, 40, cfg.hidden_size))
    n = jnp.full((2,), 40, jnp.int32)
    params = layer.init(jax.random.key(1), x, None, n * 0, n)
    dense = layer.apply(params, x, None, n * 0, n)[0]
    monkeypatch.setattr(mla_mod, "LONG_PREFILL", 16)  # force the no-T x T path at a small T
    chunked = layer.apply(params, x, None, n * 0, n)[0]
    assert jnp.max(jnp.abs(chunked - dense)) / jnp.max(jnp.abs(dense)) < 1e-5


def test_chunked_prefill_over_the_paged_history_on_the_flash_kernel(monkeypatch):
    """An MLA layer at the flash kernel's head dimensions (192 / 128) prefilling a prompt in two
    chunks over a paged cache: on the kernels (interpret) the chunks attend their history
    through `history_flash` (not the plain-JAX `history_attention`) and equal the reference."""
    import kimik3.layers.mla as mla_mod

    cfg = kimik3.Config.preset("tiny").replace(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    B, T, P, D = 2, 12, 4, cfg.hidden_size
    layer = MLA(cfg)
    x = jax.random.normal(jax.random.key(0), (B, 2 * T, D))
    table = jnp.asarray([[5, 0, 3, 7, 1, 9], [2, 8, 4, 6, 10, 11]], jnp.int32)
    zero = jnp.zeros(B, jnp.int32)
    params = layer.init(jax.random.key(1), x[:, :T], None, zero, zero + T)
    n_new = [jnp.asarray([T, T], jnp.int32), jnp.asarray([T, 5], jnp.int32)]  # row 1's 2nd chunk is ragged
    outs = {}
    for backend in ("reference", "interpret"):
        if backend == "interpret":
            monkeypatch.setattr(mla_mod, "history_attention", lambda *a, **k: 1 / 0)
        cache = {"latent": jnp.zeros((12, P, cfg.mla_cache_dim), jnp.float32)}
        outs[backend] = []
        for c in range(2):
            o, cache = layer.apply(params, x[:, c * T:(c + 1) * T], cache, zero + c * T, n_new[c],
                                   backend=backend, page_table=table)
            outs[backend].append(np.asarray(o))
    for c in range(2):
        valid = np.arange(T)[None, :] < np.asarray(n_new[c])[:, None]
        ref, out = outs["reference"][c][valid], outs["interpret"][c][valid]
        assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 1e-4


def test_write_layer_on_the_fused_attnres_norm_kernel():
    """A bf16 K3-like decoder layer that freezes a block, on the fused AttnRes mix + RMSNorm
    kernel (and the other kernels) vs the reference path: the frozen block (the residual stream
    after the pending MLP add) is bit-identical, the layer's outputs agree to bf16 rounding."""
    from kimik3.model import DecoderLayer

    cfg = kimik3.Config.preset("tiny").replace(dtype="bfloat16", param_dtype="bfloat16")
    i = cfg.attn_res_block_size  # the first write layer past the embedding's
    B, T, D = 2, 5, cfg.hidden_size
    rows = [jax.random.normal(jax.random.key(k), (B, T, D)).astype(jnp.bfloat16) for k in range(3)]
    bank, p, pending = rows[:1], rows[1], rows[2]
    n = jnp.full((B,), T, jnp.int32)
    layer = DecoderLayer(cfg, i)
    params = layer.init(jax.random.key(7), bank, p, pending, None, n * 0, n, "reference")
    ref = layer.apply(params, bank, p, pending, None, n * 0, n, "reference")
    out = layer.apply(params, bank, p, pending, None, n * 0, n, "interpret")
    assert len(out[0]) == len(ref[0]) == 2
    np.testing.assert_array_equal(np.asarray(out[0][1]).view(np.uint16),
                                  np.asarray(ref[0][1]).view(np.uint16))
    for a, b in zip(out[1:3], ref[1:3]):  # the new partial (the attention output) and the MLP's
        assert jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)) < 2e-2


def test_engine_greedy_tokens_on_the_pallas_kernels(tiny_greedy):
    """The engine on every Pallas kernel (interpret mode), the fused AttnRes norm in prefill and
    decode included, gives the reference path's greedy tokens."""
    from serve import Engine

    eng = Engine(tiny_greedy.model, max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16,
                 decode_steps=3, backend="interpret")
    assert eng.generate(tiny_greedy.prompts, max_new_tokens=8, stop_tokens=[]) == tiny_greedy.tokens
