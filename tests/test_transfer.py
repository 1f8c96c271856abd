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
from kvbroker.errors import LeaseExpired, NotFound, ProtocolError

HERE = os.path.dirname(os.path.abspath(__file__))
TOKEN = b"0123456789abcdef-test-token"


# -- coalesce ----------------------------------------------------------------------------------

def test_coalesce_merges_runs_on_both_sides():
    assert transfer.coalesce([(1000, 10), (1010, 20)], [(5000, 30)]) == [(1000, 5000, 30)]
    assert transfer.coalesce([(1000, 10), (2000, 10)], [(5000, 20)]) == [
        (1000, 5000, 10), (2000, 5010, 10)]


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


def test_parse_address_and_token(tmp_path):
    assert transfer.parse_address("10.0.0.2:7000") == ("10.0.0.2", 7000)
    assert transfer.parse_address("[::1]:7000") == ("::1", 7000)
    assert transfer.parse_address("node-a", 7001) == ("node-a", 7001)
    with pytest.raises(ValueError):
        transfer.parse_address("node-a")
    f = tmp_path / "token"
    f.write_bytes(TOKEN + b"\n")
    f.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        transfer.read_token(str(f))
    f.chmod(0o600)
    assert transfer.read_token(str(f)) == TOKEN
    f.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        transfer.read_token(str(f))


# -- control channel, in process ---------------------------------------------------------------

class _Provider:
    def __init__(self):
        self.leases: dict[int, int] = {}
        self.next = 1
        self.dropped: list[int] = []

    def pin(self, peer, namespace, key, ttl, consume):
        if key != "k":
            raise NotFound(f"{namespace}/{key} not here")
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
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _server(provider, **kw):
    kw.setdefault("token", TOKEN)
    s = transfer.PeerServer(provider, node="node-a", metadata=b"nixl-md", agent="agent-a", **kw)
    host, port = await s.start("127.0.0.1", 0)
    return s, f"{host}:{port}"


def test_handshake_pin_release_and_typed_errors():
    async def go():
        p = _Provider()
        s, addr = await _server(p)
        c = await transfer.PeerClient(addr, token=TOKEN, node="node-b").connect()
        assert (c.peer_node, c.agent, c.metadata) == ("node-a", "agent-a", b"nixl-md")
        r = await c.pin("k", namespace="ns1", ttl=5)
        assert r["extents"] == [[4096, 100]] and r["meta"] == {"ns": "ns1"}
        await c.renew(r["lease"])
        await c.release(r["lease"])
        with pytest.raises(LeaseExpired, match="peer 127.0.0.1"):
            await c.release(r["lease"])
        with pytest.raises(NotFound, match="not here"):
            await c.pin("missing")
        with pytest.raises(ProtocolError, match="ttl"):
            await c.request({"op": "pin", "key": "k", "ttl": -1})
        assert s.served_pins == 1
        await c.close()
        await s.close()
    _run(go())


def test_wrong_token_refused_without_metadata():
    async def go():
        p = _Provider()
        s, addr = await _server(p)
        with pytest.raises(transfer.PeerUnavailable, match="wrong token"):
            await transfer.PeerClient(addr, token=b"x" * 20, node="intruder").connect()
        assert s.refused == 1 and s.peers == 0 and p.leases == {}
        await s.close()
    _run(go())


def test_address_outside_allow_refused():
    async def go():
        s, addr = await _server(_Provider(), allow=["10.255.255.1"])
        with pytest.raises(transfer.PeerUnavailable, match="not a configured peer"):
            await transfer.PeerClient(addr, token=TOKEN, node="node-b").connect()
        await s.close()
        s, addr = await _server(_Provider(), allow=["127.0.0.1"])
        c = await transfer.PeerClient(addr, token=TOKEN, node="node-b").connect()
        await c.close()
        await s.close()
    _run(go())


def test_disconnect_drops_the_peers_leases():
    async def go():
        p = _Provider()
        s, addr = await _server(p)
        c1 = await transfer.PeerClient(addr, token=TOKEN, node="b1").connect()
        c2 = await transfer.PeerClient(addr, token=TOKEN, node="b2").connect()
        for _ in range(3):
            await c1.pin("k")
        await c2.pin("k")
        assert len(p.leases) == 4
        await c1.close()
        for _ in range(100):
            if len(p.leases) == 1:
                break
            await asyncio.sleep(0.01)
        assert len(p.leases) == 1 and len(p.dropped) == 1
        await s.close()           # the server stopping ends c2's connection: its lease too
        assert p.leases == {} and len(p.dropped) == 2
        with pytest.raises(transfer.PeerUnavailable):
            await c2.pin("k")
        await c2.close()
    _run(go())


def test_peer_down_is_peer_unavailable():
    async def go():
        s, addr = await _server(_Provider())
        await s.close()
        with pytest.raises(transfer.PeerUnavailable, match=addr):
            await transfer.PeerClient(addr, token=TOKEN, node="b", connect_timeout=2).connect()
    _run(go())


def test_server_must_prove_the_token():
    """A listener that does not know the token cannot pass itself off as the peer."""
    async def fake(reader, writer):
        writer.write(transfer._pack({"proto": transfer.PROTOCOL, "node": "fake",
                                     "nonce": b"n" * 32}))
        await transfer._recv(reader)
        writer.write(transfer._pack({"ok": True, "mac": b"\0" * 32, "metadata": b"evil"}))
        await writer.drain()

    async def go():
        srv = await asyncio.start_server(fake, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        with pytest.raises(transfer.PeerUnavailable, match="failed to prove"):
            await transfer.PeerClient(f"127.0.0.1:{port}", token=TOKEN, node="b").connect()
        srv.close()
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
    os.environ.setdefault("UCX_TLS", "tcp")   # before the first UCX context of this process
    np = pytest.importorskip("numpy")
    ep = transfer.NixlEndpoint(f"test-b-{os.getpid()}")
    region = np.zeros(64 << 20, dtype=np.uint8)
    ep.register([(region.ctypes.data, region.nbytes)])
    ep.region = region
    yield ep
    ep.close()


class _Peer:
    def __init__(self, tmp_path, objects, extra=()):
        tok = tmp_path / "token"
        tok.write_bytes(TOKEN)
        tok.chmod(0o600)
        env = dict(os.environ, UCX_TLS=os.environ.get("UCX_TLS", "tcp"))
        cmd = [sys.executable, os.path.join(HERE, "_nixl_peer.py"), "--token-file", str(tok)]
        for o in objects:
            cmd += ["--object", o]
        self.proc = subprocess.Popen([*cmd, *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
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


async def _pin_and_read(ep, address, key, **kw):
    import xxhash

    c = await transfer.PeerClient(address, token=TOKEN, node="node-b").connect()
    agent = ep.add_peer(c.metadata, label=address)
    r = await c.pin(key)
    nbytes = r["nbytes"]
    res = await asyncio.to_thread(ep.read, agent, [tuple(e) for e in r["extents"]],
                                  [(ep.region.ctypes.data, nbytes)], **kw)
    ok = xxhash.xxh3_64_intdigest(ep.region[:nbytes]) == r["checksum"]
    return c, agent, r, res, ok


def test_nixl_read_descriptor_list_bit_exact(endpoint, tmp_path):
    peer = _Peer(tmp_path, ["big:33554432:8", "small:262144:1"])
    try:
        async def go():
            c, agent, r, res, ok = await _pin_and_read(endpoint, peer.address, "big")
            assert ok, "32 MiB read through NIXL does not match the peer's checksum"
            assert res.nbytes == 32 << 20 and res.descriptors == 8   # 8 extents, one READ
            # the same bytes again, asked as 64 adjacent pieces: coalesced back to 8
            ext = [tuple(e) for e in r["extents"]]
            split = [(a + i * (n // 8), n // 8) for a, n in ext for i in range(8)]
            endpoint.region[: 32 << 20] = 0
            res2 = await asyncio.to_thread(endpoint.read, agent, split,
                                           [(endpoint.region.ctypes.data, 32 << 20)])
            assert res2.descriptors == 8
            import xxhash
            assert xxhash.xxh3_64_intdigest(endpoint.region[: 32 << 20]) == r["checksum"]
            await c.release(r["lease"])
            endpoint.remove_peer(agent)
            await c.close()
        _run(go())
    finally:
        peer.stop()


def test_nixl_peer_killed_mid_read(endpoint, tmp_path):
    """SIGKILL the serving process while reads are in flight: each read ends (error or, if
    it finished first, bytes that are then checked), never hangs, and the control channel
    reports PeerUnavailable."""
    peer = _Peer(tmp_path, ["big:50331648:1"])
    try:
        async def go():
            c, agent, r, res, ok = await _pin_and_read(endpoint, peer.address, "big")
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


def test_nixl_lease_expired_on_peer(endpoint, tmp_path):
    """A pin whose TTL passed: the peer's new owner rewrote the pages, so the bytes read
    fail their checksum, and the release says the lease had ended."""
    peer = _Peer(tmp_path, ["obj:1048576:2"], ["--reuse-on-expiry"])
    try:
        async def go():
            import xxhash

            c = await transfer.PeerClient(peer.address, token=TOKEN, node="node-b").connect()
            agent = endpoint.add_peer(c.metadata)
            r = await c.request({"op": "pin", "key": "obj", "ttl": 0.2})
            await asyncio.sleep(0.4)
            with pytest.raises(LeaseExpired):
                await c.renew(r["lease"])        # expiry is noticed, pages rewritten
            await asyncio.to_thread(endpoint.read, agent, [tuple(e) for e in r["extents"]],
                                    [(endpoint.region.ctypes.data, r["nbytes"])])
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
    code = ("import sys, kvbroker, kvbroker.cli, kvbroker._server.transfer, "
            "kvbroker._server.events; "
            "bad = [m for m in ('zmq', 'nixl', 'nixl_cu12', 'nixl_cu13', 'torch') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
