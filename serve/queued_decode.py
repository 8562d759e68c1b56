"""Decode calls queued on the device ahead of the host: in steady decode the next call starts
from the last one's device outputs (each row's last token, position, sample count, and whether it
still decodes), so the scheduler's work between calls overlaps the device instead of idling it.
The Engine's part that decides when a call may be queued, dispatches it and collects it."""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from kimik3.generation import stop_set
from kimik3.runtime import mesh_context

from .request import Request
from .spec_cycle import SpecCall
from .steps import STOP_SLOTS, compiled_programs, decode_steps


@dataclasses.dataclass
class DecodeCall:
    """A dispatched decode_steps call: its rows, its device outputs (sampled, fed, logprobs), the
    carry a chained call starts from, and the host inputs a chained call reuses."""
    rows: list
    steps: int
    outs: list
    carry: tuple
    common: dict
    stops: np.ndarray
    limit: np.ndarray

    def results(self):
        """(sampled [steps, B], fed [B], logprobs or None) on the host (waits for the device)."""
        sampled, fed, lp = self.outs
        return np.asarray(sampled), np.asarray(fed), lp and tuple(np.asarray(a) for a in lp)


class QueuedDecode:
    """Engine methods for the decode call queued ahead (mixed into Engine: they use its slots,
    pages, speculation controller and device cache)."""

    def _step_pending(self):
        """Collect the decode call dispatched ahead, first dispatching the next one behind it when
        nothing needs the host in between, so the device never waits for this host work."""
        return self._collect(chain=True)

    def _collect(self, chain: bool):
        """Read the queued call (dispatching the next behind it first if `chain` and nothing
        needs the host in between) and apply it."""
        call, self._pending = self._pending, None
        if isinstance(call, SpecCall):  # speculation's cycles, queued on device the same way
            return self._collect_spec(call, chain)
        rows = [r for r in call.rows if r.finished is None]
        programs = compiled_programs() if self.spec is not None else 0  # (the controller's timing only)
        with mesh_context(self.mesh):
            if chain and self._spec_stays_off(rows) and self._chainable(call):
                self._pending = self._chain(call)
            sampled, n_new, lp = call.results()
        if chain and self.spec is not None:  # a queued call's wall time is the interval between step ends
            seconds, compiled = time.perf_counter() - self._step_end, compiled_programs() > programs
            self.spec.timed(len(rows) or 1, 0, seconds / call.steps, compiled)
            self.spec.account(0, seconds, int(n_new[[r.slot for r in rows]].sum()), compiled)
        return self._apply(rows, sampled, n_new, lp, False)

    def _spec_stays_off(self, rows) -> bool:
        """With speculation, whether its controller keeps depth 0 for the next call (a depth it
        chooses instead is kept for the step that runs it, so each cycle is chosen once)."""
        if self.spec is None or not rows:
            return True
        self._spec_next = self.spec.choose([r.id for r in rows])
        return self._spec_next == 0

    def _chainable(self, call, per_call: int | None = None) -> bool:
        """Whether the call after `call` can be dispatched before the host reads `call` (per_call:
        the most tokens a row feeds in one call; a decode call's steps by default): no
        waiting request could take a free slot now, every row's stop rules run on device (stop
        tokens that fit STOP_SLOTS, no stop strings), some row will still be decoding after it,
        and the pages the next call writes are free without preempting anyone. With every slot
        busy, requests that wait are admitted one call later than they could be (a slot that
        `call` frees is seen after the next call is queued), as asynchronous schedulers admit
        them, and a loaded server's decode keeps the device busy. The host reads a row's state
        after `call` (the prefix cache's checkpoints) only where the row ends exactly at its
        sequence, which in decode means the device stopped feeding it: the next call leaves it
        as it was."""
        if self.waiting and None in self.slots:
            return False
        if any(r.cache_ahead for r in call.rows):  # an aborted row still feeds in `call`
            return False
        per_call = per_call or call.steps
        rows = [r for r in call.rows if r.finished is None]
        if not any(r.params.max_new_tokens - len(r.output) > per_call for r in rows):
            return False
        if not all(self._stops_on_device(r) for r in rows):
            return False
        # `call` and the next feed at most 2 * per_call tokens past what the host knows
        return self._reserve_pages(rows, {id(r): min(r.fed + 2 * per_call, self.max_seq_len) for r in rows})

    def _stops_on_device(self, r) -> bool:
        """Whether the device can apply the request's stop rules: stop tokens that fit
        STOP_SLOTS, no stop strings."""
        return not r.params.stop_strings and len(stop_set(self.cfg, r.params.stop_tokens)) <= STOP_SLOTS

    def _reserve_pages(self, rows, upto) -> bool:
        """Pages for each row up to upto[id(row)] tokens, if the free pages cover them all (no
        row is preempted for them)."""
        need = sum(max(0, math.ceil(upto[id(r)] / self.page_size) - len(r.pages)) for r in rows)
        if need > self.available_pages():
            return False
        for r in rows:
            got = self._ensure_pages(r, upto[id(r)])
            assert got, "pages counted as available"
        return True

    def _chain(self, call) -> "DecodeCall":
        """Dispatch the decode call that continues `call` from its device outputs."""
        table = np.zeros_like(call.common["page_table"])
        for r in call.rows:
            if r.finished is None:
                table[r.slot, :len(r.pages)] = r.pages
        tokens, start, active, gen = call.carry
        common = dict(call.common, page_table=table, gen_idx=gen)
        *outs, carry, self.layers = decode_steps(self.model, self.layers, tokens, start, active, stops=call.stops,
                                                 limit=call.limit, steps=call.steps, **common)
        return DecodeCall(call.rows, call.steps, outs, carry, common, call.stops, call.limit)

    def drain(self) -> list[tuple[Request, list[int]]]:
        """Collect a decode call dispatched ahead, dispatching nothing more (step() does that in
        its turn); returns its events."""
        return [] if self._pending is None else self._collect(chain=False)
