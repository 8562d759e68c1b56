"""The model with an fp8 MLA cache (Config.mla_cache_dtype="fp8": e4m3 values in the decode
kernel's words form, a quarter of the tiny fp32 cache's bytes, half of bf16's): close to the
full-precision cache, on the decode kernel, under decode context parallelism and in the engine."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
import sharding
from kernels_pallas.mla.reference import quantize_words
from kimik3.layers.mla import MLA
from serve import Engine


def _fp8(model):
    return model.replace(cfg=model.cfg.replace(mla_cache_dtype="fp8"))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_fp8_cache_close_to_full_precision(tiny_models, name):
    """Prefill and three decode steps: logits within 0.5% of the fp32 cache's (measured: <= 0.1%);
    the cache holds uint16 words, two values each."""
    model = tiny_models[name]
    prompts = [[1, 5, 9, 33, 7], [2, 4], list(range(40, 70))]
    runs = []
    for m in (model, _fp8(model)):
        last, cache = kimik3.prefill(m, prompts, max_seq_len=64)
        logits = [last]
        for t in range(3):
            lg, cache = kimik3.decode_step(m, cache, jnp.array([3 + t, 8 + t, 11 + t], jnp.int32))
            logits.append(lg)
        runs.append((logits, cache))
    latent = next(e["latent"] for e in runs[1][1].layers if "latent" in e)
    assert latent.dtype == jnp.uint16 and latent.shape[-1] == model.cfg.mla_cache_dim // 2
    for a, b in zip(runs[0][0], runs[1][0]):
        assert _rel(a, b) < 5e-3


def test_fp8_cache_layer_on_the_decode_kernel():
    """K3's cache width (512 + 64) in words: the layer's decode on the Pallas kernel (interpret)
    equals its reference path, which dequantises the same words; the written entry is the
    quantised token."""
    cfg = kimik3.Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64,
                                               mla_cache_dtype="fp8", mla_cache_scale=0.05)
    B, S, D = 3, 128, cfg.hidden_size
    layer = MLA(cfg)
    x = jax.random.normal(jax.random.key(0), (B, 1, D))
    params = layer.init(jax.random.key(1), x, None, jnp.zeros(B, jnp.int32), jnp.ones(B, jnp.int32))
    cache = {"latent": quantize_words(jax.random.normal(jax.random.key(2), (B, S, 576)), 0.05)}
    start = jnp.array([0, 70, 127], jnp.int32)
    n_new = jnp.array([1, 1, 0], jnp.int32)  # the last row is an idle slot
    ref, ref_cache = layer.apply(params, x, cache, start, n_new, backend="reference")
    out, out_cache = layer.apply(params, x, cache, start, n_new, backend="interpret")
    np.testing.assert_array_equal(ref_cache["latent"], out_cache["latent"])
    assert ref_cache["latent"].dtype == jnp.uint16
    np.testing.assert_array_equal(out_cache["latent"][2], cache["latent"][2])  # idle row untouched
    assert not np.array_equal(out_cache["latent"][1, 70], cache["latent"][1, 70])  # written
    err = jnp.max(jnp.abs(out[:2] - ref[:2])) / jnp.max(jnp.abs(ref[:2]))
    assert err < 2e-3, err      # the kernel's fp16 dots against the reference's fp32


@pytest.mark.parametrize("axes,dcp_axes", [(dict(tensor=4, dcp=2), ("dcp",)),
                                           (dict(tensor=8), ("tensor",))])
def test_fp8_cache_under_dcp_matches_one_device(tiny_greedy, axes, dcp_axes):
    """TP x DCP with the fp8 cache: the one-device fp8 run's last logits and greedy tokens."""
    model, prompts = _fp8(tiny_greedy.model), tiny_greedy.prompts
    want_last, _ = kimik3.prefill(model, prompts, 64)
    want = kimik3.generate(model, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64)
    mesh = sharding.make_mesh(**axes)
    placed = sharding.place_model(model, mesh)
    last, cache = kimik3.prefill(placed, prompts, 64, mesh=mesh, dcp_axes=dcp_axes)
    assert _rel(want_last, last) < 1e-5
    latent = cache.layers[model.cfg.mla_layers[0]]["latent"]
    n = np.prod([mesh.shape[a] for a in dcp_axes])
    assert latent.dtype == jnp.uint16 and latent.addressable_shards[0].data.shape[1] == 64 // n
    got = kimik3.generate(placed, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64,
                          mesh=mesh, dcp_axes=dcp_axes)
    assert got == want


def test_fp8_cache_in_the_engine(tiny_greedy):
    """The engine pages an fp8 cache: the same greedy tokens as generate with it, and a page costs
    a quarter of the fp32 tiny model's bytes (so a memory budget holds four times the pages)."""
    model, prompts = _fp8(tiny_greedy.model), tiny_greedy.prompts
    want = kimik3.generate(model, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64)
    eng = Engine(model, max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=3)
    assert eng.generate(prompts, max_new_tokens=8, stop_tokens=[]) == want
    full = Engine(tiny_greedy.model, max_batch=2, max_seq_len=64, page_size=8,
                  memory_budget_bytes=1 << 20)
    fp8 = Engine(model, max_batch=2, max_seq_len=64, page_size=8, memory_budget_bytes=1 << 20)
    assert full.page_bytes == 4 * fp8.page_bytes
    assert fp8.allocator.num_pages > 3 * full.allocator.num_pages


def test_fp8_cache_config_and_memory():
    cfg = kimik3.Config.preset("tiny")
    with pytest.raises(kimik3.ConfigError, match="mla_cache_dtype"):
        cfg.replace(mla_cache_dtype="int8")
    with pytest.raises(kimik3.ConfigError, match="even"):
        cfg.replace(mla_cache_dtype="fp8", kv_lora_rank=31)
    with pytest.raises(kimik3.ConfigError, match="mla_cache_scale"):
        cfg.replace(mla_cache_dtype="fp8", mla_cache_scale=0.0)
    k3 = kimik3.Config.preset("kimi-k3")
    bf16 = kimik3.memory_report(k3, tensor=8, tokens=142_000)["mla_cache"]
    fp8 = kimik3.memory_report(k3.replace(mla_cache_dtype="fp8"), tensor=8,
                                 tokens=142_000)["mla_cache"]
    assert bf16 == 2 * fp8


def test_calibrated_cache_scale_keeps_large_latents():
    """Latents 2000x larger (kv_a_layernorm x 2000, kv_b_proj / 2000: the same model): at the
    default scale 1.0 the fp8 cache clips them at 448 and the logits go far off; the calibrated
    scale (max|latent| / 448 x 2, a power of two) keeps them within 0.5% of the full cache."""
    base = kimik3.init(kimik3.Config.preset("tiny"), seed=0)
    c = 2000.0

    def rescale(path, x):
        s = jax.tree_util.keystr(path)
        return x * c if "kv_a_layernorm" in s else x / c if "kv_b_proj" in s else x
    model = base.replace(params=jax.tree_util.tree_map_with_path(rescale, base.params))
    prompts = [[1, 5, 9, 33, 7], list(range(40, 70))]
    amax = kimik3.calibration.mla_latent_amax(model, prompts)
    assert amax > 448.0  # the rescale worked: the default scale would clip
    scale = kimik3.calibrate_mla_cache_scale(model, prompts)
    assert amax * 2 / 448.0 <= scale < amax * 4 / 448.0 and np.log2(scale) == round(np.log2(scale))

    def logits(m):
        last, cache = kimik3.prefill(m, prompts, max_seq_len=64)
        step, _ = kimik3.decode_step(m, cache, jnp.array([3, 8], jnp.int32))
        return np.concatenate([np.asarray(last), np.asarray(step)])
    full = logits(model)
    np.testing.assert_allclose(logits(base), full, rtol=1e-3, atol=1e-3)  # the same function
    at_default = _rel(full, logits(_fp8(model)))
    calibrated = _rel(full, logits(model.replace(cfg=model.cfg.replace(
        mla_cache_dtype="fp8", mla_cache_scale=scale))))
    assert calibrated < 5e-3 < at_default, (calibrated, at_default)
    with pytest.raises(ValueError, match="headroom"):
        kimik3.calibrate_mla_cache_scale(model, prompts, headroom=0.5)
    with pytest.raises(ValueError, match="no MLA layer"):
        linear_only = kimik3.Config.preset("tiny").replace(num_layers=1, layer_types=("kda",))
        kimik3.calibrate_mla_cache_scale(kimik3.init(linear_only, seed=0), prompts)
