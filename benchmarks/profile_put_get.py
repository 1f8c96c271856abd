"""Where a put+get's time goes, request by request, as the client sees it.

Against a private daemon, ``--reps`` round trips per size of ``put`` then ``get(out=...,
consume=True)`` (the ``transfer`` loop), with every :class:`kvbroker._client.ops.Ops` call
(one request each: ``reserve``/``seal`` or ``publish``, ``claim``, the one-way release) and the
copy engine's ``copy_hashed``/``copy`` timed on their own. Prints, per size, the medians of
put, get and each step. What is left of put+get beyond the steps is Python between them.

Beside each request, the daemon's own handler time for it (``Broker.handle``: the op's work,
without the framing, the journal write and the reply's send, which come around it), taken in
the daemon (it runs under this script, ``--serve-timed``, which times each call) and written
when it stops: the ``daemon`` column. A request's client-side time less its handler is the
round trip and the daemon's framing, journal and wake-up.

A request's time includes the daemon's wake-up: after more than ``busy_poll`` (100 µs by
default) without a request the daemon sleeps in epoll, so a request sent after a long copy
pays for waking it. ``--daemon-env KVBROKER_BUSY_POLL=2ms`` runs the daemon polling longer,
to see that cost (each value a run of its own, alternated over ``--rounds``).

    python benchmarks/profile_put_get.py [--sizes 256K,32M] [--reps 60] [--rounds 2]
        [--daemon-env KVBROKER_BUSY_POLL=2ms ...] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

from kvbroker import Client
from kvbroker._bench._common import (
    invocation,
    machine_info,
    measured_commit,
    median,
    spawned_daemon,
)
from kvbroker._client import engine as _engine
from kvbroker._client import ops as _ops
from kvbroker._wire.paths import parse_size

WARMUP = 10


def _timed_methods(steps: dict[str, list[float]]) -> list[tuple[type, str, object]]:
    """Wrap the copy engine's copies and every Ops method to add their times to ``steps``;
    returns what to put back."""
    wrapped = []

    def wrap(cls, name, label):
        fn = getattr(cls, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                steps[label].append(time.perf_counter() - t)

        wrapped.append((cls, name, fn))
        setattr(cls, name, timed)

    wrap(_engine.CopyEngine, "copy_hashed", "copy + hash in")
    wrap(_engine.CopyEngine, "copy", "copy out (engine)")
    for name, fn in list(vars(_ops.Ops).items()):
        if not name.startswith("_") and callable(fn):
            wrap(_ops.Ops, name, f"request {name}")
    return wrapped


def serve_timed(out_json: str, serve_argv: list[str]) -> None:
    """Run ``kvbroker serve_argv...`` with every ``Broker.handle`` call timed per op; at exit,
    write each op's calls and median µs to ``out_json``. (The daemon of :func:`measure`.)"""
    from kvbroker._server import broker as _broker

    times: dict[str, list[float]] = defaultdict(list)
    handle = _broker.Broker.handle

    def timed(self, session, op, raw_args, daemon=None):
        t = time.perf_counter()
        try:
            return handle(self, session, op, raw_args, daemon)
        finally:
            times[op].append(time.perf_counter() - t)

    def write() -> None:
        with open(out_json, "w") as f:
            json.dump(
                {op: {"calls": len(v), "p50_us": median(v) * 1e6} for op, v in times.items()}, f
            )

    _broker.Broker.handle = timed
    atexit.register(write)
    from kvbroker.cli import main as cli_main

    sys.argv = ["kvbroker", *serve_argv]
    cli_main()


def measure(size: int, reps: int, env: dict[str, str]) -> dict:
    steps: dict[str, list[float]] = defaultdict(list)
    put_t, get_t = [], []
    handlers = os.path.join(tempfile.mkdtemp(prefix="kvb-handlers-"), "handlers.json")
    launcher = [sys.executable, os.path.abspath(__file__), "--serve-timed", handlers, "--"]
    with spawned_daemon("1G", env=env, launcher=launcher) as sock, Client(sock) as c:
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros_like(src)
        wrapped = _timed_methods(steps)
        try:
            for i in range(WARMUP + reps):
                if i == WARMUP:
                    steps.clear()
                t0 = time.perf_counter()
                c.put(f"k{i}", {"kv": src})
                t1 = time.perf_counter()
                c.get(f"k{i}", {"kv": dst}, consume=True)
                t2 = time.perf_counter()
                if i >= WARMUP:
                    put_t.append(t1 - t0)
                    get_t.append(t2 - t1)
        finally:
            for cls, name, fn in wrapped:
                setattr(cls, name, fn)
        if not np.array_equal(dst, src):
            raise AssertionError("bytes differ")
    with open(handlers) as f:  # written as the daemon stopped (spawned_daemon waits for it)
        daemon = {op: v["p50_us"] for op, v in json.load(f).items()}
    return {
        "size": size,
        "daemon_env": env,
        "reps": reps,
        "daemon_handler_p50_us": daemon,
        "put_p50_us": median(put_t) * 1e6,
        "get_p50_us": median(get_t) * 1e6,
        "steps_p50_us": {k: median(v) * 1e6 for k, v in steps.items()},
        "steps_per_round_trip": {k: len(v) / reps for k, v in steps.items()},
        "copy_threads": _engine.default_engine().threads,
    }


def markdown(result: dict) -> str:
    m = result["machine"]
    out = [
        f"# put+get, request by request ({m.get('cpu')}, {m.get('cores')} cores)",
        "",
        f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min'):.2f}; "
        f"`{result['command']}`",
        "",
        "Medians in µs (client side; each request includes the daemon's wake-up). The last "
        "column: the daemon's handler of each op alone (`Broker.handle`, timed in the daemon; "
        "no framing, journal write or reply send).",
        "",
        "| size | daemon env | round | put | get | step: p50 (per put+get) | daemon handler p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        env = " ".join(f"{k}={v}" for k, v in r["daemon_env"].items()) or "defaults"
        steps = "; ".join(
            f"{k} {v:.1f} (×{r['steps_per_round_trip'][k]:g})" for k, v in r["steps_p50_us"].items()
        )
        handlers = "; ".join(
            f"{k} {v:.1f}" for k, v in r.get("daemon_handler_p50_us", {}).items() if k != "hello"
        )
        out.append(
            f"| {r['size'] >> 10} KiB | {env} | {r['round']} | {r['put_p50_us']:.1f} | "
            f"{r['get_p50_us']:.1f} | {steps} | {handlers} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-timed"]:  # the daemon of measure(): --serve-timed JSON -- serve ...
        serve_timed(argv[1], argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,32M")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--daemon-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a second configuration of the daemon, alternated with the defaults",
    )
    ap.add_argument("--out", default=None, metavar="PREFIX")
    a = ap.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    envs = [{}] + [dict([e.split("=", 1)]) for e in a.daemon_env]
    rows = []
    for rnd in range(1, a.rounds + 1):
        for env in envs:
            for size in sizes:
                rows.append({"round": rnd, **measure(size, a.reps, env)})
                r = rows[-1]
                print(
                    f"{size >> 10} KiB {env or 'defaults'} round {rnd}: put {r['put_p50_us']:.1f} "
                    f"get {r['get_p50_us']:.1f} us; "
                    + ", ".join(f"{k} {v:.1f}" for k, v in r["steps_p50_us"].items())
                    + "; daemon handlers "
                    + ", ".join(
                        f"{k} {v:.1f}"
                        for k, v in r["daemon_handler_p50_us"].items()
                        if k != "hello"
                    ),
                    flush=True,
                )
    result = {
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
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
