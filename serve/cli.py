"""Command line: `kimik3 generate --prompt "..."` (the shipped trained tiny-code model), `kimik3 batch ...`.

It lives in serve/ (the top layer) because its subcommands drive the engine; kimik3 never imports serve.

Every failure a user can cause ends in one line on stderr and a non-zero exit (2: bad flags, paths,
checkpoints or configs; 1: anything unexpected); `--debug` shows the traceback instead. Flags are
checked when parsed or by the subcommand before any model is built.

Adding a subcommand: a module with `add_parser(subparsers)` that calls `subparsers.add_parser(...)`,
adds its flags (the shared sets below: add_model_flags, add_sampling_flags, add_mesh_flags) and
`set_defaults(run=fn)`, where fn(args) returns the exit status and raises UsageError (or ValueError,
OSError) for what the user got wrong; then list its add_parser in SUBCOMMANDS. Keep its module cheap
to import (import JAX, kimik3 and servers inside fn): every command parses through it.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_MODEL = "tiny-code"  # shipped in the package (kimik3.SHIPPED_MODELS): trained, loads offline


class UsageError(Exception):
    """Something the user gave (a flag, a path, a file) is wrong: printed as one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (argparse prints the usage block before it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- flag types: a bad value is refused while parsing, before anything is built ----
def _int_at_least(low):
    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


def _float_in(low, high=None, low_open=False):
    want = (f"> {low}" if low_open else f">= {low}") + ("" if high is None else f" and <= {high}")

    def parse(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number {want}, got {s!r}") from None
        if not (v > low if low_open else v >= low) or (high is not None and not v <= high):
            raise argparse.ArgumentTypeError(f"must be {want}, got {s}")
        return v
    parse.__name__ = f"number {want}"
    return parse


_positive = _int_at_least(1)


def speculative_depth(s):
    if s == "auto":
        return s
    v = _int_at_least(1)(s)
    if v > 7:
        raise argparse.ArgumentTypeError(f"at most 7 (a verify pass takes 8 tokens a row), got {v}")
    return v
_non_negative = _int_at_least(0)


# ---- shared flag sets ----
def add_common_flags(p):
    """--debug (tracebacks) and --compilation-cache: every subcommand has them."""
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="on an error show the Python traceback instead of one line")
    p.add_argument("--compilation-cache", metavar="DIR|off", default=None,
                   help="where JAX keeps compiled programs between runs (a second run loads them instead "
                        "of compiling); default: $KIMIK3_COMPILATION_CACHE, else $JAX_COMPILATION_CACHE_DIR, "
                        "else $XDG_CACHE_HOME/kimik3/jax or ~/.cache/kimik3/jax; off: no cache")


def add_model_flags(p):
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="tiny-code (the shipped trained byte-level model), a preset (tiny, tiny-linear, "
                        "kimi-linear-48b, kimi-k3: random weights) or a checkpoint directory (HF safetensors "
                        f"or kimik3.save); default {DEFAULT_MODEL}")
    p.add_argument("--mxfp4-layout", choices=("k3", "paired"), default=None,
                   help="MXFP4 experts' byte layout in memory: paired = re-encoded at load for the faster "
                        "CUDA decode kernel (NVIDIA only); default: paired for an HF checkpoint on an NVIDIA "
                        "GPU with bf16 activations, else as stored")
    p.add_argument("--mla-cache", choices=("auto", "fp8"), default="auto",
                   help="MLA cache storage: auto = the activation dtype; fp8 = e4m3 (per-tensor scale "
                        "Config.mla_cache_scale, 1.0 unless set), half of bf16's bytes, and the faster fp8 "
                        "path of the decode kernel")
    p.add_argument("--mla-cache-scale", type=_float_in(0, low_open=True), default=None,
                   help="the fp8 cache's per-tensor scale (values are stored as e4m3(v / scale), "
                        "clipped at 448); kimik3.calibrate_mla_cache_scale(model, prompts) measures one")


def add_sampling_flags(p, max_new_tokens: int, stop: bool = True):
    p.add_argument("--max-new-tokens", type=_positive, default=max_new_tokens,
                   help=f"most tokens to generate per prompt (default {max_new_tokens})")
    p.add_argument("--temperature", type=_float_in(0), default=0.0,
                   help="sampling temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=_non_negative, default=0, help="sample from the k likeliest tokens; 0 = all")
    p.add_argument("--top-p", type=_float_in(0, 1, low_open=True), default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p; 1 = all")
    p.add_argument("--seed", type=_non_negative, default=0,
                   help="sampling seed (and a preset's random weights)")
    if stop:
        p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop where the generated text contains TEXT (left out of the text); repeatable")


def add_mesh_flags(p):
    p.add_argument("--tensor", type=_positive, default=1, help="tensor parallelism over this many devices")
    p.add_argument("--dcp", type=_positive, default=1,
                   help="decode context parallelism: split every sequence's MLA cache positions over this "
                        "many devices (devices used: tensor x dcp)")
    add_process_flags(p)


def add_cache_flags(p):
    """The prefix cache's flags, shared by batch, serve and replay (Engine's arguments of the same
    names; serve.engine.Engine explains each)."""
    g = p.add_argument_group("prefix cache")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt from its first token (by default prompts reuse the MLA pages "
                        "and KDA checkpoints of prefixes already computed)")
    g.add_argument("--cache-memory-gb", type=_float_in(0, low_open=True), default=None, metavar="GB",
                   help="device memory for the cache: MLA pages, KDA state slots and checkpoints (default: "
                        "pages for every slot at --max-seq-len; more keeps more prefixes between turns)")
    g.add_argument("--host-cache-gb", type=_float_in(0), default=0.0, metavar="GB",
                   help="host memory that evicted prefix pages and checkpoints move to, restored on a hit "
                        "(default 0: evicted prefixes are recomputed)")
    g.add_argument("--cache-block", type=_positive, default=64,
                   help="tokens a prefix is matched by (a multiple of --page-size)")
    g.add_argument("--checkpoint-interval", type=_positive, default=None, metavar="TOKENS",
                   help="tokens between the KDA checkpoints a long prefill takes (default: as many tokens as "
                        "weigh one checkpoint in MLA pages)")


def check_cache_flags(args):
    """UsageError for cache flags that cannot work together, before any weights are loaded."""
    if args.cache_block % args.page_size:
        raise UsageError(f"--cache-block {args.cache_block} must be a multiple of --page-size {args.page_size}")
    if not args.prefix_cache and args.host_cache_gb:
        raise UsageError("--host-cache-gb holds evicted prefixes: drop it or drop --no-prefix-cache")


def cache_kwargs(args) -> dict:
    """Engine keyword arguments from add_cache_flags' flags."""
    gb = args.cache_memory_gb
    return dict(prefix_cache=args.prefix_cache, memory_budget_bytes=None if gb is None else int(gb * 1e9),
                host_cache_bytes=int(args.host_cache_gb * 1e9), cache_block=args.cache_block,
                checkpoint_interval=args.checkpoint_interval)


def add_data_parallel_flag(p):
    p.add_argument("--data-parallel", type=_positive, default=1, metavar="N",
                   help="data-parallel replicas: N copies of the --tensor x --dcp mesh (devices used: N x tensor x "
                        "dcp; over several processes the replicas split the processes first), each with its own "
                        "engine, slots and scheduler; the requests are dealt out to them")


def add_process_flags(p):
    """One mesh over several processes (hosts): README "Several hosts" has the launch recipe."""
    p.add_argument("--coordinator", metavar="HOST:PORT", default=None,
                   help="several processes: process 0's host and a free port (default $JAX_COORDINATOR_ADDRESS, "
                        "or detected on SLURM / Open MPI / Kubernetes)")
    p.add_argument("--num-processes", type=_positive, default=None,
                   help="how many processes the mesh spans (default $JAX_NUM_PROCESSES or detected)")
    p.add_argument("--process-id", type=_non_negative, default=None,
                   help="this process's id, 0..N-1; process 0 reads the input and writes the output "
                        "(default $JAX_PROCESS_ID or detected)")


# ---- what the shared flags build ----
def check_model_flags(args) -> str:
    """"dir", "shipped" or "preset" for --model, or UsageError; also the flags that depend on it. Cheap."""
    import kimik3

    if os.path.isdir(args.model):
        kind = "dir"
    elif args.model in kimik3.SHIPPED_MODELS:
        kind = "shipped"
    elif args.model in kimik3.PRESETS:
        kind = "preset"
    elif os.path.exists(args.model):
        raise UsageError(f"--model {args.model}: not a directory (a checkpoint is a directory with "
                         "config.json and *.safetensors, or a kimik3.save directory)")
    else:
        names = dict.fromkeys([*kimik3.PRESETS, *kimik3.SHIPPED_MODELS])  # tiny-code is both
        raise UsageError(f"no such checkpoint directory: {args.model} (nor a preset: {', '.join(names)})")
    if kind == "preset" and args.mxfp4_layout not in (None, "k3"):
        raise UsageError("--mxfp4-layout applies to checkpoint directories (a preset's random weights "
                         "are built in the K3 layout)")
    if args.mla_cache_scale is not None and args.mla_cache != "fp8":
        raise UsageError("--mla-cache-scale is the fp8 cache's scale: give it with --mla-cache fp8")
    return kind


def start_processes(args) -> bool:
    """Join the other processes of a multi-process run (--coordinator, --num-processes,
    --process-id or the environment) before anything uses a device; False for one process."""
    import sharding

    joined = sharding.initialize_distributed(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                             getattr(args, "process_id", None))
    if joined:  # a process that fails tells the others (main's handler): they stop too, with one line
        sharding.distributed.watch_failures()
    if joined and getattr(args, "speculative", None) and getattr(args, "num_speculative_tokens", None) == "auto":
        raise UsageError("--num-speculative-tokens auto picks depths by timing, which differs between processes: "
                         "give a depth (1..7) for a multi-process run")
    return joined


def make_mesh(args):
    """The --data-parallel x --tensor x --dcp mesh (None for one device in one process; over
    several processes it must use every device), or UsageError when the devices do not fit it."""
    import jax
    import sharding

    data = getattr(args, "data_parallel", 1)
    if data == 1 and args.tensor == 1 and args.dcp == 1 and jax.process_count() == 1:
        return None

    try:
        return sharding.make_mesh(data=data, tensor=args.tensor, dcp=args.dcp)
    except ValueError as e:
        flags = f"--data-parallel {data} " if data > 1 else ""
        raise UsageError(f"{flags}--tensor {args.tensor} --dcp {args.dcp}: {e}") from None


def load_model(args, kind: str, mesh=None):
    """(model, tokenizer, where the weights came from); `kind` from check_model_flags."""
    import kimik3

    if kind in ("dir", "shipped"):
        model = kimik3.load(args.model, mesh=mesh, mxfp4_layout=args.mxfp4_layout)
        has_bpe = kind == "dir" and os.path.exists(os.path.join(args.model, "tiktoken.model"))
        tok = kimik3.load_tokenizer(args.model) if has_bpe else kimik3.default_tokenizer(model.cfg)
        origin = kimik3.SHIPPED_MODELS.get(args.model, args.model)
    else:
        model = kimik3.init(kimik3.Config.preset(args.model), seed=args.seed, mesh=mesh)
        tok = kimik3.default_tokenizer(model.cfg)
        origin = f"random weights, seed {args.seed}"
    if mesh is not None:
        origin += f"; mesh tensor={args.tensor} dcp={args.dcp}"
        if mesh.shape["data"] > 1:
            origin += f", {mesh.shape['data']} data-parallel replicas"
        if mesh.devices.size > len(mesh.local_devices):
            origin += f" over {len({d.process_index for d in mesh.devices.flat})} processes"
    return _with_mla_cache(model, args), tok, origin


def _with_mla_cache(model, args):
    """--mla-cache fp8 [--mla-cache-scale S]: the MLA cache as e4m3 (the weights are unchanged)."""
    if args.mla_cache == "auto":
        return model
    fields = {"mla_cache_dtype": args.mla_cache}
    if args.mla_cache_scale is not None:
        fields["mla_cache_scale"] = args.mla_cache_scale
    return model.replace(cfg=model.cfg.replace(**fields))


def _dcp_axes(args):
    return ("dcp",) if args.dcp > 1 else ()


# ---- generate ----
def _cut_at_stop(tok, tokens, stops):
    """(tokens up to the one that completes the first stop text, the text before it); as the engine."""
    for n in range(1, len(tokens) + 1):
        text = tok.decode(tokens[:n])
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            return tokens[:n], text[:min(hits)]
    return tokens, tok.decode(tokens)


def _generate(args) -> int:
    import kimik3
    import sharding

    kind = check_model_flags(args)
    start_processes(args)
    mesh = make_mesh(args)
    t0 = time.perf_counter()
    model, tok, origin = load_model(args, kind, mesh)
    cfg = model.cfg
    t1 = time.perf_counter()
    prompt = (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
              else tok.encode(args.prompt, add_bos=True))
    out = kimik3.generate(model, [prompt], max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, tokenizer=tok, mesh=mesh, dcp_axes=_dcp_axes(args))[0]
    out, text = _cut_at_stop(tok, out, args.stop) if args.stop else (out, tok.decode(out))
    t2 = time.perf_counter()
    if not sharding.is_primary():  # every process ran the same program; process 0 reports it
        return 0
    print(f"model {cfg.name} ({origin}); prompt: {args.prompt!r}")
    print(f"tokens: {out}")
    print(f"text:   {text!r}")
    print(f"{len(out)} tokens in {t2 - t1:.2f}s (includes compilation; init {t1 - t0:.2f}s)")
    return 0


def _add_generate(sub):
    g = sub.add_parser("generate", help="generate a continuation of one prompt",
                       description="Generate a continuation of one prompt and print its tokens and text.")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    add_model_flags(g)
    add_sampling_flags(g, max_new_tokens=32)
    add_mesh_flags(g)
    add_common_flags(g)
    g.set_defaults(run=_generate)


# ---- batch ----
def _batch_path_error(args) -> str | None:
    """What is wrong with --input / --output, or None (checked where they live: process 0)."""
    if not os.path.isfile(args.input):
        return f"--input {args.input}: no such file"
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        return f"--output {args.output} is a directory; give a file name (results.jsonl)"
    if not os.path.isdir(out_dir):
        return f"--output {args.output}: no such directory {out_dir}"
    return None


def _batch(args) -> int:
    kind = check_model_flags(args)
    if args.page_size % args.dcp:
        raise UsageError(f"--page-size {args.page_size} must be a multiple of the DCP size {args.dcp} (--dcp)")
    check_cache_flags(args)
    start_processes(args)
    import sharding

    error = sharding.broadcast_json(_batch_path_error(args) if sharding.is_primary() else None)
    if error:  # every process stops with process 0's line
        raise UsageError(error)
    mesh = make_mesh(args)
    from serve.batch import run_batch

    model, tok, origin = load_model(args, kind, mesh)
    if sharding.is_primary():
        print(f"kimik3 batch: model {model.cfg.name} ({origin})", file=sys.stderr)
    summary = run_batch(model, args.input, args.output, tok, mesh=mesh, dcp_axes=_dcp_axes(args),
                        defaults=dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_k=args.top_k, top_p=args.top_p, seed=args.seed),
                        max_batch=args.max_batch, max_seq_len=args.max_seq_len, page_size=args.page_size,
                        prefill_chunk=args.prefill_chunk, speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens, progress=not args.quiet,
                        **cache_kwargs(args))
    if not sharding.is_primary():
        return 0
    print(f"kimik3 batch: {summary['requests']} requests, {summary['tokens']} tokens in {summary['seconds']:.1f}s "
          f"({summary['tokens_per_s']:.1f} tok/s), {summary['errors']} errors, {summary['skipped']} already done; "
          f"prefix cache: {summary['prefix_hit_tokens']} of {summary['prompt_tokens']} prompt tokens hit "
          f"({100 * summary['prefix_hit_rate']:.1f}%), {summary['kda_checkpoints']} KDA checkpoints, "
          f"{summary['evictions']} evictions, {summary['host_restored_bytes']} B restored from host", file=sys.stderr)
    return 0


def _add_batch(sub):
    b = sub.add_parser("batch", help="offline generation over a JSONL file (resumable)",
                       description="Generate for every line of a JSONL file; results are appended as they "
                                   "finish and a rerun skips the ids already written.")
    b.add_argument("--input", required=True, help="prompts.jsonl: {id, prompt | messages, [sampling fields]}")
    b.add_argument("--output", required=True, help="results.jsonl (appended; ids already there are skipped)")
    add_model_flags(b)
    add_sampling_flags(b, max_new_tokens=64, stop=False)  # per-line "stop" fields
    b.add_argument("--max-batch", type=_positive, default=8, help="most requests decoded together")
    b.add_argument("--max-seq-len", type=_positive, default=1024, help="most tokens (prompt + output) a request holds")
    b.add_argument("--page-size", type=_positive, default=16,
                   help="MLA cache positions per page (a multiple of --dcp)")
    b.add_argument("--prefill-chunk", type=_positive, default=32, help="prompt tokens prefilled per step and request")
    b.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding: ngram = drafts looked up in the request's own tokens (no weights)")
    b.add_argument("--num-speculative-tokens", type=speculative_depth, default="auto",
                   help="draft depth: auto (chosen by measured tokens per second; 0 = off) or 1..7")
    add_cache_flags(b)
    add_mesh_flags(b)
    add_data_parallel_flag(b)
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    add_common_flags(b)
    b.set_defaults(run=_batch)


def _add_serve(sub):
    from . import launch  # FastAPI / uvicorn are imported only when `kimik3 serve` runs

    add_common_flags(launch.add_parser(sub))


def _add_replay(sub):
    from . import replay

    add_common_flags(replay.add_parser(sub))


SUBCOMMANDS = [_add_generate, _add_batch, _add_serve, _add_replay]


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kimik3")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kimik3", description="Kimi K3 / Kimi Linear inference in JAX")
    p.add_argument("--version", action="version", version=f"kimik3 {_version()}",
                   help="print the version and exit")
    p.add_argument("--debug", action="store_true", help="on an error show the Python traceback instead of one line")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(sub)
    return p


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if isinstance(e, (UsageError, ValueError, OSError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from kimik3 import compilation_cache

        compilation_cache.enable_for_cli(args.compilation_cache)
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("kimik3: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        user = isinstance(e, (UsageError, ValueError, OSError))
        hint = "" if isinstance(e, UsageError) else " (--debug shows the traceback)"
        print(f"kimik3: {_one_line(e)}{hint}", file=sys.stderr)
        stop_processes(_one_line(e), 2 if user else 1)
        return 2 if user else 1


def stop_processes(line: str, status: int) -> None:
    """In a multi-process run, after this process failed with `line`: tell the others (they stop
    with one line each, wherever they wait) and exit now (the exit-time shutdown would wait for
    them). Nothing in a single-process run."""
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return
    from sharding.distributed import announce_failure

    announce_failure(line, status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
