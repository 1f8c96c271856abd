"""What would requests over shared memory save? A round trip's floor, socket against ring.

The third design in ``docs/design.md`` ("What a small put+get costs") moves requests off the
Unix socket into shared-memory rings that both sides poll. This probe measures its upper bound
with nothing else around it: one forked echo process and this one exchange a request and a
reply, both sides polling from Python, alternated over ``--rounds``:

- ``socket``: the request and the reply over a Unix socket pair, each side polling with
  ``recv_into(MSG_DONTWAIT)`` and ``sched_yield`` between tries (the client's and the daemon's
  way of waiting for each other);
- ``ring``: the same bytes through one shared page: the writer copies the message into its slot
  and then bumps an 8-byte sequence number, which the reader polls (x86's stores are seen in
  the order they were made: this probe is for x86-64 only; a real ring would also need the
  fences other CPUs want, a wake-up for a side that stopped polling, and a daemon that trusts
  nothing a client wrote);

each ``raw`` (a 120-byte message echoed as it is) and ``msgpack`` (a ``claim``-shaped request
packed, unpacked on the other side, answered with a packed reply that is unpacked in turn: the
framing work every request pays on both sides whatever carries it).

    python benchmarks/experiments/probe_ring_floor.py [--reps 20000] [--rounds 3] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import socket
import struct
import sys
import time

import msgpack

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from kvbroker._bench._common import invocation, machine_info, measured_commit  # noqa: E402
from kvbroker._bench._common import median  # noqa: E402

_SEQ = struct.Struct("<Q")
_SLOT = 4096  # one slot per direction: [seq: 8 bytes][length: 8 bytes][message]
_REQUEST = {
    "id": 1 << 20,
    "op": "claim",
    "args": {
        "namespace": "default",
        "key": "request-0123456789abcdef",
        "select": None,
        "consume": True,
        "wait": None,
        "ttl": None,
        "peer": None,
    },
}
_REPLY = {
    "id": 1 << 20,
    "ok": True,
    "result": {
        "lease": 123456,
        "ttl": 30.0,
        "buffers": {"kv": [0, 1 << 30, 262144]},
        "meta": None,
        "checksums": {"kv": [1, (1 << 63) + 12345]},
    },
}


def _socket_pair_echo(msgpack_mode: bool, reps: int, pins: tuple[int, int] | None = None) -> float:
    """p50 µs of a round trip to a forked echo process over a Unix socket pair, both sides
    polling; ``pins``: the CPUs of the echo side and of this one (``probe_placement.py``)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        try:
            if pins:
                os.sched_setaffinity(0, {pins[0]})
            a.close()
            b.setblocking(False)
            buf = bytearray(1 << 16)
            unpack, reply = msgpack.unpackb, msgpack.packb(_REPLY)
            while True:
                try:
                    n = b.recv_into(buf)
                except BlockingIOError:
                    os.sched_yield()
                    continue
                if not n:
                    break
                if msgpack_mode:
                    unpack(buf[:n])
                    b.send(reply)
                else:
                    b.send(buf[:n])
        finally:
            os._exit(0)
    before = os.sched_getaffinity(0)
    b.close()
    a.setblocking(False)
    buf, times = bytearray(1 << 16), []
    pack, unpack = msgpack.packb, msgpack.unpackb
    raw = b"x" * 120
    try:
        if pins:
            os.sched_setaffinity(0, {pins[1]})
        for _ in range(reps + reps // 10):
            t = time.perf_counter()
            a.send(pack(_REQUEST) if msgpack_mode else raw)
            while True:
                try:
                    n = a.recv_into(buf)
                    break
                except BlockingIOError:
                    os.sched_yield()
            if msgpack_mode:
                unpack(buf[:n])
            times.append(time.perf_counter() - t)
    finally:
        a.close()
        os.waitpid(pid, 0)
        os.sched_setaffinity(0, before)
    return median(times[reps // 10 :]) * 1e6


def _ring_echo(msgpack_mode: bool, reps: int) -> float:
    shared = mmap.mmap(-1, 2 * _SLOT)  # anonymous and shared: the child sees the same page
    view = memoryview(shared)
    to_server, to_client = 0, _SLOT
    pid = os.fork()
    if pid == 0:
        try:
            seen = 0
            reply = msgpack.packb(_REPLY)
            while True:
                seq = _SEQ.unpack_from(view, to_server)[0]
                if seq == seen:
                    continue
                if seq == (1 << 64) - 1:  # the parent is done
                    break
                seen = seq
                n = _SEQ.unpack_from(view, to_server + 8)[0]
                if msgpack_mode:
                    msgpack.unpackb(view[to_server + 16 : to_server + 16 + n])
                    out = reply
                else:
                    out = bytes(view[to_server + 16 : to_server + 16 + n])
                view[to_client + 16 : to_client + 16 + len(out)] = out
                _SEQ.pack_into(view, to_client + 8, len(out))
                _SEQ.pack_into(view, to_client, seq)  # last: the reader polls this
        finally:
            os._exit(0)
    pack, unpack = msgpack.packb, msgpack.unpackb
    raw, times = b"x" * 120, []
    try:
        for seq in range(1, reps + reps // 10 + 1):
            t = time.perf_counter()
            out = pack(_REQUEST) if msgpack_mode else raw
            view[to_server + 16 : to_server + 16 + len(out)] = out
            _SEQ.pack_into(view, to_server + 8, len(out))
            _SEQ.pack_into(view, to_server, seq)
            while _SEQ.unpack_from(view, to_client)[0] != seq:
                pass
            n = _SEQ.unpack_from(view, to_client + 8)[0]
            if msgpack_mode:
                unpack(view[to_client + 16 : to_client + 16 + n])
            times.append(time.perf_counter() - t)
    finally:
        _SEQ.pack_into(view, to_server, (1 << 64) - 1)
        os.waitpid(pid, 0)
        view.release()
        shared.close()
    return median(times[reps // 10 :]) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit("this probe relies on x86-64's store order")
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two CPUs: both sides poll")
    rows = []
    for r in range(args.rounds):
        for framing in ("raw", "msgpack"):
            for carrier, fn in (("socket", _socket_pair_echo), ("ring", _ring_echo)):
                us = fn(framing == "msgpack", args.reps)
                rows.append({"round": r + 1, "framing": framing, "carrier": carrier, "p50_us": us})
                print(f"round {r + 1} {framing} {carrier}: {us:.2f} us", flush=True)

    def med(framing, carrier):
        return median(
            [x["p50_us"] for x in rows if x["framing"] == framing and x["carrier"] == carrier]
        )

    summary = {f: {c: med(f, c) for c in ("socket", "ring")} for f in ("raw", "msgpack")}
    result = {
        "benchmark": "probe_ring_floor",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "reps": args.reps,
        "request_bytes": len(msgpack.packb(_REQUEST)),
        "reply_bytes": len(msgpack.packb(_REPLY)),
        "rounds": rows,
        "median": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        m = result["machine"]
        lines = [
            f"# A round trip's floor, Unix socket against a shared-memory ring ({m.get('cpu')}, "
            f"{m.get('cores')} cores, Python {m.get('python')})",
            "",
            f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min', 0):.2f}; "
            f"`{result['command']}`; both sides polling; msgpack: a {result['request_bytes']}-"
            f"byte `claim` request and a {result['reply_bytes']}-byte reply, packed and "
            "unpacked on both sides.",
            "",
            "| round | raw: socket µs | raw: ring µs | msgpack: socket µs | msgpack: ring µs |",
            "|---|---|---|---|---|",
        ]
        for r in range(args.rounds):
            v = {(x["framing"], x["carrier"]): x["p50_us"] for x in rows if x["round"] == r + 1}
            lines.append(
                f"| {r + 1} | {v['raw', 'socket']:.2f} | {v['raw', 'ring']:.2f} | "
                f"{v['msgpack', 'socket']:.2f} | {v['msgpack', 'ring']:.2f} |"
            )
        saved = summary["msgpack"]["socket"] - summary["msgpack"]["ring"]
        lines += [
            "",
            f"Medians of the rounds (p50 of {args.reps} round trips each): raw "
            f"{summary['raw']['socket']:.2f} µs over the socket against "
            f"{summary['raw']['ring']:.2f} µs through the ring; with the framing "
            f"{summary['msgpack']['socket']:.2f} against "
            f"{summary['msgpack']['ring']:.2f} µs: {saved:.2f} µs per round trip "
            "is the most a ring could save.",
        ]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
