"""How far is a put+get from the bare protocol? The client's share of a small round trip.

Against one private daemon, alternating over ``--rounds``, the p50 of ``--reps`` put+get
round trips of one ``--size`` object (consume=True, the ``transfer`` loop's shape):

- ``client``: ``Client.put`` then ``Client.get(out=..., consume=True)``;
- ``bare``: the same requests with nothing around them: the copy+hash into the write arena
  by the copy engine, ``publish``, ``claim``, one copy out and a pipelined ``release``, each
  request packed and read straight off the client's socket (no leases, no checks, no
  reconnects, no replicas). It borrows the connection, arena and mapping a ``Client`` set up.

The difference is what the client library costs; ``bare`` is what a client in Python can
reach against this daemon (the daemon's share is the same in both).

    python benchmarks/probe_protocol_floor.py [--size 256K] [--reps 5000] [--rounds 4]
        [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import msgpack
import numpy as np

from kvbroker import Client
from kvbroker._bench._common import invocation, machine_info, measured_commit, median
from kvbroker._bench._common import spawned_daemon
from kvbroker._client.engine import default_engine
from kvbroker._wire import checksum as _cs
from kvbroker._wire.paths import parse_size

WARMUP = 200


def _client_loop(c: Client, src, out, reps: int) -> list[float]:
    times = []
    for _ in range(reps + WARMUP):
        t = time.perf_counter()
        c.put("k", {"kv": src})
        c.get("k", {"kv": out}, consume=True)
        times.append(time.perf_counter() - t)
    return times[WARMUP:]


class _Bare:
    """The protocol and nothing else, over a Client's own connection, arena and mapping."""

    def __init__(self, c: Client) -> None:
        self.sock = c._session._stream.transport._sock
        self.arena = c._arena
        self.mapping = c._mapping(self.arena.extent[0])
        self.engine = default_engine()
        self.pack = msgpack.Packer().pack
        self.unpacker = msgpack.Unpacker(raw=False)
        self.buf = bytearray(1 << 16)
        self.rid = 1 << 40  # far from the session's own ids

    def call(self, op: str, args: dict):
        self.rid += 1
        self.sock.sendall(self.pack({"id": self.rid, "op": op, "args": args}))
        while True:
            while True:
                try:
                    n = self.sock.recv_into(self.buf, 0, socket.MSG_DONTWAIT)
                    break
                except BlockingIOError:
                    os.sched_yield()
            self.unpacker.feed(memoryview(self.buf)[:n])
            for msg in self.unpacker:
                if msg.get("id") == self.rid:  # (earlier ones: the pipelined releases')
                    if not msg.get("ok"):
                        raise RuntimeError(f"{op}: {msg.get('error')}")
                    return msg["result"]

    def loop(self, src, out, reps: int) -> list[float]:
        arena = self.arena
        times = []
        for _ in range(reps + WARMUP):
            t = time.perf_counter()
            _, base, _ = arena.extent
            dst = self.mapping.view(base, src.nbytes, True)
            digest = _cs.encode(self.engine.copy_hashed(dst, src))
            r = self.call(
                "publish",
                {
                    "arena": arena.id,
                    "namespace": "default",
                    "key": "k",
                    "buffers": {"kv": src.nbytes},
                    "meta": None,
                    "replace": False,
                    "consumers": 1,
                    "checksums": {"kv": digest},
                    "next_arena": arena.size,
                },
            )
            arena.id, arena.extent = r["lease"], r["arena"]
            cl = self.call(
                "claim",
                {
                    "namespace": "default",
                    "key": "k",
                    "select": None,
                    "consume": True,
                    "wait": None,
                    "ttl": None,
                    "peer": None,
                },
            )
            _, offset, nbytes = cl["buffers"]["kv"]
            self.engine.copy_here(out, self.mapping.view(offset, nbytes, False))
            self.rid += 1
            self.sock.sendall(
                self.pack(
                    {
                        "id": self.rid,
                        "op": "release",
                        "args": {"lease": cl["lease"], "consume": True},
                    }
                )
            )
            times.append(time.perf_counter() - t)
        return times[WARMUP:]

    def drain(self) -> None:
        """Read the pipelined releases' replies (all before the ping's), so the Client's
        session finds none of ours."""
        self.call("ping", {})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256K")
    p.add_argument("--reps", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    size = parse_size(args.size)
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    out = np.zeros_like(src)
    rows = []
    with spawned_daemon("1G") as sock, Client(sock, name="probe-floor") as c:
        c.put("warm", {"kv": src})  # the arena and the pool's mapping
        c.get("warm", consume=True)
        bare = _Bare(c)
        for r in range(args.rounds):
            for kind in ("client", "bare"):
                if kind == "client":
                    times = _client_loop(c, src, out, args.reps)
                else:
                    c.exists("warm")  # a round trip: the Client reads its own pending replies
                    times = bare.loop(src, out, args.reps)
                    bare.drain()
                if not np.array_equal(out, src):
                    raise AssertionError(f"{kind}: the bytes read back differ")
                rows.append({"round": r + 1, "kind": kind, "p50_us": median(times) * 1e6})
                print(f"round {r + 1} {kind}: p50 {rows[-1]['p50_us']:.1f} us", flush=True)
    p50 = {k: median([x["p50_us"] for x in rows if x["kind"] == k]) for k in ("client", "bare")}
    result = {
        "benchmark": "probe_protocol_floor",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "size": size,
        "reps": args.reps,
        "rounds": rows,
        "median_p50_us": p50,
        "client_over_bare": p50["client"] / p50["bare"],
    }
    print(
        f"median of the rounds' p50: client {p50['client']:.1f} us, bare {p50['bare']:.1f} us "
        f"({result['client_over_bare']:.2f}x)"
    )
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        m = result["machine"]
        lines = [
            f"# put+get against the bare protocol, {args.size} ({m.get('cpu')}, "
            f"{m.get('cores')} cores)",
            "",
            f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min', 0):.2f}; "
            f"`{result['command']}`",
            "",
            "| round | client p50 µs | bare protocol p50 µs |",
            "|---|---|---|",
        ]
        for r in range(args.rounds):
            c_, b_ = (x["p50_us"] for x in rows if x["round"] == r + 1)
            lines.append(f"| {r + 1} | {c_:.1f} | {b_:.1f} |")
        ratio = int(result["client_over_bare"] * 100) / 100  # cut, not rounded
        lines += [
            "",
            f"Median of the rounds: client {p50['client']:.1f} µs, bare protocol "
            f"{p50['bare']:.1f} µs: the client library takes {ratio:.2f}× the bare "
            "protocol's time.",
        ]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
