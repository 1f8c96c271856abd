"""KV event publishing rate: N BlockStored (one per seal, as the daemon emits them) then N
BlockRemoved, through EventPublisher to a SUB socket in this process, every event counted.

    .venv/bin/python benchmarks/bench_events.py [--blocks 100000] [--fmt positional|tagged]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from kvbroker._server import events as ev  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--fmt", default="positional", choices=ev.FORMATS)
    args = ap.parse_args()
    topic = ev.topic_for("bench", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, fmt=args.fmt,
                           max_queue=4 * args.blocks) as pub:
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
        n, bs = args.blocks, args.block_size
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(n):
            pub.stored([i + 1], i or None, range(i * bs, i * bs + bs), bs)
        t_pub = time.perf_counter() - t0
        for i in range(n):
            pub.removed([n - i])
        t_pub2, c_pub = time.perf_counter() - t0, time.thread_time() - c0
        seen = 0
        while seen < 2 * n:
            if not sub.poll(5000):
                break
            _t, _s, payload = sub.recv_multipart()
            seen += len(msgpack.unpackb(payload)[1])
        dt = time.perf_counter() - t0
        st = pub.stats()
    print(f"{2 * n} events ({n} stored of {bs} tokens, {n} removed), format {args.fmt}: "
          f"publish() {t_pub2 / (2 * n) * 1e6:.2f} µs wall, {c_pub / (2 * n) * 1e6:.2f} µs CPU "
          f"a call on the caller's thread "
          f"(stored {t_pub / n * 1e6:.2f} µs); all {seen} received in {dt:.2f} s = "
          f"{seen / dt:,.0f} events/s in {st['batches_published']} batches; "
          f"dropped {st['events_dropped']}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
