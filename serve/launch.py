"""`kimik3 serve` on the command line, and the engine flags it shares with `kimik3 replay`.

Kept free of the server's dependencies (FastAPI, uvicorn) so the CLI starts without the `serve`
extra; the server is imported only when `kimik3 serve` runs."""
from __future__ import annotations

import argparse
import gc
import os
import sys

from .cli import UsageError, add_cache_flags, add_data_parallel_flag, add_process_flags, speculative_depth


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
    add_cache_flags(p)


def settle_heap():
    """Take everything alive after start-up (modules, weights, compiled programs: hundreds of
    thousands of objects) out of the cyclic garbage collector's walks, as vLLM does after building
    its engine: a full collection would otherwise walk them all, a pause of tens of ms between
    engine steps."""
    gc.collect()
    gc.freeze()


def engine_factory(args):
    """(factory, tokenizer, model name, devices per replica, mesh) from add_engine_arguments'
    flags: the weights are loaded once, factory(replica=None) builds a fresh Engine over them (on
    one data-parallel replica's sub-mesh when given one). ValueError on bad flags."""
    from sharding.replicas import on_replica

    from .cli import cache_kwargs, check_cache_flags, check_model_flags, load_model, make_mesh
    from .engine import Engine  # JAX is imported when an engine is built, not when flags are parsed

    kind = check_model_flags(args)
    check_cache_flags(args)
    mesh = make_mesh(args)
    model, tokenizer, _ = load_model(args, kind, mesh)
    settle_heap()
    dcp_axes = ("dcp",) if args.dcp > 1 else ()

    def factory(replica=None, warm: bool = False):
        weights = model if replica is None else model.replace(params=on_replica(model.params, replica))
        engine = Engine(weights, max_batch=args.max_batch, max_seq_len=args.max_seq_len, page_size=args.page_size,
                        num_pages=args.num_pages, prefill_chunk=args.prefill_chunk, decode_steps=args.decode_steps,
                        tokenizer=tokenizer, dcp_axes=dcp_axes, speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens, **cache_kwargs(args))
        if warm:  # every process of a replica in the same order: the programs' collectives meet
            engine.warmup()
        return engine

    if getattr(args, "data_parallel", 1) == 1:
        factory()  # engine settings are checked now, before anything is served
    name = os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model
    return factory, tokenizer, name, args.tensor * args.dcp, mesh


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
    p.add_argument("--batch-window-ms", type=float, default=10.0,
                   help="how long an idle engine woken by a request waits for the rest of a burst, so the "
                        "burst prefills in one step (until 1/5 of it passes with no request; 0: step at once)")
    p.add_argument("--warmup", action="store_true",
                   help="compile every program serving runs (prefill widths, decode calls, speculative depths) "
                        "before listening, so no request waits for a compile (with --compilation-cache a "
                        "later start loads them)")
    add_data_parallel_flag(p)  # process 0 serves HTTP and dispatches to the replicas
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
    from .cli import start_processes, stop_processes
    try:
        start_processes(args)
        factory, tokenizer, name, devices, mesh = engine_factory(args)
        front = _start_replicas(args, factory, mesh, AsyncEngine)
        if front is None:  # this process steps engines for process 0 until it stops
            return 0
    except (ValueError, FileNotFoundError, UsageError) as e:
        print(f"kimik3: {e}", file=sys.stderr)
        stop_processes(str(e), 2)
        return 2
    name = args.served_model_name or name
    replicas = f"{args.data_parallel} data-parallel replicas of " if args.data_parallel > 1 else ""
    print(f"kimik3 serve: model {name!r} on {replicas}{devices} device(s), http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    server = uvicorn.Server(uvicorn.Config(build_app(front, tokenizer, name, devices), host=args.host, port=args.port,
                                           log_level="info"))

    def stop():  # a multi-process engine failed for good: the server stops (requests in flight were failed)
        server.config.timeout_graceful_shutdown = 5
        server.should_exit = True
    front.on_fatal = stop
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on (uvicorn.run swallows it too)
        pass
    finally:
        front.close()
    if not server.started:
        line = f"the server did not start on {args.host}:{args.port} (uvicorn's log above says why)"
        print(f"kimik3: {line}", file=sys.stderr)
        stop_processes(line, 1)
        return 1
    if front.fatal is not None:
        line = (f"process 0: {front.fatal}: the multi-process server stopped (its processes cannot step on "
                "without one another); restart every process")
        print(f"kimik3: {line}", file=sys.stderr)
        stop_processes(line, 1)
        return 1
    return 0


def _start_replicas(args, factory, mesh, AsyncEngine):
    """This process's part of the server: on process 0 the front the HTTP app drives (replica 0's
    AsyncEngine, or a Dispatcher over every data-parallel replica); None elsewhere, after stepping
    its replicas' engines until process 0 stops them (a replica's leader serves it to process 0,
    the replica's other processes follow their leader)."""
    import asyncio

    import jax
    from sharding.distributed import Messages
    from sharding.replicas import replicas

    from .async_engine import follow
    from .replicas import Dispatcher, RemoteReplica, serve_replica

    reps = replicas(mesh) if args.data_parallel > 1 else [None]
    me = jax.process_index()
    local, engines = [r for r in reps if r is None or r.local], {}
    for r in local:
        group = tuple(range(jax.process_count())) if r is None else r.processes
        index, leader = (0, 0) if r is None else (r.index, r.leader)
        followers = Messages(f"serve/replica{index}", sender=leader, receivers=[p for p in group if p != leader])
        if me != leader:
            print(f"kimik3 serve: process {me} following process {leader} (replica {index})", file=sys.stderr)
            follow(factory(r, args.warmup), followers)
            return None
        engines[index] = AsyncEngine(factory(r, args.warmup), max_waiting=args.max_waiting,
                                     followers=followers if len(group) > 1 else None,
                                     batch_window_s=args.batch_window_ms / 1e3)
    if me != 0:
        async def serve_all():
            await asyncio.gather(*(serve_replica(a, i, me) for i, a in engines.items()))
        asyncio.run(serve_all())
        return None
    if len(reps) == 1:
        return engines[0]
    def check(prompt, params):  # the checks of Engine.submit (a Request for process 0's side), nothing queued
        return engines[0].engine._request(prompt, params, None)
    return Dispatcher([engines[r.index] if r.leader == 0 else RemoteReplica(r.index, r.leader, check) for r in reps])
