"""The model on 8 fake devices: TP8, TP4 x DCP2, TP2 x DCP4 and TP8 with DCP8 (cache positions
split over the tensor axis itself) give the same greedy tokens and logits as one device, for prompts of different
lengths including ones shorter than the number of DCP shards."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
import sharding

MESHES = {
    "tp8": (dict(tensor=8), ()),
    "tp4_dcp2": (dict(tensor=4, dcp=2), ("dcp",)),
    "tp8_dcp8": (dict(tensor=8), ("tensor",)),
    "tp2_dcp4": (dict(tensor=2, dcp=4), ("dcp",)),  # KDA heads (2) split too: sharding/kda.py
}


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_decode_matches_one_device(tiny_greedy, name):
    model, prompts, want, want_last = tiny_greedy.model, tiny_greedy.prompts, tiny_greedy.tokens, tiny_greedy.last
    axes, dcp_axes = MESHES[name]
    mesh = sharding.make_mesh(**axes)
    sharded = sharding.place_model(model, mesh)  # kimik3.init(mesh=) itself: tests/model/test_model.py
    last, cache = kimik3.prefill(sharded, prompts, 64, mesh=mesh, dcp_axes=dcp_axes)
    assert jnp.max(jnp.abs(last - want_last)) / jnp.max(jnp.abs(want_last)) < 1e-5
    if dcp_axes:  # each device holds 1/dcp of every sequence's positions
        latent = cache.layers[model.cfg.mla_layers[0]]["latent"]
        n = np.prod([mesh.shape[a] for a in dcp_axes])
        assert latent.addressable_shards[0].data.shape[1] == 64 // n
    got = kimik3.generate(sharded, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64, mesh=mesh,
                          dcp_axes=dcp_axes)
    assert got == want


def test_multi_token_verify_under_dcp(tiny_models):
    model = tiny_models["tiny"]
    mesh = sharding.make_mesh(tensor=8)
    sharded = sharding.place_model(model, mesh)  # kimik3.init(mesh=) itself: tests/model/test_model.py
    toks = np.array([list(range(1, 21)), list(range(40, 60))], np.int32)
    full = kimik3.forward(model, toks)
    _, cache = kimik3.prefill(sharded, [list(toks[0, :14]), list(toks[1, :9])], 64, mesh=mesh, dcp_axes=("tensor",))
    verify = np.stack([toks[0, 14:18], toks[1, 9:13]])  # 4 draft tokens per row
    logits, _ = kimik3.extend(sharded, cache, verify)
    assert jnp.max(jnp.abs(logits[0] - full[0, 14:18])) / jnp.max(jnp.abs(full)) < 1e-5
    assert jnp.max(jnp.abs(logits[1] - full[1, 9:13])) / jnp.max(jnp.abs(full)) < 1e-5


def test_bad_dcp_settings():
    cfg = kimik3.Config.preset("tiny")
    mesh = sharding.make_mesh(tensor=8)
    with pytest.raises(ValueError, match="multiple of the DCP size 8"):
        kimik3.init_cache(cfg, 1, 60, mesh=mesh, dcp_axes=("tensor",))
    with pytest.raises(ValueError, match=r"\['dcp'\] are not axes"):
        kimik3.init_cache(cfg, 1, 64, mesh=jax.sharding.Mesh(np.array(jax.devices()), ("tensor",)), dcp_axes=("dcp",))
