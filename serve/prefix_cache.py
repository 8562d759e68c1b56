"""The engine's prefix cache: shared read-only MLA pages for every cached block of a prefix, and
KDA checkpoints (recurrent + conv state of every KDA layer) at exact positions, so a hit restores
the pages of its prefix and one checkpoint at exactly the hit position.

Where checkpoints come from (the state exists only where a device call ends):
* every `interval` tokens of a prefill (prefill chunks are cut there),
* a junction: a request whose prompt matches cached blocks further than any checkpoint cuts its
  prefill at the deepest matched block and checkpoints it (Marconi's admission: a shared prefix is
  checkpointed when a second request reaches it),
* the end of every prompt and of every request (the engine's decode stops feeding a row at its
  stop token, so the state ends exactly at its last token; the next turn extends it),
* the prompt's last block boundary (vLLM's "align" position): a next prompt that shares the
  prompt's whole blocks but not its tail (a trace of block hashes, a re-rendered last message)
  still hits there instead of at an earlier interval checkpoint.
* where a waiting request's prompt leaves a running request's prompt that is still being
  prefilled: the waiting request is not admitted until that prefill has passed the point and
  checkpointed it, then restores from there (agent sessions arriving together share a long system
  prompt: without the wait each computes it, as the cache holds only what is already computed).
Ends inside a block are "tail" nodes; a request extending one copies its partly filled last page
before writing (copy-on-write). Cached pages are owned by the allocator owner CACHE; running
requests pin the nodes whose pages they read. Eviction is LRU over both tiers: device pages and
checkpoints move to the host tier (if any) or are dropped; the host tier drops its oldest.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from .cache_ops import copy_page, padded_ids, read_pages, read_state, write_pages, write_state
from .host_tier import HostTier
from .prefix_index import Node, PrefixIndex, chain_key

CACHE = "prefix-cache"  # allocator owner of the pages the cache holds
WRITE_GROUPS = 32  # host-restored nodes written per device call


@dataclasses.dataclass
class RequestCache:
    """A request's place in the index: the chain of block nodes it has cached or restored (all
    pinned), other pinned nodes (tails whose pages it reads), and where its prefill should stop
    to checkpoint a junction."""
    chain: list = dataclasses.field(default_factory=list)
    pinned: list = dataclasses.field(default_factory=list)
    junction: int = 0
    prompt_end: Node | None = None  # the node holding the checkpoint at the prompt's end
    wanted: set = dataclasses.field(default_factory=set)  # where a waiting request will restore from

    @property
    def depth(self) -> int:
        return self.chain[-1].depth if self.chain else 0


@dataclasses.dataclass
class Hit:
    chain: list
    tail: Node | None
    length: int
    junction: int

    @property
    def nodes(self) -> list:
        return self.chain + ([self.tail] if self.tail is not None else [])


class PrefixCache:
    def __init__(self, engine, block: int, device_bytes: int, host_bytes: int, interval: int):
        self.eng, self.ps, self.block, self.interval = engine, engine.page_size, block, interval
        self.index = PrefixIndex(block)
        self.refs: dict[int, int] = {}         # page -> nodes listing it
        self.pinned_refs: dict[int, int] = {}  # page -> pinned nodes listing it
        self.ckpt_bytes = engine.slot_bytes
        self.device_budget = device_bytes
        self.device_ckpts = self.host_ckpts = 0  # counted as they come and go: stats() reads them per step
        self.host = HostTier(host_bytes) if host_bytes else None
        self.width = block // self.ps  # pages of one block
        self.counts = dict(prompt_tokens=0, prefix_hit_tokens=0, requests=0, requests_hit=0,
                           preempted_restored_tokens=0, kda_checkpoints_taken=0, evictions=0)

    # ---- lookup and restore (admission) ----
    def lookup(self, req) -> Hit:
        """The request's best hit, its nodes pinned (unpin() if it is not admitted after all)."""
        seq = req.sequence
        chain, tail, length, matched = self.index.match(seq, len(seq) - 1)
        hit = Hit(chain, tail, length, matched if length < matched <= len(seq) - 1 else 0)
        for n in hit.nodes:
            self._pin(n)
        return hit

    def shared_pages(self, hit: Hit) -> int:
        """Pages of the hit a request reads in place (no new page needed)."""
        n = sum(len(x.pages) for x in hit.chain if x.pages is not None)
        if hit.tail is not None and hit.tail.pages is not None:
            n += hit.tail.length // self.ps
        return n

    def wait_for_inflight(self, req, hit: Hit) -> bool:
        """True if a running request is still prefilling a prefix of req's prompt at least a block
        longer than the hit: req should wait for it (the running one checkpoints that position)."""
        seq = req.sequence
        for r in self.eng.running:
            if r.prefix is None or r.fed >= len(r.prompt) or r.prompt[:self.block] != seq[:self.block]:
                continue
            shared = common_prefix(seq, r.prompt, len(seq) - 1) // self.block * self.block
            if shared >= hit.length + self.block and shared > r.fed:
                r.prefix.wanted.add(shared)
                req.waits_for = (r, shared)
                return True
        return False

    def still_waiting(self, req) -> bool:
        """True while the prefill req waits for (wait_for_inflight) has not yet passed its point."""
        if req.waits_for is None:
            return False
        r, pos = req.waits_for
        if r.prefix is not None and r.fed < pos:  # still in its slot (a preempted one starts over)
            r.prefix.wanted.add(pos)
            return True
        req.waits_for = None
        return False

    def unpin(self, hit: Hit):
        for n in hit.nodes:
            self._unpin(n)

    def restore(self, req, hit: Hit, slot: int):
        """Give an admitted request the hit's pages and checkpoint; req.fed becomes the hit length."""
        eng = self.eng
        first = req.prefix_hit_tokens is None
        req.prefix = RequestCache(chain=list(hit.chain), pinned=list(hit.nodes), junction=hit.junction)
        if first:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += len(req.prompt)
            req.prefix_hit_tokens = hit.length
            self.counts["prefix_hit_tokens"] += hit.length
            self.counts["requests_hit"] += hit.length > 0
        else:
            self.counts["preempted_restored_tokens"] += hit.length
        if hit.length == 0:
            return False
        for n in hit.nodes:
            self.index.touch(n)
        on_host = [n for n in hit.nodes if n.pages is None]
        last = hit.tail or hit.chain[-1]
        items = [n.host_pages for n in on_host] + ([last.host_ckpt] if last.ckpt is None else [])
        loaded = self.host.load(items) if items else []  # one transfer for the whole request
        if on_host:
            ids, data = [], []
            for n, d in zip(on_host, loaded):
                pages = eng._alloc(math.ceil(n.length / self.ps), CACHE)
                assert pages is not None, "admission counted these pages"
                self.host.drop(n.host_pages)
                n.host_pages = None
                self._set_pages(n, pages)
                ids.append(self._ids(pages, eng.allocator.num_pages))
                data.append(d)
            self._write_nodes(ids, data)
        ckpt = last.ckpt if last.ckpt is not None else loaded[-1]
        eng.layers = write_state(eng.layers, slot, ckpt)
        pages = [p for n in hit.chain for p in n.pages]
        if hit.tail is not None:
            t = hit.tail
            pages += t.pages[:t.length // self.ps]
            if t.length % self.ps:  # copy-on-write: the request writes into this page next
                own = eng._alloc(1, req.id)
                assert own is not None, "admission counted this page"
                eng.layers = copy_page(eng.layers, t.pages[-1], own[0])
                pages += own
        req.pages, req.fed = pages, hit.length
        return True

    def _write_nodes(self, ids, data):
        """Write restored nodes' pages WRITE_GROUPS nodes a call, fewer padded to a power of two:
        the write compiles for a few group counts, not once for every size of restore."""
        fill = self._ids([], self.eng.allocator.num_pages)
        for i in range(0, len(data), WRITE_GROUPS):
            part_ids, part = ids[i:i + WRITE_GROUPS], data[i:i + WRITE_GROUPS]
            while len(part) & (len(part) - 1):
                part_ids.append(fill)
                part.append(part[0])
            self.eng.layers = write_pages(self.eng.layers, jnp.asarray(np.concatenate(part_ids)), tuple(part))

    def _ids(self, pages, fill):
        """Page ids padded to one block's page count rounded up to a power of two: every node's
        host copy has the same shape, so restores of any mix of nodes stack."""
        out = np.full(len(padded_ids(range(self.width), 0)), fill, np.int32)
        out[:len(pages)] = pages
        return out

    # ---- scheduling hooks ----
    def chunk_end(self, req, end: int) -> int:
        """Where a prefill chunk [req.fed, end) should stop: at the first checkpoint position
        inside it, so every one ends a chunk (a chunk holding both the prompt's last block
        boundary and its end stops at the boundary; the next call computes the tail)."""
        fed = req.fed
        nxt = (fed // self.interval + 1) * self.interval
        cands = [c for c in (req.prefix.junction, len(req.prompt), self._aligned_end(req), nxt, *req.prefix.wanted)
                 if fed < c < end]
        return min(cands) if cands else end

    def after_step(self, req):
        """After a device call: cache the request's newly completed blocks and checkpoint its
        state if it ends at a checkpoint position."""
        fed, n = req.fed, req.seq_len
        self._commit(req, min(fed, n))
        if 0 < fed <= n and (fed % self.interval == 0 or fed == req.prefix.junction or fed in req.prefix.wanted
                                    or fed in (len(req.prompt), self._aligned_end(req))):
            self._checkpoint(req, fed, final=False)
            if fed == len(req.prompt):
                req.prefix.prompt_end = self._node_at(req, fed)

    def _aligned_end(self, req) -> int:
        """The prompt's last block boundary (0: the prompt is shorter than a block)."""
        return len(req.prompt) // self.block * self.block

    def release(self, req):
        """The request leaves its slot (finished or preempted): cache what it computed, including
        its state if it is exactly at a known position, and unpin its nodes."""
        if req.prefix is None:
            return
        fed, n = req.fed, req.seq_len
        self._commit(req, min(fed, n))
        if 0 < fed <= n and not req.cache_ahead:  # (a chained call may have fed it further)
            self._checkpoint(req, fed, final=True)
        end = req.prefix.prompt_end
        if fed > len(req.prompt) and end is not None and id(end) in self.index.lru:
            # the request's end supersedes its prompt's end (a next turn extends the request):
            # that checkpoint goes first when the budget is short
            self.index.lru.move_to_end(id(end), last=False)
        for n in req.prefix.pinned:
            self._unpin(n)
        req.prefix = None

    def _commit(self, req, known: int):
        rc, eng = req.prefix, self.eng
        while rc.depth + self.block <= known:
            parent = rc.chain[-1] if rc.chain else self.index.root
            lo = rc.depth
            toks = req.tokens(lo, lo + self.block)
            key = chain_key(parent.key, toks)
            node = parent.children.get(key)
            own = req.pages[lo // self.ps:(lo + self.block) // self.ps]
            if node is None:
                self._take(own, req)
                node = self.index.add_block(parent, toks, own, key)
                self._add_refs(node.pages)
            else:
                self.index.touch(node)
                if node.pages is None and all(eng.allocator.owner(p) == req.id for p in own):
                    self.host.drop(node.host_pages)  # this request holds the same tokens on device
                    node.host_pages = None
                    self._take(own, req)
                    self._set_pages(node, own)
            self._pin(node)
            rc.chain.append(node)
            rc.pinned.append(node)

    def _node_at(self, req, pos: int) -> Node | None:
        """The node ending exactly at `pos` on the request's path (its block, or a tail)."""
        rc = req.prefix
        parent = rc.chain[-1] if rc.chain else self.index.root
        return parent if pos == rc.depth else self.index.tail(parent, req.tokens(rc.depth, pos))

    def _checkpoint(self, req, pos: int, final: bool):
        rc, eng, ps = req.prefix, self.eng, self.ps
        parent = rc.chain[-1] if rc.chain else self.index.root
        assert rc.depth == pos // self.block * self.block
        if pos == rc.depth:  # block-aligned: the block node itself
            if not parent.has_ckpt:
                self._add_ckpt(parent, read_state(eng.layers, req.slot))
            return
        toks = req.tokens(rc.depth, pos)
        node = self.index.tail(parent, toks)
        if node is not None:
            self.index.touch(node)
            if not node.has_ckpt:
                self._add_ckpt(node, read_state(eng.layers, req.slot))
            return
        first, full = rc.depth // ps, (pos - rc.depth) // ps
        pages = req.pages[first:first + full]
        if pos % ps:
            part = req.pages[first + full]
            if final or eng.allocator.owner(part) == CACHE:  # no more writes into it
                pages = pages + [part]
            else:  # the request keeps writing into its page: the cache gets a copy
                new = eng._alloc(1, CACHE)
                if new is None:
                    return
                eng.layers = copy_page(eng.layers, part, new[0])
                self._take(pages, req)
                node = self.index.add_tail(parent, toks, pages + new)
                self._add_refs(node.pages)
                self._finish_tail(req, node, final)
                return
        self._take(pages, req)
        node = self.index.add_tail(parent, toks, pages)
        self._add_refs(node.pages)
        self._finish_tail(req, node, final)

    def _finish_tail(self, req, node, final):
        if not final:  # the request reads the tail's full pages: they must outlive it
            self._pin(node)
            req.prefix.pinned.append(node)
        self._add_ckpt(node, read_state(self.eng.layers, req.slot))

    # ---- pages ----
    def _take(self, pages, req):
        """Move the request's own pages among `pages` to the cache."""
        alloc = self.eng.allocator
        mine = [p for p in pages if alloc.owner(p) == req.id]
        alloc.transfer(mine, req.id, CACHE)

    def _add_refs(self, pages):
        for p in pages:
            self.refs[p] = self.refs.get(p, 0) + 1

    def _set_pages(self, node: Node, pages):
        node.pages = list(pages)
        self._add_refs(node.pages)
        if node.pins:
            for p in node.pages:
                self.pinned_refs[p] = self.pinned_refs.get(p, 0) + 1

    def _drop_pages(self, node: Node):
        assert node.pins == 0
        freed = []
        for p in node.pages:
            self.refs[p] -= 1
            if not self.refs[p]:
                del self.refs[p]
                freed.append(p)
        self.eng.allocator.release(freed, CACHE)
        node.pages = None

    def _pin(self, node: Node):
        node.pins += 1
        if node.pins == 1 and node.pages is not None:
            for p in node.pages:
                self.pinned_refs[p] = self.pinned_refs.get(p, 0) + 1

    def _unpin(self, node: Node):
        node.pins -= 1
        assert node.pins >= 0
        if node.pins == 0 and node.pages is not None:
            for p in node.pages:
                self.pinned_refs[p] -= 1
                if not self.pinned_refs[p]:
                    del self.pinned_refs[p]

    def evictable_pages(self) -> int:
        """Cached device pages no running request reads (eviction can free them)."""
        return len(self.refs) - len(self.pinned_refs)

    def cached_pages(self) -> set:
        return set(self.refs)

    def evict_pages(self, n: int):
        """Evict least recently used unpinned nodes until n pages are free (or nothing is left)."""
        alloc = self.eng.allocator
        for node in self.index.nodes():
            if alloc.free >= n:
                return
            if id(node) not in self.index.lru or node.pins or node.pages is None:
                continue
            self.counts["evictions"] += 1
            if not self._pages_to_host(node) and id(node) in self.index.lru:
                self._drop_subtree(node)

    def offload(self):
        """Move every cached page no running request reads, and every checkpoint, to the host tier
        (what its budget cannot hold is dropped)."""
        for node in self.index.nodes():
            if id(node) in self.index.lru and node.ckpt is not None:
                self._ckpt_to_host(node)
            if id(node) in self.index.lru and node.pages is not None and not node.pins:
                self._pages_to_host(node)

    def _pages_to_host(self, node: Node) -> bool:
        nbytes = len(node.pages) * self.eng.page_bytes
        if self.host is None or not self._host_room(nbytes) or id(node) not in self.index.lru:
            return False  # (making room may have dropped an ancestor, and the node with it)
        data = read_pages(self.eng.layers, self._ids(node.pages, 0))
        node.host_pages = self.host.save(data, nbytes)
        self._drop_pages(node)
        return True

    def _ckpt_to_host(self, node: Node):
        """Move a device checkpoint to host, or drop it if the host tier cannot take it."""
        ckpt, node.ckpt = node.ckpt, None
        self.device_ckpts -= 1
        if self.host is not None and self._host_room(self.ckpt_bytes) and id(node) in self.index.lru:
            node.host_ckpt = self.host.save(ckpt, self.ckpt_bytes)
            self.host_ckpts += 1

    # ---- checkpoints ----
    def _add_ckpt(self, node: Node, ckpt):
        node.ckpt = ckpt
        self.device_ckpts += 1
        self.counts["kda_checkpoints_taken"] += 1
        self.index.touch(node)
        if not self.ckpt_bytes or self.device_ckpts * self.ckpt_bytes <= self.device_budget:
            return  # within the budget: no walk over the index
        for victim in self.index.nodes():
            if self.device_ckpts * self.ckpt_bytes <= self.device_budget:
                break
            if victim is node or id(victim) not in self.index.lru or victim.ckpt is None:
                continue
            self.counts["evictions"] += 1
            self._ckpt_to_host(victim)

    # ---- host tier ----
    def _host_room(self, nbytes: int) -> bool:
        """Drop the host tier's least recently used contents until nbytes fit."""
        if nbytes > self.host.budget:
            return False
        if self.host.fits(nbytes):
            return True
        for node in self.index.nodes():
            if self.host.fits(nbytes):
                break
            if id(node) not in self.index.lru or node.pins:
                continue
            if node.host_pages is not None:
                self._drop_subtree(node)
            elif node.host_ckpt is not None:
                self.host.drop(node.host_ckpt)
                node.host_ckpt = None
                self.host_ckpts -= 1
        return self.host.fits(nbytes)

    def _drop_subtree(self, node: Node):
        for n in reversed(self.index.subtree(node)):  # leaves first
            if n.pages is not None:
                self._drop_pages(n)
            if n.host_pages is not None:
                self.host.drop(n.host_pages)
            if n.host_ckpt is not None:
                self.host.drop(n.host_ckpt)
                self.host_ckpts -= 1
            if n.ckpt is not None:
                self.device_ckpts -= 1
            n.ckpt = n.host_ckpt = n.host_pages = None
            self.index.unlink(n)

    # ---- reporting and invariants ----
    def compile_ops(self):
        """Run the device copies a hit and a checkpoint make (a slot's state out and back in, a
        page onto itself) as no-ops, so they are compiled before serving (Engine.warmup)."""
        eng = self.eng
        eng.layers = write_state(eng.layers, 0, read_state(eng.layers, 0))
        eng.layers = copy_page(eng.layers, 0, 0)

    def stats(self) -> dict:
        c = self.counts
        return {"prompt_tokens": c["prompt_tokens"], "prefix_hit_tokens": c["prefix_hit_tokens"],
                "prefix_hit_rate": c["prefix_hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "requests_hit": c["requests_hit"],
                "kda_checkpoints": self.device_ckpts + self.host_ckpts,  # a node holds one or the other
                "kda_checkpoints_device": self.device_ckpts,
                "kda_checkpoints_taken": c["kda_checkpoints_taken"],
                "cached_pages_device": len(self.refs),
                "cached_blocks": len(self.index.lru),
                "host_bytes": self.host.used if self.host else 0,
                "host_saved_bytes": self.host.saved_bytes if self.host else 0,
                "host_restored_bytes": self.host.restored_bytes if self.host else 0,
                "preempted_restored_tokens": c["preempted_restored_tokens"],
                "evictions": c["evictions"]}

    def check(self, running):
        """Invariants: page reference counts match the nodes, pins match the running requests,
        every cached page a request reads belongs to a node it pins, tiers' byte counts add up."""
        nodes = self.index.nodes()
        refs, pinned = {}, {}
        for n in nodes:
            if (n.pages is None) == (n.host_pages is None):
                raise AssertionError(f"{n} must hold its pages on exactly one tier")
            for p in n.pages or []:
                refs[p] = refs.get(p, 0) + 1
                if n.pins:
                    pinned[p] = pinned.get(p, 0) + 1
        if refs != self.refs or pinned != self.pinned_refs:
            raise AssertionError("cached page reference counts differ from the index")
        pins = {}
        for r in running:
            for n in r.prefix.pinned:
                if id(n) not in self.index.lru:
                    raise AssertionError(f"request {r.id!r} pins a node that was evicted")
                pins[id(n)] = pins.get(id(n), 0) + 1
            readable = {p for n in r.prefix.pinned for p in n.pages or []}
            if len(set(r.pages)) != len(r.pages):
                raise AssertionError(f"request {r.id!r} lists a page twice")
            for p in r.pages:
                if p in self.refs and p not in readable:
                    raise AssertionError(f"request {r.id!r} reads cached page {p} without pinning its node")
        if any(n.pins != pins.get(id(n), 0) for n in nodes):
            raise AssertionError("node pins differ from the running requests that hold them")
        if self.device_ckpts != sum(n.ckpt is not None for n in nodes):
            raise AssertionError("device checkpoint count is off")
        if self.host_ckpts != sum(n.host_ckpt is not None for n in nodes):
            raise AssertionError("host checkpoint count is off")
        if any(n.ckpt is not None and n.host_ckpt is not None for n in nodes):
            raise AssertionError("a node holds its checkpoint on both tiers")
        if self.ckpt_bytes and self.device_ckpts * self.ckpt_bytes > self.device_budget:
            raise AssertionError("device checkpoints exceed their budget")
        if self.host is not None:
            used = sum(i.nbytes for n in nodes for i in (n.host_pages, n.host_ckpt) if i is not None)
            if used != self.host.used or used > self.host.budget:
                raise AssertionError(f"host tier holds {used} B but counts {self.host.used} B")


def common_prefix(a: list, b: list, limit: int) -> int:
    """Length of the longest common prefix of two token lists, at most `limit` (a binary search
    over slice comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
