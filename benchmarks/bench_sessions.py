"""Sessions against plain LRU: a replayed multi-turn trace through the client API (issue 41).

Many conversations come back to their growing prefix turn after turn; between two turns of
one conversation (its think time) every other conversation takes a turn and one-shot prompts
flow, more of them than the pool holds. An engine is played by the client API: each request
asks the node how much of its prompt it holds (``PrefixCache.match``, ``hold=False``, as a
scheduler does), recomputes the rest, and publishes its prompt's blocks
(``PrefixCache.publish``). The same trace runs twice, each time against a fresh daemon with
the same pool: once as plain LRU (no session named), once with every conversation's requests
naming their session (``session=``; the daemon's default ``[sessions]`` settings: half of
the pool may be retained). Reported: the prefix hit rate of the conversations' turns after
their first, and the tokens every request had to recompute.

Usage: ``python benchmarks/bench_sessions.py [--sessions 32] [--turns 8] [--oneshots 96]
[--pool 128M] [--out benchmarks/results/sessions-cpu]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import (  # noqa: E402
    format_table,
    invocation,
    machine_info,
    measured_commit,
    run_conditions,
    spawned_daemon,
    write_results,
)
from kvbroker._wire.paths import parse_size  # noqa: E402
from kvbroker.prefix import PrefixCache  # noqa: E402

BLOCK_TOKENS = 16
BLOCK_BYTES = 16 << 10  # KV bytes of one 16-token block (a small model's, or one shard)


def make_trace(
    sessions: int,
    turns: int,
    oneshots: int,
    first: int,
    per_turn: int,
    oneshot_tokens: int,
    seed: int,
) -> list[tuple[str | None, list[int]]]:
    """(session or None, prompt tokens) in arrival order: rounds in which every conversation
    takes one turn (in a shuffled order), one-shot prompts spread between them."""
    rng = random.Random(seed)
    prompts = {
        f"conv-{s}": [rng.randrange(1, 50_000) for _ in range(first)] for s in range(sessions)
    }
    trace: list[tuple[str | None, list[int]]] = []
    for _ in range(turns):
        order = list(prompts)
        rng.shuffle(order)
        slots = sorted(rng.randrange(0, len(order) + 1) for _ in range(oneshots))
        at = 0
        for i, name in enumerate(order):
            while at < len(slots) and slots[at] <= i:
                trace.append(
                    (None, [rng.randrange(50_000, 100_000) for _ in range(oneshot_tokens)])
                )
                at += 1
            trace.append((name, list(prompts[name])))
            # the answer and the user's next message join the conversation's prefix
            prompts[name] += [rng.randrange(1, 50_000) for _ in range(per_turn)]
        for _ in range(len(slots) - at):
            trace.append((None, [rng.randrange(50_000, 100_000) for _ in range(oneshot_tokens)]))
    return trace


def replay(socket: str, trace, retain: bool) -> dict:
    """Play the trace as an engine would; counts per kind of request."""
    out = {
        "session_turns": 0,
        "session_tokens": 0,
        "session_hit_tokens": 0,
        "reusable_tokens": 0,
        "oneshots": 0,
        "oneshot_tokens": 0,
        "recomputed_tokens": 0,
        "requests": 0,
    }
    published: dict[str, int] = {}  # tokens of a conversation's blocks published so far
    kv = bytes(BLOCK_BYTES)
    t0 = time.perf_counter()
    with Client(socket, name="bench-sessions") as c:
        pc = PrefixCache(c, namespace="chat", block_size=BLOCK_TOKENS, checksum=False)
        for name, tokens in trace:
            named = {"session": name} if retain and name is not None else {}
            hit = pc.match(tokens, hold=False, **named).num_blocks * BLOCK_TOKENS
            out["requests"] += 1
            out["recomputed_tokens"] += len(tokens) - hit
            if name is None:
                out["oneshots"] += 1
                out["oneshot_tokens"] += len(tokens)
            elif name in published:  # a turn after the first: its prefix could be here
                out["session_turns"] += 1
                out["session_tokens"] += len(tokens)
                out["session_hit_tokens"] += hit
                usable = (len(tokens) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
                out["reusable_tokens"] += min(published[name], usable)
            if name is not None:
                published[name] = len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS
            pc.publish(tokens, lambda i: {"kv": kv}, block_sizes={"kv": BLOCK_BYTES}, **named)
        snap = c.stat()
    out["seconds"] = time.perf_counter() - t0
    out["hit_rate"] = out["session_hit_tokens"] / max(1, out["session_tokens"])
    out["hit_of_reusable"] = out["session_hit_tokens"] / max(1, out["reusable_tokens"])
    out["evictions"] = snap.counters.evictions
    r = snap.retention
    out["retained_bytes_at_end"] = sum(r.retained_bytes) if r is not None else 0
    out["retained_evicted"] = dict(r.evicted) if r is not None else {}
    out["retention_dropped"] = dict(r.dropped) if r is not None else {}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--oneshots", type=int, default=96, help="one-shot prompts per round")
    ap.add_argument("--first", type=int, default=512, help="tokens of a conversation's first turn")
    ap.add_argument("--per-turn", type=int, default=128, help="tokens each turn adds")
    ap.add_argument("--oneshot-tokens", type=int, default=1024)
    ap.add_argument("--pool", default="128M")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--out", default=None, help="PREFIX: write PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    trace = make_trace(
        a.sessions, a.turns, a.oneshots, a.first, a.per_turn, a.oneshot_tokens, a.seed
    )
    before = run_conditions()
    modes = {}
    for mode, retain in (("plain LRU", False), ("sessions", True)):
        with spawned_daemon(
            a.pool, "--page-size", "4K", env={"KVBROKER_READ_REPLICAS": "0"}
        ) as socket:
            modes[mode] = replay(socket, trace, retain)
    after = run_conditions()
    pool = parse_size(a.pool)
    session_bytes = (
        a.sessions * (a.first + (a.turns - 1) * a.per_turn) // BLOCK_TOKENS * BLOCK_BYTES
    )
    rows = [
        {
            "mode": m,
            "hit_rate": r["hit_rate"],
            "of_reusable": r["hit_of_reusable"],
            "hit": r["session_hit_tokens"],
            "asked": r["session_tokens"],
            "recomputed": r["recomputed_tokens"],
            "evictions": r["evictions"],
            "seconds": r["seconds"],
        }
        for m, r in modes.items()
    ]
    lru, kept = modes["plain LRU"], modes["sessions"]
    result = {
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "conditions_before": before,
        "conditions_after": after,
        "trace": {
            "sessions": a.sessions,
            "turns": a.turns,
            "oneshots_per_round": a.oneshots,
            "first_tokens": a.first,
            "tokens_per_turn": a.per_turn,
            "oneshot_tokens": a.oneshot_tokens,
            "block_tokens": BLOCK_TOKENS,
            "block_bytes": BLOCK_BYTES,
            "requests": len(trace),
            "seed": a.seed,
            "pool_bytes": pool,
            "session_bytes_at_the_end": session_bytes,
        },
        "modes": modes,
        "rows": rows,
        "recomputed_saved": lru["recomputed_tokens"] - kept["recomputed_tokens"],
    }
    md = [
        f"Sessions against plain LRU at commit `{result['commit']}`: {a.sessions} "
        f"conversations x {a.turns} turns ({a.first} tokens, then {a.per_turn} more a turn), "
        f"{a.oneshots} one-shot prompts of {a.oneshot_tokens} tokens a round; pool "
        f"{a.pool}, blocks of {BLOCK_TOKENS} tokens / {BLOCK_BYTES >> 10} KiB.",
        "",
        format_table(
            rows,
            [
                ("mode", "mode", "s"),
                ("hit_rate", "turn hit rate", ".1%"),
                ("of_reusable", "of reusable", ".1%"),
                ("hit", "hit tokens", ","),
                ("asked", "turn tokens", ","),
                ("recomputed", "recomputed tokens", ","),
                ("evictions", "evictions", ","),
                ("seconds", "seconds", ".1f"),
            ],
        ),
        "",
        "Turn hit rate: the tokens of a conversation's later turns found on the node, of "
        "their prompts; of reusable: of the tokens its earlier turns had published.",
        f"Tokens not recomputed thanks to sessions: {result['recomputed_saved']:,}. "
        f"Load before/after: {before['loadavg_1min']}/{after['loadavg_1min']}; "
        f"CPU pressure after: {after['cpu_pressure']}. Command: `{result['command']}`.",
    ]
    write_results(a.out, result, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
