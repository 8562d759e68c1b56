"""python -m benchmarks <name> [flags]: run one benchmark (JSON to --out), or `report`."""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

# name -> module; each has add_args(parser), run(record, args) and a docstring (the help)
BENCHMARKS = {"kda": "kda", "mla": "mla", "mla-prefill": "mla_prefill", "moe": "moe",
              "attnres": "attnres", "dense": "dense",
              "engine": "engine", "sharded": "sharded",
              "prefix-cache": "prefix_cache", "speculative": "speculative", "server": "server"}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SMOKE_OUT = os.path.join(tempfile.gettempdir(), "kimik3-benchmarks-smoke")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = ap.add_subparsers(dest="name", required=True)
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(f"benchmarks.{module}")
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", default=None,
                       help="directory for <name>.json (default: benchmarks/results, the "
                            "committed results that BENCHMARKS.md is made from; with --smoke or --lower "
                            f"{SMOKE_OUT}, so a CPU check never replaces a GPU result)")
        p.add_argument("--smoke", action="store_true",
                       help="CPU check of the code paths: tiny shapes, interpret-mode kernels, "
                            "no peer; its timings mean nothing")
        p.add_argument("--budget-s", type=float, default=None,
                       help="start no new case after this many seconds (skipped ones are listed); "
                            "default 480, none with --smoke")
        mod.add_args(p)
    for name in ("report", "resources"):
        mod = importlib.import_module(f"benchmarks.{name}")
        p = sub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    if args.name in ("report", "resources"):
        return importlib.import_module(f"benchmarks.{args.name}").main(args) or 0
    mod = importlib.import_module(f"benchmarks.{BENCHMARKS[args.name]}")
    cpu_check = args.smoke or getattr(args, "lower", False)  # --lower: CUDA lowering on the CPU
    args.out = args.out or (SMOKE_OUT if cpu_check else RESULTS)
    if hasattr(mod, "prepare_env"):  # before JAX starts a backend
        mod.prepare_env(args)
    from .common import Record
    rec = Record(args.name, args, argv)
    rec.log(f"{args.name} on {rec.data['device']}, commit {rec.data['commit']}")
    mod.run(rec, args)
    rec.save()
    for r in rec.data["rows"]:
        peer = "" if r["peer"] is None else f"  {r['peer_name']} {r['peer']:.4g} {r['unit']}"
        rec.log(f"{r['area']:<40} {r['shape']:<24} ours {r['ours']:.4g} {r['unit']}{peer}")
    for case, err in rec.data["errors"].items():
        rec.log("ERROR", case, err.strip().splitlines()[-1])
    if rec.data["skipped"]:
        rec.log("skipped (budget):", rec.data["skipped"])
    rec.log(f"wrote {rec.path}")
    return 1 if rec.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
