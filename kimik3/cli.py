"""Command line: `kimik3 generate --model tiny --prompt "..."`."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _generate(args) -> int:
    import kimik3

    t0 = time.perf_counter()
    try:
        if os.path.isdir(args.model):
            model = kimik3.load(args.model)
            has_bpe = os.path.exists(os.path.join(args.model, "tiktoken.model"))
            tok = kimik3.load_tokenizer(args.model) if has_bpe else kimik3.default_tokenizer(model.cfg)
            origin = args.model
        else:
            model = kimik3.init(kimik3.Config.preset(args.model), seed=args.seed)
            tok = kimik3.default_tokenizer(model.cfg)
            origin = f"random weights, seed {args.seed}"
    except (ValueError, FileNotFoundError) as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    cfg = model.cfg
    t1 = time.perf_counter()
    try:
        prompt = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
                  else tok.encode(args.prompt, add_bos=True))
        out = kimik3.generate(model, [prompt], max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, tokenizer=tok)[0]
    except ValueError as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    t2 = time.perf_counter()
    print(f"model {cfg.name} ({origin}); prompt: {args.prompt!r}")
    print(f"tokens: {out}")
    print(f"text:   {tok.decode(out)!r}")
    print(f"{len(out)} tokens in {t2 - t1:.2f}s (includes compilation; init {t1 - t0:.2f}s)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kimik3", description="Kimi K3 / Kimi Linear inference in JAX")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation of one prompt")
    g.add_argument("--model", default="tiny",
                   help="a preset (tiny, tiny-linear, kimi-linear-48b, kimi-k3: random weights) or a checkpoint "
                        "directory (HF safetensors or kimik3.save)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
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
