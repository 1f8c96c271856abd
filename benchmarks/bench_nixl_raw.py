"""Raw NIXL READ between two processes on this host: the baseline a remote claim is held to.

A serving process (tests/_nixl_peer.py) fills objects with random bytes in one region it
registers with its NIXL agent once; this process registers its own region, gets the peer's
metadata and extents over kvbroker's control channel (one pin per size), then times
``NixlEndpoint.read`` — descriptor list built, transfer request created, posted, polled to
completion, released: everything a remote claim's READ costs, nothing of the broker's. Bytes
are checked bit-exact (xxh3 against the peer's digest) after the timed reads.

    UCX_TLS=tcp .venv/bin/python benchmarks/bench_nixl_raw.py [--reps 20] [--json-out F]

Prints a table; ``--json-out`` also writes the samples, the environment and the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SIZES = {"256KiB": 256 << 10, "32MiB": 32 << 20, "1GiB": 1 << 30}


async def run(args) -> dict:
    import numpy as np
    import xxhash

    from kvbroker._server import transfer

    from kvbroker.testing import peer_certificates

    certs = tempfile.mkdtemp(prefix="kvb-certs-")
    files = peer_certificates(certs, {"bench": ["127.0.0.1"]})["bench"]
    sizes = {k: v for k, v in SIZES.items() if k in args.sizes}
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
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        while True:
            line = peer.stdout.readline()
            if not line:
                raise SystemExit(f"peer exited with {peer.wait()}")
            if line.startswith(b"{"):
                break
        port = json.loads(line)["port"]
        ep = transfer.NixlEndpoint(f"bench-b-{os.getpid()}")
        region = np.zeros(max(sizes.values()), dtype=np.uint8)
        region[:] = 1  # fault the pages in before timing
        ep.register([(region.ctypes.data, region.nbytes)])
        tls = transfer.tls_contexts(files["cert_file"], files["key_file"], files["ca_file"])[1]
        c = await transfer.PeerClient(f"127.0.0.1:{port}", tls=tls, node="bench").connect()
        agent = ep.add_peer(c.metadata)
        rows = {}
        for name, n in sizes.items():
            r = await c.pin(name, ttl=3600)
            remote = [tuple(e) for e in r["extents"]]
            local = [(region.ctypes.data, n)]
            reps = args.reps if n < (1 << 30) else max(3, args.reps // 4)
            for _ in range(2):  # warm-up: connection, rkeys
                ep.read(agent, remote, local)
            times = []
            for _ in range(reps):
                times.append(ep.read(agent, remote, local).seconds)
            exact = xxhash.xxh3_64_intdigest(region[:n]) == r["checksum"]
            await c.release(r["lease"])
            p50 = statistics.median(times)
            rows[name] = {
                "bytes": n,
                "reps": reps,
                "p50_s": p50,
                "min_s": min(times),
                "max_s": max(times),
                "GBps_p50": n / p50 / 1e9,
                "GBps_best": n / min(times) / 1e9,
                "bit_exact": exact,
                "samples_s": times,
            }
            print(
                f"{name:>7}  p50 {p50 * 1e3:9.3f} ms  best {min(times) * 1e3:9.3f} ms  "
                f"{n / p50 / 1e9:7.3f} GB/s p50  {n / min(times) / 1e9:7.3f} GB/s best  "
                f"bit-exact {exact}",
                flush=True,
            )
        await c.close()
        ep.close()
        return rows
    finally:
        peer.stdin.close()
        try:
            peer.wait(30)
        except subprocess.TimeoutExpired:
            peer.kill()
        shutil.rmtree(certs, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--json-out")
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")
    load0 = os.getloadavg()
    t0 = time.time()
    rows = asyncio.run(run(args))
    out = {
        "what": "raw NIXL READ between two processes (UCX), descriptor list -> done",
        "rows": rows,
        "env": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "machine": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t0)),
    }
    try:
        from importlib.metadata import version

        out["versions"] = {p: version(p) for p in ("nixl-cu12", "numpy", "msgpack")}
    except Exception:  # noqa: BLE001
        pass
    print(f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
