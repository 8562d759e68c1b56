"""The engine's speculative decoding cycle: draft, verify every decoding row's drafts in one target
pass (`steps.verify_step`: ragged depths, the accepted prefix kept, rejected positions' cache
entries left to be overwritten), commit. `speculation.Speculator` chooses the depth and times the
cycles; this mixin runs them on the engine's slots, pages and requests."""
from __future__ import annotations

import numpy as np

from kimik3.generation import logprob_rows, stop_set
from kimik3.runtime import mesh_context

from .drafters import NgramDrafter
from .spec_steps import SPEC_WINDOW, spec_decode_steps, spec_inputs
from .speculation import Stopwatch
from .steps import STOP_SLOTS, verify_step


class SpeculativeCycle:
    def _speculate(self, running, k=None):
        """One draft-verify-commit cycle for the decoding rows at depth k (None: the controller
        chooses), or None when that is 0 or no row has a draft (plain decode steps then run)."""
        if k is None:
            k = self.spec.choose([r.id for r in running])
        if k == 0:
            return None
        if self._cycles_on_device(running):
            events = self._speculate_on_device(running, k)
            if events is not None:
                return events
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
        clock = Stopwatch()
        with mesh_context(self.mesh), clock:
            samples, accepted, lp, self.layers = verify_step(
                self.model, self.layers, tokens, start, n_new, table, seeds, gen, temp, top_k, top_p, stops,
                backend=self.backend, dcp_axes=self.dcp_axes, logprobs=want_lp)
            samples, accepted = np.asarray(samples), np.asarray(accepted)
            lp = lp and tuple(np.asarray(a) for a in lp)
        self.spec.timed(len(running), k, clock.seconds, clock.compiled)
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
        if not isinstance(self.spec.drafter, NgramDrafter):
            return False
        for r in running:
            p = r.params
            if p.return_logprobs or p.stop_strings or len(stop_set(self.cfg, p.stop_tokens)) > STOP_SLOTS:
                return False
        return True

    def _speculate_on_device(self, running, k):
        """`decode_steps` cycles at depth k in one device call (spec_steps.spec_decode_steps), or
        None (the host cycle runs instead) where the pages they may write are not free."""
        cycles, B = self.decode_steps, self.max_batch
        upto = {id(r): min(r.fed + cycles * (k + 1), self.max_seq_len) for r in running}
        need = sum(max(0, -(-upto[id(r)] // self.page_size) - len(r.pages)) for r in running)
        if need > self.available_pages():
            return None
        for r in running:
            got = self._ensure_pages(r, upto[id(r)])
            assert got, "pages counted as available"
        d = self.spec.drafter
        x = spec_inputs(B, k, cycles, self.max_seq_len)
        table = np.zeros((B, self.pages_per_seq), np.int32)
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
            table[s, :len(r.pages)] = r.pages
        clock = Stopwatch()
        with mesh_context(self.mesh), clock:
            *outs, self.layers = spec_decode_steps(
                self.model, self.layers, page_table=table, cycles=cycles, depth=k, min_n=d.min_n, max_n=d.max_n,
                backend=self.backend, dcp_axes=self.dcp_axes, **x)
            samples, committed, drafted, offered = (np.asarray(o) for o in outs)
        ran = int((committed.sum(1) > 0).sum()) or 1
        self.spec.timed(len(running), k, clock.seconds / ran, clock.compiled)
        events = []
        for r in running:
            s, kept = r.slot, []
            done = [c for c in range(cycles) if committed[c, s]]
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
