"""`generate`: batch prefill + a jitted decode-and-sample step per token."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .model import Cache, KimiLM, Model
from .runtime import bucket, check_tokens, mesh_context, prefill, run_mesh
from .sampling import sample
from .tokenizer import default_tokenizer


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("cache",))
def _decode_and_sample(model: Model, cache: Cache, tokens, active, keys, temperature, top_k, top_p,
                       backend=None):
    logits, layers = KimiLM(model.cfg).apply({"params": model.params}, tokens[:, None], cache.layers,
                                             cache.lengths, active, backend=backend,
                                             page_table=cache.page_table, dcp_axes=cache.dcp_axes)
    nxt = sample(logits[:, 0], keys, temperature, top_k, top_p)
    return nxt, cache.replace(lengths=cache.lengths + active, layers=layers)


_sample = jax.jit(sample)


def _row_keys(seed: int, n: int, step: int):
    base = jax.random.key(seed)
    return jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(jnp.arange(n))


def generate(model: Model, prompts, max_new_tokens: int = 16, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens=None,
             max_seq_len: int | None = None, tokenizer=None, backend=None, mesh=None,
             dcp_axes=()) -> list[list[int]]:
    """Generate up to max_new_tokens for each prompt (token lists or strings).

    Greedy when temperature == 0; otherwise temperature / top-k / top-p sampling with keys derived
    from `seed` and the prompt's index. A row stops at any of `stop_tokens` (default: the config's
    EOS), which is not included in its output. Returns one list of new token ids per prompt.
    With `mesh` the cache lives on it; `dcp_axes` splits the MLA cache positions over those axes.
    """
    cfg = model.cfg
    if isinstance(prompts, (str, bytes)) or (len(prompts) and isinstance(prompts[0], int)):
        raise ValueError("prompts must be a list of prompts (token lists or strings), not one prompt")
    if any(isinstance(p, str) for p in prompts):
        tok = tokenizer or default_tokenizer(cfg)
        prompts = [tok.encode(p, add_bos=True) if isinstance(p, str) else p for p in prompts]
    prompts = [list(check_tokens(cfg, p, f"prompt {i}")) for i, p in enumerate(prompts)]
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (temperature >= 0 and 0 < top_p <= 1 and top_k >= 0):
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    longest = max((len(p) for p in prompts), default=0)
    need = longest + max_new_tokens
    if max_seq_len is None:
        max_seq_len = bucket(need)
    if need > max_seq_len:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"needs {need} cache positions, more than max_seq_len={max_seq_len}")
    stops = {cfg.eos_token_id} if stop_tokens is None else set(stop_tokens)
    stops.discard(None)
    B = len(prompts)
    out = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return out

    last_logits, cache = prefill(model, prompts, max_seq_len, backend=backend, mesh=mesh, dcp_axes=dcp_axes)
    nxt = _sample(last_logits, _row_keys(seed, B, 0), temperature, top_k, top_p)
    done = np.zeros(B, bool)
    for step in range(max_new_tokens):
        toks = np.asarray(nxt)
        for b in range(B):
            if not done[b]:
                if int(toks[b]) in stops:
                    done[b] = True
                else:
                    out[b].append(int(toks[b]))
        if done.all() or step == max_new_tokens - 1:
            break
        active = jnp.asarray(~done, jnp.int32)
        with mesh_context(run_mesh(model, cache)):
            nxt, cache = _decode_and_sample(model, cache, jnp.asarray(toks), active,
                                            _row_keys(seed, B, step + 1), temperature, top_k, top_p,
                                            backend=backend)
    return out
