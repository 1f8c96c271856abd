"""A consume's release goes out with the connection's next request, not in a write of its own
(issue 43's small-request path); when none comes, the client's flusher thread sends it; a
close sends it; a client killed while holding one leaves nothing lent or leased."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np

from kvbroker import Client
from kvbroker._client import session as _session



def _no_flusher(session) -> None:
    """In place of the flusher's watch: a held request goes out only with a request or a
    close (so what a test sees does not depend on how fast the machine is)."""


def _count_writes(client: Client) -> list[bytes]:
    writes: list[bytes] = []
    transport = client._session._stream.transport
    send = transport.send

    def counted(data: bytes) -> None:
        writes.append(bytes(data))
        send(data)

    transport.send = counted
    return writes


def test_a_consume_release_goes_out_with_the_next_request(daemon, monkeypatch):
    monkeypatch.setattr(_session._flusher, "watch", _no_flusher)
    src = np.arange(4096, dtype=np.uint8)
    with daemon.client() as c, daemon.client() as other:
        c.put("first", {"x": src})
        writes = _count_writes(c)
        got = c.get("first", consume=True)["x"]
        assert (got == src).all()
        assert c._session.holding  # the release waits for the next request...
        assert other.exists("first")  # ...so the daemon has not freed the object yet
        c.put("second", {"x": src})
        # the claim, then the put's publish carrying the release: two writes, not three
        assert len(writes) == 2, writes
        assert not c._session.holding
        assert not other.exists("first") and other.exists("second")
        assert c.stat().read_leases == 0


def test_a_held_release_goes_out_alone_when_no_request_follows(daemon):
    with daemon.client() as c, daemon.client() as other:
        c.put("k", {"x": np.ones(4096, np.uint8)})
        c.get("k", consume=True)
        # c sends nothing more: the flusher thread must send the release for it
        deadline = time.monotonic() + 30
        while other.exists("k") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not other.exists("k")
        assert not c._session.holding


def test_close_sends_a_held_release(daemon, monkeypatch):
    monkeypatch.setattr(_session._flusher, "watch", _no_flusher)
    with daemon.client() as other:
        c = daemon.client()
        c.put("k", {"x": np.ones(4096, np.uint8)})
        c.get("k", consume=True)
        assert c._session.holding
        c.close()
        assert not other.exists("k")  # close returned: the release was served


def _consume_then_hang(sock: str, ready) -> None:
    _session._flusher.watch = _no_flusher  # the release stays held until the kill
    c = Client(sock)
    c.put("read", {"x": np.full(50_000, 2, np.uint8)})
    c.put("mine", {"x": np.full(50_000, 3, np.uint8)})
    with c.claim("read"):  # a lease held too
        c.get("mine", consume=True)
        assert c._session.holding
        ready.set()
        time.sleep(60)


def test_a_client_killed_holding_a_release_leaves_nothing_leased(daemon):
    with daemon.client(arena_size=0) as c:
        before = c.stat().pools[0].used
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        p = ctx.Process(target=_consume_then_hang, args=(daemon.socket_path, ready))
        p.start()
        assert ready.wait(60)
        mid = c.stat()
        assert mid.read_leases >= 1 and mid.pools[0].leased_write > 0  # its claims, its arena
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        deadline = time.monotonic() + 30
        while len(c.stat().clients) > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = c.stat()
        assert len(after.clients) == 1
        assert after.read_leases == 0 and after.write_leases == 0
        assert after.pools[0].leased_write == 0
        # Its consume never reached the daemon (held when it died): the object stays, as for
        # a reader killed before it released, and nothing else is held.
        assert c.exists("mine") and c.exists("read")
        c.evict(all=True)
        assert c.stat().pools[0].used == before
