"""The whole model: cache paths agree with forward, batching is invisible, inputs are checked."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
import kimik3.generation as gen_mod
import kimik3.runtime as rt
from kimik3.layers.common import RMSNorm
from kimik3.layers.kda import KDA
from kimik3.layers.mla import MLA
from kimik3.layers.moe import MLP, MoE, route

VARIANTS = ("tiny", "tiny-linear")


def _tokens(B, T, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (B, T)).astype(np.int32)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_chunked_prefill_and_decode_reproduce_forward(tiny_models, name):
    model = tiny_models[name]
    T = 60
    toks = _tokens(2, T, seed=1)
    full = kimik3.forward(model, toks)
    cache = kimik3.init_cache(model.cfg, 2, 64)
    # chunked prefill (a 24-token chunk then a 16-token chunk; row 1 shorter), then decode
    lg1, cache = kimik3.extend(model, cache, toks[:, :24], [24, 17])
    lg2, cache = kimik3.extend(model, cache, np.stack([toks[0, 24:40], toks[1, 17:33]]), [16, 16])
    assert _rel(lg1[0], full[0, :24]) < 1e-5 and _rel(lg1[1, :17], full[1, :17]) < 1e-5
    assert _rel(lg2[0], full[0, 24:40]) < 1e-5 and _rel(lg2[1], full[1, 17:33]) < 1e-5
    pos = [40, 33]
    for _ in range(20):
        lg, cache = kimik3.decode_step(model, cache, [toks[0, pos[0]], toks[1, pos[1]]])
        for b in range(2):
            assert _rel(lg[b], full[b, pos[b]]) < 1e-5, (b, pos[b])
        pos = [p + 1 for p in pos]
    np.testing.assert_array_equal(np.asarray(cache.lengths), pos)


@pytest.mark.parametrize("name", VARIANTS)
def test_padded_batch_equals_each_sequence_alone(tiny_models, name):
    model = tiny_models[name]
    prompts = [list(_tokens(1, n, seed=n)[0]) for n in (30, 9, 1)]
    together = kimik3.generate(model, prompts, max_new_tokens=6, stop_tokens=[])
    last_b, _ = kimik3.prefill(model, prompts, 64)
    for i, p in enumerate(prompts):
        assert kimik3.generate(model, [p], max_new_tokens=6, stop_tokens=[]) == [together[i]]
        last_1, _ = kimik3.prefill(model, [p], 64)
        assert _rel(last_b[i], last_1[0]) < 1e-5


def test_correction_bias_selects_but_does_not_weight():
    cfg = kimik3.Config.preset("tiny-linear")
    logits = jax.random.normal(jax.random.key(0), (16, cfg.num_experts))
    idx0, w0 = route(logits, jnp.zeros(cfg.num_experts), cfg)
    bias = jnp.zeros(cfg.num_experts).at[5].set(10.0)
    idx1, w1 = route(logits, bias, cfg)
    assert (idx1 == 5).any(-1).all() and not (idx0 == 5).any(-1).all()  # selection changed
    s = jax.nn.sigmoid(logits)
    expect = jnp.take_along_axis(s, idx1, -1)
    expect = expect / expect.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    assert jnp.max(jnp.abs(w1 - expect)) < 1e-6  # weights from the unbiased scores
    same = (idx0 == idx1).all(-1)
    assert same.any() and jnp.max(jnp.abs(jnp.where(same[:, None], w1 - w0, 0))) < 1e-6


def test_router_on_tensor_cores_picks_the_fp32_routers_experts():
    """K3's router shape: with an fp32 gate, from ROUTER_SPLIT_ROWS bf16 rows the logits come from
    the gate's three bf16 pieces; with a bf16 gate from one bf16 matmul; both match the fp32
    matmul to its own rounding and choose the same experts."""
    from kimik3.layers.moe import ROUTER_SPLIT_ROWS, router_fp32, router_logits, split_bf16

    cfg = kimik3.Config.preset("kimi-k3")
    kx, kg = jax.random.split(jax.random.key(1))
    gate = 0.02 * jax.random.normal(kg, (cfg.hidden_size, cfg.num_experts), jnp.float32)
    assert bool(jnp.array_equal(sum(p.astype(jnp.float32) for p in split_bf16(gate)), gate))  # exact pieces
    x = jax.random.normal(kx, (2048, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    want = jnp.dot(x.astype(jnp.float32), gate, precision=jax.lax.Precision.HIGHEST)  # written out
    got = jax.jit(router_logits)(x, gate)
    assert jnp.max(jnp.abs(got - want)) < 1e-5 * jnp.max(jnp.abs(want))
    few = x[:ROUTER_SPLIT_ROWS - 1]  # fewer rows: the fp32 matmul itself
    assert bool(jnp.array_equal(jax.jit(router_logits)(few, gate), jax.jit(router_fp32)(few, gate)))
    bias = jnp.zeros(cfg.num_experts)
    assert bool(jnp.array_equal(route(got, bias, cfg)[0], route(want, bias, cfg)[0]))
    # a bf16 gate (K3's storage): one bf16 matmul with fp32 accumulation at every row count
    gate16 = gate.astype(jnp.bfloat16)
    want16 = jnp.dot(x.astype(jnp.float32), gate16.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    for rows in (x[:3], x):
        got16 = jax.jit(router_logits)(rows, gate16)
        assert got16.dtype == jnp.float32
        assert jnp.max(jnp.abs(got16 - want16[:len(rows)])) < 1e-5 * jnp.max(jnp.abs(want16))
    assert bool(jnp.array_equal(route(got16, bias, cfg)[0], route(want16, bias, cfg)[0]))


def _plain_residual_logits(model, toks):
    """An independent composition of the layer modules with ordinary residuals."""
    cfg, P = model.cfg, model.params
    x = nn.Embed(cfg.vocab_size, cfg.hidden_size).apply({"params": P["embed_tokens"]}, toks)
    n = jnp.full((toks.shape[0],), toks.shape[1], jnp.int32)
    norm = lambda p, h: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps).apply({"params": p}, h)
    for i, kind in enumerate(cfg.layer_types):
        lp = P[f"layers_{i}"]
        h = norm(lp["input_layernorm"], x)
        if kind == "kda":
            a, _ = KDA(cfg).apply({"params": lp["self_attn"]}, h, None, n)
        else:
            a, _ = MLA(cfg).apply({"params": lp["self_attn"]}, h, None, n * 0, n)
        x = x + a
        h = norm(lp["post_attention_layernorm"], x)
        if cfg.is_moe_layer(i):
            x = x + MoE(cfg).apply({"params": lp["block_sparse_moe"]}, h)
        else:
            x = x + MLP(cfg, cfg.intermediate_size).apply({"params": lp["mlp"]}, h)
    return norm(P["norm"], x) @ P["lm_head"]["kernel"]


def test_attnres_block_size_zero_is_the_plain_residual_model(tiny_models):
    k3like = tiny_models["tiny"]
    plain_cfg = k3like.cfg.replace(attn_res_block_size=0)
    drop = ("self_attention_res", "mlp_res")
    params = {k: ({kk: vv for kk, vv in v.items() if kk not in drop} if k.startswith("layers_") else v)
              for k, v in k3like.params.items() if k != "output_attn_res"}
    plain = kimik3.Model(params=params, cfg=plain_cfg)
    assert jax.tree.structure(params) == jax.tree.structure(kimik3.abstract(plain_cfg))
    toks = _tokens(2, 12, seed=3)
    ref = _plain_residual_logits(plain, jnp.asarray(toks))
    assert _rel(kimik3.forward(plain, toks), ref) < 1e-5
    assert _rel(kimik3.forward(k3like, toks), ref) > 1e-3  # AttnRes really mixes when on


def test_decode_compiles_once_across_20_steps(tiny_models):
    model = tiny_models["tiny"]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    # warm: the prefill bucket and the decode step of a 32-position cache
    kimik3.generate(model, prompts, max_new_tokens=3, stop_tokens=[], max_seq_len=32)
    before = gen_mod._decode_and_sample._cache_size()
    out = kimik3.generate(model, [[9, 9], [1, 2, 3, 4]], max_new_tokens=21, stop_tokens=[], max_seq_len=32)
    assert all(len(o) == 21 for o in out)
    assert gen_mod._decode_and_sample._cache_size() == before  # 20 steps, no new compilation
    extend_before = rt._extend._cache_size()
    last, cache = kimik3.prefill(model, prompts, 32)
    for _ in range(20):
        last, cache = kimik3.decode_step(model, cache, np.asarray(jnp.argmax(last, -1)))
    assert rt._extend._cache_size() - extend_before <= 2  # one prefill bucket + one decode shape


def test_sampling_is_seeded_and_greedy_is_deterministic(tiny_models):
    model = tiny_models["tiny-linear"]
    prompts = ["hello", "kimi"]
    kw = dict(max_new_tokens=8, stop_tokens=[])
    a = kimik3.generate(model, prompts, temperature=1.0, top_k=40, top_p=0.9, seed=7, **kw)
    b = kimik3.generate(model, prompts, temperature=1.0, top_k=40, top_p=0.9, seed=7, **kw)
    c = kimik3.generate(model, prompts, temperature=1.0, top_k=40, top_p=0.9, seed=8, **kw)
    assert a == b and a != c
    assert kimik3.generate(model, prompts, **kw) == kimik3.generate(model, prompts, **kw)


def test_greedy_batches_skip_the_sort_without_a_device_branch():
    """An all-greedy batch (temperature None, as step_sampling passes it, or a Python number
    <= 0) is the argmax alone: no sort and no lax.cond; a batch mixing greedy and sampled rows
    sorts, its greedy rows still the argmax."""
    from kimik3.sampling import step_sampling

    logits = jax.random.normal(jax.random.key(1), (3, 50))
    keys = jax.random.split(jax.random.key(2), 3)
    for greedy in (None, 0.0):
        text = str(jax.make_jaxpr(lambda l, k: kimik3.sample(l, k, greedy))(logits, keys))
        assert "sort" not in text and "cond" not in text
        np.testing.assert_array_equal(kimik3.sample(logits, keys, greedy), jnp.argmax(logits, -1))
    mixed_t = jnp.array([0.0, 1.0, 0.0])
    assert "sort" in str(jax.make_jaxpr(kimik3.sample)(logits, keys, mixed_t, 0, 1.0))
    mixed = kimik3.sample(logits, keys, mixed_t)
    np.testing.assert_array_equal(mixed[::2], jnp.argmax(logits, -1)[::2])
    assert step_sampling(np.zeros(3, np.float32), np.zeros(3), np.ones(3)) == (None, None, None)
    t = np.array([0.0, 0.7], np.float32)
    assert step_sampling(t, 5, 0.9)[0] is t and step_sampling(0.0, 0, 1.0) == (None, None, None)


def test_sample_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(0), 2000)
    top1 = kimik3.sample(logits, keys, temperature=1.0, top_k=1)
    assert (top1 == 0).all()
    topp = kimik3.sample(logits, keys, temperature=1.0, top_p=0.75)  # keeps {0, 1}
    assert set(np.unique(np.asarray(topp))) == {0, 1}
    full = np.bincount(np.asarray(kimik3.sample(logits, keys, temperature=1.0)), minlength=4) / 2000
    assert np.allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.04)


def test_generate_stops_at_eos(tiny_models):
    model = tiny_models["tiny-linear"]
    free = kimik3.generate(model, [[1, 2, 3]], max_new_tokens=6, stop_tokens=[])[0]
    stopped = kimik3.generate(model, [[1, 2, 3]], max_new_tokens=6, stop_tokens=[free[2]])[0]
    assert stopped == free[:free.index(free[2])]


def test_bad_input_gives_clear_errors(tiny_models):
    model = tiny_models["tiny"]
    V = model.cfg.vocab_size
    with pytest.raises(ValueError, match=f"token id {V} at position \\(0, 2\\).*\\[0, {V}\\)"):
        kimik3.forward(model, np.array([[1, 2, V]]))
    with pytest.raises(ValueError, match="token id -1"):
        kimik3.generate(model, [[1, -1]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        kimik3.prefill(model, [[1], []], 16)
    with pytest.raises(ValueError, match="prompt 0 has 20 tokens, more than max_seq_len=16"):
        kimik3.prefill(model, [list(range(20))], 16)
    with pytest.raises(ValueError, match="needs 24 cache positions, more than max_seq_len=16"):
        kimik3.generate(model, [list(range(20))], max_new_tokens=4, max_seq_len=16)
    last, cache = kimik3.prefill(model, [list(range(16))], 16)
    with pytest.raises(ValueError, match="exceed the cache's max_seq_len 16"):
        kimik3.decode_step(model, cache, [1])
    with pytest.raises(ValueError, match="not one prompt"):
        kimik3.generate(model, [1, 2, 3])
    big = kimik3.Model(params={}, cfg=kimik3.Config.preset("kimi-k3"))
    with pytest.raises(ValueError, match="pass its tokenizer"):
        kimik3.generate(big, ["text needs a tokenizer"])


def test_init_on_a_mesh_gives_the_same_model(tiny_models):
    import sharding

    mesh = sharding.make_mesh(data=2, tensor=4)
    model = kimik3.init(kimik3.Config.preset("tiny"), seed=0, mesh=mesh)
    q = model.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    toks = _tokens(2, 10, seed=4)
    assert _rel(kimik3.forward(model, toks), kimik3.forward(tiny_models["tiny"], toks)) < 1e-5
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(tensor=16)


@pytest.mark.parametrize("pairs", [1, 16, 1000, 5000])
def test_expert_order_is_the_stable_argsort(pairs):
    """Counted (up to COUNTED_ORDER_PAIRS pairs) or sorted, the permutation is argsort's, ties
    in order; rank inverts it."""
    from kimik3.layers.moe import expert_order

    key = jax.random.randint(jax.random.key(pairs), (pairs,), 0, 9)  # many ties
    order, rank = jax.jit(expert_order)(key)
    assert np.array_equal(np.asarray(order), np.argsort(np.asarray(key), kind="stable"))
    assert np.array_equal(np.asarray(order)[np.asarray(rank)], np.arange(pairs))
