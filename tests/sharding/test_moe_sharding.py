"""The MoE on 8 fake devices, as a layer and inside the model. MoE dedup under TP: equals the
unsharded layer, needs no collective beyond the latent reduction and the output all-reduce, frees
the up-projection rows a rank does not own. Expert parallelism (EP8, TP2 x EP4): equals the
unsharded layer with MXFP4 and dense experts, each rank holds E / ep experts, the combine is an
all-reduce and nothing gathers weights. The model (tiny preset) on TP8 with dedup on and off, on
EP8 and on TP2 x EP4 gives one device's logits and greedy tokens, through the shard_map layer."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import kimik3
import sharding
from kimik3.layers.moe import MoE, moe_layer, moe_layer_tp
from sharding.moe import count_collectives, per_device_param_bytes, place_moe_params

NO_COLLECTIVES = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _layer(cfg):
    layer = MoE(cfg)
    x = jax.random.normal(jax.random.key(0), (1, 24, cfg.hidden_size))
    params = layer.init(jax.random.key(1), x)["params"]
    return params, x[0], layer.apply({"params": params}, x)[0]


@pytest.fixture(scope="module")
def setup():
    # K3-like latent MoE (MXFP4 experts, SiTU, 2 shared experts) with an intermediate that splits 8 ways
    cfg = kimik3.Config.preset("tiny").replace(moe_intermediate_size=256, num_shared_experts=2)
    return (cfg, *_layer(cfg))


@pytest.mark.parametrize("dedup", [True, False])
def test_tp8_equals_the_unsharded_layer(setup, dedup):
    cfg, params, x, ref = setup
    mesh = sharding.make_mesh(tensor=8)
    placed = place_moe_params(cfg.replace(moe_dedup=dedup), params, mesh)
    assert _rel(moe_layer_tp(cfg, mesh, dedup=dedup)(placed, x), ref) < 1e-5


def test_dedup_adds_no_collective_and_frees_rows(setup):
    cfg, params, x, _ = setup
    mesh = sharding.make_mesh(tensor=8)
    counts = {}
    for dedup in (True, False):
        placed = place_moe_params(cfg.replace(moe_dedup=dedup), params, mesh)
        hlo = moe_layer_tp(cfg, mesh, dedup=dedup).lower(placed, x).compile().as_text()
        counts[dedup] = count_collectives(hlo)
    # Dedup: the experts' latent reduction and the output all-reduce the shared experts need anyway;
    # nothing else (no gather of the up-projection's output, no extra reduction).
    assert counts[True] == {**NO_COLLECTIVES, "all-reduce": 2}
    # Without dedup the same two reductions are independent, and XLA's combiner may fuse them into
    # one all-reduce op (same bytes); dedup makes the second depend on the first.
    assert counts[False]["all-reduce"] in (1, 2) and sum(counts[False].values()) == counts[False]["all-reduce"]
    with_dedup = per_device_param_bytes(cfg, params, mesh)
    without = per_device_param_bytes(cfg.replace(moe_dedup=False), params, mesh)
    up = params["routed_expert_up_proj"]["kernel"].value  # MoE(cfg).init boxes each weight with its axes
    assert without - with_dedup == up.size * up.dtype.itemsize * 7 // 8  # 7/8 of the rows freed


def test_indivisible_shapes_are_refused(setup):
    cfg, *_ = setup
    with pytest.raises(ValueError, match="moe_intermediate_size=32 must be divisible by 256"):
        moe_layer_tp(cfg.replace(moe_intermediate_size=32), sharding.make_mesh(tensor=8))


EP_MESHES = {"ep8": dict(expert=8), "tp2_ep4": dict(tensor=2, expert=4)}


@pytest.mark.parametrize("name", list(EP_MESHES))
def test_expert_parallel_layer(setup, name):
    """MXFP4 latent experts over `expert` (and their intermediate over `tensor`): same output, each
    rank holds E / ep of them, one all-reduce combines the experts (a second one assembles the
    output under TP, with dedup); no all-gather, so no weight moves."""
    cfg, params, x, ref = setup
    mesh = sharding.make_mesh(**EP_MESHES[name])
    placed = place_moe_params(cfg, params, mesh)
    w2 = placed["experts"]["w2_packed"]
    tp, ep = mesh.shape["tensor"], mesh.shape["expert"]
    assert w2.addressable_shards[0].data.shape == (cfg.num_experts // ep, w2.shape[1], w2.shape[2] // tp)
    f = moe_layer(cfg, mesh)
    assert _rel(f(placed, x), ref) < 1e-5
    counts = count_collectives(f.lower(placed, x).compile().as_text())
    assert counts == {**NO_COLLECTIVES, "all-reduce": 1 if tp == 1 else 2}, counts
    experts = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(params["experts"]))
    others = per_device_param_bytes(cfg, {k: v for k, v in params.items() if k != "experts"}, mesh)
    assert per_device_param_bytes(cfg, params, mesh) == experts // (ep * tp) + others


def test_expert_parallel_dense_experts_without_latent():
    """Kimi-Linear-like (dense experts in hidden space): routed and shared partial sums over
    (expert, tensor) and (tensor) meet in one all-reduce, shared counted once per tensor rank."""
    cfg = kimik3.Config.preset("tiny-linear")
    params, x, ref = _layer(cfg)
    mesh = sharding.make_mesh(tensor=2, expert=4)
    f = moe_layer(cfg, mesh)
    placed = place_moe_params(cfg, params, mesh)
    assert _rel(f(placed, x), ref) < 1e-5
    assert count_collectives(f.lower(placed, x).compile().as_text()) == {**NO_COLLECTIVES, "all-reduce": 1}


MODEL_MESHES = {
    "tp8_dedup": (dict(tensor=8), dict(moe_dedup=True)),
    "tp8_no_dedup": (dict(tensor=8), dict(moe_dedup=False)),
    "ep8": (dict(expert=8), dict(moe_placement="expert")),
    "tp2_ep4": (dict(tensor=2, expert=4), dict(moe_placement="auto")),
}


@pytest.mark.parametrize("name", list(MODEL_MESHES))
def test_model_moe_on_a_mesh_matches_one_device(tiny_greedy, name):
    """Same calls as tests/sharding/test_dcp.py (its TP8 case is tp8_dedup here: shared compilations)."""
    model, prompts = tiny_greedy.model, tiny_greedy.prompts
    axes, options = MODEL_MESHES[name]
    mesh = sharding.make_mesh(**axes)
    sharded = sharding.place_model(model.replace(cfg=model.cfg.replace(**options)), mesh)
    moe = sharded.params["layers_1"]["block_sparse_moe"]
    up_spec = moe["routed_expert_up_proj"]["kernel"].sharding.spec
    assert up_spec == (P(None, "tensor") if sharded.cfg.moe_dedup and "tensor" in axes else P(None, None))
    ep = axes.get("expert", 1)
    assert moe["experts"]["w1_packed"].addressable_shards[0].data.shape[0] == model.cfg.num_experts // ep
    # every MoE layer runs in shard_map (not through XLA's partitioner); so do the KDA layers
    # when the tensor axis splits their heads (kimik3/layers/kda.py)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda p, t: kimik3.KimiLM(sharded.cfg).apply({"params": p}, t))(
            sharded.params, np.zeros((1, 4), np.int32))
    from sharding.kda import kda_tensor_axis
    kda = len(model.cfg.kda_layers) if kda_tensor_axis(model.cfg, mesh) else 0
    assert sum(e.primitive.name == "shard_map" for e in jaxpr.eqns) == model.cfg.num_moe_layers + kda
    last, _ = kimik3.prefill(sharded, prompts, 64, mesh=mesh)
    assert _rel(last, tiny_greedy.last) < 1e-5
    got = kimik3.generate(sharded, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64, mesh=mesh)
    assert got == tiny_greedy.tokens


def test_bad_moe_placements():
    cfg = kimik3.Config.preset("tiny")  # 8 experts
    with pytest.raises(ValueError, match=r"num_experts=8 is not divisible by the mesh's 'expert' axis \(3\)"):
        kimik3.init(cfg, mesh=sharding.make_mesh(expert=3))
    with pytest.raises(ValueError, match="moe_placement='tensor' keeps every routed expert on every rank"):
        moe_layer(cfg.replace(moe_placement="tensor"), sharding.make_mesh(expert=4))
    with pytest.raises(ValueError, match="moe_placement='expert' needs a mesh with an 'expert' axis > 1"):
        sharding.param_shardings(kimik3.abstract(cfg), cfg.replace(moe_placement="expert"),
                                 sharding.make_mesh(tensor=8))
    with pytest.raises(kimik3.ConfigError, match="Config.moe_placement: must be one of"):
        cfg.replace(moe_placement="experts")
    with pytest.raises(kimik3.ConfigError, match="Config.moe_dedup: must be True or False"):
        cfg.replace(moe_dedup="yes")
