"""How many warm-restart journal records a put+get costs, by kind (issue 43).

Against a private daemon, ``--reps`` rounds per size of ``put`` then ``get(out=...,
consume=True)`` (the ``transfer`` loop), then the records the daemon appended to
``<socket>.journal`` during them are read back and counted by their ``t`` (see
:mod:`kvbroker._server.journal`: ``s`` sealed, ``u`` unlinked, ``w``/``e`` pages lent for
writing and given back, ...). A count, not a time: the load the machine had does not move
it, but it is recorded (with PSI) as every results file's is.

    python benchmarks/count_journal_records.py [--sizes 4K,256K] [--reps 200] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine, command and conditions.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

from kvbroker import Client
from kvbroker._bench._common import (
    invocation,
    machine_info,
    measured_commit,
    run_conditions,
    spawned_daemon,
)
from kvbroker._server.journal import _frames, _header_of, journal_path
from kvbroker._wire.paths import parse_size


def count(size: int, reps: int) -> dict:
    """The records appended during ``reps`` put+get rounds of ``size`` bytes, by kind."""
    with spawned_daemon("256M") as path:
        journal = journal_path(path)
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        dst = np.empty_like(src)
        with Client(path) as c:
            c.put("warm-up", {"a": src})  # opens the arena: not counted
            c.get("warm-up", {"a": dst}, consume=True)
            c.exists("warm-up")  # the release above has been served
            start = os.path.getsize(journal)
            for i in range(reps):
                c.put(f"k{i}", {"a": src})
                c.get(f"k{i}", {"a": dst}, consume=True)
            c.exists("k0")  # (a round trip: the last one-way release is in the journal)
            with open(journal, "rb") as f:
                data = f.read()
        if not np.array_equal(dst, src):
            raise AssertionError("bytes differ")
    magic, seed, _ = _header_of(data)
    records, damaged, torn = _frames(data, magic, seed, start)
    if damaged or torn:
        raise AssertionError(f"the journal read back damaged: {damaged}, torn {torn}")
    kinds = collections.Counter(entry.get("t") for _, entry in records)
    return {
        "size": size,
        "reps": reps,
        "records": len(records),
        "records_per_put_get": len(records) / reps,
        "by_kind_per_put_get": {k: n / reps for k, n in sorted(kinds.items())},
    }


def markdown(result: dict) -> str:
    m, before, after = result["machine"], result["before"], result["after"]
    out = [
        f"# Journal records per put+get ({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}; `{result['command']}`; before: load "
        f"{before['loadavg_1min']:.2f}, `{before['cpu_pressure']}`; after: load "
        f"{after['loadavg_1min']:.2f}, `{after['cpu_pressure']}` (a count: load does not "
        "move it)",
        "",
        "| size | put+get rounds | records | per put+get | by kind, per put+get |",
        "|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        kinds = ", ".join(f"`{k}` {v:.2f}" for k, v in r["by_kind_per_put_get"].items())
        out.append(
            f"| {r['size'] >> 10} KiB | {r['reps']} | {r['records']} | "
            f"{r['records_per_put_get']:.2f} | {kinds} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,256K")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    before = run_conditions()
    rows = []
    for size in (parse_size(s) for s in a.sizes.split(",")):
        rows.append(count(size, a.reps))
        r = rows[-1]
        print(
            f"{size >> 10} KiB: {r['records_per_put_get']:.2f} records per put+get "
            f"{r['by_kind_per_put_get']}",
            flush=True,
        )
    result = {
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "before": before,
        "after": run_conditions(),
        "rows": rows,
    }
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
