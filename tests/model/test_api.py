"""The user-facing API: the model functions trace under jit / vmap, and kimik3.generate and
Engine.generate agree (checks, seeded samples, stop strings, log-probabilities, prompt forms)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
from serve import Engine, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["tiny"]


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def _engine(model, **kw):
    return Engine(model, **dict(dict(max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=3), **kw))


# ---- item 5: traceable model functions ----
def test_forward_traces_under_jit_and_vmap(model):
    toks = np.random.RandomState(0).randint(0, 256, (2, 2, 7)).astype(np.int32)
    want = [kimik3.forward(model, t) for t in toks]
    assert _rel(jax.jit(kimik3.forward)(model, jnp.asarray(toks[0])), want[0]) < 1e-5
    both = jax.vmap(kimik3.forward, in_axes=(None, 0))(model, jnp.asarray(toks))
    assert _rel(both[0], want[0]) < 1e-5 and _rel(both[1], want[1]) < 1e-5
    with pytest.raises(ValueError, match="integer token ids, got dtype float32"):  # dtypes still checked
        jax.jit(kimik3.forward)(model, jnp.zeros((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"shape \[batch, length>0\]"):
        jax.jit(kimik3.forward)(model, jnp.zeros((3,), jnp.int32))


def test_forward_stays_differentiable(tiny_models):
    """The vmap rule must not cost differentiation: the gradient of a logit with respect to the
    float weights of tiny-linear (dense experts) is the plain pass's."""
    model = tiny_models["tiny-linear"]
    toks = jnp.asarray([[3, 1, 4]], jnp.int32)
    loss = lambda fwd: lambda p: fwd(kimik3.Model(params=p, cfg=model.cfg), toks)[0, -1, 7]
    plain = lambda m, t: kimik3.runtime._forward(m, t)
    got = jax.grad(loss(kimik3.forward))(model.params)
    want = jax.grad(loss(plain))(model.params)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(g, w) < 1e-6
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(got))


def test_prefill_extend_and_decode_step_trace_under_jit(model):
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    want_last, want_cache = kimik3.prefill(model, prompts, 16)
    want_step, _ = kimik3.decode_step(model, want_cache, [10, 11])

    padded = jnp.asarray([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]], jnp.int32)
    prefill = jax.jit(kimik3.prefill, static_argnames="max_seq_len")
    last, cache = prefill(model, padded, max_seq_len=16, lengths=jnp.asarray([5, 3]))
    assert _rel(last, want_last) < 1e-5
    np.testing.assert_array_equal(np.asarray(cache.lengths), [5, 3])
    step, cache = jax.jit(kimik3.decode_step)(model, cache, jnp.asarray([10, 11], jnp.int32))
    assert _rel(step, want_step) < 1e-5
    logits, cache = jax.jit(kimik3.extend)(model, cache, jnp.asarray([[12, 13], [14, 0]], jnp.int32),
                                           jnp.asarray([2, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 5])
    full = kimik3.forward(model, [[5, 6, 7, 8, 9, 10, 12, 13]])
    assert _rel(logits[0], full[0, 6:]) < 1e-5
    # the concrete array form still checks values
    with pytest.raises(ValueError, match=r"lengths must be \[2\] ints in \[1, 5\]"):
        kimik3.prefill(model, np.asarray(padded), 16, lengths=[5, 0])


# ---- item 6: generate and Engine.generate agree ----
SAMPLED = dict(max_new_tokens=7, temperature=0.9, top_k=40, top_p=0.9, seed=11, stop_tokens=[])


def test_same_samples_for_the_same_seed(model):
    prompts = ["hello", [3, 1, 4, 1, 5, 9, 2, 6], "kimi k3"]
    lib = kimik3.generate(model, prompts, **SAMPLED)
    eng = _engine(model).generate(prompts, **SAMPLED)
    assert eng == lib and len({tuple(o) for o in lib}) == 3
    assert kimik3.generate(model, prompts, **dict(SAMPLED, seed=12)) != lib
    # prompt i draws with seed + i on both: prompt 1 alone with seed 12 is prompt 1 of the call with seed 11
    assert kimik3.generate(model, [prompts[1]], **dict(SAMPLED, seed=12)) == [lib[1]]
    assert _engine(model).generate([prompts[1]], **dict(SAMPLED, seed=12)) == [lib[1]]


def test_logprobs_agree_and_match_the_model(model):
    prompt = [7, 8, 9, 10]
    kw = dict(SAMPLED, return_logprobs=True, top_logprobs=3)
    lib = kimik3.generate(model, [prompt], **kw)[0]
    eng = _engine(model).generate([prompt], **kw)[0]
    assert eng == lib and len(lib.logprobs) == len(lib.top_logprobs) == len(lib) == 7
    np.testing.assert_allclose(eng.logprobs, lib.logprobs, atol=1e-4)
    assert [list(d) for d in eng.top_logprobs] == [list(d) for d in lib.top_logprobs]
    # the model's own distribution at each position (an independent pass with no cache)
    lp = np.asarray(jax.nn.log_softmax(kimik3.forward(model, [prompt + lib[:-1]])[0, len(prompt) - 1:]))
    for j, t in enumerate(lib):
        assert abs(lib.logprobs[j] - lp[j, t]) < 1e-4
        best = np.argsort(-lp[j])[:3]
        assert list(lib.top_logprobs[j]) == [int(i) for i in best]
        np.testing.assert_allclose(list(lib.top_logprobs[j].values()), lp[j, best], atol=1e-4)
    # streaming yields the same per-token data as it goes
    chunks = list(_engine(model).stream([prompt], SamplingParams(**{k: v for k, v in kw.items() if k != "stop_tokens"},
                                                                 stop_tokens=())))
    assert sum((c for _, c in chunks), []) == list(lib)
    np.testing.assert_allclose(sum((c.logprobs for _, c in chunks), []), lib.logprobs, atol=1e-4)
    assert chunks[-1][1].finish_reason == "length"
    np.testing.assert_allclose(chunks[-1][0].logprobs, lib.logprobs, atol=1e-4)  # kept on the request
    assert kimik3.generate(model, [prompt], **SAMPLED)[0].logprobs is None  # only when asked


def test_stop_strings_and_stop_tokens_on_both(model):
    free = kimik3.generate(model, ["abc"], max_new_tokens=10, stop_tokens=[])[0]
    tok = kimik3.default_tokenizer(model.cfg)
    stop = tok.decode(free[4:6])
    assert stop and free.text == tok.decode(free) and free.finish_reason == "length"
    kw = dict(max_new_tokens=10, stop_tokens=[], stop_strings=[stop])
    lib = kimik3.generate(model, ["abc"], **kw)[0]
    eng = _engine(model).generate(["abc"], **kw)[0]
    assert lib == eng and (lib.text, lib.finish_reason) == (eng.text, eng.finish_reason)
    assert lib.finish_reason == "stop" and stop not in lib.text and free.text.startswith(lib.text)
    kw = dict(max_new_tokens=10, stop_tokens=[free[3]])
    lib = kimik3.generate(model, ["abc"], **kw)[0]
    assert lib == _engine(model).generate(["abc"], **kw)[0] == free[:free.index(free[3])]
    assert lib.finish_reason == "stop"


@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1, got 2.5"),
    (dict(temperature=-1.0), "temperature must be a number >= 0"),
    (dict(top_k=1.5), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*32\)"),
    (dict(stop_strings="x"), "stop_strings must be a list of non-empty strings"),
    (dict(stop_tokens=[10 ** 6]), "stop token 1000000 is outside the vocabulary"),
    (dict(return_logprobs=True, top_logprobs=21), r"top_logprobs must be an integer in \[0, 20\]"),
])
def test_same_checks_on_both(model, bad, message):
    eng = _engine(model)
    for gen in (lambda **kw: kimik3.generate(model, ["hi"], **kw), lambda **kw: eng.generate(["hi"], **kw)):
        with pytest.raises(ValueError, match=message):
            gen(**bad)
    assert not eng.has_work()


# ---- item 7: prompt forms and failures ----
def test_a_bare_string_is_one_prompt(model):
    eng = _engine(model)
    one = eng.generate("Hello", max_new_tokens=3, stop_tokens=[])
    assert len(one) == 1 and one == eng.generate(["Hello"], max_new_tokens=3, stop_tokens=[])
    assert kimik3.generate(model, "Hello", max_new_tokens=3, stop_tokens=[]) == one


def test_a_bad_prompt_queues_nothing(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match="prompt 2: token id 1000000 at position \\(1,\\)"):
        eng.generate([[1, 2], "fine", [3, 10 ** 6]], max_new_tokens=3)
    assert not eng.has_work()
    assert eng.generate([[5, 6]], max_new_tokens=3, stop_tokens=[]) == kimik3.generate(
        model, [[5, 6]], max_new_tokens=3, stop_tokens=[])
    assert [r.prompt for r in eng.done] == [[5, 6]]  # nothing of the failed call ran
    for gen in (lambda p: kimik3.generate(model, p), lambda p: eng.generate(p)):
        with pytest.raises(ValueError, match="prompt 1: empty prompt"):
            gen([[1], []])
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        eng.submit([1, 2], SamplingParams(max_new_tokens=2.5))
    assert not eng.has_work()


def test_closing_a_stream_early_aborts_its_requests(model):
    eng = _engine(model)
    it = eng.stream([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=20, stop_tokens=()))
    next(it)
    it.close()
    assert not eng.has_work() and {r.finish_reason for r in eng.done} <= {"abort", "length"}
