"""A/B of the small-request path (issue 43): put+get p50 of two commits, side by side.

Each commit's tree is taken with ``git archive`` into a temporary folder (the compiled
modules of this checkout copied in: refused when ``csrc/`` differs between the two), and
each measurement runs in a process of its own with that tree first on ``PYTHONPATH``, against
a daemon started from the same tree. The builds alternate A, B, A, B... over ``--rounds``
(same sizes, same repetitions); each measurement records the load average and CPU pressure
(PSI) before and after it, since both move the figures and switch busy-polling on and off
(:mod:`kvbroker._cpu`). Per round: the p50 of ``put`` + ``get(out=..., consume=True)`` (the
``transfer`` loop) and of each half; per build, the median over rounds, and the median of the
per-round ratios B/A (both from the same rounds). Also counted per put+get: the client's
writes to the socket and the journal records the daemon appended.

    python benchmarks/ab_small_requests.py A_REV B_REV [--sizes 4K,256K] [--reps 400]
        [--rounds 4] [--out PREFIX]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(size: int, reps: int) -> dict:
    """In a build's own process: put+get rounds against a daemon of that build."""
    import numpy as np

    import kvbroker
    from kvbroker import Client
    from kvbroker._bench._common import run_conditions, spawned_daemon
    from kvbroker._server.journal import _frames, _header_of, journal_path

    before = run_conditions()
    put_t, get_t, both = [], [], []
    with spawned_daemon("512M") as path:
        src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
        dst = np.empty_like(src)
        with Client(path) as c:
            for i in range(50):  # warm-up: the arena opened, the code paths hot
                c.put(f"w{i}", {"a": src})
                c.get(f"w{i}", {"a": dst}, consume=True)
            c.exists("w0")
            journal = journal_path(path)
            start = os.path.getsize(journal)
            transport = c._session._stream.transport
            send, writes = transport.send, [0]

            def counted(data):
                writes[0] += 1
                send(data)

            transport.send = counted
            clock = time.perf_counter
            for i in range(reps):
                t0 = clock()
                c.put(f"k{i}", {"a": src})
                t1 = clock()
                c.get(f"k{i}", {"a": dst}, consume=True)
                t2 = clock()
                put_t.append(t1 - t0)
                get_t.append(t2 - t1)
                both.append(t2 - t0)
            transport.send = send
            c.exists("k0")  # (a round trip: the last release is served and journaled)
            with open(journal, "rb") as f:
                data = f.read()
        if not np.array_equal(dst, src):
            raise AssertionError("bytes differ")
    magic, seed, _ = _header_of(data)
    records = _frames(data, magic, seed, start)[0]
    kinds = collections.Counter(e.get("t") for _, e in records)
    return {
        "size": size,
        "reps": reps,
        "kvbroker": os.path.dirname(kvbroker.__file__),
        "put_get_p50_us": statistics.median(both) * 1e6,
        "put_p50_us": statistics.median(put_t) * 1e6,
        "get_p50_us": statistics.median(get_t) * 1e6,
        "writes_per_put_get": writes[0] / reps,
        "journal_records_per_put_get": len(records) / reps,
        "journal_by_kind": {k: n / reps for k, n in sorted(kinds.items())},
        "before": before,
        "after": run_conditions(),
    }


def build(rev: str, into: str) -> str:
    """The tree of ``rev`` in ``into``, with this checkout's compiled modules."""
    os.makedirs(into)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "kvbroker", "*.so")):
        shutil.copy(so, os.path.join(into, "kvbroker"))
    return into


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--measure"]:
        print(json.dumps(measure(int(argv[1]), int(argv[2]))))
        return 0
    from kvbroker._bench._common import invocation, machine_info
    from kvbroker._wire.paths import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--sizes", default="4K,256K")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(argv)
    revs = {}
    for label, rev in (("A", a.a), ("B", a.b)):
        revs[label] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", rev],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    if subprocess.run(["git", "-C", ROOT, "diff", "--quiet", a.a, a.b, "--", "csrc"]).returncode:
        raise SystemExit("csrc/ differs between the two commits: build each tree instead")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvb-ab-") as tmp:
        trees = {label: build(rev, os.path.join(tmp, label)) for label, rev in revs.items()}
        for rnd in range(1, a.rounds + 1):
            for size in sizes:
                for label in ("A", "B"):
                    env = {**os.environ, "PYTHONPATH": trees[label]}
                    out = subprocess.run(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--measure",
                            str(size),
                            str(a.reps),
                        ],
                        env=env,
                        check=True,
                        capture_output=True,
                        text=True,
                    ).stdout
                    r = {
                        "round": rnd,
                        "build": label,
                        "commit": revs[label],
                        **json.loads(out.strip().splitlines()[-1]),
                    }
                    if not r["kvbroker"].startswith(trees[label]):
                        raise AssertionError(f"{label} ran {r['kvbroker']}, not its tree")
                    rows.append(r)
                    print(
                        f"round {rnd} {size >> 10} KiB {label} ({revs[label]}): put+get "
                        f"{r['put_get_p50_us']:.1f} us (put {r['put_p50_us']:.1f}, get "
                        f"{r['get_p50_us']:.1f}); {r['writes_per_put_get']:.2f} writes, "
                        f"{r['journal_records_per_put_get']:.2f} journal records per put+get; "
                        f"{r['after']['cpu_pressure']}",
                        flush=True,
                    )
    summary = []
    for size in sizes:
        of = {lab: [r for r in rows if r["size"] == size and r["build"] == lab] for lab in "AB"}
        ratios = [
            b["put_get_p50_us"] / x["put_get_p50_us"] for x, b in zip(of["A"], of["B"], strict=True)
        ]
        summary.append(
            {
                "size": size,
                **{
                    f"{lab}_{k}": statistics.median(r[k] for r in of[lab])
                    for lab in "AB"
                    for k in (
                        "put_get_p50_us",
                        "put_p50_us",
                        "get_p50_us",
                        "writes_per_put_get",
                        "journal_records_per_put_get",
                    )
                },
                "B_over_A_median_of_round_ratios": statistics.median(ratios),
                "round_ratios": ratios,
            }
        )
    result = {
        "scenario": "ab-small-requests",
        "commits": revs,
        "command": invocation(),
        "machine": machine_info(),
        "rows": rows,
        "summary": summary,
    }
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(markdown(result))
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    m, revs = result["machine"], result["commits"]
    out = [
        f"# Small requests, A/B ({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"A = `{revs['A']}`, B = `{revs['B']}`; `{result['command']}`; builds alternated "
        "A, B per round and size; medians over rounds, the ratio the median of the per-round "
        "B/A ratios (same rounds). Per-measurement load and PSI in the rows below.",
        "",
        "| size | A put+get p50 µs | B put+get p50 µs | B/A | writes per put+get A → B "
        "| journal records per put+get A → B |",
        "|---|---|---|---|---|---|",
    ]
    for s in result["summary"]:
        out.append(
            f"| {s['size'] >> 10} KiB | {s['A_put_get_p50_us']:.1f} | "
            f"{s['B_put_get_p50_us']:.1f} | {s['B_over_A_median_of_round_ratios']:.2f} | "
            f"{s['A_writes_per_put_get']:.2f} → {s['B_writes_per_put_get']:.2f} | "
            f"{s['A_journal_records_per_put_get']:.2f} → "
            f"{s['B_journal_records_per_put_get']:.2f} |"
        )
    out += [
        "",
        "| round | size | build | put+get p50 µs | put | get | load before → after "
        "| PSI some avg10 before → after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        psi = [
            c["cpu_pressure"].split()[1].split("=")[1] if c["cpu_pressure"] else "?"
            for c in (r["before"], r["after"])
        ]
        out.append(
            f"| {r['round']} | {r['size'] >> 10} KiB | {r['build']} | "
            f"{r['put_get_p50_us']:.1f} | {r['put_p50_us']:.1f} | {r['get_p50_us']:.1f} | "
            f"{r['before']['loadavg_1min']:.1f} → {r['after']['loadavg_1min']:.1f} | "
            f"{psi[0]} → {psi[1]} |"
        )
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
