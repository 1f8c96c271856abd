"""The timed quarantine: pages a writer may still be copying into, although it lost them,
are not handed to the next owner before ``restart_quarantine`` seconds.

Two ways to lose them: the daemon died (SIGKILL) and a new one adopted its pools from the
journal, or the daemon cut a live client off (replies left unread, a protocol error). A
client closing its own connection is gone, and its pages are free at once, as before.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time

import msgpack
import numpy as np
import pytest
from conftest import DaemonProcess, drop_leftover_pools
from _fakes import Clock

from kvbroker._server.broker import Broker
from kvbroker._server.journal import Journal
from kvbroker._server.pool import HostPool
from kvbroker._wire.protocol import PROTOCOL_VERSION
from kvbroker.errors import PoolFull

PAGE = 4096
QUARANTINE = "2"  # seconds, for the daemons below (the default is 10)
ARGS = ("--pool-size", "16M", "--page-size", "4K")
ENV = {"KVBROKER_RESTART_QUARANTINE": QUARANTINE}  # the variable here, the flag below


def wait_until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def pages_of(extents) -> set[tuple[int, int]]:
    """(pool, page) of every page a lease's extents {name: (pool, offset, nbytes)} touch."""
    out = set()
    for pool, off, n in extents.values():
        out |= {(pool, p) for p in range(off // PAGE, -(-(off + n) // PAGE))}
    return out


def exact(st) -> bool:
    """Every used page is a sealed object's (no lease, arena or quarantine left)."""
    objects = sum(-(-ns.used // PAGE) * PAGE for ns in st.namespaces)
    p = st.pools[0]
    return (
        p.quarantined == 0
        and p.leased_write == 0
        and st.used == objects
        and p.free == p.capacity - objects
    )


@pytest.fixture
def daemons(socket_path):
    started: list[DaemonProcess] = []

    def start() -> DaemonProcess:
        d = DaemonProcess(socket_path, *ARGS, env=ENV)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    drop_leftover_pools(socket_path)  # a daemon killed last left its pools


# -- warm restart ---------------------------------------------------------------------------
def test_pages_lent_at_a_crash_are_quarantined_not_given_to_the_next_writer(daemons):
    d = daemons()
    a = d.client(reconnect=0, arena_size=1 << 20)
    a.put("sealed", {"x": np.full(5000, 3, np.uint8)})  # also opens A's write arena
    la = a.reserve("a-obj", {"x": 1 << 20})  # A starts a long copy ...
    blocks = a._call(
        "reserve_blocks", namespace="default", blocks=[{"key": "blk", "buffers": {"k": 3 * PAGE}}]
    )
    st = a.stat()
    lent = st.pools[0].leased_write
    assert lent >= (1 << 20) + 3 * PAGE + (1 << 20) // 2  # reservation, block, arena
    lent_pages = pages_of(la.extents()) | pages_of(blocks["results"][0]["buffers"])
    d.stop(signal.SIGKILL)

    d2 = daemons()
    b = d2.client(reconnect=0, arena_size=0)
    assert b.epoch == 2
    st2 = b.stat()
    assert st2.pools[0].quarantined == lent and st2.pools[0].leased_write == 0
    assert "lent for writing quarantined" in d2.log()
    # B fills the pool's free space: none of it is A's
    fills = []
    while True:
        try:
            fills.append(b.reserve(f"b-{len(fills)}", {"x": 1 << 20}))
        except PoolFull:
            break
    for lease in fills:
        assert not pages_of(lease.extents()) & lent_pages
        lease["x"][:] = 7
        lease.seal()
    la["x"][:] = 1  # ... and A's copy goes on into its old mapping: it hurts nobody
    for i in range(len(fills)):
        assert np.unique(b.get(f"b-{i}", verify=True)["x"]).tolist() == [7]
    assert np.unique(b.get("sealed")["x"]).tolist() == [3]
    # after the deadline the pages are free again and the accounting is exact
    b.evict(match="^b-")
    assert wait_until(lambda: b.stat().pools[0].quarantined == 0)
    assert exact(b.stat())
    reused = b.reserve("reuse", {"x": 15 << 20})  # needs (almost) the whole pool
    assert pages_of(reused.extents()) & lent_pages
    reused.abort()
    b.close()
    a.close()


def test_a_second_crash_inside_the_quarantine_keeps_it(daemons):
    d = daemons()
    a = d.client(reconnect=0, arena_size=0)
    la = a.reserve("a-obj", {"x": 1 << 20})
    d.stop(signal.SIGKILL)
    d2 = daemons()
    with d2.client(reconnect=0, arena_size=0) as b:
        assert b.stat().pools[0].quarantined == 1 << 20
    d2.stop(signal.SIGKILL)  # the new daemon's journal names the quarantined pages too
    d3 = daemons()
    with d3.client(reconnect=0, arena_size=0) as b:
        assert b.epoch == 3
        assert b.stat().pools[0].quarantined == 1 << 20
        lb = b.reserve("b-obj", {"x": 15 << 20})  # all that is free
        assert not pages_of(lb.extents()) & pages_of(la.extents())
        lb.abort()
        assert wait_until(lambda: b.stat().pools[0].quarantined == 0)
        assert exact(b.stat())
    a.close()


def test_seals_and_aborts_before_the_crash_leave_nothing_quarantined(daemons):
    d = daemons()
    a = d.client(reconnect=0, arena_size=0)
    for i in range(20):
        lease = a.reserve(f"k{i}", {"x": 10 * PAGE})
        lease.seal() if i % 3 else lease.abort()
    with d.client(reconnect=0, arena_size=1 << 20) as c:  # arena published, then closed
        for i in range(10):
            c.put(f"arena-{i}", {"x": np.full(3000, i, np.uint8)})
    assert wait_until(lambda: a.stat().pools[0].leased_write == 0)  # c's EOF was seen
    d.stop(signal.SIGKILL)
    d2 = daemons()
    with d2.client(reconnect=0) as b:
        assert exact(b.stat())
        assert b.get("arena-9")["x"][0] == 9
    a.close()


# -- the daemon cuts a live client off ------------------------------------------------------
def raw_client(path: str):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    unpacker = msgpack.Unpacker(raw=False)

    def call(rid, op, **args):
        s.sendall(msgpack.packb({"id": rid, "op": op, "args": args}))
        while True:
            for msg in unpacker:
                assert msg["ok"], msg
                return msg["result"]
            unpacker.feed(s.recv(65536))

    call(1, "hello", version=PROTOCOL_VERSION, name="cut-off")
    return s, call


def test_a_client_cut_off_by_the_daemon_has_its_write_pages_quarantined(make_daemon):
    d = make_daemon(*ARGS, "--restart-quarantine", f"{QUARANTINE}s")
    s, call = raw_client(d.socket_path)
    lease = call(2, "reserve", key="slow", buffers={"x": 1 << 20})
    arena = call(3, "arena", nbytes=1 << 20)
    mine = pages_of(lease["buffers"]) | pages_of({"a": arena["arena"]})
    with d.client(arena_size=0) as b:
        s.sendall(b"\xc1")  # never valid msgpack: a protocol error, the daemon closes
        assert wait_until(lambda: b.stat().pools[0].leased_write == 0)
        st = b.stat()
        assert st.pools[0].quarantined == len(mine) * PAGE
        assert "protocol error" in d.log()
        lb = b.reserve("b-obj", {"x": (16 << 20) - len(mine) * PAGE})  # all that is free
        assert not pages_of(lb.extents()) & mine
        with pytest.raises(PoolFull):
            b.reserve("more", {"x": PAGE})
        lb.abort()
        # Freed after the flag's 2 s, well before the default 10 s.
        assert wait_until(lambda: b.stat().pools[0].quarantined == 0, timeout=8)
        assert exact(b.stat())
    s.close()


def test_a_client_closing_its_own_connection_frees_at_once(make_daemon):
    d = make_daemon(*ARGS, env={"KVBROKER_RESTART_QUARANTINE": "3600"})
    s, call = raw_client(d.socket_path)
    call(2, "reserve", key="slow", buffers={"x": 1 << 20})
    call(3, "arena", nbytes=1 << 20)
    with d.client(arena_size=0) as b:
        assert b.stat().pools[0].leased_write > 1 << 20
        s.close()  # EOF: the writer is gone
        assert wait_until(lambda: b.stat().pools[0].leased_write == 0)
        assert b.stat().pools[0].quarantined == 0
        assert exact(b.stat())


# -- in process: close_session, the journal, restore ----------------------------------------
@pytest.fixture
def pool():
    p = HostPool(0, f"/kvbq.{os.getpid()}.{secrets.token_hex(3)}.0", 64 * PAGE, PAGE)
    yield p
    p.unlink()


def session(b):
    s = b.open_session(pid=1, uid=0, gid=0)
    b.handle(s, "hello", {"version": 1, "name": "t"})
    return s


def test_cut_off_quarantines_leases_arenas_and_the_ttl_quarantine_then_frees(pool):
    clock = Clock()
    b = Broker([pool], clock=clock, lease_ttl=5.0, restart_quarantine=10.0)
    w = session(b)
    b.handle(w, "reserve", {"key": "expired", "buffers": {"x": 4 * PAGE}})
    clock.now += 6
    assert b.expire() == 1  # quarantined on the session (TTL)
    b.handle(w, "reserve", {"key": "open", "buffers": {"x": 8 * PAGE}})
    b.handle(w, "arena", {"nbytes": 4 * PAGE})
    b.handle(w, "reserve", {"namespace": "t", "key": "t", "buffers": {"x": PAGE}})
    b.close_session(w, cut_off=True)
    snap = b.snapshot()
    assert snap["pools"][0]["quarantined"] == 17 * PAGE
    assert snap["pools"][0]["leased_write"] == 0 and not b.pending and not b.arenas
    assert pool.allocator.used == 17
    other = session(b)
    with pytest.raises(PoolFull):
        b.handle(other, "reserve", {"key": "big", "buffers": {"x": 48 * PAGE}})
    clock.now += 9.9
    b.expire()
    assert pool.allocator.used == 17
    clock.now += 0.2
    b.expire()
    assert pool.allocator.used == 0 and b.snapshot()["pools"][0]["quarantined"] == 0
    assert not b.accounts.statistics().charged  # every charge went back with the pages
    b.handle(other, "reserve", {"key": "big", "buffers": {"x": 64 * PAGE}})


def test_journal_replay_quarantines_exactly_what_was_lent(pool, tmp_path):
    path = str(tmp_path / "j")
    b = Broker([pool])
    b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
    s = session(b)
    sealed = b.handle(s, "reserve", {"key": "sealed", "buffers": {"x": 2 * PAGE}})
    b.handle(s, "seal", {"lease": sealed["lease"]})
    aborted = b.handle(s, "reserve", {"key": "aborted", "buffers": {"x": 2 * PAGE}})
    b.handle(s, "abort", {"lease": aborted["lease"]})
    b.handle(s, "reserve", {"key": "open", "buffers": {"x": 3 * PAGE}})
    b.handle(
        s,
        "reserve_blocks",
        {
            "namespace": "p",
            "blocks": [
                {"key": "b0", "buffers": {"k": PAGE}},
                {"key": "b1", "parent": "b0", "buffers": {"k": PAGE}},
            ],
        },
    )
    # an arena: published in part (split), then in part with no further arena (the rest
    # goes back before the seal record), then a fresh one published in part and kept
    ar = b.handle(s, "arena", {"nbytes": 4 * PAGE})["lease"]
    r = b.handle(
        s, "publish", {"arena": ar, "key": "p1", "buffers": {"x": PAGE}, "next_arena": 4 * PAGE}
    )
    r = b.handle(
        s, "publish", {"arena": r["lease"], "key": "p2", "buffers": {"x": PAGE}, "next_arena": 0}
    )
    assert r["lease"] is None
    ar = b.handle(s, "arena", {"nbytes": 4 * PAGE})["lease"]
    b.handle(
        s, "publish", {"arena": ar, "key": "p3", "buffers": {"x": PAGE}, "next_arena": 4 * PAGE}
    )

    def lent(br):
        return sorted(br.journal_lent())

    expected = lent(b)
    assert sum(n for _, _, n in expected) == 3 + 2 + 3  # open, two blocks, the arena's rest
    rec = Journal.load(path)
    assert sorted((p, st, n) for (p, st), n in rec.lent.items()) == expected
    b.compact_journal()  # a compacted journal says the same
    rec = Journal.load(path)
    assert sorted((p, st, n) for (p, st), n in rec.lent.items()) == expected
    b.journal.close()
    b.journal = None  # the old daemon is "dead": what it does next is not journaled

    clock = Clock()
    pool2 = HostPool.adopt(0, pool.name, pool.size, PAGE)
    b2 = Broker([pool2], clock=clock, restart_quarantine=10.0)
    assert b2.restore(rec.objects.values(), [(p, st, n) for (p, st), n in rec.lent.items()]) == 4
    assert sorted(b2.journal_lent()) == expected
    assert b2.snapshot()["pools"][0]["quarantined"] == 8 * PAGE
    # what the old daemon had, less its leases: the same free space once they end
    for lid in list(b.arenas):
        b.handle(s, "abort", {"lease": lid})
    b.close_session(s)
    assert pool2.allocator.used == pool.allocator.used + 8
    clock.now += 11
    b2.expire()
    assert pool2.allocator.free_extents() == pool.allocator.free_extents()


def test_restore_drops_lent_extents_a_wrong_journal_puts_over_objects(pool, tmp_path):
    path = str(tmp_path / "j")
    b = Broker([pool])
    b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
    s = session(b)
    r = b.handle(s, "reserve", {"key": "sealed", "buffers": {"x": 4 * PAGE}})
    b.handle(s, "seal", {"lease": r["lease"]})
    start = r["buffers"]["x"][1] // PAGE
    b.journal.close()
    rec = Journal.load(path)
    b2 = Broker([HostPool.adopt(0, pool.name, pool.size, PAGE)])
    bogus = [(0, start + 2, 4), (0, 60, 10), (3, 0, 1), (0, 50, 2), (0, 51, 1)]
    assert b2.restore(rec.objects.values(), bogus) == 1
    assert sorted(b2.journal_lent()) == [(0, 50, 2)]


def test_a_client_that_stops_reading_is_cut_off_and_its_write_pages_quarantined(make_daemon):
    d = make_daemon(*ARGS, env={**ENV, "KVBROKER_MAX_WRITE_BUFFER": "64K"})
    s, call = raw_client(d.socket_path)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    lease = call(2, "reserve", key="slow", buffers={"x": 1 << 20})
    mine = pages_of(lease["buffers"])
    with d.client(arena_size=0) as b:
        req = msgpack.packb({"id": 3, "op": "stat", "args": {}})
        s.settimeout(30)  # a daemon that never cuts it off fails the test, not hangs it
        try:
            for _ in range(200_000):  # pipelined, never read: past max_write_buffer
                s.sendall(req)
        except OSError:
            pass  # cut off
        assert wait_until(lambda: b.stat().pools[0].leased_write == 0)
        assert b.stat().pools[0].quarantined == 1 << 20
        assert "bytes of replies left unread" in d.log()
        lb = b.reserve("b-obj", {"x": 15 << 20})  # all that is free
        assert not pages_of(lb.extents()) & mine
        lb.abort()
        assert wait_until(lambda: b.stat().pools[0].quarantined == 0)
        assert exact(b.stat())
    s.close()


def test_a_requests_journal_records_go_out_in_one_write_even_when_it_fails(
    pool, tmp_path, monkeypatch
):
    """A 10-block reserve journals 10 lent extents in one write(2), before its reply; a
    batch that fails part-way (the pool runs out) still writes what it lent and gave back,
    so a restart quarantines nothing it should not."""
    import kvbroker._server.journal as journal_module

    path = str(tmp_path / "j")
    b = Broker([pool])
    b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
    s = session(b)
    writes = []
    real_write = os.write

    def counting_write(fd, data):
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(journal_module.os, "write", counting_write)
    blocks = [{"key": f"b{i}", "parent": f"b{i - 1}" if i else None} for i in range(10)]
    r = b.handle(
        s,
        "reserve_blocks",
        {"namespace": "p", "blocks": blocks, "buffers": {"k": PAGE}, "compact": True},
    )
    assert len(writes) == 1
    assert len(b.journal_lent()) == 10
    b.handle(s, "seal_many", {"leases": r["leases"], "checksums": None})
    assert len(writes) == 2
    too_many = [{"key": f"c{i}"} for i in range(70)]  # 64 pages, even evicting b0..b9
    with pytest.raises(PoolFull):
        b.handle(
            s, "reserve_blocks", {"namespace": "p", "blocks": too_many, "buffers": {"k": PAGE}}
        )
    assert len(writes) == 3  # what the failed batch lent, and gave back, in one write
    b.journal.close()
    rec = Journal.load(path)
    assert rec is not None and not rec.lent  # nothing stays quarantined after the failure
    assert {r["key"] for r in rec.objects.values()} <= {f"b{i}" for i in range(10)}
