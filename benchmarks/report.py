"""BENCHMARKS.md from the benchmarks' JSON results: one table per area.

    python -m benchmarks report                 # write BENCHMARKS.md from benchmarks/results/
    python -m benchmarks report --check         # exit 1 if BENCHMARKS.md is not what it renders
    python -m benchmarks report --results DIR --output FILE

Each results file is one benchmark's latest run (what `python -m benchmarks <name>` writes):
date, device, commit and command, and its rows. A row may carry its own date / device / commit
/ command where it comes from another run than the file's.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
OUTPUT = os.path.join(os.path.dirname(HERE), "BENCHMARKS.md")
ORDER = ["kda", "mla", "mla-prefill", "moe", "attnres", "dense", "engine", "sharded"]  # others follow by name
TIME_UNITS = ("ns", "us", "ms", "s")
META = ("date", "device", "commit", "command")  # where a row comes from
COLUMNS = ["shape", "ours", "peer", "ratio", "% of limit"]
TOOL = "python -m benchmarks"  # the commands' common prefix, said once above the list

PREAMBLE = """# Benchmarks

Made by `python -m benchmarks report` from `benchmarks/results/*.json` (each benchmark's latest
run; history is in git). Peers ran in-process on the same inputs. **ratio**: times faster than
the peer. **% of limit**: of the copy bandwidth (read + write) or bf16 matmul peak measured in
the same run. **commit**: whose code (and scripts) ran the command. **device**: H100 is the
NVIDIA H100 80GB HBM3, H200 the NVIDIA H200. No AMD runs yet.
"""


def load(results_dir: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    runs = [json.load(open(f)) for f in files]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(runs, key=lambda r: (rank.get(r["benchmark"], len(ORDER)), r["benchmark"]))


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 10 else f"{v:.3f}" if abs(v) >= 1 else f"{v:.4g}"


def ratio(row: dict) -> float | None:
    """How many times faster ours is than the peer (time units: peer / ours; rates: ours / peer)."""
    if row["peer"] is None or row["ours"] is None or not row["peer"] or not row["ours"]:
        return None
    return row["peer"] / row["ours"] if row["unit"] in TIME_UNITS else row["ours"] / row["peer"]


def shown_command(command: str) -> str:
    """The command as the table shows it: without the environment settings that change only how
    the older scripts printed or found the package (PYTHONUNBUFFERED, PYTHONPATH), and without
    `--out DIR` (where the run wrote its JSON, not what it measured)."""
    command = re.sub(r" --out \S+", "", command)
    return " ".join(w for w in command.split(" ")
                    if not w.startswith(("PYTHONUNBUFFERED=", "PYTHONPATH=")))


def shown_device(device: str) -> str:
    """The device as the table shows it: the GPU's model (NVIDIA H100 80GB HBM3 -> H100)."""
    return re.sub(r"NVIDIA |\s+\d+GB[^,]*", "", device)


def render(runs: list[dict]) -> str:
    areas: dict[str, list[tuple[dict, dict]]] = {}
    for run in runs:
        for row in run["rows"]:
            areas.setdefault(row["area"], []).append((run, row))
    out = [PREAMBLE]
    commands: list[str] = []  # numbered once for the whole file, listed at its end
    for area, rows in areas.items():
        peers = {r["peer_name"] for _, r in rows if r["peer"] is not None}
        one_peer = peers.pop() if len(peers) == 1 else None
        out.append(f"## {area}" + (f" vs {one_peer}" if one_peer else "") + "\n")
        metas = []
        for run, r in rows:
            meta = {k: r.get(k) or run[k] for k in ("date", "device", "commit")}
            command = shown_command(r.get("command") or run["command"])
            if command not in commands:
                commands.append(command)
            metas.append((meta["date"], shown_device(meta["device"]), meta["commit"], f"({commands.index(command) + 1})"))
        # what every row shares is said once, under the heading; what differs gets a column
        varies = [len({m[i] for m in metas}) > 1 for i in range(len(META))]
        shared = [f"{'commit ' if name == 'commit' else 'command ' if name == 'command' else ''}{metas[0][i]}"
                  for i, name in enumerate(META) if not varies[i]]
        if shared:
            out.append(", ".join(shared) + "\n")
        extra = [name for name, v in zip(META, varies) if v]
        notes = {r.get("note", "") for _, r in rows}
        shared_note = notes.pop() if len(notes) == 1 and all(r["limit_pct"] is None for _, r in rows) else ""
        if shared_note:  # a note every row carries: said once, under the table
            rows = [(run, dict(r, note="")) for run, r in rows]
        cells = []
        for (run, r), meta in zip(rows, metas):
            unit = r["unit"]
            peer = "-" if r["peer"] is None else f"{_num(r['peer'])} {unit}" + (
                "" if one_peer else f", {r['peer_name']}")
            x = ratio(r)
            limit = " ".join(filter(None, ["" if r["limit_pct"] is None else f"{r['limit_pct']:.1f}%",
                                           r.get("note", "")])) or "-"
            ours = "-" if r["ours"] is None else f"{_num(r['ours'])} {unit}"
            cells.append([r["shape"], ours, peer, "-" if x is None else f"{x:.2f}x", limit]
                         + [m for m, v in zip(meta, varies) if v])
        header = COLUMNS + extra
        keep = [i for i in range(len(header)) if i == 0 or any(c[i] != "-" for c in cells)]  # no empty columns
        out.append("| " + " | ".join(header[i] for i in keep) + " |")
        out.append("|" + "---|" * len(keep))
        out += ["| " + " | ".join(c[i] for i in keep) + " |" for c in cells]
        if shared_note:
            out.append(f"\n{shared_note}")
        out.append("")
    out.append("## Commands\n")
    out.append(f"From the repository root; `{TOOL}` is left out before a benchmark's name.\n")
    out += [f"({i + 1}) `{c.removeprefix(TOOL + ' ')}`  " for i, c in enumerate(commands)]
    return "\n".join(out).rstrip() + "\n"


def add_args(p):
    p.add_argument("--results", default=RESULTS, help="directory of <benchmark>.json files")
    p.add_argument("--output", default=OUTPUT, help="the Markdown file to write")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if the output file differs from the rendering")


def main(args) -> int:
    text = render(load(args.results))
    if args.check:
        current = open(args.output).read() if os.path.exists(args.output) else ""
        if current != text:
            print(f"{args.output} is not what `python -m benchmarks report` renders from "
                  f"{args.results}: run it and commit the result", file=sys.stderr)
            return 1
        return 0
    with open(args.output, "w") as fh:
        fh.write(text)
    print(f"wrote {args.output} ({len(text)} bytes, {len(runs_rows(args.results))} rows)")
    return 0


def runs_rows(results_dir: str) -> list[dict]:
    return [row for run in load(results_dir) for row in run["rows"]]
