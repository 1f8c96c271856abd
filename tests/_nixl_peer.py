"""A serving peer for the transfer tests and the NIXL baseline benchmark (a separate process).

It fills a region with seeded random bytes, registers it with a NIXL agent, and serves pins
of "objects" — runs of that region — over kvbroker._server.transfer's control channel. It
prints one JSON line ``{"port": P, "agent": NAME}`` when ready and serves until killed or
until stdin closes.

    python tests/_nixl_peer.py --cert C --key K --ca CA --object a:33554432:1 --object b:1048576:4
    (name:bytes:pieces — pieces > 1 places the object in that many extents with gaps)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

from kvbroker._server import transfer  # noqa: E402
from kvbroker.errors import LeaseExpired, NotFound  # noqa: E402

GAP = 4096


class TableProvider:
    """Pins over a fixed table of objects; leases end on release, TTL or disconnect. When a
    lease's TTL passes, its object's bytes are overwritten, as a new owner of the pages would
    (``--reuse-on-expiry``)."""

    max_lease_ttl = 3600.0  # the TTL rule's bound (kvbroker._wire.rules.LEASE_TTL)

    def __init__(self, region: np.ndarray, objects: dict, reuse_on_expiry: bool) -> None:
        self.region = region
        self.objects = objects
        self.leases: dict[int, tuple[int, str, float]] = {}
        self.next = 1
        self.reuse = reuse_on_expiry
        self.lock = threading.Lock()

    def _expire(self) -> None:
        now = time.monotonic()
        for lid, (_peer, name, deadline) in list(self.leases.items()):
            if now > deadline:
                del self.leases[lid]
                if self.reuse:
                    for addr, n in self.objects[name]["extents"]:
                        off = addr - self.region.ctypes.data
                        self.region[off : off + n] ^= 0xFF

    def lookup(self, peer, namespace, key):
        return None

    def pin_prefix(self, peer, namespace, keys, ttl):
        raise NotFound("no prefixes here")

    def pin(self, peer, namespace, key, ttl, consume):
        with self.lock:
            self._expire()
            obj = self.objects.get(key)
            if obj is None:
                raise NotFound(f"{namespace}/{key}")
            lid = self.next
            self.next += 1
            self.leases[lid] = (peer, key, time.monotonic() + ttl)
            return {
                "lease": lid,
                "extents": obj["extents"],
                "checksum": obj["checksum"],
                "nbytes": obj["nbytes"],
                "meta": {"name": key},
            }

    def release(self, peer, lease, consumed):
        with self.lock:
            self._expire()
            if self.leases.pop(lease, None) is None:
                raise LeaseExpired(f"lease {lease} ended (TTL)")

    def renew(self, peer, lease, ttl):
        with self.lock:
            self._expire()
            if lease not in self.leases:
                raise LeaseExpired(f"lease {lease} ended (TTL)")
            p, k, _ = self.leases[lease]
            self.leases[lease] = (p, k, time.monotonic() + ttl)

    def drop_peer(self, peer):
        with self.lock:
            for lid, (p, _k, _d) in list(self.leases.items()):
                if p == peer:
                    del self.leases[lid]


def build(specs: list[str], seed: int):
    objs = []
    total = 0
    for spec in specs:
        name, nbytes, pieces = spec.split(":")
        objs.append((name, int(nbytes), int(pieces)))
        total += int(nbytes) + GAP * int(pieces)
    region = np.random.default_rng(seed).integers(0, 256, size=total, dtype=np.uint8)
    base = region.ctypes.data
    table, off = {}, 0
    for name, nbytes, pieces in objs:
        step = -(-nbytes // pieces)
        extents, h = [], xxhash.xxh3_64()
        left = nbytes
        while left:
            n = min(step, left)
            extents.append([base + off, n])
            h.update(region[off : off + n])
            off += n + (GAP if pieces > 1 else 0)
            left -= n
        table[name] = {"extents": extents, "checksum": h.intdigest(), "nbytes": nbytes}
    return region, table


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cert", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--ca", required=True)
    ap.add_argument("--object", action="append", default=[])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default=f"peer-a-{os.getpid()}")
    ap.add_argument(
        "--peer", action="append", default=["127.0.0.1"], help="a host whose certificate is served"
    )
    ap.add_argument("--reuse-on-expiry", action="store_true")
    args = ap.parse_args()
    region, table = build(args.object, args.seed)
    endpoint = transfer.NixlEndpoint(args.name)
    endpoint.register([(region.ctypes.data, region.nbytes)])
    provider = TableProvider(region, table, args.reuse_on_expiry)
    tls, _ = transfer.tls_contexts(args.cert, args.key, args.ca)
    server = transfer.PeerServer(
        provider,
        tls=tls,
        peers=args.peer,
        node="node-a",
        metadata=endpoint.metadata(),
        agent=endpoint.name,
    )
    host, port = await server.start(args.host, args.port)
    print(json.dumps({"port": port, "agent": endpoint.name}), flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    await stdin_closed
    await server.close()
    endpoint.close()


if __name__ == "__main__":
    asyncio.run(main())
