"""Where the time of a put+get round trip goes, on both sides of the socket.

Runs the ``transfer`` loop (put, then get with consume) at one size against a private daemon
for ``--seconds``, with pyinstrument in the client and py-spy sampling the daemon, and
prints (or appends to ``--out``, markdown) the client's call tree and the daemon's top
frames by own time. Used for the results files where a target is missed.

    .venv/bin/pip install pyinstrument py-spy
    .venv/bin/python benchmarks/profile_transfer.py --size 256K --seconds 5 [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("PYINSTRUMENT_IGNORE_OVERHEAD_WARNING", "1")
from pyinstrument import Profiler

from kvbroker import Client
from kvbroker._bench import spawned_daemon
from kvbroker._wire.paths import parse_size


def top_frames(raw_path: str, n: int = 15) -> tuple[list, list]:
    """From a py-spy ``--format raw`` file: own-time share of the leaf frames, and the
    inclusive share of kvbroker's own functions (line numbers dropped)."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            k = int(count)
            total += k
            frames = stack.split(";")
            own[frames[-1] or "(idle/native)"] += k
            for fn in {fr.split(":")[0] + ")" for fr in frames if "kvbroker/" in fr}:
                incl[fn] += k
    if not total:
        return [], []
    return (
        [(c / total, f) for f, c in own.most_common(n)],
        [(c / total, f) for f, c in incl.most_common(n)],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256K")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pool-size", default="1G")
    ap.add_argument("--out", help="append a markdown summary here")
    a = ap.parse_args()
    size = parse_size(a.size)
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros_like(src)
    with spawned_daemon(a.pool_size) as sock, Client(sock, name="profile") as c:
        for i in range(20):  # warm-up
            c.put(f"w{i}", {"kv": src})
            c.get(f"w{i}", {"kv": dst}, consume=True)
        with tempfile.TemporaryDirectory() as d:
            raw = os.path.join(d, "daemon.txt")
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(c.server_pid),
                    "--rate",
                    "1000",
                    "--duration",
                    str(int(a.seconds + 0.999)),
                    "--format",
                    "raw",
                    "--output",
                    raw,
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)  # py-spy attaches
            prof = Profiler(interval=0.0002)
            n, t0 = 0, time.perf_counter()
            prof.start()
            while time.perf_counter() - t0 < a.seconds:
                c.put(f"k{n}", {"kv": src})
                c.get(f"k{n}", {"kv": dst}, consume=True)
                n += 1
            prof.stop()
            wall = time.perf_counter() - t0
            spy.wait(60)
            frames, kvb = top_frames(raw) if os.path.exists(raw) else ([], [])
    client_tree = prof.output_text(unicode=False, color=False, show_all=False)
    lines = [
        f"### profile: put+get of {a.size}, {n} round trips in {wall:.1f} s "
        f"({wall / n * 1e6:.0f} us each)",
        "",
        "Client (pyinstrument; the daemon's share shows as time waiting in recv):",
        "",
        "```",
        *client_tree.strip().splitlines()[:60],
        "```",
        "",
        "Daemon (py-spy, own time of the top frames; idle = waiting in epoll):",
        "",
        "```",
        *(f"{share:6.1%}  {frame}" for share, frame in frames),
        "```",
        "",
        "Daemon, inclusive time of kvbroker's functions:",
        "",
        "```",
        *(f"{share:6.1%}  {frame}" for share, frame in kvb),
        "```",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
