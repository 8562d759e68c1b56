"""How an engine splits its cache memory: MLA pages, and the prefix cache's KDA checkpoints and
its checkpoint interval, from the sizes the engine asks for (checked here, one line each)."""
from __future__ import annotations

import math


def plan_cache(*, max_batch: int, page_size: int, max_seq_len: int, prefill_chunk: int, page_bytes: int,
               slot_bytes: int, num_pages: int | None, memory_budget_bytes: int | None, prefix_cache: bool,
               cache_block: int, device_cache_bytes: int | None, host_cache_bytes: int,
               checkpoint_interval: int | None) -> tuple[int, int, int | None]:
    """(pages in the pool, device bytes for checkpoints, checkpoint interval); Engine's
    docstring says what each argument means. max_seq_len is a multiple of page_size."""
    pages_per_seq = max_seq_len // page_size
    if prefix_cache:
        if cache_block < 1 or cache_block % page_size:
            raise ValueError(f"cache_block={cache_block} must be a positive multiple of page_size={page_size}")
        if device_cache_bytes is not None and device_cache_bytes < slot_bytes:
            raise ValueError(f"device_cache_bytes={device_cache_bytes} holds no KDA checkpoint ({slot_bytes} B "
                             "each): raise it, or prefix_cache=False")
        block_bytes = cache_block // page_size * page_bytes
        if host_cache_bytes and host_cache_bytes < slot_bytes + block_bytes:
            raise ValueError(f"host_cache_bytes={host_cache_bytes} holds less than one block's pages plus one "
                             f"KDA checkpoint ({block_bytes} + {slot_bytes} B): raise it, or 0 for no host tier")
        if checkpoint_interval is None:
            # the tokens whose MLA pages weigh one checkpoint, rounded up to a multiple of both
            # the block and the prefill chunk: prefill chunks are cut at checkpoint positions,
            # and a cut off the chunk grid costs a whole padded chunk call
            tokens = math.ceil(slot_bytes * page_size / max(page_bytes, 1))
            grid = math.lcm(cache_block, prefill_chunk)
            checkpoint_interval = max(1, math.ceil(tokens / grid)) * grid
        if checkpoint_interval < 1 or checkpoint_interval % cache_block:
            raise ValueError(f"checkpoint_interval={checkpoint_interval} must be a positive multiple of "
                             f"cache_block={cache_block}")
    else:
        device_cache_bytes = 0
    # checkpoint bytes the default budget gives each page of the pool (one per interval)
    ckpt_per_page = (slot_bytes * page_size / checkpoint_interval
                     if prefix_cache and device_cache_bytes is None else 0.0)
    least_ckpts = max_batch * slot_bytes if ckpt_per_page else (device_cache_bytes or 0)
    if num_pages is None:
        if memory_budget_bytes is None:
            num_pages = max_batch * pages_per_seq
        else:
            left = memory_budget_bytes - max_batch * slot_bytes - least_ckpts
            num_pages = (int(left // (page_bytes + ckpt_per_page)) if page_bytes
                         else pages_per_seq)
            if num_pages < pages_per_seq:
                raise ValueError(
                    f"memory_budget_bytes={memory_budget_bytes} holds {max(num_pages, 0)} cache pages after "
                    f"{max_batch} KDA state slots ({slot_bytes} B each) and {least_ckpts} B of "
                    f"prefix-cache checkpoints, but one {max_seq_len}-token "
                    f"sequence needs {pages_per_seq} pages of {page_bytes} B: raise the budget or "
                    "lower max_batch / max_seq_len")
    if ckpt_per_page:
        device_cache_bytes = max(least_ckpts, int(num_pages * ckpt_per_page) // slot_bytes * slot_bytes)
    return int(num_pages), device_cache_bytes, checkpoint_interval
