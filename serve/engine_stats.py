"""Engine.stats() of several engines (data-parallel replicas) as one."""
from __future__ import annotations


def merge_stats(stats: list[dict]) -> dict:
    """Several engines' stats() as one (data-parallel replicas): counters added up, the hit rate
    and the acceptance recomputed from them, the deepest speculation depth; the first engine's
    cycle times."""
    out = dict(stats[0])
    for s in stats[1:]:
        for k, v in s.items():
            if isinstance(v, int) and not isinstance(v, bool) and k != "spec_depth":
                out[k] += v
        out["spec_depth"] = max(out["spec_depth"], s["spec_depth"])
    out["prefix_hit_rate"] = out["prefix_hit_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
    if "spec_acceptance" in out:
        out["spec_acceptance"] = (out["spec_accepted_tokens"] / out["spec_draft_tokens"]
                                  if out["spec_draft_tokens"] else None)
    return out
