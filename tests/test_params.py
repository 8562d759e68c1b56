import jax
import jax.numpy as jnp

import kimik3
from kimik3 import Config


def test_abstract_is_shapes_only():
    tree = kimik3.abstract(Config.preset("kimi-linear-48b"))
    leaves = jax.tree.leaves(tree)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    moe = tree["layers_1"]["block_sparse_moe"]
    assert moe["experts"]["w1"].shape == (256, 2304, 1024)
    assert moe["gate"].dtype == jnp.float32 and moe["e_score_correction_bias"].dtype == jnp.float32


def test_k3_storage_formats_and_fp32_tensors():
    tree = kimik3.abstract(Config.preset("kimi-k3"))
    kda = tree["layers_0"]["self_attn"]
    for name in ("q_conv1d", "A_log", "dt_bias", "o_norm"):
        assert kda[name].dtype == jnp.float32, name
    experts = tree["layers_1"]["block_sparse_moe"]["experts"]
    assert experts["w1_packed"].shape == (896, 3072, 3584 // 2) and experts["w1_packed"].dtype == jnp.uint8
    assert experts["w2_scale"].shape == (896, 3584, 3072 // 32)
    assert tree["layers_3"]["self_attn"]["kv_b_proj"]["kernel"].shape == (512, 96 * 256)


def test_published_parameter_counts():
    k3 = kimik3.param_count(Config.preset("kimi-k3"))
    kl = kimik3.param_count(Config.preset("kimi-linear-48b"))
    print(f"\nkimi-k3: total {k3['total'] / 1e12:.3f}T, active {k3['active'] / 1e9:.1f}B")
    print(f"kimi-linear-48b: total {kl['total'] / 1e9:.2f}B, active {kl['active'] / 1e9:.2f}B")
    assert 2.7e12 < k3["total"] < 2.9e12  # published: 2.8T
    assert 47e9 < kl["total"] < 50e9  # published: 48B (49.1B with both embedding tables)
    assert 2.5e9 < kl["active"] < 3.6e9  # published: A3B


def test_mxfp4_counts_logical_values():
    dense = kimik3.param_count(Config.preset("tiny").replace(expert_format="dense"))
    packed = kimik3.param_count(Config.preset("tiny"))
    assert dense == packed


def test_init_is_seeded(tiny_models):
    cfg = Config.preset("tiny-linear")
    a = kimik3.init(cfg, seed=0).params
    b = tiny_models["tiny-linear"].params
    assert all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    expected = jax.tree.map(lambda s: (s.shape, s.dtype), kimik3.abstract(cfg))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), a) == expected
