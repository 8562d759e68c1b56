"""Agentic session traces: the JSONL format, synthetic prompt tokens that follow a trace's block
hashes, and a generator of coding-agent sessions.

The format is Mooncake's request trace as NVIDIA AIPerf and Dynamo replay it, with sessions: one
JSON object per line, one line per request, a session's turns in file order.

    session_id     str | int   requests sharing it are one session (absent: the line is a session of its own)
    timestamp      ms          when the session's first turn arrives, from the trace's start (default 0);
                               for a later turn without "delay", its gap to the previous turn's timestamp
                               is used as the think time
    delay          ms          think time: from the previous turn's answer arriving to this turn's start
                               (alias delay_ms)
    input_length   tokens      the whole prompt, history included (alias input_tokens)
    output_length  tokens      tokens to generate (alias output_tokens)
    hash_ids       [int | str] one id per block of block_size prompt tokens (the last block may be partial);
                               equal ids mean equal token content, so shared prefixes share leading ids

Prompt tokens are synthetic: each block's tokens are drawn from a generator seeded by its hash id,
so two requests share exactly the prefixes their hash ids share.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math

import numpy as np


@dataclasses.dataclass
class Turn:
    input_length: int
    output_length: int
    hash_ids: list
    delay_ms: float = 0.0  # think time before this turn (the first turn's is unused)


@dataclasses.dataclass
class Session:
    id: object
    start_ms: float
    turns: list[Turn]


def _field(obj: dict, n: int, *names, default=None):
    for name in names:
        if name in obj:
            return obj[name]
    if default is None:
        raise ValueError(f"trace line {n}: missing \"{names[0]}\"")
    return default


def read_trace(path: str, block_size: int = 64) -> list[Session]:
    """Sessions from a JSONL trace (see the module docstring); ValueError naming the bad line."""
    sessions: dict = {}
    last_ts: dict = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"trace line {n} is not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"trace line {n} is not a JSON object")
            sid = obj.get("session_id", f"line-{n}")
            ts = obj.get("timestamp")
            try:
                turn = Turn(int(_field(obj, n, "input_length", "input_tokens")),
                            int(_field(obj, n, "output_length", "output_tokens")), list(_field(obj, n, "hash_ids")))
                if "delay" in obj or "delay_ms" in obj:
                    turn.delay_ms = float(_field(obj, n, "delay", "delay_ms"))
                elif ts is not None and sid in last_ts:
                    turn.delay_ms = max(float(ts) - last_ts[sid], 0.0)
            except (TypeError, ValueError) as e:
                raise ValueError(f"trace line {n}: {e}") from None
            check_turn(turn, block_size, f"trace line {n}")
            if ts is not None:
                last_ts[sid] = float(ts)
            if sid not in sessions:
                sessions[sid] = Session(sid, float(ts or 0.0), [])
            sessions[sid].turns.append(turn)
    if not sessions:
        raise ValueError(f"{path}: the trace has no requests")
    return list(sessions.values())


def check_turn(turn: Turn, block_size: int, where: str):
    if turn.input_length < 1 or turn.output_length < 1 or turn.delay_ms < 0:
        raise ValueError(f"{where}: input_length and output_length must be >= 1 and delay >= 0")
    want = math.ceil(turn.input_length / block_size)
    if len(turn.hash_ids) != want:
        raise ValueError(f"{where}: {turn.input_length} input tokens make {want} blocks of {block_size} but there "
                         f"are {len(turn.hash_ids)} hash_ids: pass the trace's block size (--block-size)")


def write_trace(sessions: list[Session], path: str):
    with open(path, "w") as f:
        for s in sessions:
            for k, t in enumerate(s.turns):
                row = {"session_id": s.id, "input_length": t.input_length, "output_length": t.output_length,
                       "hash_ids": t.hash_ids}
                row.update({"timestamp": s.start_ms} if k == 0 else {"delay": t.delay_ms})
                f.write(json.dumps(row) + "\n")


@functools.lru_cache(maxsize=1 << 16)
def _block(hash_id, block_size: int, vocab_size: int) -> tuple:
    seed = int.from_bytes(hashlib.blake2b(json.dumps(hash_id).encode(), digest_size=8).digest(), "little")
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, vocab_size, block_size))


def prompt_tokens(turn: Turn, block_size: int, vocab_size: int) -> list[int]:
    """The turn's synthetic prompt: each hash id's block of tokens, cut at input_length."""
    out = []
    for h in turn.hash_ids:
        out += _block(h, block_size, vocab_size)
    return out[:turn.input_length]


def prefix_reuse(sessions: list[Session], block_size: int) -> float:
    """Share of prompt tokens an unbounded prefix cache could serve, taking requests in file order
    (a request reuses its leading blocks whose ids an earlier request had)."""
    seen, reused, total = set(), 0, 0
    for s in sessions:
        for t in s.turns:
            for i, h in enumerate(t.hash_ids):
                if h not in seen:
                    break
                reused += min(block_size, t.input_length - i * block_size)
            seen.update(t.hash_ids)
            total += t.input_length
    return reused / total if total else 0.0


def coding_agent_sessions(sessions: int = 16, turns: int = 10, system_tokens: int = 6144, user_tokens: int = 256,
                          tool_tokens: int = 384, output_tokens: int = 128, think_ms: float = 2000.0,
                          arrival_ms: float = 1000.0, block_size: int = 64, seed: int = 0) -> list[Session]:
    """Sessions shaped like a coding agent's: every session starts from one shared system prompt
    with tool definitions (system_tokens), then a user request (user_tokens); each turn's answer
    (about output_tokens) and the tool output that follows it (about tool_tokens) are appended to
    the context of the next turn, so a turn re-sends the whole history. Sizes vary per turn
    (lognormal around the given means), think times are exponential around think_ms, sessions
    arrive at exponential gaps around arrival_ms."""
    if min(sessions, turns, system_tokens + user_tokens, output_tokens, block_size) < 1:
        raise ValueError("sessions, turns, output_tokens, block_size and the first prompt must be >= 1")
    rng = np.random.default_rng(seed)

    def around(mean):
        return max(1, int(round(mean * rng.lognormal(0.0, 0.3)))) if mean > 0 else 0

    shared = list(range(system_tokens // block_size))  # blocks wholly inside the shared system prompt
    next_id = len(shared)
    out, start = [], 0.0
    for s in range(sessions):
        full_blocks = list(shared)  # ids of the context's complete blocks, which later turns repeat
        length = system_tokens + around(user_tokens)
        session = Session(s, start, [])
        for k in range(turns):
            blocks = math.ceil(length / block_size)
            fresh = list(range(next_id, next_id + blocks - len(full_blocks)))
            next_id += len(fresh)
            ids = full_blocks + fresh
            n_out = around(output_tokens)
            session.turns.append(Turn(length, n_out, ids, float(rng.exponential(think_ms)) if k else 0.0))
            full_blocks = ids[:length // block_size]
            length += n_out + around(tool_tokens)
        out.append(session)
        start += float(rng.exponential(arrival_ms))
    return out
