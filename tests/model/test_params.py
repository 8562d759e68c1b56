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


def test_every_parameter_declares_its_logical_axes():
    """One axis name per dimension, for every parameter of every preset; every axis the sharding
    table places is declared by some weight (no dead rule)."""
    from sharding.rules import MOE, TENSOR

    used = set()
    for name in sorted(kimik3.PRESETS):
        cfg = Config.preset(name)
        axes = cfg.param_axes()  # the same tree structure as the parameters (else tree.map raises)
        ranks = jax.tree.map(lambda x, a: (len(x.shape), a), kimik3.abstract(cfg), axes)
        for rank, a in jax.tree.leaves(ranks, is_leaf=lambda r: isinstance(r, tuple) and isinstance(r[0], int)):
            assert isinstance(a, tuple) and len(a) == rank and all(isinstance(n, str) for n in a), (name, a)
            used.update(a)
    assert TENSOR | set(MOE) <= used, (TENSOR | set(MOE)) - used


def _specs(cfg, **mesh_axes):
    import sharding

    sh = sharding.param_shardings(kimik3.abstract(cfg), cfg, sharding.make_mesh(**mesh_axes))
    return jax.tree.map(lambda s: s.spec, sh)


def test_the_axes_table_places_the_well_known_weights():
    """Specs from the logical axes, as the former name rules gave them (checked bit for bit
    against them on these meshes when the table replaced them)."""
    from jax.sharding import PartitionSpec as P

    tiny = Config.preset("tiny")
    s = _specs(tiny, tensor=8)
    kda, moe = s["layers_0"]["self_attn"], s["layers_1"]["block_sparse_moe"]
    assert kda["q_proj"]["kernel"] == P(None, "tensor")      # output channels over tensor
    assert kda["o_proj"]["kernel"] == P("tensor", None)      # input channels over tensor
    assert kda["q_conv1d"] == P("tensor", None) and kda["dt_bias"] == P("tensor")
    assert kda["A_log"] == P(None)                          # 2 heads do not split 8 ways
    assert s["embed_tokens"]["embedding"] == P() and kda["f_a_proj"]["kernel"] == P()
    assert moe["routed_expert_up_proj"]["kernel"] == P(None, "tensor")  # MoE dedup's owned rows
    assert moe["experts"]["w1_packed"] == P(None, None, None)  # 32 values: not 8 whole scale groups
    assert _specs(tiny.replace(moe_dedup=False), tensor=8)["layers_1"]["block_sparse_moe"][
        "routed_expert_up_proj"]["kernel"] == P(None, None)

    s = _specs(tiny, tensor=4)
    mla = s["layers_2"]["self_attn"]
    assert mla["q_b_proj"]["kernel"] == P(None, "tensor") and mla["kv_b_proj"]["kernel"] == P(None, "tensor")
    assert mla["o_proj"]["kernel"] == P("tensor", None) and mla["kv_a_proj_with_mqa"]["kernel"] == P()
    assert s["layers_0"]["mlp"]["down_proj"]["kernel"] == P("tensor", None) and s["lm_head"]["kernel"] == P()

    mxfp4 = tiny.replace(num_layers=2, layer_types=("kda", "mla"), moe_intermediate_size=256, num_shared_experts=2)
    s = _specs(mxfp4, tensor=2, expert=4)
    moe = s["layers_1"]["block_sparse_moe"]
    assert moe["experts"]["w1_packed"] == P("expert", "tensor", None)  # experts' dim 0 over expert
    assert moe["experts"]["w2_scale"] == P("expert", None, "tensor")
    assert moe["shared_experts"]["down_proj"]["kernel"] == P("tensor", None) and moe["gate"] == P()
    assert s["layers_0"]["self_attn"]["A_log"] == P("tensor")

    experts = _specs(Config.preset("tiny-linear"), tensor=2, expert=4)["layers_1"]["block_sparse_moe"]["experts"]
    assert experts["w1"] == P("expert", None, "tensor") and experts["w2"] == P("expert", "tensor", None)


def test_init_compiles_one_program_per_kind_of_layer():
    """The init program per kind of layer gives the whole model's tree (structure, shapes, dtypes,
    and on a mesh the sharding rules' placement); each layer draws its own weights."""
    from kimik3.params import init_programs
    from sharding import make_mesh, param_shardings

    cfg = Config.preset("tiny").replace(num_layers=7, layer_types=("kda", "kda", "mla", "kda", "mla", "kda", "kda"),
                                        mlp_layer_types=("dense", "sparse", "sparse", "dense", "sparse", "sparse",
                                                         "sparse"))
    mesh = make_mesh(tensor=4, expert=2)
    # after the first layer's program: kda+dense, kda+moe, mla+moe, three programs for six layers
    assert len({id(p) for p in init_programs(cfg, mesh)[1:]}) == 3
    params = kimik3.init(cfg, seed=3, mesh=mesh).params
    expected = kimik3.abstract(cfg)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda s: (s.shape, s.dtype), expected)
    want = param_shardings(expected, cfg, mesh)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
    q = [params[f"layers_{i}"]["self_attn"]["q_proj"]["kernel"] for i in (0, 1, 3, 5, 6)]
    assert all(not bool(jnp.array_equal(a, b)) for a, b in zip(q, q[1:]))
