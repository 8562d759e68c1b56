"""The prefix cache: multi-turn sessions give the tokens the engine gives with the cache off (greedy
and seeded sampling), on device only, with a host tier and under constant eviction; restored KDA
checkpoints are the state at exactly their position; pages and reference counts stay consistent
after every step."""
import numpy as np
import pytest

from serve import Engine, SamplingParams, prefix_cache
from serve.cache_ops import read_state

# one engine geometry for every run, so the jitted steps compile once
GEOMETRY = dict(max_batch=6, max_seq_len=160, page_size=8, prefill_chunk=16, decode_steps=3)
BLOCK = 16


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["tiny"]


def _sessions(n, turns, seed):
    """n sessions x turns of (user tokens, sampling params): three shared system prompts (one
    shorter than a block), ragged user turns (shorter and longer than a block), and the last third
    of the sessions branching off an earlier session after its first turn."""
    rng = np.random.RandomState(seed)
    systems = [list(map(int, rng.randint(0, 256, k))) for k in (9, 23, 40)]
    plans = []
    for s in range(n):
        parent = s - 2 * n // 3 if s >= 2 * n // 3 else None
        users = [list(map(int, rng.randint(0, 256, rng.randint(1, 22)))) for _ in range(turns)]
        sampled = s % 2 == 1
        params = [SamplingParams(max_new_tokens=int(rng.randint(1, 6)), temperature=0.9 if sampled else 0.0,
                                 top_p=0.95, seed=1000 * s + t, stop_tokens=(int(rng.randint(0, 256)),))
                  for t in range(turns)]
        plans.append(dict(system=systems[s % 3], parent=parent, users=users, params=params))
    return plans


def _run_sessions(model, plans, turns, check=True, **kw):
    """Drive the sessions turn by turn (each turn re-sends the whole conversation); returns every
    request's output tokens, each request's prefix hit, and the engine."""
    eng = Engine(model, **GEOMETRY, **kw)
    hist = [list(p["system"]) for p in plans]
    outs, hits = {}, {}
    for t in range(turns):
        reqs = {}
        for s, p in enumerate(plans):
            if t == 1 and p["parent"] is not None:  # branch: the parent's first turn, then its own
                hist[s] = list(hist[p["parent"]])
            hist[s] += p["users"][t]
            reqs[s] = eng.submit(hist[s], p["params"][t], request_id=(s, t))
        while eng.has_work():
            eng.step()
            if check:
                eng.check_pages()
        for s, r in reqs.items():
            assert r.finish_reason in ("stop", "length"), r.finish_reason
            outs[s, t], hits[s, t] = r.output, r.metrics["prefix_hit_tokens"]
            hist[s] += r.output
    return outs, hits, eng


@pytest.fixture(scope="module")
def reference(model):
    plans = _sessions(30, 4, 0)
    outs, hits, eng = _run_sessions(model, plans, 4, check=False, prefix_cache=False)
    assert not any(hits.values()) and eng.stats()["prefix_hit_tokens"] == 0
    return plans, outs


def test_device_tier_sessions_match_cache_off(model, reference):
    plans, want = reference
    probe = Engine(model, **GEOMETRY, cache_block=BLOCK)
    outs, hits, eng = _run_sessions(model, plans, 4, cache_block=BLOCK, num_pages=400,
                                    device_cache_bytes=200 * probe.slot_bytes)
    assert outs == want
    st = eng.stats()
    assert st["prefix_hit_rate"] > 0.5 and st["kda_checkpoints"] > 0, st
    assert st["prefix_hit_tokens"] == sum(hits.values())
    assert all(hits[s, t] > 0 for s in range(30) for t in range(1, 4))  # every later turn hits
    assert eng.allocator.free + eng.prefix.evictable_pages() == eng.allocator.num_pages  # nothing pinned


def test_default_budget_keeps_a_checkpoint_for_every_waiting_session(model, reference):
    """With the default checkpoint budget and a pool that holds every session's pages, sessions
    waiting between turns outnumber the slots (30 sessions, 6 slots): each one's checkpoints
    survive the others' turns, so every second turn hits (a budget of one checkpoint per slot
    kept 6 and hit almost nothing). The default gives one checkpoint per checkpoint interval of
    the pool's tokens: 600 pages of 8 hold 100 of the tiny model's 48-token intervals."""
    plans, want = reference
    outs, hits, eng = _run_sessions(model, plans, 2, check=False, cache_block=BLOCK, num_pages=600)
    assert outs == {k: v for k, v in want.items() if k[1] < 2}
    assert all(hits[s, 1] > 0 for s in range(30)), [hits[s, 1] for s in range(30)]


def test_host_tier_sessions_match_cache_off(model, reference):
    """A device tier of 2 checkpoints and a page pool for ~3 sessions: the rest lives on host and
    comes back on hits."""
    plans, want = reference
    probe = Engine(model, **GEOMETRY, cache_block=BLOCK)
    outs, hits, eng = _run_sessions(model, plans, 4, cache_block=BLOCK, num_pages=60,
                                    device_cache_bytes=2 * probe.slot_bytes, host_cache_bytes=1 << 22)
    assert outs == want
    st = eng.stats()
    assert st["host_restored_bytes"] > 0 and st["evictions"] > 0 and st["prefix_hit_rate"] > 0.5, st
    assert st["host_bytes"] <= 1 << 22


def test_tiny_budget_constant_eviction_matches_cache_off(model, reference):
    """One device checkpoint, no host tier, a pool barely over one sequence: everything cached is
    evicted again and again, and waits for pinned pages instead of touching them."""
    plans, want = reference
    probe = Engine(model, **GEOMETRY, cache_block=BLOCK)
    outs, hits, eng = _run_sessions(model, plans[:12], 4, cache_block=BLOCK, num_pages=24,
                                    device_cache_bytes=probe.slot_bytes)
    assert outs == {k: v for k, v in want.items() if k[0] < 12}
    assert eng.stats()["evictions"] > 20


def _fresh_state(model, tokens):
    """The KDA state after prefilling `tokens` alone (cache off, the same chunks of 16)."""
    eng = Engine(model, **GEOMETRY, prefix_cache=False)
    r = eng.submit(tokens, SamplingParams(max_new_tokens=1, stop_tokens=()))
    slot = None
    while eng.has_work():
        slot = r.slot if r.slot is not None else slot
        eng.step()
    return read_state(eng.layers, slot)


def test_checkpoints_hold_the_state_at_their_position(model):
    """sglang #31474 (a restored state that is not the state at its position) and vllm #41292
    (state layout in chunked prefill): three requests prefill side by side in different slots with
    chunks cut at their checkpoints; every prefill checkpoint equals, bitwise, a fresh prefill of
    exactly its prefix, and the end-of-request ones (after decode) equal it to rounding."""
    rng = np.random.RandomState(5)
    shared = list(map(int, rng.randint(0, 256, 37)))
    prompts = [shared + list(map(int, rng.randint(0, 256, k))) for k in (3, 30, 11)]
    eng = Engine(model, **GEOMETRY, cache_block=BLOCK)
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=4, stop_tokens=()), request_id=i)
            for i, p in enumerate(prompts)]
    while eng.has_work():
        eng.step()
    checked = 0
    for node in eng.prefix.index.nodes():
        if node.ckpt is None:
            continue
        path, n = [], node
        while n.parent is not None:
            path.append(n)
            n = n.parent
        prefix = next(list(r.sequence[:node.depth]) for r in reqs
                      if len(r.sequence) >= node.depth and _covers(r.sequence, path))
        want = _fresh_state(model, prefix)
        from_decode = node.depth not in _prefill_ends(prompts, eng.prefix.interval)
        for a, b in zip(node.ckpt, want):
            for k in a:
                if from_decode:
                    np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-4, atol=1e-5)
                else:
                    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
        checked += 1
    assert checked >= 4


def _covers(seq, path):
    """Whether seq starts with the tokens of the node chain `path` (deepest first)."""
    from serve.prefix_index import chain_key

    key, pos = b"", 0
    for n in reversed(path):
        key = chain_key(key, seq[pos:pos + n.length])
        pos += n.length
        if key != n.key:
            return False
    return True


def _prefill_ends(prompts, interval):
    ends = {len(p) for p in prompts} | {len(p) // BLOCK * BLOCK for p in prompts}
    return ends | {k for p in prompts for k in range(interval, len(p), interval)}


def test_prompts_shorter_than_a_block_hit(model):
    """vllm #40696: sessions whose every prompt is shorter than one block still hit (the end of
    the previous turn is a checkpoint inside the block)."""
    eng = Engine(model, **GEOMETRY, cache_block=64)
    hist, hits, ends = [1, 2, 3], [], [0]
    for t in range(3):
        hist += [10 + t, 20 + t]
        r = eng.submit(list(hist), SamplingParams(max_new_tokens=3, stop_tokens=()))
        while eng.has_work():
            eng.step()
            eng.check_pages()
        hits.append(r.metrics["prefix_hit_tokens"])
        ends.append(len(hist) + 2)  # where its state ends: prompt and all but the last output token
        hist += r.output
    assert len(hist) < 64
    assert hits == ends[:3], (hits, ends)


def _one_after_another(eng, prompts, params, between=None):
    """Run each prompt to its end before the next (checking pages after every step), calling
    `between` after each; returns the outputs and the last request."""
    out = []
    for p in prompts:
        r = eng.submit(p, params)
        while eng.has_work():
            eng.step()
            eng.check_pages()
        out.append(r.output)
        if between is not None:
            between()
    return out, r


def test_a_prompt_sharing_only_whole_blocks_hits_at_the_last_boundary(model):
    """A next prompt that repeats the previous prompt's whole blocks but not its tail (a trace of
    block hashes; a re-rendered last message) hits at the previous prompt's last block boundary,
    not at an earlier interval checkpoint, and gives the cache-off tokens."""
    rng = np.random.RandomState(11)
    first = list(map(int, rng.randint(0, 256, 2 * BLOCK + 9)))
    second = first[:2 * BLOCK] + list(map(int, rng.randint(0, 256, 13)))
    params = SamplingParams(max_new_tokens=4, stop_tokens=())
    eng = Engine(model, **GEOMETRY, cache_block=BLOCK, checkpoint_interval=8 * BLOCK)
    out, r = _one_after_another(eng, (first, second), params)
    assert r.metrics["prefix_hit_tokens"] == 2 * BLOCK
    assert out == Engine(model, **GEOMETRY, prefix_cache=False).generate([first, second], params=[params] * 2)


def test_a_host_restore_of_many_blocks_is_written_in_several_calls(model, monkeypatch):
    """A restore from the host tier of more blocks than one write call takes (7 blocks, 2 a
    call here) puts every page back: the request gives the cache-off tokens."""
    monkeypatch.setattr(prefix_cache, "WRITE_GROUPS", 2)
    rng = np.random.RandomState(13)
    prefix = list(map(int, rng.randint(0, 256, 7 * BLOCK)))
    prompts = [prefix + list(map(int, rng.randint(0, 256, 5))) for _ in range(2)]
    params = SamplingParams(max_new_tokens=4, stop_tokens=())
    eng = Engine(model, **GEOMETRY, cache_block=BLOCK, host_cache_bytes=1 << 22)
    out, r = _one_after_another(eng, prompts, params, between=eng.prefix.offload)  # all to host
    assert r.metrics["prefix_hit_tokens"] == 7 * BLOCK
    assert eng.stats()["host_restored_bytes"] > 0
    assert out == Engine(model, **GEOMETRY, prefix_cache=False).generate(prompts, params=[params] * 2)


def test_the_last_boundary_is_checkpointed_when_the_prompt_ends_in_the_same_chunk(model):
    """A prefill chunk wider than the prompt's tail holds both its last block boundary and its end:
    the chunk stops at the boundary (checkpointed), so a next prompt sharing only the whole blocks
    hits there (the chunk used to stop only at the prompt's end)."""
    rng = np.random.RandomState(12)
    first = list(map(int, rng.randint(0, 256, 3 * BLOCK + 5)))
    second = first[:3 * BLOCK] + list(map(int, rng.randint(0, 256, 7)))
    params = SamplingParams(max_new_tokens=3, stop_tokens=())
    geometry = dict(GEOMETRY, prefill_chunk=64)
    eng = Engine(model, **geometry, cache_block=BLOCK, checkpoint_interval=8 * BLOCK)
    out, r = _one_after_another(eng, (first, second), params)
    assert r.metrics["prefix_hit_tokens"] == 3 * BLOCK
    assert out == Engine(model, **geometry, prefix_cache=False).generate([first, second], params=[params] * 2)


def test_requests_arriving_together_wait_for_the_prefill_of_their_shared_prefix(model):
    """Sessions arriving together with one long shared prefix (an agent's system prompt): the
    first computes it, the others wait until its prefill has passed and checkpointed the point
    where their prompts leave it, then restore from there instead of computing it again; the
    tokens equal the cache-off engine's. A prompt sharing less than a block is not held, nor
    kept from a free slot by the held ones ahead of it."""
    rng = np.random.RandomState(14)
    shared = list(map(int, rng.randint(0, 256, 5 * BLOCK + 3)))
    prompts = [shared + list(map(int, rng.randint(0, 256, 4 + 3 * i))) for i in range(3)]
    prompts.append(list(map(int, rng.randint(0, 256, 20))))  # shares nothing
    params = SamplingParams(max_new_tokens=4, stop_tokens=())
    eng = Engine(model, **GEOMETRY, cache_block=BLOCK, checkpoint_interval=8 * BLOCK)
    reqs = [eng.submit(p, params) for p in prompts]
    eng.step()  # the held requests keep their place; the unrelated one behind them starts at once
    assert [r.slot is not None for r in reqs] == [True, False, False, True]
    while eng.has_work():
        eng.step()
        eng.check_pages()
    assert [r.metrics["prefix_hit_tokens"] for r in reqs] == [0, 5 * BLOCK, 5 * BLOCK, 0]
    assert [r.output for r in reqs] == Engine(model, **GEOMETRY, prefix_cache=False).generate(
        prompts, params=[params] * len(prompts))


def test_restored_request_equals_recomputed_and_preemption_keeps_blocks(model):
    """A pool so small that requests preempt each other: the preempted request's blocks and state
    go to the host tier (its pages are what the pool needed), it resumes from them, and the
    tokens are the cache-off ones."""
    rng = np.random.RandomState(3)
    prompts = [list(map(int, rng.randint(0, 256, k))) for k in (50, 45, 60, 33)]
    params = [SamplingParams(max_new_tokens=20, stop_tokens=(), seed=i, temperature=0.8) for i in range(4)]
    off = Engine(model, **GEOMETRY, prefix_cache=False).generate(prompts, params=params)
    eng = Engine(model, **dict(GEOMETRY, max_batch=4), num_pages=26, cache_block=BLOCK, host_cache_bytes=1 << 22)
    reqs = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_work():
        eng.step()
        eng.check_pages()
    assert [r.output for r in reqs] == off
    assert sum(r.preemptions for r in reqs) > 0
    assert eng.stats()["preempted_restored_tokens"] > 0


def test_bad_budgets_are_refused(model):
    probe = Engine(model, **GEOMETRY, cache_block=BLOCK)
    with pytest.raises(ValueError, match="device_cache_bytes=.* holds no KDA checkpoint"):
        Engine(model, **GEOMETRY, device_cache_bytes=probe.slot_bytes - 1)
    with pytest.raises(ValueError, match="host_cache_bytes=100 holds less than one block"):
        Engine(model, **GEOMETRY, host_cache_bytes=100)
    with pytest.raises(ValueError, match="cache_block=12 must be a positive multiple of page_size=8"):
        Engine(model, **GEOMETRY, cache_block=12)
    with pytest.raises(ValueError, match="checkpoint_interval=24 must be a positive multiple"):
        Engine(model, **GEOMETRY, cache_block=BLOCK, checkpoint_interval=24)
    with pytest.raises(ValueError, match="prefix-cache checkpoints"):
        Engine(model, **GEOMETRY, memory_budget_bytes=3 * probe.page_bytes * 20 + 6 * probe.slot_bytes,
               device_cache_bytes=1 << 20)


def test_sessions_on_tp_and_dcp_meshes(model, reference):
    """8 fake devices, TP8 with every page's positions split over the 8 ranks (DCP8) plus a host
    tier: the one-device cache-off tokens."""
    import sharding

    plans, want = reference
    mesh = sharding.make_mesh(tensor=8)
    placed = sharding.place_model(model, mesh)
    outs, hits, eng = _run_sessions(placed, plans[:6], 3, cache_block=BLOCK, dcp_axes=("tensor",),
                                    num_pages=40, host_cache_bytes=1 << 22)
    assert outs == {k: v for k, v in want.items() if k[0] < 6 and k[1] < 3}
    assert eng.stats()["prefix_hit_tokens"] > 0


def test_warmup_compiles_the_state_and_page_copies(model):
    """Engine.warmup runs the prefix cache's device copies as no-ops: checkpoints and a hit then
    compile none of them, and the warmed engine gives the tokens of a cold one."""
    from serve import cache_ops

    ops = (cache_ops.read_state, cache_ops.write_state, cache_ops.copy_page)
    kw = dict(max_batch=2, max_seq_len=64, page_size=8, prefill_chunk=32, decode_steps=2, cache_block=8)
    prompts = [list(range(1, 21)), list(range(1, 21)) + [7, 8, 9]]
    want = [Engine(model, **kw).generate([p], max_new_tokens=3)[0] for p in prompts]
    eng = Engine(model, **kw)
    eng.warmup()
    sizes = [f._cache_size() for f in ops]
    assert [eng.generate([p], max_new_tokens=3)[0] for p in prompts] == want
    assert eng.stats()["prefix_hit_tokens"] > 0
    assert [f._cache_size() for f in ops] == sizes
