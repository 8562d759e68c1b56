"""The serving engine: batching is invisible, pages never leak, preemption recomputes exactly."""
import gc
import weakref

import jax
import numpy as np
import pytest

import kimik3
import serve.engine
from serve import Engine, PageAllocator, SamplingParams
from serve.steps import compiled_programs


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["tiny"]


def _prompts(n, seed, lo=1, hi=40):
    rng = np.random.RandomState(seed)
    return [list(map(int, rng.randint(0, 256, rng.randint(lo, hi)))) for _ in range(n)]


def test_many_requests_match_one_at_a_time(model):
    prompts = _prompts(20, 0)
    alone = [kimik3.generate(model, [p], max_new_tokens=5, stop_tokens=[], max_seq_len=64)[0] for p in prompts]
    eng = Engine(model, max_batch=6, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=3)
    assert eng.generate(prompts, max_new_tokens=5, stop_tokens=[]) == alone
    eng.check_pages()
    assert eng.allocator.free + eng.prefix.evictable_pages() == eng.allocator.num_pages  # the rest is cache


def test_pages_stay_consistent_under_random_load_and_preemption(model):
    rng = np.random.RandomState(1)
    eng = Engine(model, max_batch=4, max_seq_len=48, page_size=4, num_pages=14, prefill_chunk=8, decode_steps=2)
    prompts = _prompts(14, 2, 1, 30)
    want = {}
    for i, p in enumerate(prompts[:6]):
        eng.submit(p, SamplingParams(max_new_tokens=int(rng.randint(1, 12)), stop_tokens=()), request_id=i)
    later = list(enumerate(prompts[6:], start=6))
    steps = 0
    while eng.has_work() or later:
        if later and rng.rand() < 0.4:
            i, p = later.pop(0)
            eng.submit(p, SamplingParams(max_new_tokens=int(rng.randint(1, 12)), stop_tokens=()), request_id=i)
        eng.step()
        eng.check_pages()
        steps += 1
        assert steps < 500
    assert eng.allocator.free + eng.prefix.evictable_pages() == eng.allocator.num_pages  # the rest is cache
    done = {r.id: r for r in eng.done}
    assert sorted(done) == list(range(14))
    assert sum(r.preemptions for r in done.values()) > 0  # the pool is small enough to force it
    for i, r in done.items():
        if not r.finish_reason.startswith("error"):
            want = kimik3.generate(model, [prompts[i]], max_new_tokens=r.params.max_new_tokens, stop_tokens=[],
                                   max_seq_len=64)[0]
            assert r.output == want, i


def test_sampling_depends_on_the_seed_not_the_batch(model):
    p = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=42, stop_tokens=())
    alone = Engine(model, max_batch=2, max_seq_len=64, page_size=8).generate(["hello"], params=[p])[0]
    crowd = Engine(model, max_batch=4, max_seq_len=64, page_size=8).generate(
        ["x", "hello", "a longer prompt here"], params=[SamplingParams(6, 1.0, seed=1), p, SamplingParams(6, 0.7, seed=3)])
    assert crowd[1] == alone
    other = Engine(model, max_batch=2, max_seq_len=64, page_size=8).generate(
        ["hello"], params=[SamplingParams(6, 1.0, top_p=0.9, seed=43, stop_tokens=())])[0]
    assert other != alone


def test_streaming_stop_strings_and_metrics(model):
    eng = Engine(model, max_batch=2, max_seq_len=64, page_size=8)
    free = eng.generate(["abc"], max_new_tokens=8, stop_tokens=[])[0]
    tok = kimik3.default_tokenizer(model.cfg)
    stop = tok.decode(free[3:5])
    assert stop, "need printable bytes to stop on"
    events = list(eng.stream(["abc"], SamplingParams(max_new_tokens=8, stop_tokens=(), stop_strings=(stop,))))
    req = events[-1][0]
    assert req.finish_reason == "stop" and stop not in req.text and len(req.output) <= 5
    assert sum(len(t) for _, t in events) == len(req.output)
    m = req.metrics
    assert m["output_tokens"] == len(req.output) and m["ttft_s"] > 0


def test_bad_requests_and_budgets(model):
    eng = Engine(model, max_batch=2, max_seq_len=32, page_size=8)
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len 32"):
        eng.submit(list(range(30)), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.submit([1, 100000])
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([])
    with pytest.raises(ValueError, match="holds .* cache pages .* raise the budget"):
        Engine(model, max_batch=2, max_seq_len=256, page_size=8, memory_budget_bytes=50_000)
    sized = Engine(model, max_batch=2, max_seq_len=64, page_size=8, memory_budget_bytes=2_000_000)
    assert sized.allocator.num_pages * sized.page_bytes + 2 * sized.slot_bytes <= 2_000_000


def test_page_allocator_catches_misuse():
    a = PageAllocator(4)
    p = a.alloc(3, "r1")
    assert a.alloc(2, "r2") is None and a.free == 1
    with pytest.raises(AssertionError, match="owned by 'r1'"):
        a.release(p[:1], "r2")
    with pytest.raises(AssertionError, match="differ"):
        a.check({"r1": p[:2]})
    a.release(p, "r1")
    a.check({})


def test_steady_state_does_not_recompile(model):
    from serve import steps

    eng = Engine(model, max_batch=3, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=2)
    sizes = lambda: (steps.mixed_step._cache_size(), steps.decode_steps._cache_size())  # noqa: E731
    eng.generate(_prompts(3, 7), max_new_tokens=4, stop_tokens=[])  # compiles the two step shapes
    greedy = sizes()
    eng.generate(_prompts(2, 7), max_new_tokens=4, temperature=0.5, stop_tokens=[])  # and their sampling programs
    assert sizes() > greedy  # an all-greedy batch runs its own programs (no sort, no device branch)
    before = sizes()
    eng.generate(_prompts(7, 8), max_new_tokens=9, temperature=0.5, stop_tokens=[])
    eng.generate(_prompts(5, 8), max_new_tokens=9, stop_tokens=[])
    assert sizes() == before


def test_engine_with_decode_context_parallelism(tiny_greedy):
    """The engine with its weights on a mesh (TP2: MoE dedup in shard_map) and every page's
    positions split over a DCP axis (DCP4; pages of 8 positions: 2 on each device) gives the
    one-device greedy tokens; steady state compiles nothing more; bad DCP settings are refused."""
    import sharding

    mesh = sharding.make_mesh(tensor=2, dcp=4)
    placed = sharding.place_model(tiny_greedy.model, mesh)
    eng = Engine(placed, max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=3,
                 dcp_axes=("dcp",))
    latent = next(e["latent"] for e in eng.layers if "latent" in e)
    assert latent.addressable_shards[0].data.shape[1] == 2
    assert eng.generate(tiny_greedy.prompts, max_new_tokens=8, stop_tokens=[]) == tiny_greedy.tokens
    assert all(e["latent"].sharding.spec[1] in ("dcp", ("dcp",)) for e in eng.layers if "latent" in e)
    # steady state compiles nothing more: the decode calls queued ahead start from the last
    # call's sharded outputs, which must not make each chained call a new program
    eng.generate(_prompts(6, 4), max_new_tokens=11, temperature=0.5, stop_tokens=[])  # the sampling programs
    programs = compiled_programs()
    assert eng.generate(tiny_greedy.prompts, max_new_tokens=8, stop_tokens=[]) == tiny_greedy.tokens
    eng.generate(_prompts(6, 3), max_new_tokens=11, temperature=0.5, stop_tokens=[])
    assert compiled_programs() == programs
    one = Engine(placed, max_batch=2, max_seq_len=64, page_size=8, memory_budget_bytes=1 << 20)
    split = Engine(placed, max_batch=2, max_seq_len=64, page_size=8, memory_budget_bytes=1 << 20,
                   dcp_axes=("dcp",))
    assert split.page_bytes * 4 == one.page_bytes  # a page costs each device a quarter
    assert split.allocator.num_pages > 3 * one.allocator.num_pages
    with pytest.raises(ValueError, match="multiple of the DCP size"):
        Engine(placed, page_size=6, dcp_axes=("dcp",))
    with pytest.raises(ValueError, match="placed on a mesh"):
        Engine(tiny_greedy.model, dcp_axes=("dcp",))


def test_short_prefills_run_in_narrower_calls(model, monkeypatch):
    """A prefill call takes the narrowest width that holds its longest row (a prompt's tail, a
    prompt after a prefix-cache hit); the tokens are those of plain generate."""
    import serve.engine as engine_module
    from serve.engine import prefill_widths

    assert prefill_widths(2048) == (2048, 512, 128) and prefill_widths(256) == (256, 64)
    assert prefill_widths(16) == (16,) and prefill_widths(100) == (100,)
    widths, inner = [], engine_module.mixed_step

    def recording(m, layers, tokens, *args, **kw):
        widths.append(tokens.shape[1])
        return inner(m, layers, tokens, *args, **kw)
    monkeypatch.setattr(engine_module, "mixed_step", recording)
    prompts = [list(range(3, 303)), list(range(7, 27))]  # 300 tokens: a call of 256, then 44 in 64
    eng = Engine(model, max_batch=2, max_seq_len=320, page_size=8, prefill_chunk=256, decode_steps=2,
                 prefix_cache=False)
    out = eng.generate(prompts, max_new_tokens=5, stop_tokens=[])
    assert widths == [256, 64]
    assert out == kimik3.generate(model, prompts, max_new_tokens=5, stop_tokens=[], max_seq_len=320)


def _agent_turns(model, eng, prompts):
    """Four requests decoding together, a fifth submitted and one aborted mid-decode, then each
    finished request's next turn (its prompt + output + new tokens). Returns what a user sees."""
    sp = [SamplingParams(max_new_tokens=n, temperature=t, seed=i, stop_tokens=(), return_logprobs=True,
                         top_logprobs=2) for i, (n, t) in enumerate(zip((25, 18, 30, 12, 20), (0, 0.7, 0, 1.0, 0)))]
    reqs = [eng.submit(p, s, request_id=i) for i, (p, s) in enumerate(zip(prompts[:4], sp))]
    ahead, steps = 0, 0
    while eng.has_work():
        eng.step()
        steps += 1
        ahead += eng._pending is not None
        if steps == 4:
            reqs.append(eng.submit(prompts[4], sp[4], request_id=4))
        if len(reqs[2].output) >= 24 and reqs[2].finished is None:  # (its next call may be queued)
            assert eng.abort(reqs[2])
    eng.check_pages()
    # the aborted row as of its abort's threshold: how far past it the host saw it depends on
    # when the fifth request took a slot (one call later where calls queue ahead)
    cut = lambda r, xs: xs[:24] if r is reqs[2] else xs
    first = [(cut(r, list(r.output)), cut(r, r.output.logprobs), r.finish_reason) for r in reqs]
    # next turns: some extend the whole answer (the end-of-request checkpoint), some cut it short;
    # the aborted one is retried with what it had
    nxt = [r.prompt + o[:len(o) - 7 * (i % 2)] + prompts[5][:5 + i] for i, (r, (o, _, _)) in enumerate(zip(reqs, first))]
    again = [(list(c), c.logprobs) for c in eng.generate(nxt, max_new_tokens=6, stop_tokens=[], return_logprobs=True)]
    eng.check_pages()
    return first, again, eng.stats()["prefix_hit_tokens"], (ahead, reqs[2].cache_ahead)


def test_decode_calls_queue_ahead_without_changing_outputs(model, monkeypatch):
    """In steady decode the engine dispatches the next call before reading the last one (the
    device does not wait for the scheduler). Greedy and sampled tokens, logprobs, admissions,
    aborts, pages and the prefix cache's end-of-request checkpoints are those of an engine that
    reads every call before the next."""
    prompts = _prompts(6, 11, 10, 30)
    make = lambda: Engine(model, max_batch=4, max_seq_len=128, page_size=8, prefill_chunk=16, decode_steps=3,
                          cache_block=8, checkpoint_interval=16)
    first, again, hits, (ahead, aborted_ahead) = _agent_turns(model, make(), prompts)
    assert ahead >= 4 and aborted_ahead  # calls were queued ahead, the aborted row's among them
    monkeypatch.setattr(Engine, "_chainable", lambda self, call: False)
    first0, again0, hits0, (ahead0, _) = _agent_turns(model, make(), prompts)
    assert ahead0 == 0
    # tokens exactly; logprobs to float noise: a decode row's logprobs differ in the last bit when
    # it rides in a mixed step at another position (the fifth request takes its slot one call
    # later), where a KDA state restored from a wrong position moves them far more
    for ours, plain in ((first, first0), (again, again0)):
        drop_lp = lambda rows: [(o[0], *o[2:]) for o in rows]  # tokens (and finish reasons)
        assert drop_lp(ours) == drop_lp(plain)
        for o, p in zip(ours, plain):
            np.testing.assert_allclose(o[1], p[1], atol=1e-5, rtol=0)
    # the aborted row's state ran past its end in the queued call: it leaves no final checkpoint
    assert 0 < hits <= hits0
    greedy = [kimik3.generate(model, [p], max_new_tokens=len(o), stop_tokens=[], max_seq_len=128)[0]
              for p, (o, _, why), s in zip(prompts, first, (0, 1, 0, 1, 0)) if not s and why != "abort"]
    assert greedy == [o for (o, _, why), s in zip(first, (0, 1, 0, 1, 0)) if not s and why != "abort"]


def test_a_prefill_chunk_that_ends_no_prompt_is_not_read_back(model, monkeypatch):
    """Chunks in the middle of every running prompt have no token to give the host, so the engine
    does not wait for them: the next chunk is prepared and queued while the device computes (no
    device-to-host read until the chunk that completes a prompt). Tokens are unchanged."""
    prompt = _prompts(1, 5, 60, 61)[0]
    want = kimik3.generate(model, [prompt], max_new_tokens=4, stop_tokens=[], max_seq_len=96)[0]
    reads = []

    class Numpy:  # the engine's numpy, counting its reads of device arrays
        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, a, *args, **kw):
            if isinstance(a, jax.Array):
                reads.append(a.shape)
            return np.asarray(a, *args, **kw)

    monkeypatch.setattr(serve.engine, "np", Numpy())
    for prefix_cache in (False, True):
        eng = Engine(model, max_batch=2, max_seq_len=96, page_size=8, prefill_chunk=16, decode_steps=2,
                     prefix_cache=prefix_cache)
        req = eng.submit(prompt, SamplingParams(max_new_tokens=4, stop_tokens=()))
        reads.clear()
        for _ in range(3):  # tokens 0-47 of 60: mid-prompt chunks
            assert eng.step() == [] and req.fed % 16 == 0
        assert reads == []
        eng.step()  # the last chunk: its sample is the first token
        assert reads and req.output
        eng.abort(req)
        req = eng.submit(prompt, SamplingParams(max_new_tokens=4, stop_tokens=()))
        while eng.has_work():
            eng.step()
        assert list(req.output) == want
        eng.check_pages()


def test_no_call_queues_ahead_where_the_host_must_decide(model):
    """Stop strings are checked on the host, so a row with one is read after every call; so is a
    step while a request waits and a slot is free for it. With every slot busy, calls queue ahead
    while requests wait (they take a slot one call later), and the tokens are those of requests
    run one at a time."""
    eng = Engine(model, max_batch=2, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=2)
    eng.submit([1, 2, 3], SamplingParams(max_new_tokens=12, stop_tokens=(), stop_strings=("zz",)))
    eng.submit([4, 5], SamplingParams(max_new_tokens=12, stop_tokens=()))
    eng.submit([6], SamplingParams(max_new_tokens=12, stop_tokens=()))
    while eng.has_work():
        eng.step()
        assert eng._pending is None or not any(r.params.stop_strings for r in eng.running)
        assert eng._pending is None or not eng.waiting or None not in eng.slots

    prompts = _prompts(5, 4)
    eng = Engine(model, max_batch=2, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=2)
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=m, stop_tokens=())) for p, m in zip(prompts, (9, 14, 7, 11, 8))]
    queued_while_waiting = 0
    while eng.has_work():
        eng.step()
        queued_while_waiting += eng._pending is not None and bool(eng.waiting)
    assert queued_while_waiting > 0
    alone = [kimik3.generate(model, [p], max_new_tokens=m, stop_tokens=[], max_seq_len=64)[0]
             for p, m in zip(prompts, (9, 14, 7, 11, 8))]
    assert [list(r.output) for r in reqs] == [list(a) for a in alone]
    eng.check_pages()



def test_close_frees_the_cache_at_once_and_ends_what_was_in_flight(model):
    """An engine sits in reference cycles (its prefix cache points back at it): without close()
    its cache would wait for Python's collector, which a sweep building one engine a run outpaced."""
    gc.disable()
    try:
        eng = Engine(model, max_batch=2, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=2)
        running = eng.submit([1, 2, 3], SamplingParams(max_new_tokens=20, stop_tokens=()))
        while len(running.output) < 3:
            eng.step()
        waiting = eng.submit([4, 5], SamplingParams(max_new_tokens=4))
        cache = weakref.ref(next(c["latent"] for c in eng.layers if "latent" in c))
        eng.close()
        assert cache() is None  # freed now, not at the next collection
        assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort")
        assert not eng.has_work()
        for use in (lambda: eng.submit([1]), eng.step):
            with pytest.raises(RuntimeError, match="closed"):
                use()
    finally:
        gc.enable()
    with Engine(model, max_batch=1, max_seq_len=32, page_size=8) as eng:
        assert eng.generate([[1, 2]], max_new_tokens=2)[0]
    assert eng.closed
