"""An experiment, not a feature: what a directory partitioned over processes could give the
control plane at most.

``kvbroker bench rpc`` puts N client processes against one daemon, whose one event loop serves
them all (``docs/design.md``, "Why one writer"). Here P independent daemons stand in for P
partitions of one directory, each the single writer of its share: client ``i`` talks to
daemon ``i mod P``, looking up a key of its own on that daemon (``exists``, as ``bench rpc``
does), as a client library routing each key to its partition would. Nothing crosses
partitions, so this is an upper bound: a real partitioned daemon also pays for the requests
that span partitions (``match_prefix``, ``reserve_blocks``, ``evict``, ``list``, ``stat``)
and for quotas kept across them.

Per partition count, ``--clients`` rows of ops/s (sum over clients of operations finished in
the window), p50 and p99 of one round trip; the ratio of the largest client count to 4
clients (issue 17's "16 clients >= 1.5x the ops/s of 4, p99 <= 200 us"). Rounds alternate the
partition counts, so a busy moment of the machine hits every count alike.

    python benchmarks/experiments/rpc_partitions.py [--partitions 1,2,4,8] [--clients 1,4,16]
        [--seconds 3] [--rounds 2] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

from kvbroker import Client
from kvbroker._bench._common import invocation, machine_info, measured_commit, pct, spawned_daemon
from kvbroker._bench.rpc import PROBE_NAMESPACE, run_clients


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(sockets: list[str], clients: int, seconds: float) -> dict:
    """``clients`` processes, client i on ``sockets[i % len(sockets)]`` with a key of its own."""
    targets = []
    for i in range(clients):
        path, probe = sockets[i % len(sockets)], f"partition-probe-{os.getpid()}-{i}"
        with Client(path, name="rpc-partitions") as c:
            c.put(probe, {"x": b"1"}, namespace=PROBE_NAMESPACE, replace=True)
        targets.append((path, probe))
    lat = run_clients(targets, seconds)
    return {
        "clients": clients,
        "ops": len(lat),
        "seconds": seconds,
        "ops_per_s": len(lat) / seconds,
        "p50_us": pct(lat, 0.5) * 1e6,
        "p99_us": pct(lat, 0.99) * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partitions", type=_ints, default=[1, 2, 4, 8])
    ap.add_argument("--clients", type=_ints, default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows = []
    for rnd in range(1, args.rounds + 1):
        for parts in args.partitions:
            with contextlib.ExitStack() as stack:
                sockets = [stack.enter_context(spawned_daemon("64M")) for _ in range(parts)]
                for n in args.clients:
                    row = {"round": rnd, "partitions": parts, **measure(sockets, n, args.seconds)}
                    rows.append(row)
                    print(
                        f"round {rnd} partitions {parts} clients {n}: "
                        f"{row['ops_per_s']:,.0f} ops/s, p50 {row['p50_us']:.1f} us, "
                        f"p99 {row['p99_us']:.1f} us",
                        flush=True,
                    )
    record = {
        "experiment": "rpc over P independent daemons (partitions), client i on i mod P",
        "commit": measured_commit(),
        "machine": machine_info(),
        "command": invocation(),
        "started": started,
        "load_avg": os.getloadavg(),
        "rows": rows,
    }
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(record, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(record, args.clients))
    print(markdown(record, args.clients))


def markdown(record: dict, clients: list[int]) -> str:
    m = record["machine"]
    lines = [
        f"commit {record['commit']}, {record['started']}; {m.get('cpu')}, "
        f"{m.get('cores')} CPUs; `{record['command']}`",
        "",
        "| round | partitions | clients | ops/s | p50 us | p99 us | ops/s vs 4 clients |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["round"], r["partitions"], r["clients"]): r for r in record["rows"]}
    for r in record["rows"]:
        four = by.get((r["round"], r["partitions"], 4))
        ratio = f"{r['ops_per_s'] / four['ops_per_s']:.2f}" if four else "—"
        lines.append(
            f"| {r['round']} | {r['partitions']} | {r['clients']} | "
            f"{r['ops_per_s']:,.0f} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
