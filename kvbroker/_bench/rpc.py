"""``kvbroker bench rpc``: control-plane operations/s and latency with N client processes.

Each client is its own process (a Python client is single-threaded, and engines are separate
processes): they connect, meet at a barrier, then issue ``exists`` round trips for the same
wall-clock window. ops/s is the sum over clients of operations finished in the window.
The probe they look up is published once, under a key of this run, and evicted afterwards:
a daemon benchmarked with ``--socket`` is left as it was found.
"""

from __future__ import annotations

import os
import time
import uuid

from ._common import Result, Target, pct, save_figure

DEFAULT_CLIENTS = (1, 4, 16)
COLUMNS = [
    ("clients", "clients", "d"),
    ("ops_per_s", "ops/s", ".0f"),
    ("per_client_ops_per_s", "ops/s/client", ".0f"),
    ("p50_us", "p50 us", ".1f"),
    ("p99_us", "p99 us", ".1f"),
]


PROBE_NAMESPACE = "kvbroker-bench"


def _client_process(socket_path: str, seconds: float, barrier, results, probe: str) -> None:
    from .. import Client

    lat = []
    try:
        with Client(socket_path, map_pools=False, name="bench-rpc", role="bench") as c:
            barrier.wait(60)
            end = time.perf_counter() + seconds
            while (t := time.perf_counter()) < end:
                c.exists(probe, namespace=PROBE_NAMESPACE)
                lat.append(time.perf_counter() - t)
        results.put(("ok", lat))
    except BaseException as exc:  # the parent reports it; never leave it waiting
        results.put(("error", repr(exc)))
        barrier.abort()


def measure(socket_path: str, clients=DEFAULT_CLIENTS, seconds: float = 2.0) -> list[dict]:
    from .. import Client

    probe = f"rpc-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with Client(socket_path, name="bench-rpc", role="bench") as c:
        c.put(probe, {"x": b"1"}, namespace=PROBE_NAMESPACE)
        try:
            return _measure(socket_path, clients, seconds, probe)
        finally:
            c.evict(probe, namespace=PROBE_NAMESPACE)


def run_clients(targets: list[tuple[str, str]], seconds: float) -> list[float]:
    """One client process per ``(socket_path, probe)`` of ``targets``, all started together,
    each timing ``exists(probe)`` round trips for ``seconds``; every latency, in seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(targets)), ctx.Queue()
    procs = [
        ctx.Process(target=_client_process, args=(path, seconds, barrier, results, probe))
        for path, probe in targets
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120 + seconds) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r for kind, r in got if kind == "error"]
    if errors:
        raise RuntimeError(f"rpc client failed: {errors[0]}")
    return [x for _, r in got for x in r]


def _measure(socket_path: str, clients, seconds: float, probe: str) -> list[dict]:
    rows = []
    for n in clients:
        lat = run_clients([(socket_path, probe)] * n, seconds)
        ops = len(lat) / seconds
        rows.append(
            {
                "clients": n,
                "ops": len(lat),
                "seconds": seconds,
                "ops_per_s": ops,
                "per_client_ops_per_s": ops / n,
                "p50_us": pct(lat, 0.5) * 1e6,
                "p99_us": pct(lat, 0.99) * 1e6,
            }
        )
    return rows


def run(socket_path: str, clients=DEFAULT_CLIENTS, seconds: float = 2.0) -> Result:
    rows = measure(socket_path, clients, seconds)
    by = {r["clients"]: r for r in rows}
    targets = [
        Target("control ops/s with 4 clients", r["ops_per_s"], 20000, unit=" ops/s")
        for r in rows
        if r["clients"] == 4
    ]
    if 4 in by and 16 in by:  # issue 17: throughput grows with clients, latency stays low
        targets.append(
            Target(
                "ops/s of 16 clients vs 4 clients", by[16]["ops_per_s"] / by[4]["ops_per_s"], 1.5
            )
        )
        targets.append(
            Target("p99 of 16 clients", by[16]["p99_us"], 200, op="<=", unit=" us", fmt=".1f")
        )
    return Result(
        "rpc",
        rows,
        COLUMNS,
        params={"clients": list(clients), "seconds": seconds, "op": "exists (lookup)"},
        targets=targets,
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    n = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar([str(x) for x in n], [r["ops_per_s"] for r in rows])
    a.set_xlabel("client processes")
    a.set_ylabel("ops/s")
    a.set_title("control-plane throughput (exists)")
    b.plot(n, [r["p50_us"] for r in rows], marker="o", label="p50")
    b.plot(n, [r["p99_us"] for r in rows], marker="x", label="p99")
    b.set_xscale("log", base=2)
    b.set_xlabel("client processes")
    b.set_ylabel("µs")
    b.set_title("round-trip latency")
    b.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "rpc.png")]
