"""Does where the processes run move a small round trip? The host's floor, placed and not.

Two measurements, each alternated over ``--rounds``, unpinned and pinned (the two sides on two
CPUs of their own, far apart in the CPU list):

- ``pingpong``: a 120-byte message to a forked Python process and back over a Unix socket
  pair, both sides polling (``MSG_DONTWAIT`` + ``sched_yield``, as the client and daemon do):
  the least a request/reply between two Python processes costs on this host;
- ``put+get``: a 256 KiB put+get against one private daemon, through the ``Client`` and as the
  bare protocol (``probe_protocol_floor.py``'s two loops), the daemon and the client pinned
  with ``sched_setaffinity`` or free.

    python benchmarks/experiments/probe_placement.py [--reps 3000] [--rounds 3] [--out PREFIX]

writes ``PREFIX.json`` and ``PREFIX.md`` with the commit, machine and command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from probe_protocol_floor import _Bare, _client_loop  # noqa: E402
from probe_ring_floor import _socket_pair_echo  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import invocation, machine_info, measured_commit  # noqa: E402
from kvbroker._bench._common import median, spawned_daemon  # noqa: E402


def _daemon_pid(sock: str) -> int:
    out = subprocess.check_output(["pgrep", "-f", f"serve --socket {sock}"], text=True)
    return int(out.split()[0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs two CPUs")
    # two CPUs far apart in the list (on most hosts: different cores, not SMT siblings)
    pins = (cpus[2], cpus[len(cpus) // 2 + 2]) if len(cpus) > 8 else (cpus[0], cpus[-1])
    rows = []
    for r in range(args.rounds):
        for placed in (False, True):
            us = _socket_pair_echo(False, args.reps * 5, pins if placed else None)
            rows.append({"round": r + 1, "what": "pingpong", "pinned": placed, "p50_us": us})
            print(
                f"round {r + 1} pingpong {'pinned' if placed else 'free'}: {us:.1f} us", flush=True
            )
    src = np.random.default_rng(0).integers(0, 256, 256 * 1024, dtype=np.uint8)
    out = np.zeros_like(src)
    with spawned_daemon("1G") as sock, Client(sock, name="probe-placement") as c:
        daemon = _daemon_pid(sock)
        c.put("warm", {"kv": src})
        c.get("warm", consume=True)
        bare = _Bare(c)
        try:
            for r in range(args.rounds):
                for placed in (False, True):
                    os.sched_setaffinity(daemon, {pins[0]} if placed else set(cpus))
                    os.sched_setaffinity(0, {pins[1]} if placed else set(cpus))
                    client_us = median(_client_loop(c, src, out, args.reps)) * 1e6
                    c.exists("warm")  # the Client reads its own pending replies first
                    bare_us = median(bare.loop(src, out, args.reps)) * 1e6
                    bare.drain()
                    if not np.array_equal(out, src):
                        raise AssertionError("the bytes read back differ")
                    rows.append(
                        {
                            "round": r + 1,
                            "what": "put+get",
                            "pinned": placed,
                            "client_p50_us": client_us,
                            "bare_p50_us": bare_us,
                        }
                    )
                    print(
                        f"round {r + 1} put+get {'pinned' if placed else 'free'}: client "
                        f"{client_us:.1f} us, bare {bare_us:.1f} us",
                        flush=True,
                    )
        finally:
            os.sched_setaffinity(0, set(cpus))

    def med(what, placed, key):
        return median([x[key] for x in rows if x["what"] == what and x["pinned"] == placed])

    summary = {
        f"{'pinned' if placed else 'free'}": {
            "pingpong_us": med("pingpong", placed, "p50_us"),
            "client_us": med("put+get", placed, "client_p50_us"),
            "bare_us": med("put+get", placed, "bare_p50_us"),
        }
        for placed in (False, True)
    }
    result = {
        "benchmark": "probe_placement",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "pins": pins,
        "reps": args.reps,
        "rounds": rows,
        "median": summary,
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        m = result["machine"]
        lines = [
            f"# Placement and the small round trip ({m.get('cpu')}, {m.get('cores')} cores)",
            "",
            f"commit {result['commit']}, {m.get('when')}; load {m.get('loadavg_1min', 0):.2f}; "
            f"`{result['command']}`; pinned: CPUs {pins[0]} (daemon / echo) and {pins[1]} "
            "(client)",
            "",
            "| round | placement | ping-pong p50 µs | Client put+get p50 µs | bare p50 µs |",
            "|---|---|---|---|---|",
        ]
        for r in range(args.rounds):
            for placed in (False, True):
                pp = [x for x in rows if x["round"] == r + 1 and x["pinned"] == placed]
                ping = next(x["p50_us"] for x in pp if x["what"] == "pingpong")
                pg = next(x for x in pp if x["what"] == "put+get")
                lines.append(
                    f"| {r + 1} | {'pinned' if placed else 'free'} | {ping:.1f} | "
                    f"{pg['client_p50_us']:.1f} | {pg['bare_p50_us']:.1f} |"
                )
        lines += [
            "",
            "Medians of the rounds: "
            + "; ".join(
                f"{k}: ping-pong {v['pingpong_us']:.1f} µs, Client {v['client_us']:.1f} µs, bare "
                f"{v['bare_us']:.1f} µs"
                for k, v in summary.items()
            )
            + ".",
        ]
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
