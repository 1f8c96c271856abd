"""Two daemons on this host pulling from each other through NIXL (issue 18, phase 2).

Each daemon has its own socket and its own control port on 127.0.0.1; bytes move with one NIXL
READ over UCX TCP. What is checked:

- a remote claim (``claim(..., peer=)``, ``get``) bit-exact, metadata travelling (meta,
  consumers, checksums), never pulled twice, concurrent claims sharing one pull, a consume
  counted on the owner, ``exists``/``lookup`` with a peer moving nothing, a prefix match
  pulling every missing block in one pull, ``fetch``;
- failures ending cleanly, with nothing sealed on B and no lease left on A: peer down, a
  certificate of another CA, a byte corrupted in A's pool (ChecksumMismatch naming the
  peer), A's lease expired before the release (TransferFailed), B's pool full (PoolFull),
  A SIGKILLed mid-READ (and B pulling again from A restarted warm, which holds no lease);
- the peer channel's hardening (issue 38): a client naming a peer B was not configured
  with (a local user's relay to A) refused before B dials; a NaN TTL refused on the peer
  path and the pin's lease expiring on time; pulls charged to the asking tenant's quota;
  what A serves limited by ``[transfer] serve`` (tenant pools only when named);
- KV events from a daemon: 10,000 prefix blocks published then evicted, decoded with vLLM's
  own ``KVEventBatch``, every BlockStored/BlockRemoved in order, the start filled by replay;
- the same pull across two network namespaces joined by a veth pair (root and ``ip``).
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvbroker import Client
from kvbroker.errors import (
    BadRequest,
    ChecksumMismatch,
    Forbidden,
    LeaseExpired,
    LimitExceeded,
    NotFound,
    PeerUnavailable,
    PoolFull,
    TransferFailed,
)
from kvbroker.prefix import PrefixCache
from kvbroker.testing import DaemonProcess, drop_leftover_pools

try:
    from kvbroker._server.transfer import load_nixl

    load_nixl()
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(
        f"NIXL not installed ({e}): pip install 'kvbroker[transfer]'", allow_module_level=True
    )


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    """The module's folder, with the fleet's throwaway certificates (:func:`_certs`): every
    node of these tests is 127.0.0.1, as its peers list it; ``intruder`` is another CA's."""
    from kvbroker.testing import peer_certificates

    d = tmp_path_factory.mktemp("fleet", numbered=True)
    peer_certificates(d / "certs", {"node": ["127.0.0.1"]})
    peer_certificates(d / "other-ca", {"intruder": ["127.0.0.1"]}, ca_name="another CA")
    return d


def _certs(base, folder: str = "certs", name: str = "node") -> dict[str, str]:
    d = base / folder
    return {
        "cert_file": str(d / f"{name}.pem"),
        "key_file": str(d / f"{name}.key"),
        "ca_file": str(d / "ca.pem"),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """A daemon of the fleet: its own socket, and a control port when it serves."""

    def __init__(
        self,
        base,
        name: str,
        *,
        listen: bool = True,
        certs=None,
        port: int = 0,
        peers=(),
        pool: str = "128M",
        extra_env: dict | None = None,
        args=(),
        tls: bool = True,
        config: str | None = None,
    ) -> None:
        self.dir = base / name
        self.dir.mkdir(exist_ok=True)
        self.name = name
        self.port = port or (_free_port() if listen else 0)
        env = {
            "UCX_TLS": "tcp",
            "KVBROKER_TRANSFER_NODE": name,
            "KVBROKER_TRANSFER_LISTEN": f"127.0.0.1:{self.port}" if listen else "off",
            **(extra_env or {}),
        }
        if tls:
            files = certs or _certs(base)
            env.update(
                {
                    "KVBROKER_TRANSFER_CERT_FILE": files["cert_file"],
                    "KVBROKER_TRANSFER_KEY_FILE": files["key_file"],
                    "KVBROKER_TRANSFER_CA_FILE": files["ca_file"],
                    "KVBROKER_TRANSFER_PEERS": ",".join(peers),
                }
            )
        if config is not None:  # what only a file sets ([quotas], [tenant_pools] ...)
            (self.dir / "kvbroker.toml").write_text(config)
            env["KVBROKER_CONFIG"] = str(self.dir / "kvbroker.toml")
        self.env = env
        self.args = ("--pool-size", pool, "--page-size", "4K", *args)
        self.proc = DaemonProcess(str(self.dir / "kvb.sock"), *self.args, env=env, ready_timeout=60)
        self.address = f"127.0.0.1:{self.port}"

    def client(self, **kw) -> Client:
        return self.proc.client(**kw)

    def stat(self):
        with self.client(map_pools=False) as c:
            return c.stat()

    def restart(self) -> None:
        self.proc.stop()
        self.proc = DaemonProcess(
            str(self.dir / "kvb.sock"), *self.args, env=self.env, ready_timeout=60
        )

    def stop(self) -> int:
        running = self.proc.proc.poll() is None
        rc = self.proc.stop()
        drop_leftover_pools(self.proc.socket_path)
        return rc if running else 0


DOWN = f"127.0.0.1:{_free_port()}"  # a configured peer nobody serves


@pytest.fixture(scope="module")
def pair(fleet_dir):
    pa, pb = _free_port(), _free_port()
    a = Node(fleet_dir, "node-a", port=pa, peers=[f"127.0.0.1:{pb}"])
    b = Node(fleet_dir, "node-b", port=pb, peers=[a.address, DOWN])
    yield a, b
    assert b.stop() == 0, b.proc.log()
    assert a.stop() == 0, a.proc.log()


def _data(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _nothing_left(a: Node, b: Node, key: str | None = None, ns: str = "default") -> None:
    """No lease held on A for peers, nothing half-written on B, no pull in flight."""
    sa, sb = a.stat(), b.stat()
    assert sa.transfer.leases_served == 0, sa.leases
    assert sb.pending == 0 and sb.write_leases == 0
    assert sb.transfer.in_flight == 0
    if key is not None:
        with b.client(map_pools=False) as c:
            assert not c.exists(key, namespace=ns)


# -- what works -------------------------------------------------------------------------------


def test_remote_claim_bit_exact_metadata_travels_and_never_twice(pair):
    a, b = pair
    x, y = _data(32 << 20, 1), _data(1000, 2)
    with a.client() as ca, b.client() as cb:
        ca.put("obj", {"x": x, "y": y}, meta={"layer": 7}, consumers=3)
        before = b.stat().transfer.pulls
        with cb.claim("obj", peer=a.address, verify=True) as lease:
            assert np.array_equal(lease["x"], x) and np.array_equal(lease["y"], y)
            assert lease.meta == {"layer": 7}
        info = cb.lookup("obj")
        assert info.meta == {"layer": 7}
        assert info.checksums == ca.lookup("obj").checksums  # sealed there, verified here
        got = cb.get("obj", peer=a.address, verify=True)  # here now: not pulled again
        assert np.array_equal(got["x"], x)
        assert cb.fetch("obj", a.address)["fetched"] is False
        st = b.stat().transfer
        assert st.pulls == before + 1 and st.bytes_pulled >= x.nbytes
        assert st.peers[0].node == "node-a" and st.peers[0].connected
        sa = a.stat().transfer
        assert sa.serving >= 1 and sa.bytes_served >= x.nbytes
        cb.evict("obj")
        ca.evict("obj")
    _nothing_left(a, b)


def test_a_pulls_phases_are_in_the_stat(pair):
    """Where a remote claim's time went (issue 43's profile): B's stat names the latest
    pull's phases, each a duration within the pull's own."""
    a, b = pair
    x = _data(3 << 20, 11)
    with a.client() as ca, b.client() as cb:
        ca.put("phased", {"x": x})
        with cb.claim("phased", peer=a.address) as lease:
            assert np.array_equal(lease["x"], x)
        tr = b.stat().transfer
        phases = tr.last_pull_phases
        assert set(phases) == {
            "connect",
            "pin",
            "reserve",
            "read",
            "verify",
            "handoff",
            "release",
            "seal",
        }
        assert phases["read"] == tr.last_read_seconds > 0
        assert all(v >= 0 for v in phases.values())
        assert sum(phases.values()) <= tr.last_pull_seconds
        cb.evict("phased")
        ca.evict("phased")
    _nothing_left(a, b)


def test_concurrent_claims_share_one_pull(pair):
    a, b = pair
    x = _data(8 << 20, 3)
    with a.client() as ca:
        ca.put("shared", {"x": x})
    before = b.stat().transfer.pulls
    results, errors = [], []

    def claim():
        try:
            with b.client() as c, c.claim("shared", peer=a.address) as lease:
                results.append(np.array_equal(lease["x"], x))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [True] * 4
    assert b.stat().transfer.pulls == before + 1
    with a.client() as ca, b.client() as cb:
        ca.evict("shared")
        cb.evict("shared")
    _nothing_left(a, b)


def test_consume_counts_on_the_owner(pair):
    a, b = pair
    x = _data(1 << 20, 4)
    with a.client() as ca, b.client() as cb:
        ca.put("once", {"x": x}, consumers=1)
        with cb.claim("once", peer=a.address, consume=True) as lease:
            assert np.array_equal(lease["x"], x)
        assert not ca.exists("once"), "the consume must count on the owner"
        assert not cb.exists("once"), "the local copy was consumed too"
        ca.put("twice", {"x": x}, consumers=2)
        cb.get("twice", peer=a.address, consume=True)
        assert ca.lookup("twice") is not None  # one of two consumes left
        ca.evict("twice")
    _nothing_left(a, b)


def test_exists_and_lookup_with_a_peer_move_nothing(pair):
    a, b = pair
    with a.client() as ca, b.client() as cb:
        ca.put("there", {"x": b"abc"}, meta={"m": 1})
        before = b.stat().transfer.pulls
        assert cb.exists("there", peer=a.address)
        assert cb.lookup("there", peer=a.address).meta == {"m": 1}
        assert not cb.exists("there")
        assert not cb.exists("nowhere", peer=a.address)
        assert b.stat().transfer.pulls == before
        with pytest.raises(NotFound, match="node|peer|not published"):
            cb.claim("nowhere", peer=a.address)
        ca.evict("there")
    _nothing_left(a, b)


def test_prefix_match_pulls_the_missing_blocks_in_one_pull(pair):
    a, b = pair
    bs = 16
    tokens = list(range(1000, 1000 + 12 * bs + 1))
    blocks = [{"k": _data(8192, 100 + i), "v": _data(8192, 200 + i)} for i in range(12)]
    with a.client() as ca, b.client() as cb:
        pa, pb = PrefixCache(ca, block_size=bs), PrefixCache(cb, block_size=bs)
        assert pa.publish(tokens, blocks) == 12
        assert pb.publish(tokens[: 3 * bs], blocks[:3]) == 3  # B holds the first 3 itself
        before = b.stat().transfer
        with pb.match(tokens, peer=a.address) as m:
            assert m.num_blocks == 12
            for i, blk in enumerate(m.blocks):
                assert np.array_equal(blk["k"], blocks[i]["k"])
                assert np.array_equal(blk["v"], blocks[i]["v"])
        after = b.stat().transfer
        assert after.pulls == before.pulls + 1  # 9 blocks, one pin, one READ
        assert after.bytes_pulled - before.bytes_pulled == 9 * 2 * 8192
        with pb.match(tokens, peer=a.address) as m:  # all here now: nothing moves
            assert m.num_blocks == 12
        assert b.stat().transfer.pulls == after.pulls
        ca.evict(namespace="prefix", all=True)
        cb.evict(namespace="prefix", all=True)
    _nothing_left(a, b)


def test_a_pulled_chain_past_the_watermark_keeps_its_root(pair, fleet_dir):
    """A pulled prefix chain that takes B past its high watermark is sealed whole, then
    evicted from its leaf: before, each block was sealed (and the watermark enforced) one at a
    time, so the chain's root, a leaf until its child was sealed, was evicted by its own
    pull and B matched nothing of what it had just pulled."""
    a, _ = pair
    b = Node(
        fleet_dir,
        "watermark",
        listen=False,
        peers=[a.address],
        pool="256K",
        extra_env={"KVBROKER_HIGH_WATERMARK": "0.8", "KVBROKER_LOW_WATERMARK": "0.5"},
    )
    bs, n = 4, 56  # 56 one-page blocks of 64 pages: past 0.8, down to 32 pages
    tokens = list(range(5000, 5000 + n * bs + 1))
    blocks = [{"x": _data(4096, 400 + i)} for i in range(n)]
    try:
        with a.client() as ca, b.client() as cb:
            pa, pb = PrefixCache(ca, block_size=bs), PrefixCache(cb, block_size=bs)
            assert pa.publish(tokens, blocks) == n
            with pb.match(tokens, peer=a.address) as m:
                pulled = m.num_blocks
            assert b.stat().transfer.pulls == 1
            with pb.match(tokens) as m:  # what B kept is the chain's first blocks
                kept = m.num_blocks
                assert 0 < kept < n and kept == pulled
                for i, blk in enumerate(m.blocks):
                    assert np.array_equal(blk["x"], blocks[i]["x"])
            assert not cb.exists(pb.hashes(tokens)[-1], namespace="prefix")
            ca.evict(namespace="prefix", all=True)
    finally:
        assert b.stop() == 0, b.proc.log()


def test_fetch_command_stat_and_prometheus(pair):
    from typer.testing import CliRunner

    from kvbroker._server.metrics import BrokerCollector
    from kvbroker.cli import app

    a, b = pair
    with a.client() as ca:
        ca.put("cli", {"x": _data(1 << 20, 9)})
    sock = b.proc.socket_path
    r = CliRunner().invoke(app, ["fetch", "cli", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 0 and "pulled default/cli (1.0 MiB) from" in r.output, r.output
    r = CliRunner().invoke(app, ["fetch", "cli", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 0 and "here already" in r.output, r.output
    r = CliRunner().invoke(app, ["fetch", "nope", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 1 and "not_found" in r.output
    r = CliRunner().invoke(app, ["stat", "--socket", sock])
    assert f"peer {a.address} (node-a): connected" in r.output, r.output
    metrics = {m.name: m for m in BrokerCollector(b.stat).collect()}
    assert metrics["kvbroker_pulled_bytes"].samples[0].value >= 1 << 20
    assert {s.labels["code"] for s in metrics["kvbroker_pull_failures"].samples} >= {"not_found"}
    assert metrics["kvbroker_peer_up"].samples[0].labels["node"] == "node-a"
    served = {m.name: m for m in BrokerCollector(a.stat).collect()}
    assert served["kvbroker_served_bytes"].samples[0].value >= 1 << 20
    assert served["kvbroker_peer_leases"].samples[0].value == 0
    with a.client() as ca, b.client() as cb:
        ca.evict("cli")
        cb.evict("cli")
    _nothing_left(a, b)


# -- failures end cleanly ----------------------------------------------------------------------


def test_peer_down_is_peer_unavailable(pair):
    a, b = pair
    with b.client() as cb:
        with pytest.raises(PeerUnavailable, match=f"{DOWN}.*unavailable"):
            cb.claim("k", peer=DOWN)
    assert b.stat().transfer.failures_by_code.get("peer_unavailable", 0) >= 1
    _nothing_left(a, b)


class _Relay:
    """A local user's TCP relay to A: what issue 38 found B dialling for anyone who
    named it, and splicing B's authenticated session to A with its own frames."""

    def __init__(self, target: str) -> None:
        self.target = target.split(":")
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            up = socket.create_connection((self.target[0], int(self.target[1])))
            for src, dst in ((conn, up), (up, conn)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


def test_a_client_naming_an_unconfigured_peer_is_refused(pair):
    """B dials only its [transfer] peers: a relay on a local port, a typo, a malformed
    address are refused before any connection, and nothing reaches A."""
    a, b = pair
    relay = _Relay(a.address)
    try:
        with a.client() as ca, b.client() as cb:
            ca.put("loot", {"x": _data(300_000, 11)})
            served = a.stat().transfer.pins_served
            for how in (
                lambda: cb.claim("loot", peer=relay.address),
                lambda: cb.fetch("loot", relay.address),
                lambda: cb.exists("loot", peer=relay.address),
                lambda: PrefixCache(cb, block_size=4).match(list(range(9)), peer=relay.address),
            ):
                with pytest.raises(
                    Forbidden,
                    match=r"not one of this daemon's \[transfer\] "
                    "peers",
                ):
                    how()
            with pytest.raises(BadRequest, match="expected HOST:PORT"):
                cb.claim("loot", peer="no-port-here")
            assert relay.connections == 0, "B dialled an address nobody configured"
            assert not cb.exists("loot")
            assert a.stat().transfer.pins_served == served
            ca.evict("loot")
    finally:
        relay.close()
    _nothing_left(a, b)


def test_renew_with_a_nan_ttl_is_refused_on_the_peer_path(pair, fleet_dir):
    """The peer ops take the local ops' checks: a NaN (or negative, or too long) TTL is
    refused, and the pin's lease still expires on time (a NaN at the root of the expiry
    heap would have kept every lease of A from ever expiring)."""
    import asyncio

    from kvbroker._server import transfer

    a, b = pair
    with a.client() as ca:
        ca.put("pinned", {"x": b"0123456789"})

    async def go():
        files = _certs(fleet_dir)
        tls = transfer.tls_contexts(files["cert_file"], files["key_file"], files["ca_file"])
        c = await transfer.PeerClient(a.address, tls=tls[1], node="tester").connect()
        r = await c.pin("pinned", ttl=0.5)
        for ttl in (float("nan"), float("inf"), -1.0, 0, 10.0**9):
            with pytest.raises(BadRequest, match="ttl must be in"):
                await c.renew(r["lease"], ttl=ttl)
        with pytest.raises(BadRequest, match="ttl must be in"):
            await c.pin("pinned", ttl=float("nan"))
        with pytest.raises(BadRequest, match="key longer than"):
            await c.pin("k" * 600, ttl=1)
        deadline = time.monotonic() + 30
        while a.stat().transfer.leases_served and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert a.stat().transfer.leases_served == 0, "the pin's lease never expired"
        with pytest.raises(LeaseExpired):
            await c.release(r["lease"])
        await c.close()

    asyncio.run(go())
    assert a.stat().counters.expired_leases >= 1
    with a.client() as ca:
        ca.evict("pinned")
    _nothing_left(a, b)


def test_corrupt_byte_in_owner_pool_is_checksum_mismatch(pair):
    import mmap

    import posix_ipc

    a, b = pair
    x = _data(4 << 20, 5)
    with a.client() as ca, b.client() as cb:
        ca.put("bad", {"x": x})
        with ca.claim("bad") as lease:
            pool, offset, _ = lease._extents["x"]
        name = ca.pools[pool]["name"]
        shm = posix_ipc.SharedMemory(name)
        mm = mmap.mmap(shm.fd, ca.pools[pool]["size"])
        shm.close_fd()
        try:
            mm[offset + 12345] ^= 0x01  # one bit of A's pool, under its seal
            with pytest.raises(ChecksumMismatch, match=f"peer {a.address}"):
                cb.claim("bad", peer=a.address)
            assert not cb.exists("bad")
            mm[offset + 12345] ^= 0x01  # repaired: the next pull succeeds
            with cb.claim("bad", peer=a.address, verify=True) as lease:
                assert np.array_equal(lease["x"], x)
        finally:
            mm.close()
        cb.evict("bad")
        ca.evict("bad")
    _nothing_left(a, b)


def test_certificate_of_another_ca_is_refused(pair, fleet_dir):
    a, _ = pair
    refused = a.stat().transfer.refused
    # It trusts the fleet's CA, so it is A that refuses (its own certificate is another's).
    creds = {**_certs(fleet_dir, "other-ca", "intruder"), "ca_file": _certs(fleet_dir)["ca_file"]}
    intruder = Node(fleet_dir, "intruder", listen=False, certs=creds, peers=[a.address])
    try:
        with a.client() as ca, intruder.client() as ci:
            ca.put("secret", {"x": b"0123456789"})
            with pytest.raises(PeerUnavailable, match="refused the TLS session"):
                ci.claim("secret", peer=a.address)
            assert not ci.exists("secret")
            ca.evict("secret")
        deadline = time.monotonic() + 20
        while a.stat().transfer.refused == refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.stat().transfer.refused == refused + 1
        assert a.stat().transfer.leases_served == 0
    finally:
        assert intruder.stop() == 0


def test_pool_full_on_the_puller(pair, fleet_dir):
    a, _ = pair
    small = Node(fleet_dir, "small", listen=False, pool="8M", peers=[a.address])
    try:
        with a.client() as ca, small.client() as cs:
            ca.put("big", {"x": _data(16 << 20, 6)})
            with pytest.raises(PoolFull):
                cs.claim("big", peer=a.address)
            assert not cs.exists("big")
            ca.evict("big")
        _nothing_left(a, small)
        assert small.stat().pools[0].used == 0
    finally:
        assert small.stop() == 0


def test_owner_lease_expired_before_release(pair, fleet_dir):
    """The pin's TTL (1 ms) passes during the READ: the owner says so at the release, and
    the puller seals nothing."""
    a, _ = pair
    hasty = Node(
        fleet_dir,
        "hasty",
        listen=False,
        peers=[a.address],
        extra_env={"KVBROKER_TRANSFER_PIN_TTL": "1ms"},
    )
    try:
        with a.client() as ca, hasty.client() as ch:
            ca.put("slow", {"x": _data(16 << 20, 7)})
            with pytest.raises(TransferFailed, match="lease ended"):
                ch.claim("slow", peer=a.address)
            assert not ch.exists("slow")
            assert ca.exists("slow")  # not consumed by a failed pull
            ca.evict("slow")
        _nothing_left(a, hasty)
        assert a.stat().counters.expired_leases >= 1
    finally:
        assert hasty.stop() == 0


def test_owner_killed_mid_read_then_restarted_warm(fleet_dir):
    pa = _free_port()
    b = Node(fleet_dir, "survivor", listen=False, pool="768M", peers=[f"127.0.0.1:{pa}"])
    a = Node(
        fleet_dir,
        "victim",
        pool="768M",
        args=("--keep-pools-on-exit",),
        port=pa,
        peers=["127.0.0.1:1"],
    )  # B's certificate names 127.0.0.1: served
    try:
        x = _data(512 << 20, 8)
        with a.client() as ca:
            ca.put("huge", {"x": x})
        del x
        outcome = []

        def pull():
            try:
                with b.client() as cb, cb.claim("huge", peer=a.address):
                    outcome.append("sealed")
            except Exception as exc:  # noqa: BLE001
                outcome.append(exc)

        # A runs only in short slices until B holds the write lease its pin answer made, and
        # is stopped from then on: B cannot seal before A answers its release, so the kill
        # always lands mid-pull (the READ needs A's side progressing too), never after.
        victim = a.proc.proc
        victim.send_signal(signal.SIGSTOP)
        t = threading.Thread(target=pull)
        t.start()
        deadline = time.monotonic() + 120
        while b.stat().write_leases == 0:
            assert t.is_alive() and time.monotonic() < deadline, (outcome, b.proc.log())
            victim.send_signal(signal.SIGCONT)
            time.sleep(0.005)
            victim.send_signal(signal.SIGSTOP)
        assert b.stat().transfer.in_flight == 1
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        t.join(180)
        assert not t.is_alive(), "the pull hung after its peer died"
        assert len(outcome) == 1 and isinstance(outcome[0], (PeerUnavailable, TransferFailed)), (
            outcome
        )
        with b.client(map_pools=False) as cb:
            assert not cb.exists("huge")
        sb = b.stat()
        assert sb.pending == 0 and sb.write_leases == 0 and sb.transfer.in_flight == 0
        a.restart()  # warm: the journal and pools of the killed daemon
        sa = a.stat()
        assert sa.objects == 1 and sa.read_leases == 0 and sa.transfer.leases_served == 0
        with b.client() as cb:
            cb.evict("huge")
            with cb.claim("huge", peer=a.address, verify=True) as lease:
                assert lease["x"][:4096].tobytes() == _data(4096, 8).tobytes()
        assert a.stat().read_leases == 0
    finally:
        assert b.stop() == 0
        a.stop()


# -- KV events ---------------------------------------------------------------------------------


@pytest.mark.vllm
def test_daemon_events_10k_blocks_in_order_with_vllm_classes(fleet_dir):
    zmq = pytest.importorskip("zmq")
    try:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM not importable ({type(e).__name__}: {e})")
    import msgspec

    from kvbroker._server.events import external_hash

    pub, rep = _free_port(), _free_port()
    node = Node(
        fleet_dir,
        "events",
        listen=False,
        tls=False,
        pool="96M",
        extra_env={
            "KVBROKER_EVENTS_PUBLISH": f"tcp://*:{pub}",  # binds (a host connects)
            "KVBROKER_EVENTS_REPLAY": f"tcp://127.0.0.1:{rep}",
            "KVBROKER_EVENTS_FORMAT": "tagged",
            "KVBROKER_EVENTS_MODEL": "llama",
        },
    )
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@events@llama")
    time.sleep(0.5)
    n, bs = 10_000, 4
    tokens = list(range(7, 7 + n * bs))
    try:
        with node.client() as c:
            pc = PrefixCache(c, block_size=bs, checksum=False)
            size = {"kv": 64}
            zero = {"kv": b"\0" * 64}
            assert pc.publish(tokens[: 5000 * bs], lambda i: zero, block_sizes=size) == 5000
            assert pc.publish(tokens, lambda i: zero, block_sizes=size) == 5000  # 2 requests
            keys = pc.keys(pc.hashes(tokens))
            assert c.evict(namespace="prefix", all=True).count == n
            c.evict(all=True)  # AllBlocksCleared

        batches: dict[int, bytes] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not sub.poll(1000):
                if batches and _complete(batches):
                    break
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@events@llama"
            batches[int.from_bytes(seq, "big")] = payload
        # What PUB sent before the subscription arrived (on a loaded machine, possibly all
        # of it): replay fills it.
        if min(batches, default=1) > 0:
            d = ctx.socket(zmq.DEALER)
            d.connect(f"tcp://127.0.0.1:{rep}")
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert d.poll(10_000), "no replay reply"
                frames = d.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                batches.setdefault(int.from_bytes(frames[2], "big"), frames[3])
            d.close(linger=0)
        seqs = sorted(batches)
        assert seqs == list(range(len(seqs))), "a gap in sequence numbers"
        events = []
        for s in seqs:
            batch = msgspec.msgpack.decode(batches[s], type=KVEventBatch)
            events += batch.events
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert isinstance(events[0], AllBlocksCleared) and isinstance(events[-1], AllBlocksCleared)
        hashes = [external_hash(k) for k in keys]
        assert [e.block_hashes[0] for e in stored] == hashes
        assert [e.parent_block_hash for e in stored] == [None, *hashes[:-1]]
        assert all(
            e.token_ids == tokens[i * bs : (i + 1) * bs]
            and e.block_size == bs
            and e.medium == "CPU"
            for i, e in enumerate(stored)
        )
        assert removed == hashes[::-1]  # evicted leaf first, every one of them
        st = node.stat().events
        assert st.events_dropped == 0 and st.events_published == 2 * n + 2
    finally:
        sub.close(linger=0)
        assert node.stop() == 0


def _complete(batches) -> bool:
    import msgpack

    last = batches[max(batches)]
    evs = msgpack.unpackb(last)[1]
    return bool(evs) and evs[-1].get("type") == "AllBlocksCleared" and len(batches) > 2


# -- across a network stack: two namespaces, one veth pair -------------------------------------


def _netns_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) on this host")
    probe = subprocess.run(["ip", "netns", "add", "kvbprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"ip netns does not work here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", "kvbprobe"], capture_output=True)


def test_pull_across_two_network_namespaces(fleet_dir):
    """A in netns kvba (10.77.0.1), B in kvbb (10.77.0.2), one veth pair between them: the
    control channel and UCX's TCP both cross that link (A serves only B's address)."""
    _netns_or_skip()
    ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    tag = str(os.getpid() % 10000)
    na, nb = f"kvba{tag}", f"kvbb{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    procs = []
    try:
        ip("netns", "add", na)
        ip("netns", "add", nb)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", na)
        ip("link", "set", vb, "netns", nb)
        ip("-n", na, "addr", "add", "10.77.0.1/24", "dev", va)
        ip("-n", nb, "addr", "add", "10.77.0.2/24", "dev", vb)
        for ns, dev in ((na, va), (nb, vb)):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        from kvbroker.testing import peer_certificates

        certs = fleet_dir / "netns-certs"
        peer_certificates(certs, {"serve": ["10.77.0.1"], "pull": ["10.77.0.2"]})
        script = os.path.join(os.path.dirname(__file__), "_netns_node.py")
        env = dict(
            os.environ,
            UCX_TLS="tcp",
            PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        a = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                na,
                sys.executable,
                script,
                "serve",
                str(fleet_dir / "nsa"),
                str(certs),
                "10.77.0.1",
                "10.77.0.2",
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        procs.append(a)
        assert a.stdout.readline().strip() == "ready", "the serving node did not start"
        b = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                nb,
                sys.executable,
                script,
                "pull",
                str(fleet_dir / "nsb"),
                str(certs),
                "10.77.0.2",
                "10.77.0.1:7070",
            ],
            capture_output=True,
            env=env,
            text=True,
            timeout=300,
        )
        assert b.returncode == 0, b.stdout + b.stderr
        assert "bit-exact" in b.stdout
        # the link saw the bytes: the veth pair's counters on A's side
        rx = subprocess.run(
            ["ip", "-n", na, "-s", "link", "show", va], capture_output=True, text=True
        ).stdout
        tx_bytes = int(rx.split("TX:")[1].split("\n")[1].split()[0])
        assert tx_bytes >= 16 << 20, rx
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin = None
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for ns in (na, nb):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# -- tenants across nodes ----------------------------------------------------------------------

TENANT = 50001  # a uid with no passwd entry


def _as_user(uid: int, gid: int, fn):
    """``fn()`` in a forked child that dropped to uid/gid; what it returned (JSON), or
    RuntimeError with the child's exception."""
    import json

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "error" in out:
        raise RuntimeError(out["error"])
    return out["ok"]


@pytest.fixture
def open_dir():
    """A folder other uids may traverse (pytest's are 0700): their sockets live there."""
    import pathlib
    import tempfile

    d = tempfile.mkdtemp(prefix="kvb-fleet-", dir="/tmp")
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another uid")
def test_pulls_are_charged_to_the_asking_tenant(pair, fleet_dir, open_dir):
    """issue 38: with "user:X" = "4M", a tenant held 28 MiB through 24 pulls (charged to
    the daemon's uid). A pull is charged as the tenant's own put is: its 24 pulls of 1 MiB
    and a local 1 MiB put never hold more than its 4 MiB on B (its own least recently
    used objects make room, as they do for puts)."""
    a, _ = pair
    b = Node(
        open_dir,
        "quota",
        listen=False,
        certs=_certs(fleet_dir),
        peers=[a.address],
        config=f'group = 0\n[quotas]\n"user:{TENANT}" = "4M"\n',
    )
    try:
        keys = [f"q{i}" for i in range(24)]
        with a.client() as ca:
            for i, k in enumerate(keys):
                ca.put(k, {"x": _data(1 << 20, 300 + i)})

        def tenant():
            from kvbroker.errors import QuotaExceeded

            refused, held = 0, []
            with Client(b.proc.socket_path) as c:
                c.put("mine", {"x": np.zeros(1 << 20, np.uint8)}, namespace="t")
                for k in keys:
                    try:
                        c.fetch(k, a.address)
                    except QuotaExceeded:
                        refused += 1
                    held.append(sum(n.used for n in c.stat().namespaces))
            return {"refused": refused, "most": max(held)}

        got = _as_user(TENANT, 0, tenant)
        st = b.stat()
        used = sum(n.used for n in st.namespaces)
        assert got["most"] <= 4 << 20 and used <= 4 << 20, (got, st.namespaces)
        with b.client() as cb:  # and the pulls happened: the latest are here, whole
            assert cb.exists(keys[-1])
            assert np.array_equal(cb.get(keys[-1])["x"], _data(1 << 20, 323))
        with a.client() as ca:
            for k in keys:
                ca.evict(k)
        _nothing_left(a, b)
    finally:
        assert b.stop() == 0, b.proc.log()


@pytest.mark.skipif(os.getuid() != 0, reason="a tenant pool is chowned to its tenant")
def test_what_a_peer_may_pin_is_configured(fleet_dir):
    """[transfer] serve: namespaces outside it are Forbidden to peers; a tenant's own pool
    is never covered by a bare "*" (issue 38: B read a victim's object out of a tenant
    pool only the victim may map), only by a glob that names it."""
    pools = (
        f'[tenant_pools.alice]\nsize = "4M"\nuser = {TENANT}\nnamespaces = ["alice", "alice/*"]\n'
    )
    pa, pa2 = _free_port(), _free_port()
    b = Node(fleet_dir, "asker", listen=False, peers=[f"127.0.0.1:{pa}", f"127.0.0.1:{pa2}"])
    a = Node(fleet_dir, "owner-star", port=pa, peers=["127.0.0.1:1"], config=pools)
    a2 = Node(
        fleet_dir,
        "owner-listed",
        port=pa2,
        peers=["127.0.0.1:1"],
        config=pools,
        extra_env={"KVBROKER_TRANSFER_SERVE": "prefix,127.0.0.1=alice/*"},
    )
    try:
        for owner, tag in ((a, ""), (a2, "2")):
            with owner.client() as c:
                c.put("secret" + tag, {"x": b"victim's bytes"}, namespace="alice/kv")
                c.put("open" + tag, {"x": b"anyone's"}, namespace="prefix")
                c.put("other" + tag, {"x": b"not listed"}, namespace="team")
        with b.client() as cb:
            with pytest.raises(Forbidden, match="'alice/kv' is not served.*tenant pool"):
                cb.claim("secret", namespace="alice/kv", peer=a.address)
            assert cb.get("open", namespace="prefix", peer=a.address)["x"].tobytes() == b"anyone's"
            assert cb.get("other", namespace="team", peer=a.address)["x"].tobytes() == b"not listed"
            with pytest.raises(Forbidden, match="'team' is not served"):
                cb.get("other2", namespace="team", peer=a2.address)
            with pytest.raises(Forbidden, match="'team' is not served"):
                cb.lookup("other2", namespace="team", peer=a2.address)
            assert (
                cb.get("open2", namespace="prefix", peer=a2.address)["x"].tobytes() == b"anyone's"
            )
            got = cb.get("secret2", namespace="alice/kv", peer=a2.address)
            assert got["x"].tobytes() == b"victim's bytes"  # named for this peer: served
            assert not cb.exists("secret", namespace="alice/kv")
            assert not cb.exists("other2", namespace="team")
        assert a.stat().transfer.leases_served == 0 == a2.stat().transfer.leases_served
    finally:
        for n in (b, a, a2):
            assert n.stop() == 0, n.proc.log()


def test_a_tenant_pool_is_served_only_by_a_glob_naming_it(tmp_path):
    """Only a glob whose first path component is literal serves a tenant pool's namespace:
    a glob written for every namespace (``**``, ``?*``, ``[a-z]*`` as much as ``*``) served
    tenant pools by accident, when only a bare ``*`` was refused."""
    import secrets

    from kvbroker._server.broker import Broker
    from kvbroker._server.fleet_serving import BrokerProvider
    from kvbroker._server.policy import TenantPool
    from kvbroker._server.pool import HostPool

    tenant = TenantPool("alice", 8 << 12, os.getuid(), None, ("alice", "alice/*"))
    name = f"/kvbf.{os.getpid()}.{secrets.token_hex(3)}"
    pools = [
        HostPool(0, name + ".0", 8 << 12, 4096),
        HostPool(1, name + ".1", 8 << 12, 4096, tenant=tenant),
    ]
    try:
        b = Broker(pools)

        def served(glob: str, namespace: str) -> bool:
            provider = BrokerProvider(b, [0, 0], [(None, glob)])
            try:
                provider._authorize(1, namespace)
            except Forbidden as exc:
                assert "tenant pool" in str(exc) or namespace == "team", exc
                return False
            return True

        for glob in ("*", "**", "?*", "[a-z]*", "*/*", "al*", "al*/*"):
            assert not served(glob, "alice/kv"), glob
            assert not served(glob, "alice"), glob
            assert served(glob, "team") == fnmatch.fnmatchcase("team", glob), glob
        assert served("alice/*", "alice/kv") and not served("alice/*", "alice")
        assert served("alice", "alice") and not served("alice", "alice/kv")
        assert served("alice/k?", "alice/kv")
        assert not served("alice/*", "team")
    finally:
        for p in pools:
            p.unlink()


def test_one_peers_pins_leave_the_daemons_lease_budget_to_others(pair, fleet_dir):
    """A peer's pins are leases of sessions with the daemon's uid, as are the daemon's own
    pulls (its fleet session) and its administrators' connections. One peer holding pins on
    several connections is held to one client's budget (max_leases_per_client) in all, so
    it cannot fill max_leases_per_uid: before, two connections of one peer pinning 4 each
    left this daemon (8 leases per uid) unable to pull anything for anyone (LimitExceeded)."""
    import asyncio

    from kvbroker._server import transfer

    a, _ = pair
    b = Node(
        fleet_dir,
        "budget",
        peers=[a.address],
        extra_env={"KVBROKER_MAX_LEASES_PER_CLIENT": "4", "KVBROKER_MAX_LEASES_PER_UID": "8"},
    )
    try:
        with a.client() as ca, b.client() as cb:
            ca.put("wanted", {"x": _data(65536, 41)})
            cb.put("here", {"x": _data(4096, 42)})
            files = _certs(fleet_dir)
            tls = transfer.tls_contexts(files["cert_file"], files["key_file"], files["ca_file"])[1]

            async def hog() -> tuple[int, list, object]:
                conns = [
                    await transfer.PeerClient(b.address, tls=tls, node="hog").connect()
                    for _ in range(2)
                ]
                held, refused = 0, []
                for c in conns:
                    for _ in range(4):
                        try:
                            await c.pin("here", ttl=60.0)
                            held += 1
                        except LimitExceeded as exc:
                            refused.append(exc)

                def pull():
                    try:
                        return cb.fetch("wanted", a.address)["fetched"]
                    except LimitExceeded as exc:
                        return exc

                pulled = await asyncio.get_running_loop().run_in_executor(None, pull)
                for c in conns:
                    await c.close()
                return held, refused, pulled

            held, refused, pulled = asyncio.run(asyncio.wait_for(hog(), 120))
            assert pulled is True, pulled  # before: LimitExceeded (uid 8 leases)
            assert held == 4 and len(refused) == 4, (held, refused)
            assert np.array_equal(cb.get("wanted")["x"], _data(65536, 41))
            ca.evict("wanted")
    finally:
        assert b.stop() == 0, b.proc.log()


# -- a forged owner: the puller checks what it seals --------------------------------------------


class _ForgingOwner:
    """An owner that holds the fleet's certificate (a compromised node, or the relay of
    issue 38 before TLS) and answers pins as ``mode`` says. It serves one real object,
    ``asked`` (two buffers in a NIXL-registered region of this process, with checksums),
    honestly in mode "honest"; every other mode forges the reply. It counts pins and the
    leases it holds: a puller that refuses a reply must release its lease."""

    max_lease_ttl = 3600.0  # the TTL rule's bound (kvbroker._wire.rules.LEASE_TTL)

    def __init__(self, certs: dict) -> None:
        import asyncio

        from kvbroker._server import transfer
        from kvbroker._wire import checksum

        os.environ.setdefault("UCX_TLS", "tcp")
        self.region = _data(8 << 20, 21)
        self.endpoint = transfer.NixlEndpoint(f"forger-{os.getpid()}")
        self.endpoint.register([(self.region.ctypes.data, self.region.nbytes)])
        self.base = self.region.ctypes.data
        self.x, self.y = self.region[4096 : 4096 + 300_000], self.region[307200 : 307200 + 1000]
        self.sums = {
            "x": checksum.encode(checksum.digest(self.x)),
            "y": checksum.encode(checksum.digest(self.y)),
        }
        self.mode = "honest"
        self.looked_up: object = None  # what lookup answers
        self.pins = 0
        self.leases: set[int] = set()
        self._next = 1
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        tls = transfer.tls_contexts(certs["cert_file"], certs["key_file"], certs["ca_file"])[0]
        self.server = transfer.PeerServer(
            self,
            tls=tls,
            peers=["127.0.0.1"],
            node="forger",
            metadata=self.endpoint.metadata(),
            agent=self.endpoint.name,
        )
        _, port = asyncio.run_coroutine_threadsafe(
            self.server.start("127.0.0.1", 0), self.loop
        ).result(30)
        self.address = f"127.0.0.1:{port}"

    def honest(self, key: str = "asked") -> dict:
        return {
            "namespace": "default",
            "key": key,
            "nbytes": 301_000,
            "buffers": {"x": [0, 300_000], "y": [303104, 1000]},
            "extents": [[self.base + 4096, 300_000], [self.base + 307200, 1000]],
            "meta": {"layer": 1},
            "checksums": dict(self.sums),
            "consumers": 1,
            "parent": None,
            "tokens": [1, 2, 3, 4],
        }

    def forged(self) -> list[dict]:
        d, m = self.honest(), self.mode
        if m == "planted":
            d["key"] = "planted"
        elif m == "fifty":
            return [d] + [self.honest(f"extra{i}") for i in range(49)]
        elif m == "raw extents":
            d["buffers"] = {"x": [0, 4 << 20]}
            d["extents"], d["checksums"], d["nbytes"] = [[self.base, 4 << 20]], None, 4 << 20
        elif m == "scattered extents":
            d["extents"][1][0] += 65536  # y read from elsewhere than the object
        elif m == "empty checksums":
            d["checksums"] = {}
        elif m == "no checksums":
            d["checksums"] = None
        elif m == "malformed checksum":
            d["checksums"]["y"] = "zz"
        elif m == "parent not a key":
            d["parent"] = [1, 2]
        elif m == "over-long parent":
            d["parent"] = "p" * 600
        elif m == "string tokens":
            d["tokens"] = ["a", "b"]
        elif m == "float tokens":
            d["tokens"] = [1.5]
        elif m == "no consumers":
            d["consumers"] = 0
        elif m == "another namespace":
            d["namespace"] = "victim"
        elif m == "meta not a map":
            d["meta"] = "x"
        elif m == "bad buffer name":
            d["buffers"] = {"": [0, 300_000], "y": [303104, 1000]}
        return [d]

    # the Provider protocol
    def pin(self, peer, namespace, key, ttl, consume):
        self.pins += 1
        lid, self._next = self._next, self._next + 1
        self.leases.add(lid)
        return {"lease": lid, "ttl": ttl, "objects": self.forged()}

    def pin_prefix(self, peer, namespace, keys, ttl):
        return self.pin(peer, namespace, keys[0], ttl, False)

    def lookup(self, peer, namespace, key):
        return self.looked_up

    def release(self, peer, lease, consumed):
        self.leases.remove(lease)

    def renew(self, peer, lease, ttl):
        pass

    def drop_peer(self, peer):
        self.leases.clear()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.endpoint.close()


@pytest.fixture(scope="module")
def forged(fleet_dir):
    owner = _ForgingOwner(_certs(fleet_dir))
    strict = Node(
        fleet_dir,
        "strict",
        listen=False,
        peers=[owner.address],
        extra_env={"KVBROKER_REQUIRE_CHECKSUMS": "true"},
    )
    yield owner, strict
    assert strict.stop() == 0, strict.proc.log()
    owner.close()


FORGERIES = [
    "planted",
    "fifty",
    "raw extents",
    "scattered extents",
    "empty checksums",
    "no checksums",
    "malformed checksum",
    "parent not a key",
    "over-long parent",
    "string tokens",
    "float tokens",
    "no consumers",
    "another namespace",
    "meta not a map",
    "bad buffer name",
]


def test_an_honest_reply_of_the_same_owner_is_pulled(forged):
    """The control: the forger's honest answer is pulled bit-exact (so what the other
    tests see refused is refused for what was forged)."""
    owner, b = forged
    owner.mode = "honest"
    with b.client() as cb:
        with cb.claim("asked", peer=owner.address, verify=True) as lease:
            assert np.array_equal(lease["x"], owner.x) and np.array_equal(lease["y"], owner.y)
            assert lease.meta == {"layer": 1}
        assert cb.lookup("asked").checksums == owner.sums
        cb.evict("asked")
    assert owner.leases == set()


@pytest.mark.parametrize("mode", FORGERIES)
def test_a_forged_pin_reply_is_refused_with_nothing_sealed(forged, mode):
    owner, b = forged
    owner.mode = mode
    pins = owner.pins
    with b.client() as cb:
        before = cb.stat()
        with pytest.raises(TransferFailed, match="nothing was sealed"):
            cb.claim("asked", peer=owner.address)
        assert owner.pins == pins + 1
        assert not cb.exists("asked") and not cb.exists("planted")
        after = cb.stat()
        assert after.objects == before.objects == 0, cb.list()
        assert after.pending == 0 and after.write_leases == 0
        assert after.pools[0].used == 0
    assert owner.leases == set(), "the owner's lease was left held"


def _info(**kw) -> dict:
    info = {
        "namespace": "default",
        "key": "asked",
        "nbytes": 301_000,
        "buffers": 2,
        "pool": 0,
        "readers": 0,
        "created_at": 1.0,
        "last_access": 1.0,
        "meta": {"layer": 1},
        "checksums": None,
    }
    return {**info, **kw}


FORGED_LOOKUPS = {
    "not a map": 5,
    "another key": _info(key="victim-secret"),
    "another namespace": _info(namespace="victim"),
    "nbytes not an int": _info(nbytes="many"),
    "meta not a map": _info(meta=[1]),
    "unknown fields only": {"x": 1},
}


@pytest.mark.parametrize("mode", FORGED_LOOKUPS)
def test_a_forged_lookup_reply_is_refused(forged, mode):
    """A peer's lookup answer reaches the client only as the object asked, well formed: a
    reply that is not a map, names another key or namespace, or has fields of the wrong
    type is TransferFailed (before, it was handed to the client as it came: a non-map or
    a partial map failed in the client with TypeError, another key's info was returned as
    the answer for the key asked)."""
    owner, b = forged
    owner.looked_up = FORGED_LOOKUPS[mode]
    try:
        with b.client() as cb:
            with pytest.raises(TransferFailed, match="lookup"):
                cb.lookup("asked", peer=owner.address)
            owner.looked_up = _info()  # the control: a well-formed answer is returned
            info = cb.lookup("asked", peer=owner.address)
            assert (info.namespace, info.key, info.nbytes) == ("default", "asked", 301_000)
    finally:
        owner.looked_up = None


@pytest.mark.parametrize("key", ["", "k" * 600], ids=["empty", "600 characters"])
def test_a_key_no_local_op_takes_is_never_pulled(forged, key):
    """An empty or over-long key is refused as a local reserve refuses it, before the
    owner is asked (issue 38: a 100,000-character key sealed from a peer broke `stat` and
    `ls` for every client, across restarts; the local protocol's 64 KiB string limit
    refuses such a claim before the daemon reads it)."""
    owner, b = forged
    owner.mode = "honest"
    pins = owner.pins
    with b.client() as cb:
        with pytest.raises(BadRequest, match="key must not be empty|key longer than"):
            cb.claim(key, peer=owner.address)
        assert cb.stat().objects == 0
    assert owner.pins == pins


@pytest.mark.parametrize("victim", ["owner", "puller"])
def test_a_pool_truncated_under_a_pull_does_not_kill_either_daemon(fleet_dir, victim):
    """A client that may map a pool may ftruncate it (a tenant its own tenant pool). NIXL
    reads the owner's and writes the puller's pool through the daemons' mappings: the
    owner refuses to pin an object of a truncated pool, the puller to read into one (both
    TransferFailed, nothing sealed), and both daemons keep serving their other clients.
    Before, the daemon whose pool was truncated died of SIGBUS (the owner under the peer's
    READ, the puller under its own)."""
    pa, pb = _free_port(), _free_port()
    a = Node(fleet_dir, f"trunc-a-{victim}", port=pa, peers=[f"127.0.0.1:{pb}"], pool="16M")
    b = Node(fleet_dir, f"trunc-b-{victim}", port=pb, peers=[a.address], pool="16M")
    try:
        x = _data(1 << 20, 9)
        with a.client() as ca, b.client() as cb:
            ca.put("k", {"x": x})
            for p in (ca if victim == "owner" else cb).pools:
                os.truncate("/dev/shm" + p["name"], 0)
            match = "is not served: pool 0" if victim == "owner" else "pool 0 is truncated"
            with pytest.raises(TransferFailed, match=match):
                cb.claim("k", peer=a.address)
        for node in (a, b):
            assert node.proc.proc.poll() is None, node.proc.log()[-3000:]
            with node.client(map_pools=False) as c:  # a client that comes after
                assert c.ping()
                assert c.exists("k") == (node is a)
        assert b.stat().pending == 0 and b.stat().write_leases == 0
        assert a.stat().transfer.leases_served == 0
    finally:
        assert b.stop() == 0, b.proc.log()[-3000:]
        assert a.stop() == 0, a.proc.log()[-3000:]
