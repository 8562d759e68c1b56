"""What a user submits and what the engine tracks per request: sampling settings, the request's
state (slot, pages, tokens fed, timings) and a view of its sequence that copies nothing."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from kimik3.generation import Completion
from kimik3.sampling import check_sampling


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple | None = None  # None: the model's EOS
    stop_strings: tuple = ()
    return_logprobs: bool = False  # fill Request.logprobs / top_logprobs as tokens are accepted
    top_logprobs: int = 0  # alternatives per token with return_logprobs (<= kimik3.sampling.MAX_TOP_LOGPROBS)

    def check(self, vocab_size=None):
        """The same rules as kimik3.generate's (kimik3.sampling.check_sampling)."""
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed, self.stop_tokens,
                       self.stop_strings, self.top_logprobs, vocab_size)


class SequenceView(Sequence):
    """A request's sequence (prompt, then output) read in place: its length, an item and a slice
    (step 1) copy only what they return; the request may grow between reads."""
    __slots__ = ("_req",)

    def __init__(self, req):
        self._req = req

    def __len__(self) -> int:
        return self._req.seq_len

    def __getitem__(self, i):
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            return self._req.tokens(start, max(start, stop)) if step == 1 else self._req.sequence[i]
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"index {i} out of a sequence of {n} tokens")
        prompt = self._req.prompt
        return prompt[j] if j < len(prompt) else self._req.output[j - len(prompt)]


@dataclasses.dataclass
class Request:
    id: object
    prompt: list
    params: SamplingParams
    output: Completion = dataclasses.field(default_factory=Completion)  # the accepted tokens (a list)
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
    waits_for: tuple | None = None  # (running request, position) whose prefill it waits for, queued
    cache_ahead: bool = False  # aborted while a chained decode call fed it: its state is past `fed`

    @property
    def logprobs(self) -> list[float] | None:
        """With params.return_logprobs: each accepted token's log-probability, as accepted."""
        return self.output.logprobs

    @property
    def top_logprobs(self) -> list[dict] | None:
        """With params.return_logprobs: per accepted token {id: logprob} of the top_logprobs best."""
        return self.output.top_logprobs

    @property
    def sequence(self):
        """What the cache must hold before the next sample: prompt, then all but the newest output.
        A new list each time: per-step code uses seq_len and tokens() (a long context's copy per
        request per step was host time the device waited for)."""
        return self.prompt + self.output

    @property
    def seq_len(self) -> int:
        return len(self.prompt) + len(self.output)

    def view(self) -> "SequenceView":
        """The sequence read in place (the drafters' input: no copy of a long context a cycle)."""
        return SequenceView(self)

    def tokens(self, start: int, end: int) -> list:
        """sequence[start:end], copying only that span."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:] + self.output[:end - n]

    @property
    def metrics(self) -> dict:
        ttft = None if self.first_token is None else self.first_token - self.submitted
        n = len(self.output)
        span = (self.finished or time.perf_counter()) - (self.first_token or self.submitted)
        return {"prompt_tokens": len(self.prompt), "output_tokens": n, "ttft_s": ttft,
                "decode_tokens_per_s": (n - 1) / span if n > 1 and span > 0 else None,
                "preemptions": self.preemptions, "prefix_hit_tokens": self.prefix_hit_tokens or 0}
