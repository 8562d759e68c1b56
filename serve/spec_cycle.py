"""The engine's speculative decoding cycle: draft, verify every decoding row's drafts in one target
pass (`steps.verify_step`: ragged depths, the accepted prefix kept, rejected positions' cache
entries left to be overwritten), commit. `speculation.Speculator` chooses the depth and times the
cycles; this mixin runs them on the engine's slots, pages and requests."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from kimik3.generation import logprob_rows
from kimik3.runtime import mesh_context
from kimik3.sampling import step_sampling

from .drafters import NgramDrafter
from .spec_steps import SPEC_WINDOW, spec_decode_steps, spec_inputs
from .speculation import Stopwatch
from .steps import STOP_SLOTS, compiled_programs, verify_step


class SpeculativeCycle:
    def _speculate(self, running, k=None):
        """One draft-verify-commit cycle for the decoding rows at depth k (None: the controller
        chooses), or None when that is 0 or no row has a draft (plain decode steps then run).
        With n-gram drafts the cycles run on device, several a call, once some row has a draft."""
        if k is None:
            k = self.spec.choose([r.id for r in running])
        if k == 0:
            return None
        rows = {}
        for r in running:  # a row drafts only what it can still commit and what fits the cache
            room = min(k, r.params.max_new_tokens - len(r.output) - 1, self.max_seq_len - r.fed - 1)
            if room > 0:
                rows[r.slot] = (r.id, r.view(), room)
        drafts = self.spec.propose({s: (key, seq) for s, (key, seq, _) in rows.items()}, k,
                                   self.max_batch, self.max_seq_len)
        rooms = {s: room for s, (_, _, room) in rows.items()}
        drafts = {s: d[:rooms[s]] for s, d in drafts.items() if d[:rooms[s]]}
        if not drafts:  # this cycle commits one token a row, as if every draft were rejected
            for key, _, room in rows.values():
                self.spec.record(key, 0, 0, offered=room)
            return None
        # the host's lookup only decides whether cycles run at all (the device looks again, each
        # cycle): where no row has a draft, plain decoding's step runs, with its cost and rounding
        if self._cycles_on_device(running):
            events = self._speculate_on_device(running, k)
            if events is not None:
                return events
        B = self.max_batch
        for r in list(running):
            if r.slot is not None and not self._ensure_pages(r, r.fed + 1 + len(drafts.get(r.slot, []))):
                self._finish(r, "error: the request does not fit in the cache pages")
        running = self.running
        tokens = np.zeros((B, k + 1), np.int32)
        start, n_new, seeds, gen = (np.zeros(B, np.int32) for _ in range(4))
        seeds = seeds.astype(np.uint32)
        temp, top_k, top_p = np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32)
        table = np.zeros((B, self.pages_per_seq), np.int32)
        stops = np.full((B, STOP_SLOTS), -1, np.int32)
        for r in running:
            s, p, d = r.slot, r.params, drafts.get(r.slot, [])
            stop = self._stop_ids(r)
            stops[s, :len(stop)] = stop
            tokens[s, 0], tokens[s, 1:1 + len(d)] = r.output[-1], d
            start[s], n_new[s] = r.fed, 1 + len(d)
            table[s, :len(r.pages)] = r.pages
            seeds[s], gen[s] = p.seed, len(r.output)
            temp[s], top_k[s], top_p[s] = p.temperature, p.top_k, p.top_p
        want_lp = any(r.params.return_logprobs for r in running)
        temp, top_k, top_p = step_sampling(temp, top_k, top_p)
        clock = Stopwatch()
        with mesh_context(self.mesh), clock:
            samples, accepted, lp, self.layers = verify_step(
                self.model, self.layers, tokens, start, n_new, table, seeds, gen, temp, top_k, top_p, stops,
                backend=self.backend, dcp_axes=self.dcp_axes, logprobs=want_lp)
            samples, accepted = np.asarray(samples), np.asarray(accepted)
            lp = lp and tuple(np.asarray(a) for a in lp)
        self.spec.timed(len(running), k, clock.seconds, clock.compiled)
        self.spec.account(k, clock.seconds, int(accepted[[r.slot for r in running]].sum()) + len(running), clock.compiled)
        events = []
        for r in running:
            s = r.slot
            a = int(accepted[s])
            self.spec.record(r.id, int(n_new[s]) - 1, a, offered=rooms.get(s, 0))
            r.fed += a + 1  # the last sampled token and the accepted drafts are now cached
            if self.prefix is not None:
                self.prefix.after_step(r)
            rows = None
            if r.params.return_logprobs:
                rows = [logprob_rows(lp, r.params.top_logprobs, t)[s] for t in range(a + 1)]
            kept = self._accept(r, samples[s, :a + 1], rows)
            if kept or r.finished:
                events.append((r, kept))
        return events

    def _cycles_on_device(self, running) -> bool:
        """Whether these rows' cycles can run on device (spec_steps): n-gram drafts, no logprobs,
        and stop rules the device checks (stop tokens that fit STOP_SLOTS, no stop strings)."""
        return isinstance(self.spec.drafter, NgramDrafter) and all(
            not r.params.return_logprobs and self._stops_on_device(r) for r in running)

    def _speculate_on_device(self, running, k):
        """`decode_steps` cycles at depth k in one device call (spec_steps.spec_decode_steps), the
        next call chained behind it where nothing needs the host in between; None (the host cycle
        runs instead) where the pages they may write are not free."""
        cycles, B = self.decode_steps, self.max_batch
        upto = {id(r): min(r.fed + cycles * (k + 1), self.max_seq_len) for r in running}
        if not self._reserve_pages(running, upto):
            return None
        x = spec_inputs(B, k, cycles, self.max_seq_len)
        window = min(self.max_seq_len, SPEC_WINDOW)
        for r in running:
            s, p = r.slot, r.params
            seq = r.view()
            n = min(len(seq), window)
            x["hist"][s, :n] = seq[len(seq) - n:]
            x["hist_len"][s], x["start"][s], x["active"][s] = n, r.fed, 1
            x["gen_idx"][s], x["limit"][s], x["cap"][s] = len(r.output), p.max_new_tokens, upto[id(r)]
            x["seeds"][s], x["temperature"][s], x["top_k"][s], x["top_p"][s] = p.seed, p.temperature, p.top_k, p.top_p
            stop = self._stop_ids(r)
            x["stops"][s, :len(stop)] = stop
        x["temperature"], x["top_k"], x["top_p"] = step_sampling(x["temperature"], x["top_k"], x["top_p"])
        clock = Stopwatch()
        with mesh_context(self.mesh), clock:
            call = self._spec_dispatch(running, k, x)
            dispatched = time.perf_counter()
            if self._spec_chainable(call):
                self._pending = self._spec_chain(call)
            results = call.results()
        # a call run alone (a depth being timed) is timed from its dispatch's return: the calls it
        # is compared with run queued, their dispatch hidden behind the call ahead of them
        seconds = clock.seconds if self._pending is not None else clock.t + clock.seconds - dispatched
        return self._spec_apply(call, results, seconds, clock.compiled)

    def _spec_dispatch(self, rows, k, x) -> "SpecCall":
        table = np.zeros((self.max_batch, self.pages_per_seq), np.int32)
        for r in rows:
            table[r.slot, :len(r.pages)] = r.pages
        d = self.spec.drafter
        *outs, carry, self.layers = spec_decode_steps(
            self.model, self.layers, page_table=table, cycles=self.decode_steps, depth=k, min_n=d.min_n,
            max_n=d.max_n, backend=self.backend, dcp_axes=self.dcp_axes, **x)
        return SpecCall(rows, k, self.decode_steps, outs, carry, x)

    def _spec_chainable(self, call) -> bool:
        """Whether the call after `call` can be dispatched before the host reads `call`: its depth
        is settled (timed, not due a re-timing: a depth being tried waits for its timing), the
        controller keeps it, and QueuedDecode._chainable's conditions hold for calls feeding up
        to steps * (depth + 1) tokens a row. A depth it chooses instead is kept for the step
        that runs it."""
        rows = [r for r in call.rows if r.finished is None]
        if not rows or not self.spec.settled(len(rows), call.depth):
            return False
        self._spec_next = self.spec.choose([r.id for r in rows])
        if self._spec_next == call.depth and self._chainable(call, call.steps * (call.depth + 1)):
            self._spec_next = None
            return True
        return False

    def _spec_chain(self, call) -> "SpecCall":
        """Dispatch the call that continues `call` from its device outputs."""
        hist, hist_len, start, active, gen = call.carry
        cap = np.zeros(self.max_batch, np.int32)
        rows = [r for r in call.rows if r.finished is None]
        for r in rows:
            cap[r.slot] = min(r.fed + 2 * call.steps * (call.depth + 1), self.max_seq_len)
        x = dict(call.x, hist=hist, hist_len=hist_len, start=start, active=active, gen_idx=gen, cap=cap)
        return self._spec_dispatch(rows, call.depth, x)

    def _collect_spec(self, call, chain: bool):
        """Read a queued speculation call (dispatching the next behind it first if `chain` and
        nothing needs the host in between) and apply it; its time is the interval since the
        last step ended, as a queued decode call's."""
        programs = compiled_programs()
        with mesh_context(self.mesh):
            if chain and self._spec_chainable(call):
                self._pending = self._spec_chain(call)
            results = call.results()
        return self._spec_apply(call, results, time.perf_counter() - self._step_end, compiled_programs() > programs)

    def _spec_apply(self, call, results, seconds: float, compiled: bool):
        """A speculation call's results applied to its rows (tokens fed, blocks cached, tokens
        accepted, each cycle's drafts recorded), its time given to the controller per cycle run."""
        samples, committed, drafted, offered = results
        rows = [r for r in call.rows if r.finished is None]
        ran = int((committed.sum(1) > 0).sum())
        if ran:  # (a call in which no row fed a token times no cycle)
            self.spec.timed(len(rows) or 1, call.depth, seconds / ran, compiled)
        self.spec.account(call.depth, seconds, int(committed[:, [r.slot for r in rows]].sum()), compiled)
        events = []
        for r in rows:
            s, kept = r.slot, []
            done = [c for c in range(call.steps) if committed[c, s]]
            for c in done:
                self.spec.record(r.id, int(drafted[c, s]), int(committed[c, s]) - 1, offered=int(offered[c, s]))
            r.fed += int(committed[:, s].sum())  # the cache now ends after the last cycle's tokens
            if self.prefix is not None:
                self.prefix.after_step(r)
            for c in done:
                if r.finished:
                    break
                kept += self._accept(r, samples[c, s, :committed[c, s]])
            if kept or r.finished:
                events.append((r, kept))
        return events


@dataclasses.dataclass
class SpecCall:
    """A dispatched spec_decode_steps call: its rows, depth and cycles (`steps`), its device outputs
    (samples, committed, drafted, offered), the carry a chained call starts from, and the host
    inputs a chained call reuses."""
    rows: list
    depth: int
    steps: int
    outs: list
    carry: tuple
    x: dict

    def results(self):
        return tuple(np.asarray(o) for o in self.outs)
