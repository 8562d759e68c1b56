"""Continuous-batching engine: a fixed set of decode slots, chunked prefill interleaved with
decode, a paged MLA latent cache with a page allocator, a pool of KDA state slots, admission by
free pages, and preemption (free the pages, recompute later) instead of running out of memory.

Jitted shapes: one mixed step of width `prefill_chunk` and one `decode_steps`-token decode loop,
both over all `max_batch` slots, so nothing recompiles in steady state.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from kimik3.model import Model, cache_shapes
from kimik3.runtime import check_tokens, mesh_context, run_mesh
from kimik3.tokenizer import default_tokenizer

from .pages import PageAllocator
from .prefix_cache import CACHE, PrefixCache
from .steps import decode_steps, mixed_step


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple | None = None  # None: the model's EOS
    stop_strings: tuple = ()

    def check(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                             f"{self.temperature}, {self.top_p}, {self.top_k}")


@dataclasses.dataclass
class Request:
    id: object
    prompt: list
    params: SamplingParams
    output: list = dataclasses.field(default_factory=list)
    slot: int | None = None
    pages: list = dataclasses.field(default_factory=list)
    fed: int = 0  # tokens of prompt + output already in the cache
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    preemptions: int = 0
    text: str | None = None
    prefix_hit_tokens: int | None = None  # prompt tokens restored from the prefix cache at admission
    prefix: object = None  # its place in the prefix cache while it holds a slot

    @property
    def sequence(self):
        """What the cache must hold before the next sample: prompt, then all but the newest output."""
        return self.prompt + self.output

    @property
    def metrics(self) -> dict:
        ttft = None if self.first_token is None else self.first_token - self.submitted
        n = len(self.output)
        span = (self.finished or time.perf_counter()) - (self.first_token or self.submitted)
        return {"prompt_tokens": len(self.prompt), "output_tokens": n, "ttft_s": ttft,
                "decode_tokens_per_s": (n - 1) / span if n > 1 and span > 0 else None,
                "preemptions": self.preemptions, "prefix_hit_tokens": self.prefix_hit_tokens or 0}


STOP_SLOTS = 8  # stop tokens the decode loop checks on device (past that, the host still stops)


class Engine:
    def __init__(self, model: Model, max_batch: int = 8, max_seq_len: int = 1024, page_size: int = 16,
                 num_pages: int | None = None, memory_budget_bytes: int | None = None,
                 prefill_chunk: int = 32, decode_steps: int = 4, tokenizer=None, backend=None,
                 dcp_axes: tuple = (), prefix_cache: bool = True, cache_block: int = 64,
                 device_cache_bytes: int | None = None, host_cache_bytes: int = 0,
                 checkpoint_interval: int | None = None):
        """memory_budget_bytes: what one device may spend on the cache (MLA pages + KDA state slots);
        the page count follows from it. dcp_axes: decode context parallelism over these axes of
        the mesh the weights are placed on: every cache page's positions are split over them
        (page_size must be a multiple of their size), so each device holds 1/dcp of every
        sequence's MLA history, and a budget buys dcp times the pages.

        prefix_cache: reuse the MLA pages and KDA state of prompt prefixes already computed
        (serve/prefix_cache.py), in blocks of cache_block tokens (a multiple of page_size).
        Cached pages share the page pool with running requests (evicted when it runs short);
        device_cache_bytes bounds the KDA checkpoints kept on device (default: one per slot, the
        end of each running session's turn), host_cache_bytes the host tier both move to when
        evicted (0: none). checkpoint_interval: tokens between checkpoints taken inside a long
        prefill (default: the tokens whose MLA pages weigh as much as one checkpoint, rounded up
        to a block, so interior checkpoints never outweigh the pages they pair with)."""
        cfg = model.cfg
        if max_batch < 1 or max_seq_len < 1 or page_size < 1 or prefill_chunk < 1 or decode_steps < 1:
            raise ValueError("max_batch, max_seq_len, page_size, prefill_chunk, decode_steps must be >= 1")
        self.model, self.cfg, self.backend = model, cfg, backend
        self.dcp_axes = tuple(dcp_axes)
        mesh = run_mesh(model)
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
        self.tokenizer = tokenizer
        shapes = cache_shapes(cfg, max_batch, page_size)
        item = lambda s, d: math.prod(s) * np.dtype(d).itemsize
        # bytes of one page on one device (under DCP each device holds 1/dcp of every page)
        self.page_bytes = sum(item(e["latent"][0][1:], e["latent"][1]) for e in shapes if "latent" in e) // dcp
        self.slot_bytes = sum(item(s[1:], d) for e in shapes if "latent" not in e for s, d in e.values())
        if prefix_cache:
            if cache_block < 1 or cache_block % page_size:
                raise ValueError(f"cache_block={cache_block} must be a positive multiple of page_size={page_size}")
            if device_cache_bytes is None:
                device_cache_bytes = max_batch * self.slot_bytes
            if device_cache_bytes < self.slot_bytes:
                raise ValueError(f"device_cache_bytes={device_cache_bytes} holds no KDA checkpoint ({self.slot_bytes} B "
                                 "each): raise it, or prefix_cache=False")
            block_bytes = cache_block // page_size * self.page_bytes
            if host_cache_bytes and host_cache_bytes < self.slot_bytes + block_bytes:
                raise ValueError(f"host_cache_bytes={host_cache_bytes} holds less than one block's pages plus one "
                                 f"KDA checkpoint ({block_bytes} + {self.slot_bytes} B): raise it, or 0 for no host tier")
            if checkpoint_interval is None:
                tokens = math.ceil(self.slot_bytes * page_size / max(self.page_bytes, 1))
                checkpoint_interval = max(1, math.ceil(tokens / cache_block)) * cache_block
            if checkpoint_interval < 1 or checkpoint_interval % cache_block:
                raise ValueError(f"checkpoint_interval={checkpoint_interval} must be a positive multiple of "
                                 f"cache_block={cache_block}")
        else:
            device_cache_bytes = 0
        if num_pages is None:
            if memory_budget_bytes is None:
                num_pages = max_batch * self.pages_per_seq
            else:
                left = memory_budget_bytes - max_batch * self.slot_bytes - device_cache_bytes
                num_pages = left // max(self.page_bytes, 1) if self.page_bytes else self.pages_per_seq
                if num_pages < self.pages_per_seq:
                    raise ValueError(
                        f"memory_budget_bytes={memory_budget_bytes} holds {max(num_pages, 0)} cache pages after "
                        f"{max_batch} KDA state slots ({self.slot_bytes} B each) and {device_cache_bytes} B of "
                        f"prefix-cache checkpoints, but one {self.max_seq_len}-token "
                        f"sequence needs {self.pages_per_seq} pages of {self.page_bytes} B: raise the budget or "
                        "lower max_batch / max_seq_len")
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
        self._ids = itertools.count()
        self._reset = np.zeros(max_batch, bool)
        self.prefix = (PrefixCache(self, cache_block, device_cache_bytes, host_cache_bytes, checkpoint_interval)
                       if prefix_cache else None)

    # ---- submission ----
    def submit(self, prompt, params: SamplingParams | None = None, request_id=None) -> Request:
        params = params or SamplingParams()
        params.check()
        if isinstance(prompt, str):
            tok = self.tokenizer or default_tokenizer(self.cfg)
            prompt = tok.encode(prompt, add_bos=True)
        if len(prompt) == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        prompt = [int(t) for t in check_tokens(self.cfg, list(prompt), "prompt")]
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds "
                             f"the engine's max_seq_len {self.max_seq_len}")
        req = Request(id=next(self._ids) if request_id is None else request_id, prompt=prompt,
                      params=params, submitted=time.perf_counter())
        self.waiting.append(req)
        return req

    @property
    def running(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

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
        """Prefix-cache counters (prompt_tokens, prefix_hit_tokens, prefix_hit_rate, kda_checkpoints,
        host_restored_bytes, evictions, ...); zeros with the cache off."""
        if self.prefix is not None:
            return self.prefix.stats()
        prompt = sum(len(r.prompt) for r in self.done) + sum(len(r.prompt) for r in self.running)
        return {"prompt_tokens": prompt, "prefix_hit_tokens": 0, "prefix_hit_rate": 0.0, "kda_checkpoints": 0,
                "host_restored_bytes": 0, "evictions": 0}

    # ---- scheduling ----
    def _admit(self):
        for s in range(self.max_batch):
            if self.slots[s] is None and self.waiting:
                req = self.waiting[0]
                need = math.ceil((len(req.sequence) + 1) / self.page_size)
                hit = self.prefix.lookup(req) if self.prefix else None  # pins the hit's pages
                if hit is not None:
                    need -= self.prefix.shared_pages(hit)
                if self._available() - self._reserve() < need:
                    if hit is not None:
                        self.prefix.unpin(hit)
                    return  # FIFO: wait for pages rather than let later requests overtake
                self.waiting.popleft()
                assert not req.pages, "a waiting request holds no pages"
                req.slot, req.fed = s, 0
                self.slots[s] = req
                self._reset[s] = not (hit is not None and self.prefix.restore(req, hit, s))

    def _available(self) -> int:
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
        if req.slot is not None:
            self._release(req)
        self.done.append(req)

    def _accept(self, req: Request, tokens) -> list[int]:
        """Append sampled tokens until a stop condition; returns the tokens kept."""
        p = req.params
        stops = {self.cfg.eos_token_id} if p.stop_tokens is None else set(p.stop_tokens)
        kept = []
        for t in tokens:
            t = int(t)
            if req.first_token is None:
                req.first_token = time.perf_counter()
            if t in stops:
                self._finish(req, "stop")
                return kept
            req.output.append(t)
            kept.append(t)
            if p.stop_strings:
                tok = self.tokenizer or default_tokenizer(self.cfg)
                text = tok.decode(req.output)
                hit = [text.index(s) for s in p.stop_strings if s in text]
                if hit:
                    req.text = text[:min(hit)]
                    self._finish(req, "stop")
                    return kept
            if len(req.output) >= p.max_new_tokens:
                self._finish(req, "length")
                return kept
        return kept

    # ---- one scheduler iteration ----
    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one device call; returns (request, new tokens) for every request that produced any."""
        self._admit()
        running = self.running
        if not running:
            if self.waiting:  # nothing fits even alone
                req = self.waiting.popleft()
                self._finish(req, "error: the request does not fit in the cache pages")
                return [(req, [])]
            return []
        prefilling = [r for r in running if r.fed < len(r.sequence) - (1 if r.output else 0)]
        B = self.max_batch
        start = np.zeros(B, np.int32)
        n_new = np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        gen = np.zeros(B, np.int32)
        temp = np.zeros(B, np.float32)
        top_k = np.zeros(B, np.int32)
        top_p = np.ones(B, np.float32)
        if prefilling:
            T = self.prefill_chunk
            tokens = np.zeros((B, T), np.int32)
            chunks = {}
            for r in list(running):
                if r.slot is None:  # preempted by an earlier row of this loop
                    continue
                if r in prefilling:
                    end = r.fed + T if self.prefix is None else self.prefix.chunk_end(r, r.fed + T)
                    todo = r.sequence[r.fed:end]
                else:
                    todo = [r.output[-1]]
                if self._ensure_pages(r, r.fed + len(todo)):
                    chunks[id(r)] = todo
                else:
                    self._finish(r, "error: the request does not fit in the cache pages")
            running = self.running  # preemption may have removed rows
            for r in running:
                todo = chunks[id(r)]
                tokens[r.slot, :len(todo)] = todo
                start[r.slot], n_new[r.slot] = r.fed, len(todo)
            steps = 1
        else:
            steps = self.decode_steps
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
                stop = sorted({self.cfg.eos_token_id} if r.params.stop_tokens is None else set(r.params.stop_tokens))
                stops[r.slot, :min(len(stop), STOP_SLOTS)] = stop[:STOP_SLOTS]
                limit[r.slot] = r.params.max_new_tokens
        table = np.zeros((B, self.pages_per_seq), np.int32)
        for r in running:
            s, p = r.slot, r.params
            table[s, :len(r.pages)] = r.pages
            seeds[s], gen[s] = p.seed, len(r.output)
            temp[s], top_k[s], top_p[s] = p.temperature, p.top_k, p.top_p
        args = [jnp.asarray(a) for a in (start, n_new)]
        common = dict(page_table=jnp.asarray(table), seeds=jnp.asarray(seeds), gen_idx=jnp.asarray(gen),
                      temperature=jnp.asarray(temp), top_k=jnp.asarray(top_k), top_p=jnp.asarray(top_p),
                      backend=self.backend, dcp_axes=self.dcp_axes)
        # on a mesh the MoE layers run in shard_map (dedup / expert parallelism) under it
        with mesh_context(run_mesh(self.model)):
            if prefilling:
                sampled, self.layers = mixed_step(self.model, self.layers, jnp.asarray(tokens), *args,
                                                  jnp.asarray(self._reset), **common)
                sampled = np.asarray(sampled)[None]  # [1, B]
            else:
                sampled, fed, self.layers = decode_steps(self.model, self.layers, jnp.asarray(tokens),
                                                         args[0], args[1], stops=jnp.asarray(stops),
                                                         limit=jnp.asarray(limit), steps=steps, **common)
                sampled, n_new = np.asarray(sampled), np.asarray(fed)
        self._reset[:] = False
        events = []
        for r in running:
            s = r.slot
            r.fed += int(n_new[s])
            if self.prefix is not None:
                self.prefix.after_step(r)
            if r.fed < len(r.prompt):  # mid-prefill: the sample is not a token yet
                continue
            if prefilling and r.fed < len(r.sequence):  # recomputing after preemption
                continue
            kept = self._accept(r, sampled[:, s])
            if kept or r.finished:
                events.append((r, kept))
        return events

    # ---- user-facing ----
    def stream(self, prompts, params=None):
        """Submit prompts and yield (request, new tokens) as they are produced."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.submit(p, sp) for p, sp in zip(prompts, plist)]
        pending = {id(r) for r in reqs}
        while pending:
            for req, toks in self.step():
                if id(req) in pending:
                    yield req, toks
                    if req.finished is not None:
                        pending.discard(id(req))

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop_tokens=None, stop_strings=(), params=None):
        """Generate for a list of prompts (token lists or strings): one token list per prompt.
        `params` (one SamplingParams per prompt) overrides the keyword defaults."""
        if params is None:
            params = [SamplingParams(max_new_tokens, temperature, top_k, top_p, seed + i,
                                     None if stop_tokens is None else tuple(stop_tokens), tuple(stop_strings))
                      for i in range(len(prompts))]
        reqs = {}
        for req, _ in self.stream(prompts, params):
            reqs[id(req)] = req
        order = sorted(reqs.values(), key=lambda r: r.submitted)
        return [r.output for r in order]
