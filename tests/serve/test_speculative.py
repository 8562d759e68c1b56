"""Speculative decoding: outputs equal plain decoding (greedy and seeded sampling), rollback keeps
exactly the accepted prefix's state, the committed tokens follow the target's distribution, and the
depth controller picks the depth with the most committed tokens per second."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimik3
from serve import Engine, SamplingParams
from serve.drafters import NgramDrafter
from serve.speculation import WINDOW, Speculator
from serve.steps import verify_step


SHAPE = dict(max_batch=3, max_seq_len=96, page_size=8)  # one engine shape: its steps compile once


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["tiny"]


def _repetitive_prompts(n, seed):
    """Prompts that repeat a random span (what n-gram drafts catch), plus a random tail."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        span = list(map(int, rng.integers(1, 255, size=int(rng.integers(2, 7)))))
        tail = list(map(int, rng.integers(1, 255, size=int(rng.integers(0, 4)))))
        out.append([1] + span * int(rng.integers(1, 5)) + tail)
    return out


def _verify(model, cache, tokens, n_new, seeds, temperature=0.0):
    B = tokens.shape[0]
    return verify_step(model, jax.tree.map(jnp.copy, cache.layers), jnp.asarray(tokens, jnp.int32),
                       cache.lengths, jnp.asarray(n_new, jnp.int32), None, jnp.asarray(seeds, jnp.uint32),
                       jnp.zeros(B, jnp.int32), jnp.full(B, temperature, jnp.float32), jnp.zeros(B, jnp.int32),
                       jnp.ones(B, jnp.float32), jnp.full((B, 1), -1, jnp.int32), backend="reference")


def test_rollback_keeps_exactly_the_accepted_prefix(model):
    """After a verify pass with a rejected draft, each row's KDA state and conv state are bitwise
    those of a pass that fed only the accepted tokens, and match token-by-token decoding."""
    cfg = model.cfg
    _, cache = kimik3.prefill(model, [[1, 5, 9, 13, 7], [1, 2, 3], [4]], max_seq_len=32, backend="reference")
    plain, c, tok = [], jax.tree.map(jnp.copy, cache), jnp.array([11, 12, 13])
    toks = [np.asarray(tok)]
    for _ in range(4):
        lg, c = kimik3.decode_step(model, c, tok, backend="reference")
        plain.append(jax.tree.map(np.asarray, c.layers))
        tok = jnp.argmax(lg, -1)
        toks.append(np.asarray(tok))
    toks = np.stack(toks, 1)  # [B, 5]: the fed token, then 4 greedy tokens
    tokens = toks[:, :4].copy()
    tokens[1, 2] = (tokens[1, 2] + 1) % cfg.vocab_size  # row 1: its 2nd draft is wrong
    n_new = np.array([4, 4, 2])  # row 2 drafts one token only
    samples, accepted, _, layers = _verify(model, cache, tokens, n_new, np.zeros(3))
    accepted = np.asarray(accepted)
    np.testing.assert_array_equal(accepted, [3, 1, 1])
    np.testing.assert_array_equal(np.asarray(samples)[0], toks[0, 1:])
    keep = accepted + 1
    # the same pass feeding only the kept tokens
    _, only = kimik3.extend(model, jax.tree.map(jnp.copy, cache), tokens, keep, backend="reference")
    for i, (e, o) in enumerate(zip(layers, only.layers)):
        if "latent" in e:
            continue
        for key in ("state", "conv"):
            np.testing.assert_array_equal(np.asarray(e[key]), np.asarray(o[key]), err_msg=f"layer {i} {key}")
            for b in range(3):
                np.testing.assert_allclose(np.asarray(e[key])[b], plain[keep[b] - 1][i][key][b], atol=2e-6)


class OracleDrafter:
    """Drafts the known plain-decoding continuation, each token corrupted with probability 1/3:
    acceptance and rejection at ragged positions, across rows, with known right answers."""

    def __init__(self, prompts, outputs, seed=0):
        self.want = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.rng = np.random.default_rng(seed)

    def propose(self, key, tokens, k):
        for p, o in self.want.items():
            if tuple(tokens[:len(p)]) == p:
                d = list(o[len(tokens) - len(p):][:k])
                return [t if self.rng.random() > 1 / 3 else (t + 1) % 256 for t in d]
        raise AssertionError("unknown request")


def test_engine_outputs_equal_plain_decoding(model):
    """Continuous batching, ragged acceptance: greedy rows and seeded sampled rows give the tokens
    plain decoding gives; rollback after every rejection keeps later tokens exact."""
    prompts = _repetitive_prompts(7, 0)
    params = [SamplingParams(max_new_tokens=10, temperature=0.0 if i % 2 else 0.8, top_k=0 if i % 3 else 20,
                             seed=i, stop_tokens=()) for i in range(len(prompts))]
    want = Engine(model, **SHAPE).generate(prompts, params=params)
    eng = Engine(model, **SHAPE, speculative=OracleDrafter(prompts, want),
                 num_speculative_tokens=3)
    assert eng.generate(prompts, params=params) == want
    s = eng.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    assert s["spec_depth"] == 3
    eng.check_pages()
    assert eng.allocator.free + eng.prefix.evictable_pages() == eng.allocator.num_pages  # the rest is cache


def test_ngram_drafts_catch_a_repeating_output(model):
    """The random tiny model falls into a loop of a few tokens on this prompt (as random models
    do): n-gram drafts of the loop are accepted and the output is unchanged."""
    prompts = [[1, 2, 3, 2, 3]]
    want = Engine(model, **SHAPE).generate(prompts, max_new_tokens=30, stop_tokens=[])
    eng = Engine(model, **SHAPE, speculative="ngram", num_speculative_tokens=3)
    assert eng.generate(prompts, max_new_tokens=30, stop_tokens=[]) == want
    assert eng.stats()["spec_accepted_tokens"] >= 4


def test_a_model_drafter_is_exact_and_accepted(model):
    """The target itself as the draft model: every greedy draft should be accepted, and the
    outputs are those of plain decoding."""
    prompts = _repetitive_prompts(3, 1)
    want = Engine(model, **SHAPE).generate(prompts, max_new_tokens=9, stop_tokens=[])
    eng = Engine(model, **SHAPE, speculative=model, num_speculative_tokens=3)
    assert eng.generate(prompts, max_new_tokens=9, stop_tokens=[]) == want
    s = eng.stats()
    assert s["spec_accepted_tokens"] >= 0.9 * s["spec_draft_tokens"] > 0


def test_committed_tokens_follow_the_target_distribution(model):
    """Chi-square over 1500 seeded rows on a 6-token slice of the vocabulary: the first committed
    token follows softmax(logits / T) whether the draft was accepted or not."""
    n, temp = 1500, 1.5
    prompt = [1, 7, 9]
    _, cache = kimik3.prefill(model, [prompt] * n, max_seq_len=8, backend="reference")
    logits = np.asarray(kimik3.forward(model, np.array([prompt + [3]]), backend="reference"))[0, -1]
    p = np.exp((logits - logits.max()) / temp)
    p /= p.sum()
    draft = int(np.argmax(p))
    tokens = np.tile(np.array([[3, draft]]), (n, 1))
    samples, accepted, _, _ = _verify(model, cache, tokens, np.full(n, 2), np.arange(n), temperature=temp)
    first = np.asarray(samples)[:, 0]
    np.testing.assert_array_equal(np.asarray(accepted), (first == draft).astype(int))
    top = np.argsort(p)[::-1][:5]  # five likeliest tokens + "any other"
    obs = np.array([(first == t).sum() for t in top] + [(~np.isin(first, top)).sum()])
    exp = n * np.append(p[top], 1 - p[top].sum())
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert chi2 < 20.5, (chi2, obs, exp)  # df 5, p = 0.001
    assert abs((first == draft).mean() - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)


def test_ngram_drafter_finds_the_latest_repeat():
    d = NgramDrafter(min_n=2, max_n=3)
    seq = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert d.propose("r", seq, 3) == [9, 2, 5]  # the latest earlier "5 6" was followed by 9 2 5
    seq += [9, 2]
    assert d.propose("r", seq, 2) == [5, 6]  # "6 9 2" ... longest match first
    assert d.propose("r", [1, 2, 3, 4], 3) == []  # nothing repeats
    assert d.propose("fresh", seq, 0) == []


def test_depth_controller_maximises_committed_tokens_per_second():
    s = Speculator("ngram", "auto")
    keys = ["a", "b"]
    for k in s.depths:  # calls that compile are not timed
        s.timed(2, k, 100.0, compiled=True)
    for _ in range(20):
        s.record("a", 10, 9)
        s.record("b", 10, 9)
    s.timed(2, 0, 0.010)  # a plain token
    for k, t in ((2, 0.012), (4, 0.014), (7, 0.040)):
        s.timed(2, k, t)
    assert s.choose(keys) == 2  # one timing each: re-timed first, the longest waiting first
    for k, t in ((2, 0.012), (4, 0.014), (7, 0.040)):
        s.timed(2, k, t)
    assert s.choose(keys) == 4  # ~4.1 tokens / 14 ms beats 2.7 / 12 ms, 1 / 10 ms, 5.7 / 40 ms
    s.cycle_s[(2, 4)] = s.cycle_s[(2, 2)] = s.cycle_s[(2, 7)] = 1.0  # speculation too slow: off
    assert s.choose(keys) == 0
    assert s.stats()["spec_depth"] == 0


def test_depth_controller_prunes_deeper_depths_and_re_times_losers_by_their_cost():
    """Timed as on the GPU for a tiny model whose verify cycle is host-bound: plain 0.5 ms a token,
    depth 2 1.74 ms; at acceptance 0.69 depth 4 commits ~2.7 tokens, which cannot beat plain
    decoding at no less than depth 2's cycle, so it is not tried (the old rule costed it at one
    plain token and paid a probe of each deeper depth). Depth 2, 3.5x plain, is re-timed at the
    next cycle (one timing may be a program's slow first run), then after 3.5 x explore_every
    cycles, not every explore_every."""
    s = Speculator("ngram", "auto", explore_every=10)
    for _ in range(30):
        s.record("a", 10, 7)
    assert s.choose(["a"]) == 0
    s.timed(1, 0, 0.0005)
    assert s.choose(["a"]) == 2  # untimed, could pay at plain decoding's cycle
    s.timed(1, 2, 0.00174)
    chosen = []
    for _ in range(80):
        chosen.append(s.choose(["a"]))
        s.timed(1, chosen[-1], 0.00174 if chosen[-1] else 0.0005)
    retimed = [i for i, k in enumerate(chosen) if k]
    assert set(chosen) == {0, 2}, chosen  # never depth 4 or 7
    assert retimed == [0, 35, 70], retimed  # then every 35 cycles (3.48 x 10), not every 10


def test_a_cycle_time_is_the_least_of_its_recent_timings():
    """A slow first timing (a program's first run, a collection pause) does not hold a depth's
    estimate up, as it did in an average; WINDOW later timings replace it, so a rising load is
    followed; a one-token call where nothing was drafted does not overwrite a depth's real cycles,
    only stand in for them until they are timed."""
    s = Speculator("ngram", "auto")
    s.timed(1, 0, 0.001)
    s.timed(1, 2, 0.009)
    s.timed(1, 2, 0.002)
    assert s.cycle_s[(1, 2)] == 0.002
    for _ in range(WINDOW):
        s.timed(1, 2, 0.003)
    assert s.cycle_s[(1, 2)] == 0.003
    s.timed_undrafted(1, 2, 0.050)
    assert s.cycle_s[(1, 2)] == 0.003 and s.cycle_s[(1, 4)] == s.cycle_s[(1, 7)] == 0.050  # untimed ones: timed
    s.timed_undrafted(1, 4, 0.020)  # depths that one-token calls alone timed follow them
    assert s.cycle_s[(1, 4)] == s.cycle_s[(1, 7)] == 0.020
    s.timed(1, 4, 0.030)  # until their real cycles are timed
    assert s.cycle_s[(1, 4)] == 0.030 and s.cycle_s[(1, 7)] == 0.020
    s.account(2, 0.010, 22)
    s.account(0, 0.010, 10)
    assert s.stats()["spec_spent"] == {"depth 0": {"seconds": 0.010, "tokens": 10},
                                       "depth 2": {"seconds": 0.010, "tokens": 22}}


def test_a_depth_being_timed_is_settled_only_once_timed():
    """A call at a depth not yet timed (or due a re-timing, or timed by one-token calls alone)
    has no call queued behind it: the engine waits for its timing before choosing again."""
    s = Speculator("ngram", "auto", explore_every=10)
    for _ in range(30):
        s.record("a", 10, 7)
    s.timed(16, 0, 0.0005)
    assert s.choose(["a"] * 16) == 2 and not s.settled(16, 2)
    s.timed(16, 2, 0.0007)
    assert not s.settled(16, 2)  # one timing: timed again before calls queue behind it
    assert s.choose(["a"] * 16) == 2
    s.timed(16, 2, 0.0006)
    assert s.settled(16, 2) and not s.settled(8, 2)  # per size class
    s.timed_undrafted(16, 2, 0.0006)
    assert not s.settled(16, 4)  # one-token calls stand in for its cycle: still to be timed
    s.cycles += 100
    assert not s.settled(16, 2)  # due a re-timing
    assert Speculator("ngram", 3).settled(4, 3)  # a fixed depth: no choice waits on a timing


def test_engine_queues_no_call_behind_a_depth_it_is_timing(model, monkeypatch):
    """A depth's first device call is collected before the next is dispatched (it used to queue
    a second call of the same untimed depth behind it); once timed, calls queue ahead. The
    tokens stay plain decoding's."""
    prompts = [[1] + [5, 6, 7, 8] * 6, [1] + [9, 10, 11] * 8]
    kw = dict(max_batch=2, max_seq_len=128, page_size=8, decode_steps=2, prefix_cache=False)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, stop_tokens=())
    want = Engine(model, **kw).generate(prompts, params=[params] * 2)
    eng = Engine(model, **kw, speculative="ngram")  # auto, its choice pinned at depth 2
    monkeypatch.setattr(Speculator, "choose", lambda self, keys: setattr(self, "depth", 2) or 2)
    queued_unsettled = []
    real = Engine._spec_chain

    def chain(self, call):
        queued_unsettled.append(not self.spec.settled(len(call.rows), call.depth))
        return real(self, call)

    monkeypatch.setattr(Engine, "_spec_chain", chain)
    reqs = [eng.submit(p, params) for p in prompts]
    while eng.has_work():
        eng.step()
    assert [list(r.output) for r in reqs] == want
    assert queued_unsettled and not any(queued_unsettled)  # calls were queued, none unsettled


def test_a_call_run_alone_is_timed_from_its_dispatch(model, monkeypatch):
    """A depth being timed runs its call alone (nothing queued behind it); the depths it is
    compared with run queued, their dispatch hidden behind the call ahead. So a lone call's
    timing leaves out its dispatch: here a dispatch made 0.4 s slow does not reach the
    controller's cycle times, and the tokens stay plain decoding's."""
    prompts = [[1] + [5, 6, 7, 8] * 6, [1] + [9, 10, 11] * 8]
    kw = dict(max_batch=2, max_seq_len=128, page_size=8, decode_steps=2, prefix_cache=False)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, stop_tokens=())
    want = Engine(model, **kw).generate(prompts, params=[params] * 2)
    eng = Engine(model, **kw, speculative="ngram")
    monkeypatch.setattr(Speculator, "choose", lambda self, keys: setattr(self, "depth", 2) or 2)
    monkeypatch.setattr(Speculator, "settled", lambda self, rows, depth: False)  # every call alone
    assert eng.generate(prompts, params=[params] * 2) == want  # compiles the programs the test runs
    real, slow = Engine._spec_dispatch, 0.4

    def dispatch(self, rows, k, x):
        call = real(self, rows, k, x)
        jax.block_until_ready(call.outs)  # the device's work done within the dispatch's time
        time.sleep(slow)
        return call

    monkeypatch.setattr(Engine, "_spec_dispatch", dispatch)
    timings = []
    monkeypatch.setattr(Speculator, "timed", lambda self, rows, depth, seconds, compiled=False: timings.append(
        (depth, seconds, compiled)))
    reqs = [eng.submit(p, params) for p in prompts]
    while eng.has_work():
        eng.step()
    assert [list(r.output) for r in reqs] == want
    cycles = [t for d, t, compiled in timings if d == 2 and not compiled]
    assert cycles and max(cycles) * kw["decode_steps"] < slow, timings


def test_depth_controller_turns_itself_off_when_nothing_is_drafted():
    # a drafter that never finds a draft (random text): every depth-k cycle commits one token at
    # the cost of a one-step call, which is what every depth costs then: two timed such cycles
    # (after the one that compiles it) turn speculation off, not two per depth
    s = Speculator("ngram", "auto")
    assert s.choose(["a"]) == 0  # plain decoding is timed first
    s.timed(1, 0, 1.0, compiled=True)  # not timed
    s.timed(1, 0, 0.010)
    chosen = []
    for _ in range(60):
        k = s.choose(["a"])
        chosen.append(k)
        if k:
            s.record("a", 0, 0, offered=k)
            s.timed_undrafted(1, k, 0.015, compiled=not any(chosen[:-1]))  # its first call compiles
        else:
            s.timed(1, 0, 0.010)
    # the shallowest depth that could pay: its compiling call, then two timed ones (one timing
    # may be a program's slow first run)
    assert chosen[:3] == [2, 2, 2] and chosen[3:] == [0] * 57, chosen
    assert {k: round(t, 3) for (_, k), t in s.cycle_s.items()} == {0: 0.010, 2: 0.015, 4: 0.015, 7: 0.015}
    assert s.stats()["spec_draft_tokens"] == 0


def test_bad_speculation_settings_are_one_line_errors(model):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, max_batch=2, max_seq_len=32, speculative="ngram", num_speculative_tokens=9)
    with pytest.raises(ValueError, match="speculative="):
        Engine(model, max_batch=2, max_seq_len=32, speculative="eagle")
    other = kimik3.Model(params=model.params, cfg=model.cfg.replace(vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, max_batch=2, max_seq_len=32, speculative=other)


def test_speculation_keeps_prefix_cache_hits(model):
    """A second turn that extends the first still hits the prefix cache with speculation on (the
    peers' reported bug: speculation silently disabling hybrid-model prefix hits), and its tokens
    equal those of an engine with neither."""
    first = [1] + list(range(40, 110))  # longer than one 64-token block
    eng = Engine(model, **SHAPE, speculative=NgramDrafter(min_n=1), num_speculative_tokens=3)
    out1 = eng.generate([first], max_new_tokens=6, stop_tokens=[])[0]
    second = first + list(out1) + [7, 8, 9]
    out2 = eng.generate([second], max_new_tokens=6, stop_tokens=[])[0]
    s = eng.stats()
    assert s["prefix_hit_tokens"] >= 64, s
    plain = Engine(model, **SHAPE, prefix_cache=False)
    assert [list(out1), list(out2)] == [list(o) for o in plain.generate([first, second], max_new_tokens=6,
                                                                          stop_tokens=[])]


def test_speculation_on_tp_and_dcp_meshes(tiny_greedy):
    """The verify pass under TP2 x DCP4 (MLA's T > 1 path over every rank's slice of the pages,
    KDA keeping every position's state in shard_map) with ragged acceptance and rollback: the
    tokens are the one-device plain decoding's."""
    import sharding

    placed = sharding.place_model(tiny_greedy.model, sharding.make_mesh(tensor=2, dcp=4))
    eng = Engine(placed, max_batch=4, max_seq_len=64, page_size=8, prefill_chunk=16, decode_steps=3,
                 dcp_axes=("dcp",), speculative=OracleDrafter(tiny_greedy.prompts, tiny_greedy.tokens, seed=1),
                 num_speculative_tokens=3)
    assert eng.generate(tiny_greedy.prompts, max_new_tokens=8, stop_tokens=[]) == tiny_greedy.tokens
    s = eng.stats()
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    eng.check_pages()


def test_drafters_read_the_sequence_in_place():
    """The drafters' input is a view of prompt + output (no copy of a long context a cycle):
    length, items and slices (negative, past the end, across the prompt's end) equal the list's,
    and it follows the request as it grows."""
    import random

    from serve.request import Request

    rng = random.Random(0)
    req = Request.__new__(Request)
    for _ in range(50):
        req.prompt = [rng.randrange(100) for _ in range(rng.randrange(9))]
        req.output = [rng.randrange(100) for _ in range(rng.randrange(9))]
        view, seq = req.view(), req.prompt + req.output
        assert len(view) == len(seq) and view[::2] == seq[::2]
        for a in range(-11, 12):
            if -len(seq) <= a < len(seq):
                assert view[a] == seq[a]
            for b in (*range(-11, 12), None):
                assert view[a:b] == seq[a:b]
        req.output.append(7)
        assert len(view) == len(seq) + 1 and view[-1] == 7
    with pytest.raises(IndexError, match="out of a sequence"):
        view[len(view)]


def test_plain_calls_queue_ahead_while_speculation_is_off(model, monkeypatch):
    """Where the controller keeps speculation off (depth 0: its choice is pinned here, as wall-clock
    timings decide it), plain decode calls are queued ahead of the host as without speculation,
    each still chosen and timed, and the tokens stay plain decoding's."""
    rng = np.random.RandomState(5)
    prompts = [list(map(int, rng.randint(0, 256, 20))) for _ in range(3)]
    params = SamplingParams(max_new_tokens=60, stop_tokens=())
    want = Engine(model, **SHAPE).generate(prompts, params=[params] * 3)
    chosen = []
    monkeypatch.setattr(Speculator, "choose", lambda self, keys: chosen.append(len(keys)) or 0)
    eng = Engine(model, **SHAPE, speculative="ngram")
    for p in prompts:
        eng.submit(p, params)
    ahead = steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        ahead += eng._pending is not None
    assert [list(r.output) for r in sorted(eng.done, key=lambda r: r.submitted)] == want
    assert ahead >= 3 and len(chosen) <= steps  # one choice a cycle
    assert (4, 0) in eng.spec.cycle_s  # plain calls timed, queued ones included


def test_ngram_index_equals_a_plain_search_as_the_sequence_grows():
    """The drafter's index (hashed n-grams, extended in numpy) proposes what a plain search for the
    latest earlier occurrence of the longest suffix proposes, as tokens arrive one or several at a
    time and when a request restarts shorter than what was indexed."""
    def plain(seq, k, lo, hi):
        for n in range(min(hi, len(seq) - 1), lo - 1, -1):
            ends = [e for e in range(n, len(seq)) if seq[e - n:e] == seq[-n:]]
            if ends:
                return seq[ends[-1]:ends[-1] + k]
        return []

    rng = np.random.RandomState(0)
    for lo, hi in ((2, 4), (1, 3), (3, 3)):
        d = NgramDrafter(min_n=lo, max_n=hi)
        for trial in range(40):
            seq = list(map(int, rng.randint(0, 6, rng.randint(0, 30))))  # a small vocabulary repeats
            for grown in range(7):
                k = int(rng.randint(0, 5))
                assert d.propose(trial, seq, k) == (plain(seq, k, lo, hi) if k and len(seq) > lo else []), (seq, k)
                seq = seq + list(map(int, rng.randint(0, 6, rng.randint(1, 4))))
            seq = seq[:rng.randint(0, len(seq))]  # restarted, shorter than what was indexed
            assert d.propose(trial, seq, 3) == (plain(seq, 3, lo, hi) if len(seq) > lo else []), seq
    vocab = 163840  # K3's: token ids that fill 18 bits
    seq = list(map(int, rng.randint(0, vocab, 500))) * 2
    assert NgramDrafter().propose("k3", seq, 7) == seq[500:507]


def test_only_calls_that_compile_go_untimed(model):
    """The controller leaves out of its cycle times exactly the calls that compiled a program: the
    first engine of some shapes compiles its first decode call, a second engine of the same shapes
    (a new server, a new benchmark run) compiles nothing and is timed from its first call."""
    kw = dict(max_batch=3, max_seq_len=88, page_size=8, prefill_chunk=8, decode_steps=3, speculative="ngram",
              prefix_cache=False)  # shapes no other test runs: the first engine compiles here
    prompts = [list(range(i, i + 8)) for i in (1, 20, 40)]

    def first_decode_call_timed(eng):
        reqs = [eng.submit(p, SamplingParams(max_new_tokens=12, stop_tokens=())) for p in prompts]
        while not all(r.output for r in reqs):  # the prefill call samples each row's first token
            eng.step()
        eng.step()
        timed = (4, 0) in eng.spec.cycle_s  # 3 rows: size class 4, depth 0
        while eng.has_work():
            eng.step()
        return timed

    assert not first_decode_call_timed(Engine(model, **kw))
    assert first_decode_call_timed(Engine(model, **kw))


def test_a_trained_model_accepts_the_ngram_drafts_of_a_code_edit():
    """On the trained tiny-code model (a model whose greedy choices are not near-ties, unlike the
    random-weight ones) re-emitting held-out code, the n-gram drafts are mostly accepted, and the
    tokens are plain decoding's."""
    from benchmarks.speculative import code_edit_prompts

    code = kimik3.load("tiny-code")
    prompts = code_edit_prompts(code, 2, 400)
    shape = dict(max_batch=2, max_seq_len=640, page_size=16, prefill_chunk=128, decode_steps=4)
    plain = Engine(code, **shape).generate(prompts, max_new_tokens=40, stop_tokens=[])
    eng = Engine(code, **shape, speculative="ngram", num_speculative_tokens=3)
    assert eng.generate(prompts, max_new_tokens=40, stop_tokens=[]) == plain
    stats = eng.stats()
    assert stats["spec_acceptance"] > 0.4 and stats["spec_accepted_tokens"] >= 20, stats


def test_chained_cycles_resume_a_row_that_filled_its_call_and_compile_nothing_after_warmup(model):
    """A row whose drafts all pass commits depth + 1 tokens a cycle and reaches, at a call's end,
    the positions its pages were reserved for; the call chained behind it resumes it (it had
    carried the row as ended, and the engine then stepped forever committing nothing). Chained
    calls, speculative and plain, run programs that warmup compiled."""
    from serve.queued_decode import DecodeCall
    from serve.spec_cycle import SpecCall
    from serve.steps import compiled_programs

    prompts = [[1] + [5, 6, 7, 8] * 6, [1] + [9, 10, 11] * 8]
    kw = dict(max_batch=2, max_seq_len=128, page_size=8, decode_steps=2, prefix_cache=False)
    params = SamplingParams(max_new_tokens=60, temperature=0.0, stop_tokens=())
    outputs, counts = [], []
    for spec in (None, "ngram"):
        eng = Engine(model, **kw, speculative=spec, num_speculative_tokens=2)
        eng.warmup()
        before = compiled_programs()
        reqs = [eng.submit(p, params) for p in prompts]
        chained, most = 0, 0
        for _ in range(200):
            if not eng.has_work():
                break
            done = [len(r.output) for r in reqs]
            eng.step()
            most = max([most] + [len(r.output) - n for r, n in zip(reqs, done)])
            chained += isinstance(eng._pending, SpecCall if spec else DecodeCall)
        assert not eng.has_work() and compiled_programs() == before and chained
        outputs.append([list(r.output) for r in reqs])
        counts.append(most)
    assert outputs[0] == outputs[1]
    assert counts[1] == 2 * 3  # a call's 2 cycles committed 3 tokens each: it filled its pages


def test_warmup_compiles_every_program_serving_runs(model):
    """Engine.warmup compiles the prefill widths, the decode calls and the depth's verify pass
    (plain and with logprobs) on idle rows: requests of every prompt length, speculation and
    logprobs then compile nothing, and give the tokens of an engine that did not warm up."""
    from serve.steps import compiled_programs

    kw = dict(max_batch=2, max_seq_len=80, page_size=8, prefill_chunk=64, decode_steps=2, prefix_cache=False)
    prompts = [list(range(1, 70)), [5, 6, 7], _repetitive_prompts(1, 3)[0]]  # widths 64 and 16
    params = [SamplingParams(max_new_tokens=9, temperature=0.7 * (i % 2), seed=i, stop_tokens=(),
                             return_logprobs=i == 2, top_logprobs=2 * (i == 2)) for i in range(3)]
    want = Engine(model, **kw).generate(prompts, params=params)
    for depth in (3,):  # a depth "auto" never chooses: only warmup compiles it
        eng = Engine(model, **kw, speculative=NgramDrafter(min_n=1), num_speculative_tokens=depth)
        assert eng.warmup(logprobs=True) > 0
        before = compiled_programs()
        got = eng.generate(prompts, params=params)
        assert compiled_programs() == before
        assert [list(c) for c in got] == [list(c) for c in want]
        assert eng.stats()["spec_draft_tokens"] > 0
        with pytest.raises(RuntimeError, match="before the first request"):
            eng.submit([1, 2]) and eng.warmup()


def test_device_ngram_drafts_equal_the_host_drafter():
    """drafters.ngram_drafts (every row at once, on device) proposes what NgramDrafter.propose does,
    on sequences of small and large alphabets (many repeats, few), empty and short ones included."""
    from serve.drafters import ngram_drafts

    rng = np.random.RandomState(0)
    B, H, k = 48, 80, 5
    hist, lengths, want = np.zeros((B, H), np.int32), np.zeros(B, np.int32), []
    for b in range(B):
        seq = list(map(int, rng.randint(0, [2, 3, 5, 50][b % 4], rng.randint(0, 78))))
        hist[b, :len(seq)], lengths[b] = seq, len(seq)
        want.append(NgramDrafter().propose(b, seq, k))
    drafts, count = (np.asarray(a) for a in ngram_drafts(jnp.asarray(hist), jnp.asarray(lengths), k))
    assert [list(drafts[b, :count[b]]) for b in range(B)] == want
    assert 0 < sum(map(bool, want)) < B


def test_ngram_cycles_run_on_device_and_equal_plain_decoding(model, monkeypatch):
    """With n-gram drafts the cycles run several to a device call (spec_steps), the next call
    queued behind the one the host reads: greedy and seeded sampled rows, stop tokens and ragged
    lengths, more requests than slots, give plain decoding's tokens; a row asking for logprobs
    sends the cycles back to the host, still exact."""
    import serve.spec_cycle as spec_cycle

    calls, chained = [], []
    real, real_chain = spec_cycle.spec_decode_steps, Engine._spec_chain
    monkeypatch.setattr(spec_cycle, "spec_decode_steps", lambda *a, **kw: calls.append(kw["depth"]) or real(*a, **kw))
    monkeypatch.setattr(Engine, "_spec_chain", lambda self, call: chained.append(1) or real_chain(self, call))
    prompts = _repetitive_prompts(6, 4) + [[1, 2, 3, 2, 3]]
    params = [SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.0 if i % 3 else 0.9, seed=i,
                             stop_tokens=(7,) if i == 4 else ()) for i in range(len(prompts))]
    want = Engine(model, **SHAPE, decode_steps=3).generate(prompts, params=params)
    eng = Engine(model, **SHAPE, decode_steps=3, speculative="ngram", num_speculative_tokens=3)
    assert eng.generate(prompts, params=params) == want
    assert calls and set(calls) == {3} and eng.stats()["spec_accepted_tokens"] > 0
    assert chained  # calls queued on device behind the one the host reads
    eng.check_pages()
    n = len(calls)
    lp = [SamplingParams(max_new_tokens=8, stop_tokens=(), return_logprobs=True, top_logprobs=1)]
    want_lp = Engine(model, **SHAPE, decode_steps=3).generate(prompts[-1:], params=lp)
    assert eng.generate(prompts[-1:], params=lp) == want_lp and len(calls) == n


def test_ngram_cycles_on_device_slide_their_window(model, monkeypatch):
    """A row longer than the drafter's window: each call (and each call chained behind it) looks
    up only the newest tokens, and the token it feeds is still the newest; outputs unchanged."""
    import serve.spec_cycle as spec_cycle
    import serve.spec_steps as spec_steps

    monkeypatch.setattr(spec_steps, "SPEC_WINDOW", 8)
    monkeypatch.setattr(spec_cycle, "SPEC_WINDOW", 8)
    prompts = [[1, 2, 3, 2, 3], _repetitive_prompts(1, 5)[0]]
    want = Engine(model, **SHAPE, decode_steps=3).generate(prompts, max_new_tokens=30, stop_tokens=[])
    eng = Engine(model, **SHAPE, decode_steps=3, speculative="ngram", num_speculative_tokens=2)
    assert eng.generate(prompts, max_new_tokens=30, stop_tokens=[]) == want
    assert eng.stats()["spec_accepted_tokens"] > 0


def test_no_cycle_runs_where_no_row_has_a_draft(model, monkeypatch):
    """Speculative cycles run only once the host finds a draft for some row; until then plain
    decoding's step runs, not a verify pass (which costs more and, on the GPU, rounds
    differently): with the verify pass made wrong, a row the drafter finds nothing for keeps
    plain decoding's tokens, and a row it drafts for does not."""
    import serve.spec_steps as spec_steps

    real = spec_steps.verify

    def wrong(model, layers, tokens, *args):
        samples, accepted, lp, layers = real(model, layers, tokens, *args)
        return (samples + 1) % model.cfg.vocab_size, accepted, lp, layers

    monkeypatch.setattr(spec_steps, "verify", wrong)
    spec_steps.spec_decode_steps.clear_cache()  # traced again with the wrong verify pass, and after
    try:
        rng = np.random.RandomState(7)
        fresh = [list(map(int, rng.randint(1, 256, 12)))]
        params = [SamplingParams(max_new_tokens=10, temperature=0.9, seed=3, stop_tokens=())]
        plain = Engine(model, **SHAPE, decode_steps=3)
        eng = Engine(model, **SHAPE, decode_steps=3, speculative="ngram", num_speculative_tokens=3)
        assert eng.generate(fresh, params=params) == plain.generate(fresh, params=params)
        assert eng.stats()["spec_draft_tokens"] == 0
        repeating = [[1, 2, 3, 2, 3], _repetitive_prompts(1, 5)[0]]  # greedy: drafts found
        want = plain.generate(repeating, max_new_tokens=30, stop_tokens=[])
        assert eng.generate(repeating, max_new_tokens=30, stop_tokens=[]) != want
        assert eng.stats()["spec_draft_tokens"] > 0
    finally:
        spec_steps.spec_decode_steps.clear_cache()
