"""Command line: `kimik3 generate --model tiny --prompt "..."`."""
from __future__ import annotations

import argparse
import sys
import time


def _generate(args) -> int:
    import kimik3

    try:
        cfg = kimik3.Config.preset(args.model)
    except kimik3.ConfigError as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model = kimik3.init(cfg, seed=args.seed)
    tok = kimik3.default_tokenizer(cfg)
    t1 = time.perf_counter()
    try:
        out = kimik3.generate(model, [args.prompt], max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, tokenizer=tok)[0]
    except ValueError as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    print(f"model {cfg.name} (random weights, seed {args.seed}); prompt: {args.prompt!r}")
    print(f"tokens: {out}")
    print(f"text:   {tok.decode(out)!r}")
    print(f"{len(out)} tokens in {t2 - t1:.2f}s (includes compilation; init {t1 - t0:.2f}s)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 / Kimi Linear inference in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("--model", default="tiny", help="preset name: tiny, tiny-linear, kimi-linear-48b, kimi-k3")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    return {"generate": _generate}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
