"""Command line: `kimik3 generate --model tiny --prompt "..."`, `kimik3 batch ...`.

It lives in serve/ (the top layer) because its subcommands drive the engine; kimik3 never imports serve."""
from __future__ import annotations

import argparse
import os
import sys
import time


def _load(args):
    """(model, tokenizer, where the weights came from) for a preset name or a checkpoint dir."""
    import kimik3

    if os.path.isdir(args.model):
        model = _with_mla_cache(kimik3.load(args.model, mxfp4_layout=args.mxfp4_layout), args)
        has_bpe = os.path.exists(os.path.join(args.model, "tiktoken.model"))
        tok = kimik3.load_tokenizer(args.model) if has_bpe else kimik3.default_tokenizer(model.cfg)
        return model, tok, args.model
    if args.mxfp4_layout not in (None, "k3"):
        raise ValueError("--mxfp4-layout applies to checkpoint directories (a preset's random weights "
                         "are built in the K3 layout)")
    model = _with_mla_cache(kimik3.init(kimik3.Config.preset(args.model), seed=args.seed), args)
    return model, kimik3.default_tokenizer(model.cfg), f"random weights, seed {args.seed}"


def _with_mla_cache(model, args):
    """--mla-cache fp8 [--mla-cache-scale S]: the MLA cache as e4m3 (the weights are unchanged)."""
    if args.mla_cache == "auto":
        if args.mla_cache_scale is not None:
            raise ValueError("--mla-cache-scale is the fp8 cache's scale: give it with --mla-cache fp8")
        return model
    fields = {"mla_cache_dtype": args.mla_cache}
    if args.mla_cache_scale is not None:
        fields["mla_cache_scale"] = args.mla_cache_scale
    return model.replace(cfg=model.cfg.replace(**fields))


def _batch(args) -> int:
    from serve.batch import run_batch

    try:
        model, tok, origin = _load(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    if not os.path.exists(args.input):
        print(f"kimik3: no input file {args.input}", file=sys.stderr)
        return 2
    dcp_axes = ()
    if args.tensor > 1 or args.dcp > 1:
        import sharding

        try:  # TP over `tensor`; DCP over its own axis (DCP ranks hold their own weight copies)
            mesh = sharding.make_mesh(tensor=args.tensor, dcp=args.dcp)
        except ValueError as e:
            print(f"kimik3: --tensor {args.tensor} --dcp {args.dcp}: {e}", file=sys.stderr)
            return 2
        model = sharding.place_model(model, mesh)
        dcp_axes = ("dcp",) if args.dcp > 1 else ()
        origin += f"; mesh tensor={args.tensor} dcp={args.dcp}"
    print(f"kimik3 batch: model {model.cfg.name} ({origin})", file=sys.stderr)
    try:
        summary = run_batch(model, args.input, args.output, tok, dcp_axes=dcp_axes,
                            defaults=dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                          top_k=args.top_k, top_p=args.top_p, seed=args.seed),
                            max_batch=args.max_batch, max_seq_len=args.max_seq_len, page_size=args.page_size,
                            prefill_chunk=args.prefill_chunk, progress=not args.quiet)
    except ValueError as e:  # engine settings (what was written so far stays; a re-run resumes)
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    print(f"kimik3 batch: {summary['requests']} requests, {summary['tokens']} tokens in {summary['seconds']:.1f}s "
          f"({summary['tokens_per_s']:.1f} tok/s), {summary['errors']} errors, {summary['skipped']} already done; "
          f"prefix cache: {summary['prefix_hit_tokens']} of {summary['prompt_tokens']} prompt tokens hit "
          f"({100 * summary['prefix_hit_rate']:.1f}%), {summary['kda_checkpoints']} KDA checkpoints, "
          f"{summary['evictions']} evictions, {summary['host_restored_bytes']} B restored from host", file=sys.stderr)
    return 0


def _generate(args) -> int:
    import kimik3

    t0 = time.perf_counter()
    try:
        model, tok, origin = _load(args)
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
    g.add_argument("--mxfp4-layout", choices=("k3", "paired"), default=None,
                   help="MXFP4 experts' byte layout in memory: paired = re-encoded at load for the faster "
                        "CUDA decode kernel (NVIDIA only); default: paired for an HF checkpoint on an NVIDIA "
                        "GPU with bf16 activations, else as stored")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mla-cache", choices=("auto", "fp8"), default="auto",
                   help="MLA cache storage: auto = the activation dtype; fp8 = e4m3 (per-tensor scale "
                        "Config.mla_cache_scale, 1.0 unless set), half of bf16's bytes, and the faster fp8 "
                        "path of the decode kernel")
    g.add_argument("--mla-cache-scale", type=float, default=None,
                   help="the fp8 cache's per-tensor scale (values are stored as e4m3(v / scale), "
                        "clipped at 448); kimik3.calibrate_mla_cache_scale(model, prompts) measures one")
    b = sub.add_parser("batch", help="offline generation over a JSONL file (resumable)")
    b.add_argument("--model", default="tiny", help="a preset or a checkpoint directory")
    b.add_argument("--mxfp4-layout", choices=("k3", "paired"), default=None,
                   help="MXFP4 experts' byte layout in memory (see generate --help)")
    b.add_argument("--input", required=True, help="prompts.jsonl: {id, prompt | messages, [sampling fields]}")
    b.add_argument("--output", required=True, help="results.jsonl (appended; ids already there are skipped)")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--mla-cache", choices=("auto", "fp8"), default="auto",
                   help="MLA cache storage (see generate --help)")
    b.add_argument("--mla-cache-scale", type=float, default=None,
                   help="the fp8 cache's scale (see generate --help)")
    b.add_argument("--max-batch", type=int, default=8)
    b.add_argument("--max-seq-len", type=int, default=1024)
    b.add_argument("--page-size", type=int, default=16)
    b.add_argument("--prefill-chunk", type=int, default=32)
    b.add_argument("--tensor", type=int, default=1, help="tensor parallelism over this many devices")
    b.add_argument("--dcp", type=int, default=1,
                   help="decode context parallelism: split every cache page over this many devices "
                        "(--page-size must be a multiple; devices used: tensor x dcp)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    return {"generate": _generate, "batch": _batch}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
