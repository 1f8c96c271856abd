"""Broker-to-broker transfer (kvbroker/_server/transfer.py).

- ``coalesce``: the descriptor list of one READ, split where either side breaks, merged where
  both run on;
- the control channel in one process (no NIXL needed): mutual token authentication, a wrong
  token or an address outside ``allow`` refused with PeerUnavailable and no NIXL metadata
  handed out, errors typed across the wire, a peer's leases dropped when its connection
  closes, a peer that is down;
- NIXL between two processes over UCX TCP (skipped without NIXL): a 32 MiB object in 8
  extents read bit-exact with one READ of 8 descriptors, adjacent extents merged into one,
  the serving process SIGKILLed mid-read (the read fails, never hangs; the control channel
  says PeerUnavailable), a lease expired on the peer whose pages were reused (the checksum
  and the release both say so).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvbroker._server import transfer
from kvbroker.errors import BadRequest, LeaseExpired, NotFound, ProtocolError

HERE = os.path.dirname(os.path.abspath(__file__))


# -- coalesce ----------------------------------------------------------------------------------


def test_coalesce_merges_runs_on_both_sides():
    assert transfer.coalesce([(1000, 10), (1010, 20)], [(5000, 30)]) == [(1000, 5000, 30)]
    assert transfer.coalesce([(1000, 10), (2000, 10)], [(5000, 20)]) == [
        (1000, 5000, 10),
        (2000, 5010, 10),
    ]


def test_coalesce_splits_where_either_side_breaks():
    got = transfer.coalesce([(0, 100)], [(1000, 30), (2000, 70)])
    assert got == [(0, 1000, 30), (30, 2000, 70)]
    got = transfer.coalesce([(0, 50), (100, 50)], [(1000, 20), (1020, 60), (5000, 20)])
    assert got == [(0, 1000, 50), (100, 1050, 30), (130, 5000, 20)]
    assert sum(n for *_, n in got) == 100


def test_coalesce_rejects_unequal_totals():
    with pytest.raises(ValueError, match="remote extents hold 10 bytes, local ones 11"):
        transfer.coalesce([(0, 10)], [(0, 11)])
    assert transfer.coalesce([], []) == []


def test_parse_address_and_key_mode(certs):
    assert transfer.parse_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert transfer.parse_address("[::1]:7000") == ("::1", 7000)
    assert transfer.parse_address("node-a", 7001) == ("node-a", 7001)
    with pytest.raises(ValueError):
        transfer.parse_address("node-a")
    a = certs["node-a"]
    os.chmod(a["key_file"], 0o644)
    try:
        with pytest.raises(ValueError, match="chmod 600"):
            transfer.tls_contexts(a["cert_file"], a["key_file"], a["ca_file"])
    finally:
        os.chmod(a["key_file"], 0o600)
    assert transfer.identity("::0001") == "::1" and transfer.identity("Node-A.") == "node-a"


# -- control channel, in process ---------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """node-a and node-b (both 127.0.0.1, as the peers list them), a certificate of the same
    CA naming a host nobody configured, and one of another CA."""
    from kvbroker.testing import peer_certificates

    d = tmp_path_factory.mktemp("certs")
    out = peer_certificates(
        d / "fleet", {"node-a": ["127.0.0.1"], "node-b": ["127.0.0.1"], "stranger": ["10.9.9.9"]}
    )
    out.update(peer_certificates(d / "other", {"intruder": ["127.0.0.1"]}, ca_name="another CA"))
    return out


def _tls(certs, name):
    c = certs[name]
    return transfer.tls_contexts(c["cert_file"], c["key_file"], c["ca_file"])


class _Provider:
    max_lease_ttl = 3600.0  # the TTL rule's bound (kvbroker._wire.rules.LEASE_TTL)

    def __init__(self):
        self.leases: dict[int, int] = {}
        self.next = 1
        self.dropped: list[int] = []
        self.pins = 0

    def pin(self, peer, namespace, key, ttl, consume):
        if key != "k":
            raise NotFound(f"{namespace}/{key} not here")
        self.pins += 1
        lid, self.next = self.next, self.next + 1
        self.leases[lid] = peer
        return {"lease": lid, "extents": [[4096, 100]], "meta": {"ns": namespace}}

    def release(self, peer, lease, consumed):
        if self.leases.pop(lease, None) is None:
            raise LeaseExpired(f"lease {lease} ended")

    def renew(self, peer, lease, ttl):
        if lease not in self.leases:
            raise LeaseExpired(f"lease {lease} ended")

    def drop_peer(self, peer):
        self.dropped.append(peer)
        for lid, p in list(self.leases.items()):
            if p == peer:
                del self.leases[lid]


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _until(cond, seconds=20.0):
    """Wait for the server's side of what the client already saw (it runs on its own)."""
    for _ in range(int(seconds / 0.01)):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def _server(provider, certs, name="node-a", peers=("127.0.0.1",), **kw):
    s = transfer.PeerServer(
        provider,
        tls=_tls(certs, name)[0],
        peers=peers,
        node="node-a",
        metadata=b"nixl-md",
        agent="agent-a",
        **kw,
    )
    host, port = await s.start("127.0.0.1", 0)
    return s, f"{host}:{port}"


def _client(certs, addr, name="node-b", **kw):
    return transfer.PeerClient(addr, tls=_tls(certs, name)[1], node=name, **kw)


def test_handshake_pin_release_and_typed_errors(certs):
    async def go():
        p = _Provider()
        s, addr = await _server(p, certs)
        c = await _client(certs, addr).connect()
        assert (c.peer_node, c.agent, c.metadata) == ("node-a", "agent-a", b"nixl-md")
        r = await c.pin("k", namespace="ns1", ttl=5)
        assert r["extents"] == [[4096, 100]] and r["meta"] == {"ns": "ns1"}
        await c.renew(r["lease"])
        await c.release(r["lease"])
        with pytest.raises(LeaseExpired, match="peer 127.0.0.1"):
            await c.release(r["lease"])
        with pytest.raises(NotFound, match="not here"):
            await c.pin("missing")
        # arguments are checked against the declared peer ops, as local ones are
        with pytest.raises(BadRequest, match="ttl must be int or float, not str"):
            await c.call("pin", key="k", ttl="forever")
        with pytest.raises(BadRequest, match="unexpected argument 'extra'"):
            await c.call("pin", key="k", ttl=1, extra=1)
        with pytest.raises(BadRequest, match="unknown peer op 'delete'"):
            await c.call("delete", key="k")
        assert s.served_pins == 1
        await c.close()
        await s.close()

    _run(go())


def test_certificate_of_another_ca_refused_without_metadata(certs):
    """A client that trusts the fleet's CA, with a certificate another CA signed for the
    right address: the server refuses it before any frame."""

    async def go():
        p = _Provider()
        s, addr = await _server(p, certs)
        i = certs["intruder"]
        tls = transfer.tls_contexts(i["cert_file"], i["key_file"], certs["node-b"]["ca_file"])[1]
        with pytest.raises(transfer.PeerUnavailable, match="refused the TLS session"):
            await transfer.PeerClient(addr, tls=tls, node="intruder").connect()
        assert await _until(lambda: s.refused == 1)
        assert s.peers == 0 and p.leases == {}
        await s.close()

    _run(go())


def test_certificate_naming_no_configured_peer_refused(certs):
    """Signed by the fleet's CA, but for a host that is not among this node's peers."""

    async def go():
        p = _Provider()
        s, addr = await _server(p, certs)
        with pytest.raises(transfer.PeerUnavailable, match="10.9.9.9: not one of its"):
            await _client(certs, addr, "stranger").connect()
        assert s.refused == 1 and s.peers == 0
        await s.close()
        s, addr = await _server(p, certs, peers=["10.9.9.9"])  # now it is one
        c = await _client(certs, addr, "stranger").connect()
        await c.close()
        await s.close()

    _run(go())


def test_disconnect_drops_the_peers_leases(certs):
    async def go():
        p = _Provider()
        s, addr = await _server(p, certs)
        c1 = await _client(certs, addr).connect()
        c2 = await _client(certs, addr).connect()
        for _ in range(3):
            await c1.pin("k")
        await c2.pin("k")
        assert len(p.leases) == 4
        await c1.close()
        assert await _until(lambda: len(p.leases) == 1)
        assert len(p.dropped) == 1
        await s.close()  # the server stopping ends c2's connection: its lease too
        assert p.leases == {} and len(p.dropped) == 2
        with pytest.raises(transfer.PeerUnavailable):
            await c2.pin("k")
        await c2.close()

    _run(go())


def test_peer_down_is_peer_unavailable(certs):
    async def go():
        s, addr = await _server(_Provider(), certs)
        await s.close()
        with pytest.raises(transfer.PeerUnavailable, match=addr):
            await _client(certs, addr, connect_timeout=2).connect()

    _run(go())


def test_server_must_hold_a_certificate_of_the_ca_naming_its_address(certs):
    """A listener with another CA's certificate, or with the fleet's certificate of another
    host, cannot pass itself off as the peer dialled."""

    async def go():
        for name, why in (
            ("intruder", "its certificate was refused"),
            ("stranger", "its certificate was refused.*IP address mismatch"),
        ):
            s, addr = await _server(_Provider(), certs, name=name)
            with pytest.raises(transfer.PeerUnavailable, match=why):
                await _client(certs, addr).connect()
            await s.close()

    _run(go())


class _Relay:
    """A TCP relay between a client and a server that sees TLS records. It forwards them;
    it keeps the client's latest encrypted record (``last``), and once ``inject`` is set,
    sends that record in place of the client's next one: a record of this connection sent
    again (a replay) or one recorded on another connection (a splice)."""

    def __init__(self, target: str) -> None:
        self.target = transfer.parse_address(target)
        self.last: bytes | None = None
        self.inject: bytes | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer):
        ur, uw = await asyncio.open_connection(*self.target)

        async def back():
            while data := await ur.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.create_task(back())
        try:
            while True:
                head = await reader.readexactly(5)
                record = head + await reader.readexactly(int.from_bytes(head[3:5], "big"))
                if head[0] == 23:  # encrypted (TLS 1.3 sends all of those as type 23)
                    if self.inject is not None:
                        record, self.inject = self.inject, None
                    else:
                        self.last = record
                uw.write(record)
                await uw.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            uw.close()
            task.cancel()


@pytest.mark.parametrize("mode", ["replay", "splice"])
def test_a_replayed_or_spliced_frame_is_refused(certs, mode):
    """Every frame after the handshake is authenticated by TLS: a relay that sends a pin
    request again, or one recorded on another connection to the same server, breaks the
    connection; the pin is not served again, and the connection's lease ends with it."""

    async def go():
        p = _Provider()
        s, addr = await _server(p, certs)
        other = _Relay(addr)
        c0 = await _client(certs, await other.start()).connect()
        await c0.pin("k")
        recorded = other.last  # c0's pin request, encrypted
        relay = _Relay(addr)
        c = await _client(certs, await relay.start()).connect()
        r = await c.pin("k")
        assert p.pins == 2 and len(p.leases) == 2
        relay.inject = relay.last if mode == "replay" else recorded
        with pytest.raises(transfer.PeerUnavailable):
            await c.pin("k")  # what arrives is not this request
        assert await _until(lambda: len(p.leases) == 1), (
            f"lease {r['lease']} outlived the broken connection"
        )
        assert p.pins == 2, "a replayed or spliced pin was served"
        assert s.peers == 1  # c0 only
        await c0.close()
        await c.close()
        await s.close()

    _run(go())


def test_unauthenticated_connections_are_capped_and_buffer_nothing(certs):
    """No frame is read before the TLS handshake: a connection announcing a 63 MiB frame
    is dropped at its first bytes, and past MAX_HANDSHAKES connections that never finish
    their handshake, the next is closed unanswered."""

    async def go():
        s, addr = await _server(_Provider(), certs, max_handshakes=4)
        host, port = transfer.parse_address(addr)
        r, w = await asyncio.open_connection(host, port)
        w.write((63 << 20).to_bytes(4, "big") + b"\x00" * (1 << 20))
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await w.drain()
            assert await asyncio.wait_for(r.read(1 << 16), 10) == b""
            raise ConnectionError("closed")
        w.close()
        idle = [await asyncio.open_connection(host, port) for _ in range(4)]
        await asyncio.sleep(0.2)
        r, w = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(r.read(1), 10) == b""  # closed at once
        assert s.refused >= 1
        for _, iw in idle:
            iw.close()
        w.close()
        c = await _client(certs, addr).connect()  # the handshakes ended: served again
        await c.close()
        await s.close()

    _run(go())


def test_stalled_handshakes_of_one_host_do_not_keep_the_peers_out(certs):
    """Unauthenticated connections from one address that never finish their handshake fill
    that address's share of the handshake slots, not all of them: a configured peer
    connecting from another address meanwhile is served (before, MAX_HANDSHAKES stalled
    connections from 127.0.0.2 made the server refuse every peer until they timed out)."""

    async def go():
        s, addr = await _server(_Provider(), certs, handshake_timeout=60.0)
        host, port = transfer.parse_address(addr)
        stalled = [
            await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
            for _ in range(transfer.MAX_HANDSHAKES)
        ]
        c = await _client(certs, addr).connect()  # from 127.0.0.1, while they still stall
        assert (await c.pin("k"))["lease"] >= 1
        await c.close()
        share = transfer.MAX_HANDSHAKES_PER_SOURCE
        assert await _until(lambda: s.refused == transfer.MAX_HANDSHAKES - share)
        assert all(not r.at_eof() for r, _ in stalled[:share])  # its share: still waiting
        for _, w in stalled:
            w.close()
        await s.close()

    _run(go())


# -- NIXL between two processes ------------------------------------------------------------------


def _nixl_or_skip():
    try:
        transfer.load_nixl()
    except ImportError as e:
        pytest.skip(f"NIXL not installed: {e}")


@pytest.fixture(scope="module")
def endpoint():
    _nixl_or_skip()
    os.environ.setdefault("UCX_TLS", "tcp")  # before the first UCX context of this process
    np = pytest.importorskip("numpy")
    ep = transfer.NixlEndpoint(f"test-b-{os.getpid()}")
    region = np.zeros(64 << 20, dtype=np.uint8)
    ep.register([(region.ctypes.data, region.nbytes)])
    ep.region = region
    yield ep
    ep.close()


class _Peer:
    def __init__(self, certs, objects, extra=()):
        a = certs["node-a"]
        env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
        cmd = [
            sys.executable,
            os.path.join(HERE, "_nixl_peer.py"),
            "--cert",
            a["cert_file"],
            "--key",
            a["key_file"],
            "--ca",
            a["ca_file"],
        ]
        for o in objects:
            cmd += ["--object", o]
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"peer process exited with {self.proc.wait()}")
            if line.startswith(b"{"):
                break
        info = json.loads(line)
        self.address = f"127.0.0.1:{info['port']}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _pin_and_read(ep, certs, address, key, **kw):
    import xxhash

    c = await _client(certs, address).connect()
    agent = ep.add_peer(c.metadata, label=address)
    r = await c.pin(key)
    nbytes = r["nbytes"]
    res = await asyncio.to_thread(
        ep.read, agent, [tuple(e) for e in r["extents"]], [(ep.region.ctypes.data, nbytes)], **kw
    )
    ok = xxhash.xxh3_64_intdigest(ep.region[:nbytes]) == r["checksum"]
    return c, agent, r, res, ok


def test_nixl_read_descriptor_list_bit_exact(endpoint, certs):
    peer = _Peer(certs, ["big:33554432:8", "small:262144:1"])
    try:

        async def go():
            c, agent, r, res, ok = await _pin_and_read(endpoint, certs, peer.address, "big")
            assert ok, "32 MiB read through NIXL does not match the peer's checksum"
            assert res.nbytes == 32 << 20 and res.descriptors == 8  # 8 extents, one READ
            # the same bytes again, asked as 64 adjacent pieces: coalesced back to 8
            ext = [tuple(e) for e in r["extents"]]
            split = [(a + i * (n // 8), n // 8) for a, n in ext for i in range(8)]
            endpoint.region[: 32 << 20] = 0
            res2 = await asyncio.to_thread(
                endpoint.read, agent, split, [(endpoint.region.ctypes.data, 32 << 20)]
            )
            assert res2.descriptors == 8
            import xxhash

            assert xxhash.xxh3_64_intdigest(endpoint.region[: 32 << 20]) == r["checksum"]
            await c.release(r["lease"])
            endpoint.remove_peer(agent)
            await c.close()

        _run(go())
    finally:
        peer.stop()


def test_nixl_peer_killed_mid_read(endpoint, certs):
    """SIGKILL the serving process while reads are in flight: each read ends (error or, if
    it finished first, bytes that are then checked), never hangs, and the control channel
    reports PeerUnavailable."""
    peer = _Peer(certs, ["big:50331648:1"])
    try:

        async def go():
            c, agent, r, res, ok = await _pin_and_read(endpoint, certs, peer.address, "big")
            assert ok
            ext = [tuple(e) for e in r["extents"]]
            local = [(endpoint.region.ctypes.data, r["nbytes"])]
            outcomes = []

            def reads():
                for _ in range(200):
                    try:
                        endpoint.read(agent, ext, local, timeout=20)
                        outcomes.append("done")
                    except transfer.TransferFailed as e:
                        outcomes.append(f"failed: {e}")
                        return

            t = threading.Thread(target=reads)
            t0 = time.monotonic()
            t.start()
            await asyncio.sleep(0.5)
            os.kill(peer.proc.pid, signal.SIGKILL)
            peer.proc.wait()
            await asyncio.to_thread(t.join, 60)
            assert not t.is_alive(), "a NIXL read hung after the peer died"
            assert outcomes and outcomes[-1].startswith("failed"), outcomes[-3:]
            assert time.monotonic() - t0 < 60
            with pytest.raises(transfer.PeerUnavailable):
                await c.release(r["lease"])
            endpoint.remove_peer(agent)
            await c.close()

        _run(go())
    finally:
        peer.stop()


def test_nixl_lease_expired_on_peer(endpoint, certs):
    """A pin whose TTL passed: the peer's new owner rewrote the pages, so the bytes read
    fail their checksum, and the release says the lease had ended."""
    peer = _Peer(certs, ["obj:1048576:2"], ["--reuse-on-expiry"])
    try:

        async def go():
            import xxhash

            c = await _client(certs, peer.address).connect()
            agent = endpoint.add_peer(c.metadata)
            r = await c.pin("obj", ttl=0.2)
            await asyncio.sleep(0.4)
            with pytest.raises(LeaseExpired):
                await c.renew(r["lease"])  # expiry is noticed, pages rewritten
            await asyncio.to_thread(
                endpoint.read,
                agent,
                [tuple(e) for e in r["extents"]],
                [(endpoint.region.ctypes.data, r["nbytes"])],
            )
            assert xxhash.xxh3_64_intdigest(endpoint.region[: r["nbytes"]]) != r["checksum"]
            with pytest.raises(LeaseExpired):
                await c.release(r["lease"])
            endpoint.remove_peer(agent)
            await c.close()

        _run(go())
    finally:
        peer.stop()


def test_importing_the_engines_imports_no_extra():
    """kvbroker, its CLI, and the two engine modules import neither NIXL, pyzmq nor torch:
    those load only when a daemon creates an endpoint or a publisher."""
    code = (
        "import sys, kvbroker, kvbroker.cli, kvbroker._server.transfer, "
        "kvbroker._server.events; "
        "bad = [m for m in ('zmq', 'nixl', 'nixl_cu12', 'nixl_cu13', 'torch') "
        "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_peer_frame_over_the_channels_limit_is_refused_while_it_arrives():
    """An authenticated peer streaming one frame bigger than the channel's limit, made of
    small arrays msgpack parses as they come (so its own buffer limit never trips): the
    channel's framing refuses it after at most its limit and one read, never reading (and
    building objects of) the whole frame."""
    from kvbroker._server.peer_channel import _Frames

    limit, items = 64 << 10, 1 << 16
    data = b"\xdd" + items.to_bytes(4, "big") + (b"\x9f" + b"\x00" * 15) * items  # 1 MiB

    async def go():
        reader = asyncio.StreamReader(limit=len(data) + 1)
        reader.feed_data(data)
        reader.feed_eof()
        with pytest.raises(ProtocolError, match="exceeds the size limit"):
            await _Frames(reader, limit).recv()
        return len(data) - len(reader._buffer)  # what the channel read of it

    read = _run(go())
    assert read <= limit + (1 << 16)
