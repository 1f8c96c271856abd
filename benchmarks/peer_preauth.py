"""What unauthenticated peer connections cost a daemon serving ``[transfer] listen`` (issue 38
item 5): RSS before and after each attack, the attacker's view of it, and the machine's load.

- ``hellos``: ``--conns`` (8) connections each announce a 63 MiB frame (a 4-byte length, as
  the shared-token channel's hello was framed) and send the 63 MiB, as fast as the daemon
  takes them; how many bytes each got in before the daemon closed it, and the daemon's RSS
  (and peak RSS) before and after;
- ``stalled``: ``--stalled`` (200) connections opened at once that never send a byte (a
  handshake that never ends): how many the daemon closed at once, RSS before and after.

Usage: ``python benchmarks/peer_preauth.py [--out benchmarks/results/peer-preauth-cpu]``.
``--token FILE`` runs the same against a daemon of the shared-token channel (a checkout
from before issue 38, on PYTHONPATH), for the figure it replaces.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvbroker._bench._common import (  # noqa: E402
    invocation,
    machine_info,
    measured_commit,
    process_memory,
    write_results,
)
from kvbroker.testing import DaemonProcess, drop_leftover_pools  # noqa: E402

MiB = 1 << 20


def _psi() -> dict[str, str]:
    out = {}
    for what in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{what}") as f:
                out[what] = f.readline().strip()
        except OSError:
            pass
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hello(port: int, nbytes: int, out: list, i: int) -> None:
    """One attacker: announce ``nbytes``, send them; record what got in."""
    sent, how = 0, "sent all"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(nbytes.to_bytes(4, "big"))
            chunk = b"\0" * MiB
            while sent < nbytes:
                n = min(len(chunk), nbytes - sent)
                sent += s.send(chunk[:n])
            s.settimeout(10)
            try:
                how = "closed by the daemon" if s.recv(1 << 16) == b"" else how
            except (TimeoutError, OSError):
                pass
    except OSError as e:
        how = f"closed by the daemon ({type(e).__name__})"
    out[i] = {"bytes_sent": sent, "outcome": how}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--hello", type=int, default=63 * MiB)
    ap.add_argument("--stalled", type=int, default=200)
    ap.add_argument("--token", help="a shared-token daemon (pre-issue-38 code on PYTHONPATH)")
    ap.add_argument("--out")
    args = ap.parse_args()

    folder = tempfile.mkdtemp(prefix="kvb-preauth-")
    port = _port()
    env = {
        "UCX_TLS": "tcp",
        "KVBROKER_TRANSFER_LISTEN": f"127.0.0.1:{port}",
        "KVBROKER_TRANSFER_NODE": "target",
    }
    if args.token:
        env["KVBROKER_TRANSFER_TOKEN_FILE"] = args.token
    else:
        from kvbroker.testing import peer_certificates

        files = peer_certificates(os.path.join(folder, "certs"), {"a": ["127.0.0.1"]})["a"]
        env.update(
            {
                "KVBROKER_TRANSFER_CERT_FILE": files["cert_file"],
                "KVBROKER_TRANSFER_KEY_FILE": files["key_file"],
                "KVBROKER_TRANSFER_CA_FILE": files["ca_file"],
                "KVBROKER_TRANSFER_PEERS": "127.0.0.1:1",
            }
        )
    load_before, psi_before = os.getloadavg(), _psi()
    d = DaemonProcess(
        os.path.join(folder, "kvb.sock"), "--pool-size", "64M", env=env, ready_timeout=120
    )
    results = {}
    try:
        pid = d.proc.pid
        time.sleep(1.0)
        rss0 = process_memory(pid)
        outcomes: list = [None] * args.conns
        threads = [
            threading.Thread(target=_hello, args=(port, args.hello, outcomes, i))
            for i in range(args.conns)
        ]
        for t in threads:
            t.start()
        time.sleep(3.0)  # what the daemon holds while the hellos are in flight
        during = process_memory(pid)
        for t in threads:
            t.join(300)
        rss1 = process_memory(pid)
        results["hellos"] = {
            "connections": args.conns,
            "announced_bytes": args.hello,
            "rss_before": rss0["VmRSS"],
            "rss_during": during["VmRSS"],
            "rss_after": rss1["VmRSS"],
            "peak_rss": rss1["VmHWM"],
            "rss_growth_peak": rss1["VmHWM"] - rss0["VmRSS"],
            "attackers": outcomes,
        }

        rss0 = process_memory(pid)
        socks, closed = [], 0
        for _ in range(args.stalled):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
        time.sleep(1.0)
        for s in socks:
            s.setblocking(False)
            try:
                if s.recv(1) == b"":
                    closed += 1
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        rss1 = process_memory(pid)
        for s in socks:
            s.close()
        results["stalled"] = {
            "connections": args.stalled,
            "closed_at_once": closed,
            "rss_before": rss0["VmRSS"],
            "rss_after": rss1["VmRSS"],
        }
    finally:
        d.stop()
        drop_leftover_pools(d.socket_path)
    res = {
        "commit": measured_commit(),
        "machine": machine_info(),
        "command": invocation(),
        "channel": "shared token (before issue 38)" if args.token else "mutual TLS",
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "psi_before": psi_before,
        "psi_after": _psi(),
        "results": results,
    }
    h, st = results["hellos"], results["stalled"]
    md = "\n".join(
        [
            f"# Unauthenticated peer connections ({res['channel']})",
            "",
            f"commit {res['commit']}, {res['machine']['cpu']} x{res['machine']['cores']}, "
            f"load {load_before[0]:.2f} before / {res['load_after'][0]:.2f} after, "
            f"`{res['command']}`",
            "",
            "| attack | RSS before | RSS after | peak RSS | attacker's view |",
            "|---|---|---|---|---|",
            f"| {h['connections']} hellos announcing {h['announced_bytes'] / MiB:.0f} MiB | "
            f"{h['rss_before'] / MiB:.1f} MiB | {h['rss_after'] / MiB:.1f} MiB | "
            f"{h['peak_rss'] / MiB:.1f} MiB (+{h['rss_growth_peak'] / MiB:.1f}) | "
            f"{sorted(set(o['outcome'] for o in h['attackers']))}, at most "
            f"{max(o['bytes_sent'] for o in h['attackers']) / MiB:.1f} MiB sent each |",
            f"| {st['connections']} stalled handshakes | {st['rss_before'] / MiB:.1f} MiB | "
            f"{st['rss_after'] / MiB:.1f} MiB | | {st['closed_at_once']} closed at once |",
            "",
            f"PSI before: {psi_before}",
            f"PSI after: {res['psi_after']}",
            "",
        ]
    )
    write_results(args.out, res, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
