"""`generate`: batch prefill + a jitted decode-and-sample step per token, and what it shares with
the serving engine (`serve.Engine.generate`) so that the two agree: prompt and setting checks, the
`Completion` each prompt's output is returned as, and the per-token stop rules."""
from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from sharding.distributed import host_value

from .model import Cache, KimiLM, Model
from .runtime import bucket, check_tokens, mesh_context, prefill, run_mesh
from .sampling import check_sampling, sample_step, step_sampling
from .tokenizer import IncrementalDecoder, default_tokenizer


class Completion(list):
    """One prompt's output. It is the list of new token ids (index it, compare it with a list,
    json.dumps it as one), and it also carries:

    - `text`: the decoded tokens, cut before the first stop string that ended it (None when no
      tokenizer is known for the model);
    - `finish_reason`: "stop" (a stop token or stop string) or "length" (max_new_tokens);
    - `logprobs`: with return_logprobs, the model's log-probability of each token (log-softmax of
      the raw logits, before temperature / top-k / top-p), else None;
    - `top_logprobs`: with return_logprobs, per token a dict {token id: logprob} of the
      `top_logprobs` most likely tokens, most likely first (empty dicts when top_logprobs=0).

    A token that stops the output (a stop token) is not in it; the token that completes a stop
    string is (its text is cut). It prints as the plain list of ids.
    """

    def __init__(self, tokens=(), text=None, finish_reason=None, logprobs=None, top_logprobs=None):
        super().__init__(tokens)
        self.text, self.finish_reason = text, finish_reason
        self.logprobs, self.top_logprobs = logprobs, top_logprobs
        self.decoder = None  # the stop-string search's text so far (accept_token)

    @property
    def tokens(self) -> list[int]:
        return list(self)


def text_tokenizer(cfg, tokenizer=None):
    """The tokenizer that turns text into ids for this model: the given one, else the config's
    default (bytes for tiny models), else None (the caller must pass ids)."""
    if tokenizer is not None:
        return tokenizer
    try:
        return default_tokenizer(cfg)
    except ValueError:
        return None


def encode_prompts(cfg, prompts, tokenizer=None, first: int = 0) -> list[list[int]]:
    """Prompts as lists of in-vocabulary ids, every one checked before anything runs.

    A bare string is one prompt; otherwise a list of prompts, each a string or a list of ids."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, bytes) or (len(prompts) and isinstance(prompts[0], numbers.Integral)):
        raise ValueError("prompts must be a list of prompts (token lists or strings), not one prompt "
                         "of token ids: wrap it as [ids]")
    out = []
    for i, p in enumerate(prompts, first):
        if isinstance(p, str):
            tok = tokenizer or default_tokenizer(cfg)
            p = tok.encode(p, add_bos=True)
        if isinstance(p, (bytes, numbers.Number)):
            raise ValueError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompt {i}: empty prompt; every prompt needs at least one token")
        out.append([int(t) for t in check_tokens(cfg, list(p), f"prompt {i}")])
    return out


def accept_token(out: Completion, token: int, max_new_tokens: int, stop_tokens, stop_strings=(),
                 tokenizer=None, logprob=None) -> str | None:
    """Apply one sampled token to an output: a stop token ends it (and is dropped); otherwise the
    token (and its `logprob`, (chosen, {id: logprob})) is appended, and a stop string in the text
    or reaching max_new_tokens ends it. Returns the finish reason once it ends, else None."""
    if token in stop_tokens:
        return "stop"
    out.append(token)
    if out.logprobs is not None:
        out.logprobs.append(logprob[0])
        out.top_logprobs.append(logprob[1])
    if stop_strings:
        if out.decoder is None:
            out.decoder = IncrementalDecoder(tokenizer)
        seen = len(out.decoder.settled)  # searched already, up to a stop string's length back
        text = out.decoder.push([token])
        lo = max(0, seen - max(map(len, stop_strings)) + 1)
        hits = [i for i in (text.find(s, lo) for s in stop_strings) if i >= 0]
        if hits:
            out.text = text[:min(hits)]
            return "stop"
    if len(out) >= max_new_tokens:
        return "length"
    return None


def logprob_rows(lp, n_top: int, step: int | None = None):
    """Per row (chosen logprob, {id: logprob} of the n_top best) from a sampling step's device
    output (chosen [.., B], top ids [.., B, K], top logprobs [.., B, K]); `step` picks a leading
    index when the arrays have one."""
    chosen, ids, lps = (np.asarray(a) if step is None else np.asarray(a)[step] for a in lp)
    return [(float(chosen[b]), {int(i): float(v) for i, v in zip(ids[b, :n_top], lps[b, :n_top])})
            for b in range(chosen.shape[0])]


def stop_set(cfg, stop_tokens) -> set:
    """The ids that end an output: the given ones, else the config's EOS."""
    stops = {cfg.eos_token_id} if stop_tokens is None else set(int(t) for t in stop_tokens)
    stops.discard(None)
    return stops


@functools.partial(jax.jit, static_argnames=("backend", "logprobs"), donate_argnames=("cache",))
def _decode_and_sample(model: Model, cache: Cache, tokens, active, seeds, gen_idx, temperature, top_k, top_p,
                       backend=None, logprobs=False):
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens[:, None], cache.layers,
                                             cache.lengths, active, backend=backend,
                                             page_table=cache.page_table, dcp_axes=cache.dcp_axes)
    nxt, lp = sample_step(logits[:, 0], seeds, gen_idx, temperature, top_k, top_p, logprobs)
    return nxt, lp, cache.replace(lengths=cache.lengths + active, layers=layers)


_sample_step = jax.jit(sample_step, static_argnames=("logprobs",))


def prompt_seeds(seed: int, n: int) -> np.ndarray:
    """The seed of each of n prompts of one call (seed, seed + 1, ...): `generate` and
    `Engine.generate` give prompt i the same one, so they draw the same samples."""
    return (np.uint64(seed) + np.arange(n, dtype=np.uint64)).astype(np.uint32)


def generate(model: Model, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens=None, stop_strings=(),
             return_logprobs: bool = False, top_logprobs: int = 0,
             max_seq_len: int | None = None, tokenizer=None, backend=None, mesh=None,
             dcp_axes=()) -> list[Completion]:
    """Generate up to max_new_tokens for each prompt; returns one `Completion` per prompt (a list
    of new token ids with .text, .finish_reason, .logprobs, .top_logprobs).

    `prompts`: a list of prompts (token lists or strings); a bare string is one prompt.
    Greedy when temperature == 0; otherwise temperature / top-k / top-p sampling; prompt i's
    token j is drawn with a key from (seed + i, j), the same as `serve.Engine.generate`'s. A row
    stops at any of `stop_tokens` (default: the config's EOS; not included in its output) or once
    its text contains one of `stop_strings` (the text is cut before it). `return_logprobs=True`
    fills each output's .logprobs and .top_logprobs (`top_logprobs` alternatives per token).
    With `mesh` the cache lives on it; `dcp_axes` splits the MLA cache positions over those axes.
    Not traceable (a host loop over tokens); `kimik3.prefill` / `decode_step` are.
    """
    cfg = model.cfg
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, stop_strings,
                   top_logprobs, cfg.vocab_size)
    tok = text_tokenizer(cfg, tokenizer)
    if stop_strings and tok is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=")
    prompts = encode_prompts(cfg, prompts, tokenizer)
    if not prompts:
        return []
    longest = max(len(p) for p in prompts)
    need = longest + max_new_tokens
    if max_seq_len is None:
        max_seq_len = bucket(need)
    if need > max_seq_len:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"needs {need} cache positions, more than max_seq_len={max_seq_len}")
    stops = stop_set(cfg, stop_tokens)
    B = len(prompts)
    outs = [Completion(logprobs=[] if return_logprobs else None, top_logprobs=[] if return_logprobs else None)
            for _ in range(B)]
    seeds = jnp.asarray(prompt_seeds(seed, B))
    temperature, top_k, top_p = step_sampling(temperature, top_k, top_p)  # None: greedy, no sort

    last_logits, cache = prefill(model, prompts, max_seq_len, backend=backend, mesh=mesh, dcp_axes=dcp_axes)
    nxt, lp = _sample_step(last_logits, seeds, jnp.zeros(B, jnp.int32), temperature, top_k, top_p,
                           logprobs=return_logprobs)
    done = np.zeros(B, bool)
    for step in range(max_new_tokens):
        toks = host_value(nxt)  # every process takes the same decisions (one SPMD program)
        rows = logprob_rows(lp, top_logprobs) if return_logprobs else [None] * B
        for b in range(B):
            if not done[b]:
                reason = accept_token(outs[b], int(toks[b]), max_new_tokens, stops, stop_strings, tok, rows[b])
                if reason:
                    done[b], outs[b].finish_reason = True, reason
        if done.all():
            break
        active = jnp.asarray(~done, jnp.int32)
        with mesh_context(run_mesh(model, cache)):
            nxt, lp, cache = _decode_and_sample(model, cache, jnp.asarray(toks), active, seeds,
                                                jnp.full(B, step + 1, jnp.int32), temperature, top_k, top_p,
                                                backend=backend, logprobs=return_logprobs)
    for o in outs:
        if o.text is None and tok is not None:
            o.text = tok.decode(o)
    return outs
