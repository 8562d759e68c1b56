"""MoE dedup on 8 fake devices: equals the unsharded layer, needs no collective beyond the latent
reduction and the output all-reduce, frees the up-projection rows a rank does not own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
import sharding
from kimik3.layers.moe import MoE
from sharding.moe_dedup import count_collectives, moe_layer_tp, per_device_param_bytes, place_moe_params


@pytest.fixture(scope="module")
def setup():
    # K3-like latent MoE (MXFP4 experts, SiTU, 2 shared experts) with an intermediate that splits 8 ways
    cfg = kimik3.Config.preset("tiny").replace(moe_intermediate_size=256, num_shared_experts=2)
    layer = MoE(cfg)
    x = jax.random.normal(jax.random.key(0), (1, 24, cfg.hidden_size))
    params = layer.init(jax.random.key(1), x)["params"]
    ref = layer.apply({"params": params}, x)[0]
    return cfg, params, x[0], ref


@pytest.mark.parametrize("dedup", [True, False])
def test_tp8_equals_the_unsharded_layer(setup, dedup):
    cfg, params, x, ref = setup
    mesh = sharding.make_mesh(tensor=8)
    placed = place_moe_params(params, mesh, dedup=dedup)
    out = moe_layer_tp(cfg, mesh, dedup=dedup)(placed, x)
    assert jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)) < 1e-5


def test_dedup_adds_no_collective_and_frees_rows(setup):
    cfg, params, x, _ = setup
    mesh = sharding.make_mesh(tensor=8)
    counts = {}
    for dedup in (True, False):
        placed = place_moe_params(params, mesh, dedup=dedup)
        hlo = moe_layer_tp(cfg, mesh, dedup=dedup).lower(placed, x).compile().as_text()
        counts[dedup] = count_collectives(hlo)
    # Dedup: the experts' latent reduction and the output all-reduce the shared experts need anyway;
    # nothing else (no gather of the up-projection's output, no extra reduction).
    assert counts[True] == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0,
                            "collective-permute": 0}
    # Without dedup the same two reductions are independent, and XLA's combiner may fuse them into
    # one all-reduce op (same bytes); dedup makes the second depend on the first.
    assert counts[False]["all-reduce"] in (1, 2) and sum(counts[False].values()) == counts[False]["all-reduce"]
    with_dedup = per_device_param_bytes(params, mesh, dedup=True)
    without = per_device_param_bytes(params, mesh, dedup=False)
    up = params["routed_expert_up_proj"]["kernel"]
    assert without - with_dedup == up.size * up.dtype.itemsize * 7 // 8  # 7/8 of the rows freed


def test_indivisible_shapes_are_refused(setup):
    cfg, *_ = setup
    with pytest.raises(ValueError, match="moe_intermediate_size=32 must be divisible by 256"):
        moe_layer_tp(cfg.replace(moe_intermediate_size=32), sharding.make_mesh(tensor=8))
