"""The KV event stream, three parts (``--part``, any of them; all by default):

- ``rate``: N BlockStored (one per seal, as the daemon emits them) then N BlockRemoved through
  an EventPublisher to a SUB socket in this process, every event counted;
- ``rss``: a daemon's RSS after 2,000 prefix blocks of 16,384 token ids (values below 151,000,
  a real vocabulary's) published and evicted, ``--rss-round`` (100) at a time, nobody
  subscribed: what stays is the replay buffer ([events] replay_buffer) and what the
  allocator keeps of the token ids of the blocks alive at once;
- ``flood``: a daemon whose replay buffer is full of such blocks, one DEALER asking for
  replays from 0 as fast as it can (reading nothing, or reading everything), and 200 live
  prefix blocks published one by one beside it: how many reach a live subscriber, their
  latency (publish call to arrival), the daemon's RSS before and after.

``--daemon-src DIR`` runs the daemons from another source tree (e.g. ``git archive`` of an
older commit), for a baseline in the same run. Results: ``--out PREFIX`` writes PREFIX.json
and PREFIX.md with the commit, machine, command, load and CPU pressure (PSI).

    .venv/bin/python benchmarks/bench_events.py --out benchmarks/results/events-cpu
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import (  # noqa: E402
    MiB,
    checkout_commit,
    invocation,
    machine_info,
    measured_commit,
    pct,
    process_memory,
    spawned_daemon,
    write_results,
)
from kvbroker._server import events as ev  # noqa: E402
from kvbroker.prefix import PrefixCache  # noqa: E402

LONG = 16_384
VOCAB = 151_000


def psi() -> str | None:
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def long_tokens(i: int) -> list[int]:
    return ((np.arange(LONG, dtype=np.int64) + i * LONG) * 2654435761 % VOCAB).tolist()


def publish_long(c: Client, first: int, n: int, namespace: str = "bench") -> None:
    pc = PrefixCache(c, namespace=namespace, block_size=LONG, checksum=False)
    for i in range(first, first + n):
        pc.publish(long_tokens(i), lambda _i: {"kv": b"\0" * 64}, block_sizes={"kv": 64})


def settled(c: Client, timeout: float = 300.0) -> None:
    """Until the daemon's publisher has sent everything queued."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        e = c.stat().events
        if e.queued == 0:
            time.sleep(0.5)  # the batch in flight
            if c.stat().events.queued == 0:
                return
        time.sleep(0.2)
    raise RuntimeError("the daemon's event queue never drained")


def daemon(src: str | None, events: dict):
    env = {"KVBROKER_TRANSFER_NODE": "bench", **events}
    launcher = None
    if src:  # ahead of the working directory, which ``python -m`` would put first
        launcher = [
            sys.executable,
            "-c",
            f"import runpy, sys; sys.path.insert(0, {src!r}); "
            "runpy.run_module('kvbroker', run_name='__main__', alter_sys=True)",
        ]
    return spawned_daemon("64M", "--page-size", "4K", env=env, launcher=launcher)


# -- parts -------------------------------------------------------------------------------------


def part_rate(args) -> dict:
    topic = ev.topic_for("bench", "m")
    n, bs = args.blocks, 16
    with ev.EventPublisher("tcp://*:0", topic=topic, max_queue=4 * n) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        while True:  # until the subscription is through
            pub.cleared()
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(n):
            pub.stored([i + 1], i or None, range(i * bs, i * bs + bs), bs)
        for i in range(n):
            pub.removed([n - i])
        t_pub, c_pub = time.perf_counter() - t0, time.thread_time() - c0
        seen = 0
        while seen < 2 * n and sub.poll(5000):
            seen += len(msgpack.unpackb(sub.recv_multipart()[2])[1])
        dt = time.perf_counter() - t0
        st = pub.stats()
        sub.close(linger=0)
    return {
        "events": 2 * n,
        "publish_us_wall": t_pub / (2 * n) * 1e6,
        "publish_us_cpu": c_pub / (2 * n) * 1e6,
        "received": seen,
        "seconds": dt,
        "events_per_s": seen / dt,
        "batches": st["batches_published"],
        "dropped": st["events_dropped"],
    }


def part_rss(args) -> dict:
    rep = free_port()
    with daemon(
        args.daemon_src,
        {
            "KVBROKER_EVENTS_PUBLISH": f"tcp://*:{free_port()}",
            "KVBROKER_EVENTS_REPLAY": f"tcp://127.0.0.1:{rep}",
        },
    ) as path:
        with Client(path, map_pools=False) as c:
            pid = c.stat().pid
            settled(c)
            before = process_memory(pid)
            for r in range(0, args.rss_blocks, args.rss_round):
                publish_long(c, r, min(args.rss_round, args.rss_blocks - r))
                c.evict(namespace="bench", all=True)
            settled(c)
            after = process_memory(pid)
            st = c.stat()
            e = st.events
    return {
        "blocks": args.rss_blocks,
        "round": args.rss_round,
        "tokens_per_block": LONG,
        "rss_before_MiB": before["VmRSS"] / MiB,
        "rss_after_MiB": after["VmRSS"] / MiB,
        "peak_rss_MiB": after["VmHWM"] / MiB,
        "objects_after": st.objects,
        "events_published": e.events_published,
        "batches": e.next_seq,
        "replay_buffer_bytes": getattr(e, "buffered_bytes", None),
    }


def part_flood(args, read: bool) -> dict:
    pub_port, rep = free_port(), free_port()
    ctx = zmq.Context.instance()
    with daemon(
        args.daemon_src,
        {
            "KVBROKER_EVENTS_PUBLISH": f"tcp://*:{pub_port}",
            "KVBROKER_EVENTS_REPLAY": f"tcp://127.0.0.1:{rep}",
        },
    ) as path:
        c = Client(path, map_pools=False)
        pid = c.stat().pid
        publish_long(c, 0, args.flood_fill)  # the replay buffer: as full as it gets
        c.evict(namespace="bench", all=True)
        settled(c)
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        live = PrefixCache(c, namespace="live", block_size=16, checksum=False)
        probe = 10**8
        while not sub.poll(200):  # until the subscription is through
            live.publish(
                list(range(probe, probe + 16)), lambda _i: {"kv": b"\0"}, block_sizes={"kv": 1}
            )
            probe += 16
        while sub.poll(500):
            sub.recv_multipart()
        rss_before = process_memory(pid)["VmRSS"]
        arrived: dict[int, float] = {}
        stop = threading.Event()
        asked = [0]

        def receive():
            while not stop.is_set():
                if sub.poll(100):
                    frames = sub.recv_multipart()
                    now = time.perf_counter()
                    for e in msgpack.unpackb(frames[2])[1]:
                        if e[0] == "BlockStored":
                            arrived.setdefault(e[1][0], now)

        def flood():
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.SNDHWM, 0)
            d.connect(f"tcp://127.0.0.1:{rep}")
            while not stop.is_set():
                try:
                    d.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
                    asked[0] += 1
                except zmq.Again:
                    time.sleep(0.001)
                while read and d.poll(0):
                    d.recv_multipart()
            d.close(linger=0)

        threads = [threading.Thread(target=receive), threading.Thread(target=flood)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood under way
        sent: dict[int, float] = {}
        for i in range(args.live):
            tokens = list(range(10**9 + i * 16, 10**9 + i * 16 + 16))
            t0 = time.perf_counter()
            live.publish(tokens, lambda _i: {"kv": b"\0"}, block_sizes={"kv": 1})
            sent[ev.external_hash(live.keys(live.hashes(tokens))[0])] = t0
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline and not set(sent) <= set(arrived):
            time.sleep(0.05)
        rss_flood = process_memory(pid)["VmRSS"]
        stop.set()
        for t in threads:
            t.join(30)
        e = c.stat().events
        c.close()
        sub.close(linger=0)
    lat = sorted(arrived[h] - t for h, t in sent.items() if h in arrived)
    return {
        "reads_replies": read,
        "fill_blocks": args.flood_fill,
        "live": args.live,
        "live_arrived": len(lat),
        "wait_s": args.wait,
        "requests_sent": asked[0],
        "replay_requests_answered": e.replay_requests,
        "replay_refused": getattr(e, "replay_refused", None),
        "latency_ms_p50": pct(lat, 0.5) * 1e3 if lat else None,
        "latency_ms_p99": pct(lat, 0.99) * 1e3 if lat else None,
        "latency_ms_max": lat[-1] * 1e3 if lat else None,
        "rss_before_MiB": rss_before / MiB,
        "rss_during_MiB": rss_flood / MiB,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", action="append", choices=("rate", "rss", "flood"))
    ap.add_argument("--blocks", type=int, default=100_000, help="rate: events of each kind")
    ap.add_argument("--rss-blocks", type=int, default=2000)
    ap.add_argument(
        "--rss-round",
        type=int,
        default=100,
        help="rss: blocks published before each eviction (alive at once)",
    )
    ap.add_argument(
        "--flood-fill",
        type=int,
        default=400,
        help="flood: 16,384-token blocks published first (the replay buffer)",
    )
    ap.add_argument("--live", type=int, default=200)
    ap.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="flood: seconds the live events may take after the last publish",
    )
    ap.add_argument("--daemon-src", help="run the daemons from this source tree (a baseline)")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    args = ap.parse_args()
    parts = args.part or ["rate", "rss", "flood"]
    machine, psi_before = machine_info(), psi()
    result: dict = {
        "benchmark": "events",
        "commit": measured_commit(),
        "command": invocation(),
        "daemon_src": args.daemon_src,
        "machine": machine,
        "psi_cpu_before": psi_before,
    }
    if args.daemon_src:
        result["daemon_commit"] = checkout_commit(args.daemon_src)
    if "rate" in parts:
        result["rate"] = part_rate(args)
    if "rss" in parts:
        result["rss"] = part_rss(args)
    if "flood" in parts:
        result["flood"] = [part_flood(args, read=False), part_flood(args, read=True)]
    result["psi_cpu_after"], result["loadavg_after"] = psi(), os.getloadavg()[0]
    who = f"daemon from {args.daemon_src}" if args.daemon_src else "daemon from this tree"
    lines = [
        f"# KV events ({machine['cpu']}, {machine['cores']} cores)",
        "",
        f"Commit {result['commit']} ({who}); `{result['command']}`; {machine['when']}.",
        f"Load average {machine['loadavg_1min']} before, {result['loadavg_after']:.2f} "
        f"after; CPU pressure before `{psi_before}`, after `{result['psi_cpu_after']}`.",
        "",
    ]
    if "rate" in result:
        r = result["rate"]
        lines.append(
            f"- rate: {r['events']} events, publish() {r['publish_us_wall']:.2f} µs "
            f"wall / {r['publish_us_cpu']:.2f} µs CPU a call; {r['received']} "
            f"received, {r['events_per_s']:,.0f} events/s; dropped {r['dropped']}."
        )
    if "rss" in result:
        r = result["rss"]
        lines.append(
            f"- rss: {r['blocks']} blocks of {r['tokens_per_block']} token ids "
            f"published and evicted {r['round']} at a time: daemon RSS "
            f"{r['rss_before_MiB']:.0f} → "
            f"{r['rss_after_MiB']:.0f} MiB (peak {r['peak_rss_MiB']:.0f}); replay "
            f"buffer {r['replay_buffer_bytes']} B; {r['objects_after']} objects left."
        )
    for f in result.get("flood", []):
        lat = (
            "-"
            if f["latency_ms_p50"] is None
            else f"{f['latency_ms_p50']:.1f} / {f['latency_ms_p99']:.1f} / "
            f"{f['latency_ms_max']:.1f} ms"
        )
        lines.append(
            f"- flood ({'reading' if f['reads_replies'] else 'not reading'} its "
            f"replies; {f['requests_sent']} requests sent, "
            f"{f['replay_requests_answered']} taken): {f['live_arrived']} of "
            f"{f['live']} live events arrived within {f['wait_s']:g} s of the last; "
            f"latency p50 / p99 / max {lat}; daemon RSS {f['rss_before_MiB']:.0f} → "
            f"{f['rss_during_MiB']:.0f} MiB."
        )
    write_results(args.out, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
