"""This round's two changes to a large put, side by side: the copy+hash in one pass or two,
and the write arena grown (a put of up to 32 MiB in one request) or not (reserve + seal).

Against one private daemon, alternating the four combinations over ``--rounds``, the p50 of
``--reps`` put+get round trips of one ``--size`` object (``put``, then ``get(out=...,
consume=True)``: the ``transfer`` loop), and beside them a plain ``numpy.copyto`` of the same
bytes twice (the floor of any put+get). ``one pass`` / ``two passes``: the C loops' one-pass
copy+hash on or off (``kvbroker._copyhash.use_fused``; where it does not run, only two);
``grown`` / ``not grown``: ``Client(arena_max=64 MiB)`` (the default) against
``arena_max=arena_size`` (no growth, the code before this round).

    python benchmarks/experiments/ab_large_put.py [--size 32M] [--reps 40] [--rounds 4] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvbroker import Client
from kvbroker._bench._common import invocation, machine_info, measured_commit, median
from kvbroker._bench._common import ratio_span, spawned_daemon, write_results
from kvbroker._client import engine as _engine
from kvbroker._wire.paths import parse_size

WARMUP = 5


def _loop(c: Client, src, out, reps: int) -> float:
    times = []
    for i in range(WARMUP + reps):
        t = time.perf_counter()
        c.put("k", {"kv": src})
        c.get("k", {"kv": out}, consume=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - t)
    if not np.array_equal(out, src):
        raise AssertionError("bytes differ")
    return median(times)


def _memcpy(src, out, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(out, src)
        np.copyto(src, out)
        times.append(time.perf_counter() - t)
    return median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="32M")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(argv)
    size = parse_size(a.size)
    fused = _engine.fused_loop()
    passes = [True, False] if fused else [False]
    arena = 2 << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.empty_like(src)
    rows = []
    with spawned_daemon("2G") as sock:
        clients = {
            True: Client(sock, arena_size=arena),  # grown: the default arena_max
            False: Client(sock, arena_size=arena, arena_max=arena),
        }
        try:
            from kvbroker import _copyhash

            for rnd in range(1, a.rounds + 1):
                row = {"round": rnd, "memcpy_x2_ms": _memcpy(src, out, a.reps) * 1e3}
                for one_pass in passes:
                    if fused:
                        _copyhash.use_fused(one_pass)
                    for grown in (True, False):
                        name = (
                            f"{'one pass' if one_pass else 'two passes'}, "
                            f"{'grown' if grown else 'not grown'}"
                        )
                        row[name] = _loop(clients[grown], src, out, a.reps) * 1e3
                rows.append(row)
                print(
                    f"round {rnd}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "round"),
                    flush=True,
                )
        finally:
            if fused:
                _copyhash.use_fused(True)
            for c in clients.values():
                c.close()
    names = [k for k in rows[0] if k not in ("round", "memcpy_x2_ms")]
    base = "two passes, not grown"
    result = {
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "size": size,
        "reps": a.reps,
        "copy_threads": _engine.default_engine().threads,
        "rows": rows,
        "summary": {
            n: {
                "p50_ms_median": median([r[n] for r in rows]),
                "x_before_per_round": [r[base] / r[n] for r in rows],
                "memcpy_x2_over_it_per_round": [r["memcpy_x2_ms"] / r[n] for r in rows],
            }
            for n in names
        },
    }
    write_results(a.out, result, markdown(result, names, base))
    return 0


def markdown(result: dict, names: list[str], base: str) -> str:
    m = result["machine"]

    out = [
        f"# A {result['size'] >> 20} MiB put+get: one pass or two, arena grown or not "
        f"({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min'):.2f}; "
        f"`{result['command']}`; the copy engine on {result['copy_threads']} thread(s); "
        f"{len(result['rows'])} rounds alternated, p50 of {result['reps']} each.",
        "",
        f"| variant | put+get p50 ms (median of rounds) | × `{base}` (the code before "
        "this round) per round: median (range) | two memcpys / it |",
        "|---|---|---|---|",
    ]
    for n in names:
        s = result["summary"][n]
        out.append(
            f"| {n} | {s['p50_ms_median']:.3f} | {ratio_span(s['x_before_per_round'])} | "
            f"{ratio_span(s['memcpy_x2_over_it_per_round'])} |"
        )
    out += [
        "",
        "× above 1: faster than the code before; two memcpys / it: one `numpy.copyto` of "
        "the bytes each way, on one thread, over the variant's time.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
