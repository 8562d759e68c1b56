"""Continuous-batching engine: a fixed set of decode slots, chunked prefill interleaved with
decode, a paged MLA latent cache with a page allocator, a pool of KDA state slots, admission by
free pages, and preemption (free the pages, recompute later) instead of running out of memory.

Jitted shapes: a mixed step of width `prefill_chunk` (and of a few narrower widths, so a short
prefill, such as a prompt's tail after a prefix-cache hit, does not pay for a whole chunk) and one
`decode_steps`-token decode loop, all over the `max_batch` slots, so nothing recompiles in steady
state.

In steady decode the engine keeps one decode call queued on the device ahead of the host: the
next call starts from the last one's device outputs (each row's last token, position, sample
count, and whether it still decodes), so the scheduler's work between calls (reading tokens,
stop checks, the prefix cache's bookkeeping, streaming) overlaps the device instead of idling it.
Where the host must decide between calls (a request waiting with a slot free for it, stop strings,
pages short, speculation) it reads each call before dispatching the next.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.generation import (Completion, accept_token, encode_prompts, logprob_rows, prompt_seeds, stop_set,
                               text_tokenizer)
from kimik3.model import Model, cache_shapes
from kimik3.runtime import mesh_context, run_mesh
from kimik3.sampling import check_sampling, step_sampling

from .cache_budget import plan_cache
from .pages import PageAllocator
from .prefix_cache import CACHE, PrefixCache
from .speculation import Speculator, Stopwatch
from .spec_cycle import SpeculativeCycle
from .queued_decode import DecodeCall, QueuedDecode
from .request import Request, SamplingParams
from .drafters import NgramDrafter
from .spec_steps import compile_spec_idle
from .steps import STOP_SLOTS, compile_idle, compiled_programs, decode_steps, mixed_step


MIN_PREFILL_WIDTH = 64  # narrower calls are launch-bound: a few more widths would only add compiles


def prefill_widths(chunk: int) -> tuple[int, ...]:
    """The mixed step's widths, widest first: the chunk, then quarters of it down to 64 tokens;
    a call takes the narrowest that holds its longest row."""
    widths = [chunk]
    while widths[-1] % 4 == 0 and widths[-1] // 4 >= MIN_PREFILL_WIDTH:
        widths.append(widths[-1] // 4)
    return tuple(widths)


class Engine(QueuedDecode, SpeculativeCycle):
    def __init__(self, model: Model, max_batch: int = 8, max_seq_len: int = 1024, page_size: int = 16,
                 num_pages: int | None = None, memory_budget_bytes: int | None = None,
                 prefill_chunk: int = 32, decode_steps: int = 4, tokenizer=None, backend=None,
                 dcp_axes: tuple = (), prefix_cache: bool = True, cache_block: int = 64,
                 device_cache_bytes: int | None = None, host_cache_bytes: int = 0,
                 checkpoint_interval: int | None = None, speculative=None, num_speculative_tokens="auto"):
        """memory_budget_bytes: what one device may spend on the cache (MLA pages + KDA state slots);
        the page count follows from it. dcp_axes: decode context parallelism over these axes of
        the mesh the weights are placed on: every cache page's positions are split over them
        (page_size must be a multiple of their size), so each device holds 1/dcp of every
        sequence's MLA history, and a budget buys dcp times the pages.

        prefix_cache: reuse the MLA pages and KDA state of prompt prefixes already computed
        (serve/prefix_cache.py), in blocks of cache_block tokens (a multiple of page_size).
        Cached pages share the page pool with running requests (evicted when it runs short);
        device_cache_bytes bounds the KDA checkpoints kept on device (default: one checkpoint per
        checkpoint_interval tokens the page pool holds, at least one per slot: cached history is
        only restorable with a checkpoint at its end, and sessions waiting between turns outnumber
        the slots), host_cache_bytes the host tier both move to when evicted (0: none).
        checkpoint_interval: tokens between checkpoints taken inside a long prefill (default:
        the tokens whose MLA pages weigh as much as one checkpoint, rounded up to a multiple of
        the block and of prefill_chunk, so interior checkpoints never outweigh the pages they
        pair with and never cut a chunk short).
        speculative: None, "ngram" (drafts from the request's own tokens) or a kimik3 Model sharing
        the tokenizer (drafts greedily on its own cache); num_speculative_tokens: "auto" (the
        depth with the most committed tokens per second, measured; 0 = off) or an int 1..7."""
        cfg = model.cfg
        if max_batch < 1 or max_seq_len < 1 or page_size < 1 or prefill_chunk < 1 or decode_steps < 1:
            raise ValueError("max_batch, max_seq_len, page_size, prefill_chunk, decode_steps must be >= 1")
        self.model, self.cfg, self.backend = model, cfg, backend
        self.dcp_axes = tuple(dcp_axes)
        self.mesh = mesh = run_mesh(model)  # found once: flattening the weights every step costs host time
        dcp = 1
        if self.dcp_axes:
            if mesh is None:
                raise ValueError("dcp_axes needs the model's weights placed on a mesh: "
                                 "kimik3.init(cfg, mesh=...) or sharding.place_model(model, mesh)")
            missing = [a for a in self.dcp_axes if a not in mesh.axis_names]
            if missing:
                raise ValueError(f"dcp_axes {missing} are not axes of the weights' mesh {mesh.axis_names}")
            dcp = math.prod(mesh.shape[a] for a in self.dcp_axes)
            if page_size % dcp:
                raise ValueError(f"page_size={page_size} must be a multiple of the DCP size {dcp} "
                                 f"(each device holds page_size / {dcp} positions of every page)")
        self.max_batch, self.page_size = max_batch, page_size
        self.pages_per_seq = math.ceil(max_seq_len / page_size)
        self.max_seq_len = self.pages_per_seq * page_size
        self.prefill_chunk, self.decode_steps = prefill_chunk, decode_steps
        self.prefill_widths = prefill_widths(prefill_chunk)
        self.tokenizer = tokenizer
        shapes = cache_shapes(cfg, max_batch, page_size)
        item = lambda s, d: math.prod(s) * np.dtype(d).itemsize
        # bytes of one page on one device (under DCP each device holds 1/dcp of every page)
        self.page_bytes = sum(item(e["latent"][0][1:], e["latent"][1]) for e in shapes if "latent" in e) // dcp
        self.slot_bytes = sum(item(s[1:], d) for e in shapes if "latent" not in e for s, d in e.values())
        plan = plan_cache(max_batch=max_batch, page_size=page_size, max_seq_len=self.max_seq_len,
                          prefill_chunk=prefill_chunk, page_bytes=self.page_bytes, slot_bytes=self.slot_bytes,
                          num_pages=num_pages, memory_budget_bytes=memory_budget_bytes, prefix_cache=prefix_cache,
                          cache_block=cache_block, device_cache_bytes=device_cache_bytes,
                          host_cache_bytes=host_cache_bytes, checkpoint_interval=checkpoint_interval)
        num_pages, device_cache_bytes, checkpoint_interval = plan
        self.allocator = PageAllocator(int(num_pages))
        layers = []
        for e in cache_shapes(cfg, max_batch, page_size):
            if "latent" in e:
                s, d = e["latent"]
                pool = jnp.zeros((self.allocator.num_pages,) + s[1:], d)
                if self.dcp_axes:  # every page's positions over the DCP axes
                    pool = jax.device_put(pool, jax.sharding.NamedSharding(
                        mesh, jax.sharding.PartitionSpec(None, self.dcp_axes, None)))
                layers.append({"latent": pool})
            else:
                layers.append({k: jnp.zeros(s, d) for k, (s, d) in e.items()})
        self.layers = tuple(layers)
        self.slots: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.done: list[Request] = []
        self.admitted_prompt_tokens = 0  # with the prefix cache off (it counts its own)
        self._ids = itertools.count()
        self._reset = np.zeros(max_batch, bool)
        self._pending = None  # a DecodeCall or SpecCall dispatched ahead of the host
        self._step_end = time.perf_counter()
        self._spec_next = None  # a depth speculation's controller chose while a call was queued
        self.closed = False
        self.prefix = (PrefixCache(self, cache_block, device_cache_bytes, host_cache_bytes, checkpoint_interval)
                       if prefix_cache else None)
        self.spec = None if speculative is None else Speculator(speculative, num_speculative_tokens)
        if self.spec is not None and hasattr(self.spec.drafter, "check_target"):
            self.spec.drafter.check_target(cfg)

    # ---- submission ----
    def submit(self, prompt, params: SamplingParams | None = None, request_id=None) -> Request:
        """Queue one prompt (a string or a list of token ids); raises ValueError before queueing
        anything if the prompt or the settings are bad."""
        req = self._request(prompt, params, request_id)
        self.waiting.append(req)
        return req

    def _request(self, prompt, params: SamplingParams | None, request_id, index: int = 0) -> Request:
        """A checked request, not yet queued."""
        self._check_open()
        params = params or SamplingParams()
        params.check(self.cfg.vocab_size)
        tok = text_tokenizer(self.cfg, self.tokenizer)
        if params.stop_strings and tok is None:
            raise ValueError("stop_strings need the model's tokenizer: pass Engine(..., tokenizer=)")
        prompt = encode_prompts(self.cfg, [prompt], self.tokenizer, first=index)[0]
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt {index}: {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                             f"the engine's max_seq_len {self.max_seq_len}")
        lp = [] if params.return_logprobs else None
        return Request(id=next(self._ids) if request_id is None else request_id, prompt=prompt, params=params,
                       output=Completion(logprobs=lp, top_logprobs=None if lp is None else []),
                       submitted=time.perf_counter())

    def abort(self, req: Request) -> bool:
        """Stop a request between steps (its client went away, its stream was closed): it leaves
        the queue or its slot, its pages are freed, finish_reason "abort". False if it had
        already finished."""
        if req.finished is not None:
            return False
        if self._pending is not None and req.slot is not None and any(r is req for r in self._pending.rows):
            req.cache_ahead = True  # the call in flight may feed it past req.fed
        for i, r in enumerate(self.waiting):
            if r is req:  # by identity: Requests compare by value
                del self.waiting[i]
                break
        self._finish(req, "abort")
        return True

    def close(self):
        """Free the engine's device and host memory now: its cache, the call queued ahead, the
        prefix cache's checkpoints and host tier. An engine sits in reference cycles (its prefix
        cache points back at it), so dropping the last name of one frees nothing until Python's
        collector runs: a sweep building an engine per run held every earlier run's cache. Requests
        still in flight end with finish_reason "abort"; the engine takes no more work."""
        for req in list(self.waiting) + self.running:
            self.abort(req)
        self._pending = self.prefix = self.layers = None
        self.closed = True

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this Engine was closed (Engine.close): build a new one to run more requests")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def warmup(self, logprobs: bool = False, sampling: bool = True) -> int:
        """Compile what steady serving runs (each prefill width, the decode calls, each speculative
        depth's verify pass or, with n-gram drafts, its on-device cycles; the prefix cache's state
        and page copies; with `logprobs`, the steps' logprob variants too; the programs of
        all-greedy batches and, with `sampling`, of batches where a row samples) before the first
        request, as servers capture their graphs at start-up: no request then waits for a compile
        and speculation's first cycles are timed, not compiled. Returns how many of the steps'
        programs were compiled (0 where this process already holds them)."""
        self._check_open()
        if self.has_work():
            raise RuntimeError("Engine.warmup runs before the first request: call it right after Engine(...)")
        before = compiled_programs()
        depths = [k for k in (self.spec.depths if self.spec is not None else ()) if k]
        lengths = sorted({self.decode_steps} | ({1} if depths else set()))  # 1: a cycle without drafts
        with mesh_context(self.mesh):
            on_device = depths and isinstance(self.spec.drafter, NgramDrafter)  # n-gram cycles run on device
            for sampled in sorted({False, sampling}):
                for lp in sorted({False, logprobs}):  # (the host's verify pass: other drafters, and logprobs)
                    host_depths = depths if not on_device or lp else ()
                    self.layers = compile_idle(self.model, self.layers, self.max_batch, self.prefill_widths, lengths,
                                               host_depths, self.pages_per_seq, self.backend, self.dcp_axes, lp,
                                               sampled)
                if on_device:
                    self.layers = compile_spec_idle(self.model, self.layers, self.max_batch, depths,
                                                    self.decode_steps, self.max_seq_len, self.pages_per_seq,
                                                    self.spec.drafter.min_n, self.spec.drafter.max_n, self.backend,
                                                    self.dcp_axes, sampled)
        if self.prefix is not None:
            self.prefix.compile_ops()
        jax.block_until_ready(self.layers)
        return compiled_programs() - before

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or self._pending is not None or any(r is not None for r in self.slots)

    def check_pages(self):
        """Allocator invariants: no leaked pages, none owned twice, every holder listed; with the
        prefix cache, the cache's own (stats() and reference counts) too."""
        if self.prefix is None:
            return self.allocator.check({r.id: r.pages for r in self.running})
        cached = self.prefix.cached_pages()
        held = {r.id: [p for p in r.pages if p not in cached] for r in self.running}
        held[CACHE] = sorted(cached)
        self.allocator.check(held)
        self.prefix.check(self.running)

    def stats(self) -> dict:
        """Counters of this engine's work so far: the prefix cache's (prompt_tokens,
        prefix_hit_tokens, prefix_hit_rate, kda_checkpoints, host_restored_bytes, evictions, ...;
        zeros with the cache off) and speculation's (spec_draft_tokens, spec_accepted_tokens,
        spec_depth, the cycle times the depth was chosen from and each depth's seconds and
        committed tokens (spec_spent); zeros with it off)."""
        if self.prefix is not None:
            out = self.prefix.stats()
        else:
            out = {"prompt_tokens": self.admitted_prompt_tokens, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0,
                   "kda_checkpoints": 0, "host_restored_bytes": 0, "evictions": 0}
        if self.spec is not None:
            out.update(self.spec.stats())
        else:
            out.update(spec_draft_tokens=0, spec_accepted_tokens=0, spec_depth=0)
        return out

    # ---- scheduling ----
    def _admit(self):
        held = []  # requests waiting for a running prefill of their prefix: they keep their place
        try:
            for s in range(self.max_batch):
                if self.slots[s] is not None:
                    continue
                while self.waiting:
                    req = self.waiting[0]
                    if self.prefix is not None and self.prefix.still_waiting(req):  # no lookup per step
                        held.append(self.waiting.popleft())
                        continue
                    hit = self.prefix.lookup(req) if self.prefix else None  # pins the hit's pages
                    if hit is None or not self.prefix.wait_for_inflight(req, hit):
                        break
                    self.prefix.unpin(hit)  # restored once that prefill has checkpointed the prefix
                    held.append(self.waiting.popleft())
                else:
                    return
                need = math.ceil((req.seq_len + 1) / self.page_size)
                if hit is not None:
                    need -= self.prefix.shared_pages(hit)
                if self.available_pages() - self._reserve() < need:
                    if hit is not None:
                        self.prefix.unpin(hit)
                    return  # FIFO: wait for pages rather than let later requests overtake
                self.waiting.popleft()
                assert not req.pages, "a waiting request holds no pages"
                req.slot, req.fed = s, 0
                self.slots[s] = req
                if self.prefix is None and req.prefix_hit_tokens is None:  # first admission (not after preemption)
                    req.prefix_hit_tokens = 0
                    self.admitted_prompt_tokens += len(req.prompt)
                self._reset[s] = not (hit is not None and self.prefix.restore(req, hit, s))
        finally:
            self.waiting.extendleft(reversed(held))

    def available_pages(self) -> int:
        """Free pages plus cached pages no running request reads (evicted on demand)."""
        return self.allocator.free + (self.prefix.evictable_pages() if self.prefix else 0)

    def _alloc(self, n: int, owner) -> list[int] | None:
        if self.prefix is not None and self.allocator.free < n:
            self.prefix.evict_pages(n)
        return self.allocator.alloc(n, owner)

    def _reserve(self) -> int:
        """Pages running requests still need to reach their next step (admission keeps them)."""
        return sum(max(0, math.ceil((r.fed + self.decode_steps) / self.page_size) - len(r.pages))
                   for r in self.running)

    def _preempt(self, keep: Request) -> bool:
        victims = [r for r in self.running if r is not keep]
        if not victims:
            return False
        victim = max(victims, key=lambda r: r.submitted)  # the newest loses its cache first
        self._release(victim)
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        return True

    def _release(self, req: Request):
        if self.prefix is not None:
            self.prefix.release(req)  # caches its blocks and final state, hands those pages over
        self.allocator.release([p for p in req.pages if self.allocator.owner(p) == req.id], req.id)
        req.pages = []
        self.slots[req.slot] = None
        req.slot = None

    def _ensure_pages(self, req: Request, upto: int) -> bool:
        need = math.ceil(upto / self.page_size) - len(req.pages)
        while need > 0:
            got = self._alloc(need, req.id)
            if got is not None:
                req.pages += got
                return True
            if not self._preempt(req):
                return False
        return True

    def _finish(self, req: Request, reason: str):
        req.finish_reason, req.finished = reason, time.perf_counter()
        if self.spec is not None:
            self.spec.forget(req.id)
        if req.slot is not None:
            self._release(req)
        self.done.append(req)

    def _accept(self, req: Request, tokens, logprobs=None) -> list[int]:
        """Append sampled tokens until a stop condition (kimik3.generate's rules); returns the
        tokens kept. logprobs: per token (chosen, {id: logprob}) when the request asked for them."""
        p = req.params
        stops = stop_set(self.cfg, p.stop_tokens)
        tok = text_tokenizer(self.cfg, self.tokenizer)
        start = len(req.output)
        for j, t in enumerate(tokens):
            if req.first_token is None:
                req.first_token = time.perf_counter()
            reason = accept_token(req.output, int(t), p.max_new_tokens, stops, p.stop_strings, tok,
                                  None if logprobs is None else logprobs[j])
            if reason:
                req.text = req.output.text
                self._finish(req, reason)
                break
        return req.output[start:]

    # ---- one scheduler iteration ----
    def step(self) -> list[tuple[Request, list[int]]]:
        """Collect one device call; returns (request, new tokens) for every request that produced
        any. In steady decode the next call is already queued on the device when this returns
        (its tokens come with the next step)."""
        self._check_open()
        try:
            return self._step_pending() if self._pending is not None else self._step()
        finally:
            self._step_end = time.perf_counter()

    def _step(self):
        self._admit()
        running = self.running
        if not running:
            if self.waiting:  # nothing fits even alone
                req = self.waiting.popleft()
                self._finish(req, "error: the request does not fit in the cache pages")
                return [(req, [])]
            return []
        prefilling = [r for r in running if r.fed < r.seq_len - (1 if r.output else 0)]
        B = self.max_batch
        start = np.zeros(B, np.int32)
        n_new = np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        gen = np.zeros(B, np.int32)
        temp = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        if prefilling:
            chunks = {}
            for r in list(running):
                if r.slot is None:  # preempted by an earlier row of this loop
                    continue
                if r in prefilling:
                    end = r.fed + self.prefill_chunk
                    end = end if self.prefix is None else self.prefix.chunk_end(r, end)
                    todo = r.tokens(r.fed, end)
                else:
                    todo = [r.output[-1]]
                if self._ensure_pages(r, r.fed + len(todo)):
                    chunks[id(r)] = todo
                else:
                    self._finish(r, "error: the request does not fit in the cache pages")
            running = self.running  # preemption may have removed rows
            longest = max((len(chunks[id(r)]) for r in running), default=1)
            T = next(w for w in reversed(self.prefill_widths) if w >= longest)
            tokens = np.zeros((B, T), np.int32)
            for r in running:
                todo = chunks[id(r)]
                tokens[r.slot, :len(todo)] = todo
                start[r.slot], n_new[r.slot] = r.fed, len(todo)
            steps = 1
        else:
            steps, undrafted = self.decode_steps, 0
            if self.spec is not None:
                events = self._speculate(running, self._spec_next)
                self._spec_next = None
                if events is not None:
                    return events
                if self.spec.depth:  # no draft this time: one token, so the next has a chance
                    steps, undrafted = 1, self.spec.depth
            tokens = np.zeros(B, np.int32)
            stops = np.full((B, STOP_SLOTS), -1, np.int32)
            limit = np.zeros(B, np.int32)
            for r in list(running):
                if r.slot is None:  # preempted by an earlier row of this loop
                    continue
                # tokens past max_seq_len are never accepted (max_new_tokens ends the request first)
                if not self._ensure_pages(r, min(r.fed + steps, self.max_seq_len)):
                    self._finish(r, "error: the request does not fit in the cache pages")
            running = self.running
            for r in running:
                tokens[r.slot], start[r.slot], n_new[r.slot] = r.output[-1], r.fed, 1
                stop = self._stop_ids(r)
                stops[r.slot, :len(stop)] = stop
                limit[r.slot] = r.params.max_new_tokens
        table = np.zeros((B, self.pages_per_seq), np.int32)
        for r in running:
            s, p = r.slot, r.params
            table[s, :len(r.pages)] = r.pages
            seeds[s], gen[s] = p.seed, len(r.output)
            temp[s], top_k[s], top_p[s] = p.temperature, p.top_k, p.top_p
        # host arrays go to the jitted steps as they are: jit moves them in its C++ dispatch, where
        # a jnp.asarray each was a Python-level dispatch per array per step
        want_lp = any(r.params.return_logprobs for r in running)  # else the steps skip that work
        temp, top_k, top_p = step_sampling(temp, top_k, top_p)  # None: an all-greedy batch's program
        common = dict(page_table=table, seeds=seeds, gen_idx=gen, temperature=temp, top_k=top_k, top_p=top_p,
                      backend=self.backend, dcp_axes=self.dcp_axes, logprobs=want_lp)
        # on a mesh the MoE layers run in shard_map (dedup / expert parallelism) under it
        clock = Stopwatch()
        with mesh_context(self.mesh), clock:
            if prefilling:
                sampled, lp, self.layers = mixed_step(self.model, self.layers, tokens, start, n_new,
                                                      self._reset.copy(), **common)
                if any(r.fed + int(n_new[r.slot]) >= r.seq_len for r in running):  # a sample is a token
                    sampled = np.asarray(sampled)[None]  # [1, B]
                    lp = lp and tuple(np.asarray(a)[None] for a in lp)
                else:  # every row is mid-prompt: nothing to read, so the next chunk queues behind this one
                    sampled = lp = None
            else:
                *outs, carry, self.layers = decode_steps(self.model, self.layers, tokens, start, n_new,
                                                         stops=stops, limit=limit, steps=steps, **common)
                call = DecodeCall(running, steps, outs, carry, common, stops, limit)
                if (self.spec is None or self.spec.depth == 0) and self._chainable(call):
                    self._pending = self._chain(call)
                sampled, n_new, lp = call.results()
        if self.spec is not None and not prefilling:
            # a plain call is depth 0's per-token cost; a depth-k cycle that found no draft is
            # what depth k costs while drafts are missing
            if undrafted:
                self.spec.timed_undrafted(len(running), undrafted, clock.seconds, clock.compiled)
            else:
                self.spec.timed(len(running), 0, clock.seconds / steps, clock.compiled)
            self.spec.account(undrafted, clock.seconds, int(n_new[[r.slot for r in running]].sum()), clock.compiled)
        self._reset[:] = False
        return self._apply(running, sampled, n_new, lp, prefilling)

    def _apply(self, running, sampled, n_new, lp, prefilling: bool):
        """Apply a device call's results to its rows: tokens fed, blocks cached, samples accepted."""
        events = []
        for r in running:
            s = r.slot
            r.fed += int(n_new[s])
            if self.prefix is not None:
                self.prefix.after_step(r)
            if r.fed < len(r.prompt):  # mid-prefill: the sample is not a token yet
                continue
            if prefilling and r.fed < r.seq_len:  # recomputing after preemption
                continue
            rows = None
            if r.params.return_logprobs:  # per step: (chosen, {id: logprob}) of this row
                rows = [logprob_rows(lp, r.params.top_logprobs, i)[s] for i in range(sampled.shape[0])]
            kept = self._accept(r, sampled[:, s], rows)
            if kept or r.finished:
                events.append((r, kept))
        return events

    def _stop_ids(self, r: Request) -> list[int]:
        """The ids the device steps stop feeding a row at (at most STOP_SLOTS)."""
        return sorted(stop_set(self.cfg, r.params.stop_tokens))[:STOP_SLOTS]

    # ---- user-facing ----
    def stream(self, prompts, params=None):
        """Submit prompts (a list of strings / token lists; a bare string is one prompt) and yield
        (request, chunk) as tokens are accepted: chunk is a `Completion` of the new tokens (with
        their .logprobs / .top_logprobs when params ask for them, and .finish_reason on the last).
        Every prompt is checked before any is queued; closing the iterator early aborts the
        requests it still has in flight."""
        yield from self._drive(self._queue(prompts, params))

    def _queue(self, prompts, params) -> list[Request]:
        """Check every prompt and its params, then queue them all (or none)."""
        prompts = encode_prompts(self.cfg, prompts, self.tokenizer)
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} SamplingParams for {len(prompts)} prompts: give one per prompt")
        reqs = [self._request(p, sp, None, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        self.waiting.extend(reqs)
        return reqs

    def _drive(self, reqs):
        """Step until every one of reqs has finished, yielding (request, chunk) for them."""
        pending = {id(r): r for r in reqs}
        try:
            while pending:
                for req, toks in self.step():
                    if id(req) not in pending:
                        continue
                    out, n = req.output, len(toks)
                    tail = lambda xs: None if xs is None else xs[len(xs) - n:]
                    yield req, Completion(toks, finish_reason=req.finish_reason, logprobs=tail(out.logprobs),
                                          top_logprobs=tail(out.top_logprobs))
                    if req.finished is not None:
                        del pending[id(req)]
        finally:
            for req in pending.values():
                self.abort(req)

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens=None, stop_strings=(), return_logprobs=False,
                 top_logprobs: int = 0, params=None) -> list[Completion]:
        """kimik3.generate's contract on the engine: one `Completion` per prompt (a list of new
        token ids with .text, .finish_reason, .logprobs, .top_logprobs), the same checks, and the
        same samples for the same seed (prompt i uses seed + i). A bare string is one prompt.
        `params` (one SamplingParams per prompt) overrides the keyword settings."""
        if params is None:
            check_sampling(max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, stop_strings,
                           top_logprobs, self.cfg.vocab_size)
            n = 1 if isinstance(prompts, str) else len(prompts)
            params = [SamplingParams(max_new_tokens, temperature, top_k, top_p, int(s),
                                     None if stop_tokens is None else tuple(stop_tokens), tuple(stop_strings),
                                     return_logprobs, top_logprobs) for s in prompt_seeds(seed, n)]
        reqs = self._queue(prompts, params)
        for _ in self._drive(reqs):
            pass
        tok = text_tokenizer(self.cfg, self.tokenizer)
        for r in reqs:
            r.output.finish_reason = r.finish_reason
            r.output.text = r.text if r.text is not None else (tok.decode(r.output) if tok is not None else None)
        return [r.output for r in reqs]

