"""Speculative decoding's host side: which depth to draft at, and the drafts for each row.

The useful figure is committed tokens per second of a whole draft-verify-commit cycle, not the
acceptance rate: a deeper draft pays only if the extra expected tokens outweigh the longer verify
pass. So the controller measures both sides and chooses the depth that maximises their ratio:
- per request, the chance that a draft token is accepted (alpha, counted over the positions it
  could have drafted: a drafter that finds no draft counts as rejected drafts); a row
  drafting k tokens then commits 1 + alpha + ... + alpha^k tokens on average;
- per number of running rows (in power-of-two classes), the wall time of a cycle at each depth,
  and of one plain decode token (depth 0: speculation off).
Plain decoding is timed first; a depth not yet timed is costed optimistically, at the cycle of
the deepest shallower depth timed (a deeper verify does that work and more), so it is tried only
while acceptance could make it pay, the shallowest such depth first: a slow shallow depth rules
out the deeper ones untried. A call that compiled a program is not timed. A cycle in which no row
has a draft runs one plain token, which is what every depth costs while the drafter finds
nothing: it times the depths not yet timed (a timed depth keeps the time of its real cycles).
A cycle's time is the minimum of its last few timings: noise only adds to it (a collection pause,
a host hiccup, a program's first run), and a single slow sample kept in an average made a depth
look slower than it is until it was re-timed. Each cycle runs the best estimate; a depth with a
single timing is timed again at the next cycle (a program's first call on real rows can be much
slower than its later ones), and a timed depth not chosen is re-timed, so that the estimates
follow the load, once `explore_every` cycles times its cycle over a plain token's have passed:
each losing depth costs about 1/explore_every of plain decoding's time, however slow. A depth being
tried or re-timed runs one device call at a time (`settled`), so its timing is in before the
next call is chosen; such a lone call is timed from its dispatch's return, as the queued calls
it is compared with have their dispatch hidden behind the call ahead.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque

from kimik3.model import Model

from .drafters import ModelDrafter, NgramDrafter
from .steps import compiled_programs

log = logging.getLogger("kimik3.serve.speculation")

AUTO_DEPTHS = (0, 2, 4, 7)  # k + 1 <= 8: the verify pass's per-position KDA recurrence
WINDOW = 4  # a cycle's time: the minimum of its last WINDOW timings


def _size_class(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


class Speculator:
    def __init__(self, drafter, depth="auto", explore_every: int = 64):
        if isinstance(drafter, str):
            if drafter != "ngram":
                raise ValueError(f"speculative={drafter!r}: use 'ngram' or a kimik3 model (the drafter)")
            drafter = NgramDrafter()
        elif isinstance(drafter, Model):
            drafter = ModelDrafter(drafter)
        elif not (hasattr(drafter, "propose") or hasattr(drafter, "propose_batch")):
            raise ValueError(f"speculative={type(drafter).__name__}: use 'ngram', a kimik3 Model, or a drafter "
                             "(an object with propose(key, tokens, k) -> list of up to k token ids)")
        if depth == "auto":
            self.depths = AUTO_DEPTHS
        elif isinstance(depth, int) and not isinstance(depth, bool) and 1 <= depth <= 7:
            self.depths = (depth,)
        else:
            raise ValueError(f"num_speculative_tokens={depth!r}: use 'auto' or an int in 1..7 "
                             "(a verify pass takes at most 8 tokens a row)")
        self.drafter, self.explore_every = drafter, explore_every
        self.cycle_s: dict = {}  # (size class, depth) -> seconds of a cycle (depth 0: a token)
        self.samples: dict = {}  # (size class, depth) -> its last WINDOW timings
        self.undrafted_only: set = set()  # (size class, depth)s timed by one-token calls alone
        self.last_timed: dict = {}
        self.spent = defaultdict(lambda: [0.0, 0])  # depth -> [wall seconds, tokens committed]
        self.cycles = 0
        self.depth = self.depths[0]
        self.draft_tokens = self.accepted_tokens = 0
        self.per_request: dict = {}  # request key -> [drafted, accepted]

    # ---- the depth ----
    def alpha(self, key) -> float:
        drafted, accepted = self.per_request.get(key, (0, 0))
        return (accepted + 1) / (drafted + 2)  # Laplace: an unseen request counts as 1/2

    def choose(self, keys) -> int:
        """The depth for the next cycle of these running requests."""
        self.cycles += 1
        cls = _size_class(len(keys))
        timed = [k for k in self.depths if (cls, k) in self.cycle_s]
        if len(self.depths) == 1:
            choice = self.depths[0]
        elif 0 not in timed:  # plain decoding first: the yardstick every depth is held against
            choice = 0
        else:
            alphas = [self.alpha(r) for r in keys]
            rate = {}  # committed tokens a second; an untimed depth is costed optimistically at the
            for k in self.depths:  # deepest shallower timed depth's cycle (a deeper verify does more)
                cycle = self.cycle_s.get((cls, k)) or max(self.cycle_s[(cls, j)] for j in timed if j < k)
                rate[k] = sum(sum(a ** i for i in range(k + 1)) for a in alphas) / cycle
            choice = max(self.depths, key=rate.get)  # ties: the shallower depth
            if (cls, choice) not in self.cycle_s:  # probe the shallowest depth that could win: its
                floor = max(rate[k] for k in timed)  # cycle bounds the deeper ones' from below
                choice = min(k for k in self.depths if (cls, k) not in self.cycle_s and rate[k] > floor)
            due = [k for k in timed if k != choice and self._due(cls, k)]
            if due:  # re-time the losing depth waiting longest
                choice = min(due, key=lambda k: self.last_timed.get((cls, k), 0))
        if choice != self.depth:
            log.info("speculative depth %d -> %d at %d rows (cycle s by depth: %s)", self.depth, choice,
                     len(keys), {k: self.cycle_s.get((cls, k)) for k in self.depths})
        self.depth = choice
        return choice

    def settled(self, rows: int, depth: int) -> bool:
        """Whether depth's cycle at this many rows has a real timing that is not due a re-timing
        (with a fixed depth: always). A call at a depth still to be timed waits for its timing
        before another call is queued behind it: queued at once, a depth being tried (a slow one,
        too) ran two calls of cycles before the controller could drop it."""
        if len(self.depths) == 1:
            return True  # a fixed depth: no choice waits on a timing
        cls = _size_class(rows)
        if (cls, depth) not in self.cycle_s or (cls, depth) in self.undrafted_only:
            return False
        return (cls, 0) not in self.cycle_s or not self._due(cls, depth)

    def _due(self, cls: int, k: int) -> bool:
        """Whether timed depth k is due a re-timing: always while a speculative depth has one
        timing (a program's first call on real rows can be much slower than its later calls, and
        one such timing kept a depth that pays off for explore_every cycles), then once
        explore_every cycles times its cost in plain tokens have passed since it was last timed."""
        if k and len(self.samples.get((cls, k), ())) < 2:
            return True
        ratio = self.cycle_s[(cls, k)] / self.cycle_s[(cls, 0)]
        return self.cycles - self.last_timed.get((cls, k), 0) >= self.explore_every * max(1.0, ratio)

    def timed(self, rows: int, depth: int, seconds: float, compiled: bool = False):
        """Record a cycle's wall time (for depth 0: per decode token); a call that `compiled` a
        program (Stopwatch.compiled) is not timed."""
        if not compiled:
            key = (_size_class(rows), depth)
            if key in self.undrafted_only:  # its first real cycle: one-token calls no longer stand in
                self.undrafted_only.discard(key)
                self.samples.pop(key)
            self._record(*key, seconds)

    def timed_undrafted(self, rows: int, depth: int, seconds: float, compiled: bool = False):
        """A depth-`depth` cycle in which no row had a draft ran one plain token instead: what
        that depth costs while drafts are missing. The other depths not yet timed at this size
        would have run the same call, so it times them too: one such cycle, not one per depth,
        shows that speculation does not pay while the drafter finds nothing. A depth its real
        cycles timed keeps their time (a one-token call is not its cycle): its re-timing is done."""
        if compiled:
            return
        cls = _size_class(rows)
        for k in self.depths:
            if k and ((cls, k) not in self.cycle_s or (cls, k) in self.undrafted_only):
                self._record(cls, k, seconds)
                self.undrafted_only.add((cls, k))
        self.last_timed[(cls, depth)] = self.cycles

    def _record(self, cls: int, depth: int, seconds: float):
        key = (cls, depth)
        recent = self.samples.setdefault(key, deque(maxlen=WINDOW))
        recent.append(seconds)
        self.cycle_s[key] = min(recent)
        self.last_timed[key] = self.cycles

    def account(self, depth: int, seconds: float, tokens: int, compiled: bool = False):
        """Wall time and committed tokens of a call while `depth` was chosen (0: plain decoding;
        a call that compiled is left out), for stats(): the tokens a second each depth delivered,
        beside the cycle times it was chosen by."""
        if compiled:
            return
        self.spent[depth][0] += seconds
        self.spent[depth][1] += tokens

    # ---- drafts ----
    def propose(self, rows: dict, k: int, max_batch: int, max_seq_len: int) -> dict:
        """rows: slot -> (request key, tokens so far) -> slot -> up to k draft tokens."""
        if hasattr(self.drafter, "propose_batch"):
            return self.drafter.propose_batch(rows, k, max_batch, max_seq_len)
        return {s: self.drafter.propose(key, seq, k) for s, (key, seq) in rows.items()}

    def record(self, key, drafted: int, accepted: int, offered: int | None = None):
        """A row's cycle: `drafted` tokens proposed, `accepted` of them kept, out of `offered`
        positions it could have drafted (a drafter that finds nothing wastes the cycle as surely
        as rejected drafts do, so the request's acceptance counts offered positions)."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        c = self.per_request.setdefault(key, [0, 0])
        c[0] += drafted if offered is None else max(offered, drafted)
        c[1] += accepted

    def forget(self, key):
        self.per_request.pop(key, None)
        if hasattr(self.drafter, "forget"):
            self.drafter.forget(key)

    def stats(self) -> dict:
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens,
                "spec_acceptance": self.accepted_tokens / self.draft_tokens if self.draft_tokens else None,
                "spec_depth": self.depth,
                "spec_cycle_s": {f"{cls} rows, depth {k}": s for (cls, k), s in sorted(self.cycle_s.items())},
                "spec_spent": {f"depth {k}": {"seconds": t, "tokens": n} for k, (t, n) in sorted(self.spent.items())}}


class Stopwatch:
    """Wall time of a block of engine calls, and whether any of them compiled a program (the
    jitted steps' program count grew): a compile's time says nothing about a cycle's."""

    def __enter__(self):
        self.programs = compiled_programs()
        self.t = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t
        self.compiled = compiled_programs() > self.programs
