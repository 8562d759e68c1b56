"""`kimik3 serve` on the command line, and the engine flags it shares with `kimik3 replay`.

Kept free of the server's dependencies (FastAPI, uvicorn) so the CLI starts without the `serve`
extra; the server is imported only when `kimik3 serve` runs."""
from __future__ import annotations

import argparse
import os
import sys

from .cli import UsageError, add_process_flags, speculative_depth


def add_engine_arguments(p: argparse.ArgumentParser, model_default: str | None = "tiny"):
    """Model and engine flags: which weights, on how many devices, with what cache and batch."""
    p.add_argument("--model", default=model_default,
                   help="a preset (tiny, tiny-linear, kimi-linear-48b, kimi-k3: random weights) or a checkpoint "
                        "directory (HF safetensors or kimik3.save)")
    p.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    p.add_argument("--mxfp4-layout", choices=("k3", "paired"), default=None,
                   help="MXFP4 experts' byte layout in memory (see kimik3 generate --help)")
    p.add_argument("--mla-cache", choices=("auto", "fp8"), default="auto",
                   help="MLA cache storage: auto = the activation dtype; fp8 = e4m3 (see kimik3 generate --help)")
    p.add_argument("--mla-cache-scale", type=float, default=None, help="the fp8 cache's per-tensor scale")
    p.add_argument("--max-batch", type=int, default=16, help="decode slots (requests running at once)")
    p.add_argument("--max-seq-len", type=int, default=16384, help="longest prompt + completion, in tokens")
    p.add_argument("--page-size", type=int, default=16, help="tokens per MLA cache page")
    p.add_argument("--num-pages", type=int, default=None,
                   help="MLA cache pages (default: enough for every slot at --max-seq-len)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens a slot feeds per step")
    p.add_argument("--decode-steps", type=int, default=4, help="decode steps per device call")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding: ngram = drafts looked up in the request's own tokens (no weights)")
    p.add_argument("--num-speculative-tokens", default="auto", type=speculative_depth,
                   help="draft depth: auto (chosen by measured tokens per second; 0 = off) or 1..7")
    p.add_argument("--tensor", type=int, default=1, help="tensor parallelism over this many devices")
    p.add_argument("--dcp", type=int, default=1,
                   help="decode context parallelism: split every cache page over this many devices "
                        "(--page-size must be a multiple; devices used: tensor x dcp)")


def engine_factory(args):
    """(factory, tokenizer, model name, devices) from add_engine_arguments' flags: the weights are
    loaded once, factory() builds a fresh Engine over them. ValueError on bad flags."""
    from .cli import check_model_flags, load_model, make_mesh
    from .engine import Engine  # JAX is imported when an engine is built, not when flags are parsed

    model, tokenizer, _ = load_model(args, check_model_flags(args), make_mesh(args))
    dcp_axes = ("dcp",) if args.dcp > 1 else ()

    def factory():
        return Engine(model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, page_size=args.page_size,
                      num_pages=args.num_pages, prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
                      tokenizer=tokenizer, dcp_axes=dcp_axes, speculative=args.speculative,
                      num_speculative_tokens=args.num_speculative_tokens)

    factory()  # engine settings are checked now, before anything is served
    name = os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model
    return factory, tokenizer, name, args.tensor * args.dcp


def add_parser(subparsers):
    """`kimik3 serve`: adds the subcommand (its handler as `run`) and returns its parser."""
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install -e \".[serve]\")")
    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the preset's name or the checkpoint directory's)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may queue for a decode slot; beyond it the server answers 503")
    add_process_flags(p)  # process 0 serves HTTP; the others step their engines with it
    p.set_defaults(run=_serve)
    return p


def _serve(args) -> int:
    try:
        import uvicorn

        from .async_engine import AsyncEngine
        from .server import build_app
    except ImportError as e:
        print(f"kimik3 serve needs the serve extra ({e.name} is missing): pip install -e \".[serve]\"",
              file=sys.stderr)
        return 2
    from sharding.distributed import Messages, is_primary

    from .async_engine import follow
    from .cli import start_processes
    try:
        several = start_processes(args)
        factory, tokenizer, name, devices = engine_factory(args)
        if not is_primary():  # every step's inputs come from process 0
            print(f"kimik3 serve: following process 0 on {devices} device(s)", file=sys.stderr)
            follow(factory(), Messages("serve"))
            return 0
        aengine = AsyncEngine(factory(), max_waiting=args.max_waiting, followers=Messages("serve") if several else None)
    except (ValueError, FileNotFoundError, UsageError) as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or name
    print(f"kimik3 serve: model {name!r} on {devices} device(s), http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(build_app(aengine, tokenizer, name, devices), host=args.host, port=args.port, log_level="info")
    finally:
        aengine.close()
    return 0
