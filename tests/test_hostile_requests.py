"""Requests that used to hurt other clients or lose state (found by an adversarial review):
each test here failed on the code before its fix.

A frame's bytes past the request limit; renewals growing the expiry heap; metas and names
that cost the daemon far more memory than the pool bytes they take; counters a bad
``block_tokens`` overflows; a NaN ``older_than``; batches applied in part before an error;
a frame a client hides in its meta read back as a record of a damaged journal.
"""

from __future__ import annotations

import mmap
import os
import secrets
import signal
import struct
import time
import zlib

import msgpack
import posix_ipc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import DaemonProcess, drop_leftover_pools
from kvbroker._server.broker import Broker
from kvbroker._server.journal import Journal, JournalError, journal_path
from kvbroker._server.pool import HostPool
from kvbroker._server.state import index_footprint
from kvbroker._wire.checksum import digest, encode
from kvbroker._wire.protocol import MAX_REQUEST, PROTOCOL_VERSION
from kvbroker.errors import BadRequest, BrokerUnavailable, LeaseExpired, PoolFull, Timeout
from test_hardening import raw, recv_one, rss
from test_quarantine import session


@pytest.fixture
def broker():
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 4096 * 4096, 4096)
    b = Broker([pool], max_lease_ttl=3600.0)
    yield b
    pool.unlink()


def _sealed(b, s, key, nbytes=4096, **kw):
    r = b.handle(s, "reserve", {"key": key, "buffers": {"kv": nbytes}, **kw})
    b.handle(s, "seal", {"lease": r["lease"]})


# -- framing ---------------------------------------------------------------------------------
def _send_unfinished_frame(s) -> int:
    """An array of 1M arrays of 15 ints (16 MiB in all), sent until the peer hangs up (or
    8 requests' worth went); returns the bytes sent."""
    s.sendall(b"\xdd" + struct.pack(">I", 1 << 20))
    sent = 0
    try:
        while sent < 8 * MAX_REQUEST:
            s.sendall((b"\x9f" + b"\x00" * 15) * 4096)
            sent += 65536
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def test_a_frame_longer_than_a_request_is_cut_off_while_it_arrives(daemon):
    before = rss(daemon.proc.pid)
    s = raw(daemon.socket_path, hello=False)
    sent = _send_unfinished_frame(s)
    reply = recv_one(s)
    assert reply["ok"] is False and "exceeds" in reply["error"]["message"]
    assert sent <= 2 * MAX_REQUEST
    grown = rss(daemon.proc.pid) - before
    assert grown < 200 << 20, f"one unfinished frame grew the daemon by {grown >> 20} MiB"
    with daemon.client() as c:
        assert c.ping()


# -- the expiry heap ------------------------------------------------------------------------
def test_renewals_and_long_claims_keep_the_expiry_heap_bounded(broker):
    s = session(broker)
    _sealed(broker, s, "a")
    lease = broker.handle(s, "claim", {"key": "a", "ttl": 3600})["lease"]
    for _ in range(20):
        reply = broker.handle(s, "renew", {"leases": [lease] * 10_000, "ttl": 3600})
        assert len(reply["expires_in"]) == 10_000
    for _ in range(5000):  # claims released long before their TTL
        other = broker.handle(s, "claim", {"key": "a", "ttl": 3600})["lease"]
        broker.handle(s, "release", {"lease": other})
    assert broker.leases.statistics().scheduled <= 2 * len(broker.leases) + 1024
    assert broker.expire(time.monotonic() + 7200) == 1  # the renewed lease still expires


# -- what an object costs the daemon --------------------------------------------------------
def test_an_object_occupies_at_least_the_memory_of_its_meta_and_names(broker):
    s = session(broker)
    meta = {"m": [{}] * 60_000}  # 60 KB packed, ~4 MB unpacked
    r = broker.handle(s, "reserve", {"key": "heavy", "buffers": {"kv": 16}, "meta": meta})
    obj = broker.leases[r["lease"]].obj
    ps = obj.pool.page_size
    assert index_footprint(obj.buffers, meta) > 60_000 * 56
    assert obj.npages * ps >= index_footprint(obj.buffers, meta)
    names = {f"b{i:05d}" + "x" * 100: 0 for i in range(8192)}
    r = broker.handle(s, "reserve", {"key": "names", "buffers": names})
    obj = broker.leases[r["lease"]].obj
    assert obj.npages * ps >= 8192 * 100
    # an ordinary object is not made larger
    r = broker.handle(s, "reserve", {"key": "kv", "buffers": {"k": 65536, "v": 65536}})
    assert broker.leases[r["lease"]].obj.npages * ps == 131072


def test_many_heavy_metas_keep_the_daemon_within_its_pool(make_daemon):
    d = make_daemon("--pool-size", "32M", "--page-size", "4K")
    before = rss(d.proc.pid)
    with d.client() as c:
        for i in range(200):
            lease = c.reserve(f"k{i}", {"kv": 16}, meta={"m": [{}] * 60_000}, checksum=False)
            lease.seal()
        assert c.stat().counters.evictions > 0  # each took megabytes of the pool
    grown = rss(d.proc.pid) - before
    assert grown < 160 << 20, f"200 heavy metas grew the daemon by {grown >> 20} MiB"


# -- argument ranges -------------------------------------------------------------------------
@pytest.mark.parametrize("block_tokens", [2**64 - 1, 1 << 40, -1])
def test_a_block_tokens_out_of_range_is_refused_and_stat_keeps_working(daemon, block_tokens):
    with daemon.client() as c:
        c.put("blk", {"kv": b"x" * 16})
        with pytest.raises(BadRequest, match="block_tokens"):
            c.ops.match_prefix(["blk"], block_tokens=block_tokens, hold=False)
        with daemon.client() as other:
            assert other.stat().counters.prefix_hit_tokens >= 0


@pytest.mark.parametrize("older_than", [float("nan"), -1.0, float("inf")])
def test_evict_with_an_older_than_that_is_not_a_duration_is_refused(client, older_than):
    for k in ("x1", "x2", "x3"):
        client.put(k, {"kv": b"v" * 64})
    with pytest.raises(BadRequest, match="older_than"):
        client.evict(older_than=older_than)
    assert all(client.exists(k) for k in ("x1", "x2", "x3"))


# -- batches: all or nothing ------------------------------------------------------------------
def test_batches_check_every_item_before_changing_anything(broker):
    s = session(broker)
    a = broker.handle(s, "reserve", {"key": "a", "buffers": {"kv": 4096}})["lease"]
    with pytest.raises(BadRequest):
        broker.handle(s, "seal_many", {"leases": [a, "not-a-lease"]})
    with pytest.raises(BadRequest, match="no lease"):
        broker.handle(s, "seal_many", {"leases": [a, 999_999]})
    b = broker.handle(s, "reserve", {"key": "b", "buffers": {"kv": 4096}})["lease"]
    with pytest.raises(BadRequest):
        broker.handle(s, "seal_many", {"leases": [a, b], "checksums": [None, {"kv": "bogus"}]})
    with pytest.raises(BadRequest, match="twice"):
        broker.handle(s, "seal_many", {"leases": [a, a]})
    assert not broker.objects  # nothing was sealed
    broker.handle(s, "seal_many", {"leases": [a, b]})
    assert set(broker.objects) == {("default", "a"), ("default", "b")}
    claim = broker.handle(s, "claim", {"key": "a", "consume": True})["lease"]
    with pytest.raises(BadRequest, match="twice"):
        broker.handle(s, "release_many", {"leases": [claim, claim]})
    with pytest.raises(BadRequest, match="no lease"):
        broker.handle(s, "release_many", {"leases": [claim, 999_999]})
    assert ("default", "a") in broker.objects  # not consumed
    with pytest.raises(BadRequest, match="no lease"):
        broker.handle(s, "renew", {"leases": [claim, 999_999], "ttl": 77})
    assert broker.leases[claim].ttl != 77
    broker.handle(s, "release_many", {"leases": [claim]})
    assert ("default", "a") not in broker.objects


# -- the journal ------------------------------------------------------------------------------
@pytest.mark.parametrize("magic", [b"KVJ2", b"KVJ3"])  # either format's
def test_a_record_hidden_in_a_meta_is_not_read_back_from_a_damaged_journal(socket_path, magic):
    """A client writes a whole journal frame (sealing another client's key over its own
    bytes) into its meta; the file's tail is then damaged. The reader looks inside the
    damage for the next frame: it must not take the hidden one for a record."""
    args = ("--pool-size", "16M", "--page-size", "4K", "--read-replicas", "0")
    d = DaemonProcess(socket_path, *args)
    try:
        with d.client(arena_size=0) as victim:
            victim.put("victim-key", {"kv": b"V" * 5000})
        s = raw(socket_path, hello=False)

        def call(op, **args):
            s.sendall(msgpack.packb({"id": 1, "op": op, "args": args}))
            return recv_one(s)

        pools = call("hello", version=PROTOCOL_VERSION)["result"]["pools"]
        r = call("reserve", namespace="mallory", key="m-data", buffers={"kv": 5000})["result"]
        pool, off, n = r["buffers"]["kv"]
        shm = posix_ipc.SharedMemory(pools[pool]["name"])
        mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        mm[off : off + n] = b"M" * n
        mm.close()
        sums = {"kv": encode(digest(b"M" * n))}
        call("seal", lease=r["lease"], checksums=sums)
        body = msgpack.packb(
            {
                "t": "s",
                "o": {
                    "serial": 10**9,
                    "namespace": "default",
                    "key": "victim-key",
                    "pool": pool,
                    "start": off // pools[pool]["page_size"],
                    "npages": 2,
                    "nbytes": n,
                    "buffers": {"kv": [off, n]},
                    "meta": None,
                    "created_at": time.time(),
                    "consumers": 1,
                    "parent_key": None,
                    "checksums": sums,
                    "tokens": None,
                    "tenants": [],
                    "parent": None,
                },
            }
        )
        frame = struct.pack("<4sII", magic, len(body), zlib.crc32(body)) + body
        r = call(
            "reserve", namespace="mallory", key="carrier", buffers={"kv": 1}, meta={"x": frame}
        )["result"]
        call("seal", lease=r["lease"])
        s.close()
        time.sleep(0.2)
        d.stop(signal.SIGKILL)
        path = journal_path(socket_path)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:-1])  # the last record torn
        d = DaemonProcess(socket_path, *args)
        with d.client() as victim:
            assert victim.get("victim-key")["kv"].tobytes() == b"V" * 5000
    finally:
        d.stop()
        drop_leftover_pools(socket_path)


def test_a_format_2_journal_is_still_read_and_rewritten_as_format_3(tmp_path):
    """Journals written before the seed (an upgrade with a warm restart)."""
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 64 * 4096, 4096)
    try:
        path = str(tmp_path / "j")

        def frame(entry):
            body = msgpack.packb(entry)
            return struct.pack("<4sII", b"KVJ2", len(body), zlib.crc32(body)) + body

        header = frame({"t": "h", "v": 2, "epoch": 7, "pools": [pool.describe()], "ids": 5})
        record = {
            "serial": 3,
            "namespace": "default",
            "key": "old",
            "pool": 0,
            "start": 0,
            "npages": 1,
            "nbytes": 10,
            "buffers": {"kv": [0, 10]},
            "meta": None,
            "created_at": time.time(),
            "consumers": 1,
            "parent_key": None,
            "checksums": None,
            "tokens": None,
            "tenants": [],
            "parent": None,
        }
        with open(path, "wb") as f:
            f.write(header + header + frame({"t": "s", "o": record}))
        rec = Journal.load(path)
        assert list(rec.objects) == [3] and not rec.suspect
        j = Journal(path, 8, [pool.describe()])
        j.rewrite([record], 10)
        j.close()
        with open(path, "rb") as f:
            assert f.read(4) == b"KVJ3"
        assert list(Journal.load(path).objects) == [3]
    finally:
        pool.unlink()


def test_only_the_files_first_frames_can_be_its_header(tmp_path):
    """Both copies of the header damaged: the reader gives up (JournalError) rather than
    take a header frame a client hid in a meta further on, whose seed would make the
    client's hidden records pass."""
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 64 * 4096, 4096)
    try:
        path = str(tmp_path / "j")
        body = msgpack.packb(
            {"t": "h", "v": 3, "epoch": 1, "pools": [pool.describe()], "ids": 5, "seed": 42}
        )
        hidden = struct.pack("<4sII", b"KVJ3", len(body), zlib.crc32(body)) + body
        record = {
            "serial": 3,
            "namespace": "m",
            "key": "carrier",
            "pool": 0,
            "start": 0,
            "npages": 1,
            "nbytes": 1,
            "buffers": {"kv": [0, 1]},
            "meta": {"x": hidden},
            "created_at": time.time(),
            "consumers": 1,
            "parent_key": None,
            "checksums": None,
            "tokens": None,
            "tenants": [],
            "parent": None,
        }
        j = Journal(path, 8, [pool.describe()])
        j.rewrite([record], 10)
        j.close()
        assert list(Journal.load(path).objects) == [3]
        with open(path, "r+b") as f:
            data = f.read()
            second = data.find(b"KVJ3", 1)
            for at in (0, second):  # both copies' magic
                f.seek(at)
                f.write(b"XXXX")
        with pytest.raises(JournalError, match="header"):
            Journal.load(path)
    finally:
        pool.unlink()


# -- eviction -------------------------------------------------------------------------------
def _pool_broker(mib: int = 64):
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", mib << 20, 64 << 10)
    return pool, Broker([pool], high_watermark=1.0, low_watermark=1.0)


def test_a_reservation_no_eviction_can_make_room_for_evicts_nothing():
    pool, b = _pool_broker()
    try:
        s = session(b)
        for i in range(60):
            _sealed(b, s, f"obj{i}", 1 << 20)
        other = session(b)
        b.handle(other, "claim", {"key": "obj30"})  # a reader in the middle of the pool
        with pytest.raises(PoolFull, match="whatever is evicted"):
            b.handle(other, "reserve", {"key": "big", "buffers": {"kv": 40 << 20}})
        assert len(b.objects) == 60 and b.counters["evictions"] == 0
        r = b.handle(other, "reserve", {"key": "fits", "buffers": {"kv": 20 << 20}})
        assert r["lease"] and len(b.objects) < 60  # room that eviction can make: made
    finally:
        pool.unlink()


def test_eviction_reaches_the_parents_of_evicted_blocks():
    """A prefix chain's parents join the LRU only as their children go: a reservation
    that needs the whole chain's room evicts it all, not just the leaves it saw first."""
    pool, b = _pool_broker(16)
    try:
        s = session(b)
        parent = None
        for i in range(15):  # one chain of 15 blocks of 1 MiB
            blk = {"key": f"b{i}", "parent": parent, "buffers": {"kv": 1 << 20}}
            r = b.handle(s, "reserve_blocks", {"blocks": [blk]})
            b.handle(s, "seal", {"lease": r["results"][0]["lease"]})
            parent = f"b{i}"
        assert len(list(b.directory.evictable())) == 1  # only the leaf is evictable at first
        r = b.handle(s, "reserve", {"key": "big", "buffers": {"kv": 16 << 20}})
        assert r["lease"] and not b.objects
    finally:
        pool.unlink()


def test_an_evict_that_reads_every_buffer_name_does_not_stall_other_clients(make_daemon):
    """match_buffers over many objects of many buffers: seconds of regex searches, done in
    slices of the loop so another client's requests are answered meanwhile."""
    import threading

    d = make_daemon("--pool-size", "256M", "--page-size", "4K")
    with d.client() as c:
        names = {f"b{j:05d}" + "x" * 40: 0 for j in range(4096)}
        for i in range(80):
            c.reserve(f"k{i}", names, checksum=False).seal()
        c.reserve("target", {"zzz-kv": 16}, checksum=False).seal()
        waits: list[float] = []
        done = threading.Event()

        def honest():
            with d.client() as h:
                while not done.is_set():
                    t = time.perf_counter()
                    h.ping()
                    waits.append(time.perf_counter() - t)
                    time.sleep(0.01)

        th = threading.Thread(target=honest)
        th.start()
        deadline = time.monotonic() + 60
        while not waits:  # the honest client is answered before the evict starts
            assert time.monotonic() < deadline, "the honest client got no answer"
            time.sleep(0.01)
        t = time.perf_counter()
        result = c.evict(match_buffers="zzz")
        took = time.perf_counter() - t
        done.set()
        th.join()
        assert result.count == 1 and not c.exists("target") and c.exists("k0")
    assert took > 0.2, "the scan was too quick to show anything: make it bigger"
    assert max(waits) < took / 3, f"a ping waited {max(waits):.2f} s of the {took:.2f} s evict"


# -- what the client sends ---------------------------------------------------------------------
def test_the_client_refuses_a_request_the_daemon_would_not_read_and_stays_connected(client):
    names = {f"b{i:05d}" + "n" * 200: 0 for i in range(8192)}  # ~1.7 MB of names
    with pytest.raises(BadRequest, match="packs to"):
        client.reserve("too-big", names)
    assert client.ping()
    client.put("fine", {"kv": b"x" * 10})
    assert client.get("fine")["kv"].tobytes() == b"x" * 10


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3000), max_size=200), st.integers(1, 5000), st.integers(1, 50))
def test_request_chunks_cover_the_batch_in_order_within_the_limits(costs, budget, most):
    from kvbroker._wire.protocol import request_chunks

    ranges = request_chunks(costs, budget, most)
    assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(len(costs)))
    for lo, hi in ranges:
        assert hi - lo <= most
        assert hi - lo == 1 or sum(costs[lo:hi]) <= budget  # an item alone may be over


# -- a forked process -------------------------------------------------------------------------
def _in_child(fn) -> int:
    """Run ``fn`` in a forked child; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_child_never_reads_its_parents_replies(daemon):
    import numpy as np

    with daemon.client() as c:
        c.put("a", {"x": np.full(4096, 1, np.uint8)})
        c.put("b", {"x": np.full(4096, 2, np.uint8)})

        def child() -> bool:
            buf = np.empty(4096, np.uint8)
            for _ in range(500):
                c.get("b", {"x": buf})
                if not (buf == 2).all():
                    return False
            return True

        pid = os.fork()
        if pid == 0:
            os._exit(0 if child() else 3)
        buf = np.empty(4096, np.uint8)
        for _ in range(500):
            c.get("a", {"x": buf})
            assert (buf == 1).all()
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert c.ping()  # the parent's connection is untouched


def test_a_forked_child_without_reconnecting_gets_a_clear_error(daemon):
    with daemon.client(reconnect=0) as c:
        c.put("a", {"x": b"1"})

        def child() -> bool:
            try:
                c.exists("a")
            except BrokerUnavailable as exc:
                return "forked" in str(exc)
            return False

        assert _in_child(child) == 0
        assert c.exists("a")


# -- second review ----------------------------------------------------------------------------
def test_an_arena_put_too_big_for_one_request_takes_reserve_and_seal(client):
    import numpy as np

    names = {f"buffer_{j:05d}_" + "n" * 50: np.zeros(8, np.uint8) for j in range(8192)}
    assert client.put("many", names) is True
    assert client.get("many")["buffer_00007_" + "n" * 50].tobytes() == bytes(8)


def test_a_damaged_first_header_is_damage(tmp_path):
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 64 * 4096, 4096)
    try:
        path = str(tmp_path / "j")
        j = Journal(path, 8, [pool.describe()])
        j.rewrite([], 10)
        j.close()
        with open(path, "r+b") as f:
            f.seek(20)
            byte = f.read(1)
            f.seek(20)
            f.write(bytes([byte[0] ^ 0xFF]))  # inside the first copy's body
        rec = Journal.load(path)
        assert rec.suspect and rec.damaged[0][0] == 0
    finally:
        pool.unlink()


def test_a_format_2_journal_with_its_first_bytes_damaged_is_still_read(tmp_path):
    pool = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 64 * 4096, 4096)
    try:
        path = str(tmp_path / "j")
        body = msgpack.packb({"t": "h", "v": 2, "epoch": 7, "pools": [pool.describe()], "ids": 5})
        header = struct.pack("<4sII", b"KVJ2", len(body), zlib.crc32(body)) + body
        with open(path, "wb") as f:
            f.write(b"X" + header[1:] + header)
        rec = Journal.load(path)
        assert rec.epoch == 7 and rec.suspect
    finally:
        pool.unlink()


def test_eviction_room_counts_chains_across_pools():
    """A parent in one pool whose child in another is being read cannot be evicted: the
    pool holding it has no room for a whole-pool reservation, and nothing is evicted."""
    a = HostPool(0, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 16 << 20, 64 << 10)
    b2 = HostPool(1, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}", 16 << 20, 64 << 10)
    try:
        b = Broker([a, b2], high_watermark=1.0, low_watermark=1.0)
        s = session(b)
        for key, parent in (("parent", None), ("child", "parent")):
            blk = {"key": key, "parent": parent, "buffers": {"kv": 1 << 20}}
            r = b.handle(s, "reserve_blocks", {"blocks": [blk]})
            b.handle(s, "seal", {"lease": r["results"][0]["lease"]})
        assert b.objects[("default", "parent")].pool is not b.objects[("default", "child")].pool
        b.handle(s, "claim", {"key": "child"})
        for i in range(20):
            _sealed(b, s, f"f{i}", 1 << 20)
        before = len(b.objects)
        with pytest.raises(PoolFull, match="whatever is evicted"):
            b.handle(s, "reserve", {"key": "big", "buffers": {"kv": 16 << 20}})
        assert len(b.objects) == before and b.counters["evictions"] == 0
    finally:
        a.unlink()
        b2.unlink()


def test_a_read_replica_cuts_off_a_frame_longer_than_a_request(make_daemon):
    d = make_daemon("--pool-size", "16M", "--read-replicas", "1")
    with d.client() as c:
        paths = c._replica.paths if c._replica is not None else []
    if not paths:
        pytest.skip("no read replica started here")
    s = raw(paths[0], hello=False)
    sent = _send_unfinished_frame(s)
    assert sent <= 2 * MAX_REQUEST


def test_a_refused_seal_many_aborts_every_lease_it_did_not_seal(client):
    from kvbroker._client.leases import seal_many

    first = client.reserve("first", {"kv": 16})
    second = client.reserve("second", {"kv": 16})
    client.ops.abort(second.id)  # gone before the batch: the daemon refuses it whole
    with pytest.raises(LeaseExpired):
        seal_many([first, second])
    assert not client.exists("first")
    assert client.stat().write_leases == 0


def test_list_and_evict_replies_stay_small_whatever_the_metas(make_daemon):
    """Objects of one byte with 60 KB metas: a reply listing thousands of them passed a
    reader's write buffer (the daemon cut honest readers off) and stalled the loop."""
    d = make_daemon("--pool-size", "64M", "--page-size", "64K")
    with d.client() as c:
        for i in range(900):
            c.put(f"big-{i}", {"x": b"1"}, meta={"m": "a" * 60_000}, namespace="hostile")
        with d.client() as honest:
            honest.put("mine", {"x": b"1"})
            listed = honest.list()
            assert len(listed) == 901 and not listed.truncated
            pages = list(honest.list_pages())
            assert len(pages) > 1  # pages of at most ~4 MiB
        result = c.evict(all=True)
        assert result.count == 901 and 0 < len(result.objects) < 901
        assert c.stat().objects == 0


def test_a_forked_child_leaves_its_parents_socket_options_alone(daemon):
    """The socket is shared: a timeout the child set (a claim's wait, the parting-error
    read) would be the parent's too."""
    import socket as socket_mod

    with daemon.client(timeout=30.0) as c:
        c.put("a", {"x": b"1"})
        sock = c._session._stream.transport._sock
        before = sock.getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_RCVTIMEO, 16)

        def child() -> bool:
            c.exists("a")  # connects again from the child
            with pytest.raises(Timeout):
                c.claim("never", wait=0.2)
            return True

        assert _in_child(child) == 0
        assert sock.getsockopt(socket_mod.SOL_SOCKET, socket_mod.SO_RCVTIMEO, 16) == before
        assert c.exists("a")


# -- third round --------------------------------------------------------------------------------
def test_a_forked_childs_put_never_writes_into_its_parents_arena(daemon):
    with daemon.client() as c:
        c.put("warm", {"a": b"w" * 1000})  # the parent holds an arena now

        def child() -> bool:
            for i in range(20):
                c.put(f"child-{i}", {"a": b"C" * 1000})
            return True

        pid = os.fork()
        if pid == 0:
            os._exit(0 if child() else 3)
        for i in range(20):
            c.put(f"parent-{i}", {"a": b"P" * 1000})
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        for i in range(20):
            assert c.get(f"parent-{i}", verify=True)["a"].tobytes() == b"P" * 1000
            assert c.get(f"child-{i}", verify=True)["a"].tobytes() == b"C" * 1000


def test_a_child_forked_while_a_thread_is_mid_call_does_not_hang(daemon):
    import threading

    with daemon.client() as c:
        c.put("present", {"a": b"x" * 16})
        waiting = threading.Thread(target=lambda: pytest.raises(Timeout, c.claim, "never", wait=3))
        waiting.start()
        time.sleep(0.3)  # the thread holds the session's lock, waiting for its reply

        def child() -> bool:
            signal.alarm(10)  # a hang fails the child, not the test run
            return c.exists("present")

        assert _in_child(child) == 0
        waiting.join()


def test_a_put_whose_seal_would_pass_a_request_is_refused_before_anything_is_reserved(client):
    buffers = {f"{i:05d}" + "n" * 115: b"x" for i in range(8192)}
    before = client.stat()
    with pytest.raises(BadRequest, match="seal"):
        client.put("big", buffers)
    after = client.stat()
    assert after.write_leases == 0 and after.objects == before.objects
    assert after.counters.aborts == before.counters.aborts  # nothing was reserved
    assert client.put("fine", {"x": b"1"})


def test_batches_are_sized_by_their_utf8_bytes(client):
    from kvbroker.prefix import PrefixCache

    pc = PrefixCache(client, block_size=4)
    names = [f"{j:02d}" + "中" * 126 for j in range(64)]  # 380 bytes each, 128 characters
    tokens = list(range(480))
    assert pc.publish(tokens, [{n: b"\x01" for n in names}] * 120) == 120
    with pc.match(tokens + [7]) as m:  # (a match leaves the prompt's last token out)
        assert m.num_blocks == 120


def test_list_pages_refuses_a_page_size_that_would_never_end(client):
    client.put("k", {"x": b"1"})
    with pytest.raises(BadRequest, match="page_size"):
        next(iter(client.list_pages(page_size=0)))
