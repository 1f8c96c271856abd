"""Remote claims between two kvbroker daemons on this host, beside the raw NIXL READ inside them.

Two daemons (A serves on a control port, B pulls), each with its own socket and pools, NIXL
over UCX (``UCX_TLS=tcp`` here). Three parts:

``throughput`` / ``latency``
    A publishes objects of random bytes (32 MiB and 1 GiB by default, with checksums). Each
    rep evicts B's copy, then times ``claim(key, peer=A)`` in a client of B, from the request
    to the lease in hand: B asks A to pin and describe, reserves a write lease, one NIXL
    READ, verifies the xxh3 checksums, releases A's lease, seals, and claims locally. The
    bytes are then compared with the source bit for bit (untimed). Beside each claim: the
    raw NIXL READ of the same bytes between the same two processes in the same run — the
    ``NixlEndpoint.read`` call inside that very pull (descriptor list, transfer request
    created, posted, polled to completion, released: what benchmarks/bench_nixl_raw.py
    times), reported by B's statistics (``transfer.last_read_seconds``). The ratio is
    raw READ seconds / remote claim seconds, i.e. the claim's throughput as a fraction of
    the READ's. ``latency`` does the same for 256 KiB (p50).

``crash``
    N remote claims of small objects while A is SIGKILLed at random points (between and
    during pulls) and restarted warm on the same port. Counts claims that succeeded
    (bit-exact) or failed typed (PeerUnavailable, TransferFailed, ...), then checks: no
    object half-written on B (no pending object, no write lease, every object B holds
    verifies against its checksums), no lease left on A after its last warm restart.

    UCX_TLS=tcp .venv/bin/python benchmarks/bench_remote.py [--reps 5] [--json-out F]
        [--parts throughput latency crash] [--crash-claims 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench import checkout_commit  # noqa: E402
from kvbroker._bench._common import run_conditions  # noqa: E402
from kvbroker.errors import KVBrokerError  # noqa: E402
from kvbroker.testing import DaemonProcess, drop_leftover_pools  # noqa: E402

SIZES = {"32MiB": 32 << 20, "1GiB": 1 << 30}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pair:
    def __init__(self, folder: str, pool_a: str, pool_b: str, *, keep: bool = False) -> None:
        from kvbroker.testing import peer_certificates

        # throwaway certificates for the two daemons' mutual TLS (both 127.0.0.1)
        certs = peer_certificates(os.path.join(folder, "certs"), {"bench": ["127.0.0.1"]})
        files = certs["bench"]
        self.port = _port()
        self.address = f"127.0.0.1:{self.port}"
        base = {
            "UCX_TLS": os.environ.get("UCX_TLS", "tcp"),
            "KVBROKER_TRANSFER_CERT_FILE": files["cert_file"],
            "KVBROKER_TRANSFER_KEY_FILE": files["key_file"],
            "KVBROKER_TRANSFER_CA_FILE": files["ca_file"],
            "KVBROKER_TRANSFER_PEERS": self.address,
        }
        self.env_a = {
            **base,
            "KVBROKER_TRANSFER_LISTEN": self.address,
            "KVBROKER_TRANSFER_NODE": "bench-a",
        }
        self.args_a = ["--pool-size", pool_a, *(["--keep-pools-on-exit"] if keep else [])]
        self.sock_a = os.path.join(folder, "a.sock")
        self.sock_b = os.path.join(folder, "b.sock")
        self.a = DaemonProcess(self.sock_a, *self.args_a, env=self.env_a, ready_timeout=120)
        self.b = DaemonProcess(
            self.sock_b,
            "--pool-size",
            pool_b,
            env={**base, "KVBROKER_TRANSFER_NODE": "bench-b"},
            ready_timeout=120,
        )

    def restart_a(self) -> None:
        self.a.stop(signal.SIGKILL)
        self.a = DaemonProcess(self.sock_a, *self.args_a, env=self.env_a, ready_timeout=120)

    def close(self) -> None:
        for d in (self.b, self.a):
            d.stop()
            drop_leftover_pools(d.socket_path)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class RawReader:
    """bench_nixl_raw.py's baseline, in this run: this process's own NIXL agent READs
    objects of the same sizes from a serving process (tests/_nixl_peer.py, a region
    registered once), with ``NixlEndpoint.read`` (descriptor list, transfer request created,
    posted, polled to completion, released) — nothing of the broker's."""

    def __init__(self, folder: str, sizes: dict[str, int]) -> None:
        import asyncio
        import subprocess

        from kvbroker._server import transfer
        from kvbroker.testing import peer_certificates

        files = peer_certificates(os.path.join(folder, "raw-certs"), {"bench": ["127.0.0.1"]})[
            "bench"
        ]
        cmd = [
            sys.executable,
            os.path.join(ROOT, "tests", "_nixl_peer.py"),
            "--cert",
            files["cert_file"],
            "--key",
            files["key_file"],
            "--ca",
            files["ca_file"],
        ]
        for name, n in sizes.items():
            cmd += ["--object", f"{name}:{n}:1"]
        self.peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        while True:
            line = self.peer.stdout.readline()
            if not line:
                raise SystemExit(f"the raw NIXL peer exited with {self.peer.wait()}")
            if line.startswith(b"{"):
                break
        port = json.loads(line)["port"]
        self.ep = transfer.NixlEndpoint(f"bench-raw-{os.getpid()}")
        self.region = np.zeros(max(sizes.values()), dtype=np.uint8)
        self.region[:] = 1  # fault the pages in before timing
        self.ep.register([(self.region.ctypes.data, self.region.nbytes)])
        tls = transfer.tls_contexts(files["cert_file"], files["key_file"], files["ca_file"])[1]
        self.loop = asyncio.new_event_loop()  # the control connection lives between calls
        self.client = self.loop.run_until_complete(
            transfer.PeerClient(f"127.0.0.1:{port}", tls=tls, node="bench").connect()
        )
        self.agent = self.ep.add_peer(self.client.metadata)
        self.pins = {
            name: self.loop.run_until_complete(self.client.pin(name, ttl=3600)) for name in sizes
        }

    def read(self, name: str) -> float:
        r = self.pins[name]
        return self.ep.read(
            self.agent, [tuple(e) for e in r["extents"]], [(self.region.ctypes.data, r["nbytes"])]
        ).seconds

    def exact(self, name: str) -> bool:
        import xxhash

        r = self.pins[name]
        return xxhash.xxh3_64_intdigest(self.region[: r["nbytes"]]) == r["checksum"]

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.client.close())
            self.loop.close()
            self.ep.close()
        finally:
            self.peer.stdin.close()
            try:
                self.peer.wait(30)
            except Exception:  # noqa: BLE001
                self.peer.kill()


def _median_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    rs = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(rs), min(rs), max(rs)


def throughput(
    pair: Pair,
    sizes: dict[str, int],
    reps: int,
    raw: RawReader | None = None,
    big_reps: int | None = None,
) -> list[dict]:
    """Per round: B's remote claim and, with ``raw``, the standalone raw READ of the same
    size (the order alternating round by round, so neither always runs first)."""
    rows = []
    with Client(pair.sock_a) as ca, Client(pair.sock_b) as cb:
        for name, n in sizes.items():
            src = np.random.default_rng(n % 9973).integers(0, 256, n, dtype=np.uint8)
            ca.put(name, {"kv": src})
            claim_s, read_s, pull_s, exact, raw_s, phases = [], [], [], [], [], []
            n_reps = big_reps if big_reps and n >= 1 << 30 else reps
            for i in range(n_reps + 1):  # the first rep connects to the peer: not counted
                if raw is not None and i % 2 == 0:
                    raw_s.append(raw.read(name))
                cb.evict(name)
                t0 = time.perf_counter()
                # a TTL past the 1 GiB compare on a loaded VM (30 s ran out there)
                with cb.claim(name, peer=pair.address, ttl=900) as lease:
                    dt = time.perf_counter() - t0
                    ok = np.array_equal(lease["kv"], src)
                if raw is not None and i % 2 == 1:
                    raw_s.append(raw.read(name))
                tr = cb.stat().transfer
                assert tr.last_pull_bytes == n, tr
                claim_s.append(dt)
                read_s.append(tr.last_read_seconds)
                pull_s.append(tr.last_pull_seconds)
                # the claim outside the pull: B's client request, the deferred claim, reply
                phases.append({**(tr.last_pull_phases or {}), "client": dt - tr.last_pull_seconds})
                exact.append(ok)
            claim_s, read_s, pull_s, exact = claim_s[1:], read_s[1:], pull_s[1:], exact[1:]
            phases, raw_s = phases[1:], raw_s[1:]
            ratio = _median_ratio(read_s, claim_s)
            row = {
                "size": name,
                "nbytes": n,
                "reps": n_reps,
                "bit_exact": all(exact),
                "claim_s": claim_s,
                "raw_read_s": read_s,
                "pull_in_daemon_s": pull_s,
                "claim_p50_s": statistics.median(claim_s),
                "raw_read_p50_s": statistics.median(read_s),
                "claim_gbps_p50": n / statistics.median(claim_s) / 1e9,
                "raw_read_gbps_p50": n / statistics.median(read_s) / 1e9,
                "ratio_p50": ratio[0],
                "ratio_min": ratio[1],
                "ratio_max": ratio[2],
                "phases_s": phases,
                "phases_p50_s": {
                    k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]
                }
                if phases
                else {},
            }
            if raw is not None:
                sa = _median_ratio(raw_s, claim_s)
                row.update(
                    {
                        "standalone_read_s": raw_s,
                        "standalone_read_p50_s": statistics.median(raw_s),
                        "standalone_bit_exact": raw.exact(name),
                        "standalone_ratio_p50": sa[0],
                        "standalone_ratio_min": sa[1],
                        "standalone_ratio_max": sa[2],
                    }
                )
            rows.append(row)
            print(
                f"{name:>7}: remote claim p50 {row['claim_p50_s'] * 1e3:9.2f} ms "
                f"({row['claim_gbps_p50']:.3f} GB/s), READ in the pull p50 "
                f"{row['raw_read_p50_s'] * 1e3:9.2f} ms ({row['raw_read_gbps_p50']:.3f} GB/s),"
                f" ratio p50 {row['ratio_p50']:.2f} [{row['ratio_min']:.2f}, "
                f"{row['ratio_max']:.2f}], bit-exact {row['bit_exact']}",
                flush=True,
            )
            if raw is not None:
                print(
                    f"{'':>7}  standalone raw READ p50 "
                    f"{row['standalone_read_p50_s'] * 1e3:9.2f} ms, ratio p50 "
                    f"{row['standalone_ratio_p50']:.2f} [{row['standalone_ratio_min']:.2f}, "
                    f"{row['standalone_ratio_max']:.2f}], bit-exact "
                    f"{row['standalone_bit_exact']}",
                    flush=True,
                )
            print(
                f"{'':>7}  phases p50 (ms): "
                + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in row["phases_p50_s"].items()),
                flush=True,
            )
            cb.evict(name)
            ca.evict(name)
            del src
    return rows


def crash(pair: Pair, claims: int, seed: int) -> dict:
    """``claims`` remote claims of 256 KiB-4 MiB objects; A SIGKILLed at random points."""
    rng = random.Random(seed)
    nkeys = 64
    data = {}
    with Client(pair.sock_a) as ca:
        for i in range(nkeys):
            n = rng.choice((256 << 10, 1 << 20, 4 << 20))
            data[f"c{i}"] = np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8)
            ca.put(f"c{i}", {"kv": data[f"c{i}"]})
    ok = failed = kills = 0
    kinds: dict[str, int] = {}
    wrong = 0
    killer_stop = threading.Event()
    krng = random.Random(seed + 1)
    lock = threading.Lock()

    def killer():
        nonlocal kills
        while not killer_stop.is_set():
            time.sleep(krng.uniform(0.2, 4.0))  # a random point: between or during pulls
            if killer_stop.is_set():
                return
            with lock:
                pair.restart_a()  # SIGKILL, then a warm start on the same port
                kills += 1

    t = threading.Thread(target=killer, daemon=True)
    t0 = time.time()
    t.start()
    cb = Client(pair.sock_b)
    try:
        for i in range(claims):
            key = f"c{rng.randrange(nkeys)}"
            cb.evict(key)  # pull again, every time
            try:
                with cb.claim(key, peer=pair.address) as lease:
                    if np.array_equal(lease["kv"], data[key]):
                        ok += 1
                    else:
                        wrong += 1
            except KVBrokerError as exc:
                failed += 1
                kinds[exc.code] = kinds.get(exc.code, 0) + 1
                time.sleep(0.2)  # A is (re)starting: do not burn claims on a closed port
            if (i + 1) % 100 == 0:
                print(f"  {i + 1} claims: {ok} ok, {failed} failed, {kills} kills", flush=True)
    finally:
        killer_stop.set()
        t.join(60)
    # Nothing half-written on B: no unsealed object, no write lease, and every object B
    # holds verifies (claim with verify re-hashes the bytes against the seal's checksums).
    sb = cb.stat()
    bad_on_b = 0
    held = [o.key for o in cb.list()]
    for key in held:
        try:
            with cb.claim(key, verify=True) as lease:
                bad_on_b += not np.array_equal(lease["kv"], data[key])
        except KVBrokerError:
            bad_on_b += 1
    cb.close()
    with lock:
        pair.restart_a()  # a last warm restart: what A holds for peers now
    with Client(pair.sock_a, map_pools=False) as ca:
        sa = ca.stat()
    out = {
        "claims": claims,
        "ok_bit_exact": ok,
        "wrong_bytes_served": wrong,
        "failed": failed,
        "failed_by_code": kinds,
        "kills": kills,
        "seconds": time.time() - t0,
        "b_objects": sb.objects,
        "b_evictions": sb.counters.evictions,
        "b_publishes": sb.counters.publishes,
        "b_pulls": sb.transfer.pulls,
        "b_pending": sb.pending,
        "b_write_leases": sb.write_leases,
        "b_objects_checked": len(held),
        "b_objects_bad": bad_on_b,
        "a_objects_after_warm_restart": sa.objects,
        "a_read_leases_after_restart": sa.read_leases,
        "a_leases_served_after_restart": sa.transfer.leases_served,
    }
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--latency-reps", type=int, default=50)
    ap.add_argument("--big-reps", type=int, help="reps of objects of 1 GiB or more")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--parts", nargs="+", default=["throughput", "latency", "crash"])
    ap.add_argument("--crash-claims", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument(
        "--no-standalone",
        action="store_true",
        help="skip the standalone raw NIXL READ beside each claim",
    )
    ap.add_argument("--json-out")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    load0 = os.getloadavg()
    before = run_conditions()
    t0 = time.time()
    commit = checkout_commit(ROOT)  # "+dirty": the code that runs is not the commit's
    out: dict = {
        "what": "remote claim (B <- A through NIXL) vs the raw NIXL READ inside it",
        "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
    }
    folder = tempfile.mkdtemp(prefix="kvb-remote-")
    sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
    biggest = max(sizes.values()) if "throughput" in args.parts else 64 << 20
    pool = f"{(biggest + (256 << 20)) >> 20}M"
    if "throughput" in args.parts or "latency" in args.parts:
        pair = Pair(folder, pool, pool)
        raw = None
        try:
            if not args.no_standalone:
                raw = RawReader(
                    folder,
                    {
                        **(sizes if "throughput" in args.parts else {}),
                        **({"256KiB": 256 << 10} if "latency" in args.parts else {}),
                    },
                )
            if "throughput" in args.parts:
                out["throughput"] = throughput(pair, sizes, args.reps, raw, args.big_reps)
            if "latency" in args.parts:
                out["latency"] = throughput(pair, {"256KiB": 256 << 10}, args.latency_reps, raw)
        finally:
            if raw is not None:
                raw.close()
            pair.close()
    if "crash" in args.parts:
        pair = Pair(folder, "512M", "512M", keep=True)
        try:
            out["crash"] = crash(pair, args.crash_claims, args.seed)
        finally:
            pair.close()
    out.update(
        {
            "commit": commit,
            "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
            "machine": {
                "node": platform.node(),
                "cpus": os.cpu_count(),
                "cpu": _cpu_model(),
                "python": platform.python_version(),
                "kernel": platform.release(),
            },
            "loadavg_before": load0,
            "loadavg_after": os.getloadavg(),
            "conditions": {"before": before, "after": run_conditions()},
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
        }
    )
    try:
        from importlib.metadata import version

        out["versions"] = {p: version(p) for p in ("nixl-cu12", "numpy", "msgpack")}
    except Exception:  # noqa: BLE001
        pass
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
