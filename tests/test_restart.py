"""Warm restart: a daemon killed with SIGKILL comes back with every sealed object intact;
clients reconnect by themselves; leases that died with the old daemon say so."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import numpy as np
import posix_ipc
import pytest

from conftest import DaemonProcess, drop_leftover_pools
from kvbroker import BrokerUnavailable, Exists, LeaseExpired, NotFound, PoolFull
from kvbroker._server.allocator import ExtentAllocator
from kvbroker._server.broker import Broker
from kvbroker._server.journal import Journal, _frame, journal_path
from kvbroker._server.pool import HostPool, segment_prefix
from kvbroker.prefix import PrefixCache

ARGS = ("--pool-size", "16M", "--page-size", "4K")


def pattern(key: str, n: int) -> np.ndarray:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def daemons(socket_path):
    """Start daemons on one socket, one after another; every one is stopped at the end."""
    started: list[DaemonProcess] = []

    def start(*args: str) -> DaemonProcess:
        d = DaemonProcess(socket_path, *(args or ARGS))
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    drop_leftover_pools(socket_path)  # a daemon killed last left its pools


def segment_exists(name: str) -> bool:
    try:
        posix_ipc.SharedMemory(name).close_fd()
        return True
    except posix_ipc.ExistentialError:
        return False


def test_sigkill_restart_keeps_sealed_objects_and_drops_unsealed(daemons):
    d = daemons()
    c = d.client(reconnect=0)
    keys = [f"obj-{i}" for i in range(30)]
    for i, k in enumerate(keys):
        c.put(k, {"kv": pattern(k, 5000 + 999 * i), "tail": pattern(k + "t", 7)}, meta={"i": i})
    c.put("replaced", {"kv": pattern("old", 100)})
    c.put("replaced", {"kv": pattern("new", 200)}, replace=True)
    c.put("shared", {"kv": pattern("shared", 300)}, consumers=2)
    with c.claim("shared", consume=True):
        pass  # one of its two consumers is done
    with c.claim("obj-0", consume=True):
        pass  # consumed: gone
    pending = c.reserve("half-written", {"kv": 1 << 20})
    pending["kv"][:10] = 1
    held = c.claim("obj-1")
    c.evict("obj-2")
    st = c.stat()
    # everything but the unsealed reservation and the client's write arena (pages lent for
    # writing: the next daemon quarantines them, their writer may still be copying)
    lent = st.pools[0].leased_write
    assert lent >= 1 << 20
    used_sealed = st.used - lent
    old_pid = c.server_pid
    d.stop(signal.SIGKILL)

    d2 = daemons()
    with d2.client(reconnect=0) as c2:
        assert c2.server_pid != old_pid and c2.epoch == 2
        st2 = c2.stat()
        # the half-written object's pages are not an object, nor free yet: quarantined
        assert st2.used == used_sealed + lent and st2.pools[0].quarantined == lent
        assert not c2.exists("half-written")
        with pytest.raises(NotFound):
            c2.claim("obj-0")
        assert not c2.exists("obj-2")
        for i, k in enumerate(keys[3:], start=3):
            got = c2.get(k)
            assert np.array_equal(got["kv"], pattern(k, 5000 + 999 * i))
            assert np.array_equal(got["tail"], pattern(k + "t", 7))
            assert c2.lookup(k).meta == {"i": i}
        assert np.array_equal(c2.get("obj-1")["kv"], pattern("obj-1", 5999))
        assert np.array_equal(c2.get("replaced")["kv"], pattern("new", 200))
        # One consumer left of two: the next consume-claim frees it.
        with c2.claim("shared", consume=True):
            pass
        assert not c2.exists("shared")
        # Lease ids continue past the old daemon's: an old id is reported as such.
        fresh = c2.claim("obj-3")
        assert fresh.id > held.id
        with pytest.raises(LeaseExpired, match="previous daemon"):
            c2._call("release", lease=held.id)
        fresh.release()
        c2.evict(all=True)
        assert c2.stat().used == lent  # the quarantine lasts restart_quarantine (10 s)
    assert "warm restart (epoch 2)" in d2.log()


def test_client_reconnects_and_old_leases_raise_lease_expired(daemons):
    d = daemons()
    c = d.client(reconnect=10)
    c.put("a", {"kv": pattern("a", 4096)})
    rl = c.claim("a")
    wl = c.reserve("b", {"kv": 100})
    d.stop(signal.SIGKILL)
    daemons()
    # The next call notices the broken connection, reconnects, and is sent again.
    assert np.array_equal(c.get("a")["kv"], pattern("a", 4096))
    assert c.generation == 1 and c.restarts == 1 and c.epoch == 2
    with pytest.raises(LeaseExpired, match="daemon restarted"):
        rl.release()
    with pytest.raises(LeaseExpired, match="daemon restarted"):
        wl.seal()
    assert not c.exists("b")
    c.put("b", {"kv": pattern("b", 100)})  # the key is free again
    assert np.array_equal(c.get("b")["kv"], pattern("b", 100))
    c.close()


def test_call_in_flight_when_daemon_dies_is_resent(daemons):
    d = daemons()
    c = d.client(reconnect=10)
    c.put("a", {"kv": pattern("a", 10)})
    # A claim waiting for a key is in flight when the daemon dies; the client resends it
    # to the next daemon, where the key gets published.
    import threading

    result = {}

    def wait_for_key():
        try:
            result["v"] = c.get("late", wait=20)["kv"]
        except Exception as exc:  # surfaced by the assertion below
            result["e"] = exc

    t = threading.Thread(target=wait_for_key)
    t.start()
    time.sleep(0.3)
    d.stop(signal.SIGKILL)
    d2 = daemons()
    with d2.client() as other:
        deadline = time.monotonic() + 60
        while c.generation == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        other.put("late", {"kv": pattern("late", 64)})
    t.join(20)
    assert "e" not in result, result.get("e")
    assert np.array_equal(result["v"], pattern("late", 64))
    c.close()


def test_pipelined_requests_reconnect_after_the_daemon_restarted(daemons):
    """A client that only pipelines (the vLLM CUDA save) sees the break once, where it
    happened; its next submit reconnects as a call would, instead of failing on the dead
    connection for ever. A request naming a lease of the old connection raises LeaseExpired."""
    d = daemons()
    c = d.client(reconnect=10)
    lease = c.ops.reserve("w", {"kv": 64})["lease"]
    d.stop(signal.SIGKILL)
    daemons()
    with pytest.raises(BrokerUnavailable):  # the break, on the connection it was sent on
        c.ops.pipelined.ping().result()
    with pytest.raises(LeaseExpired, match="daemon restarted"):  # reconnects first
        c.ops.pipelined.seal(lease)
    assert c.generation == 1 and c.restarts == 1
    assert c.ops.pipelined.ping().result()["epoch"] == 2
    c.close()


def test_reconnect_gives_up_after_its_bound(daemons):
    d = daemons()
    c = d.client(reconnect=0.5)
    d.stop(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="gave up reconnecting after 0.5 s"):
        c.stat()
    assert time.monotonic() - t0 < 5
    c.close()


def test_prefix_chain_survives_and_is_evicted_leaf_first(daemons):
    d = daemons()
    c = d.client()
    cache = PrefixCache(c, block_size=4)
    tokens = list(range(4 * 6))
    blocks = [{"k": pattern(f"blk{i}", 512)} for i in range(6)]
    assert cache.publish(tokens, blocks) == 6
    d.stop(signal.SIGKILL)
    d2 = daemons()
    with d2.client() as c2:
        cache2 = PrefixCache(c2, block_size=4)
        with cache2.match(tokens + [0]) as m:
            assert m.num_blocks == 6
            for i, blk in enumerate(m.blocks):
                assert np.array_equal(blk["k"], blocks[i]["k"])
        # A parent is never evicted before its children: evicting the root alone keeps it.
        root = cache2.hashes(tokens)[0]
        r = c2.evict(root, namespace="prefix")
        assert r.count == 0 and c2.exists(root, namespace="prefix")
        assert c2.evict(namespace="prefix").count == 6
        assert c2.stat().used == 0


def test_geometry_change_is_refused_and_cold_start_drops(daemons, socket_path):
    d = daemons()
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
        seg = c.pools[0]["name"]
    d.stop(signal.SIGKILL)
    with pytest.raises(RuntimeError, match="--cold to drop them"):
        daemons("--pool-size", "32M", "--page-size", "4K")
    assert segment_exists(seg)  # refusing loses nothing
    d3 = daemons(*ARGS, "--cold")
    with d3.client() as c3:
        assert not c3.exists("a") and c3.pools[0]["name"] != seg
    assert not segment_exists(seg)


def test_clean_stop_drops_by_default_and_keeps_when_asked(daemons, socket_path):
    d = daemons()
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
        seg = c.pools[0]["name"]
    assert d.stop() == 0
    assert not segment_exists(seg) and not os.path.exists(journal_path(socket_path))
    d = daemons(*ARGS, "--keep-pools-on-exit")
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
        seg = c.pools[0]["name"]
    assert d.stop() == 0
    assert segment_exists(seg)
    d = daemons()
    with d.client() as c:
        assert c.pools[0]["name"] == seg
        assert np.array_equal(c.get("a")["kv"], pattern("a", 100))
    assert d.stop() == 0
    assert not segment_exists(seg)


def test_a_restart_keeps_the_cache_and_a_stop_frees_it(daemons, socket_path):
    """systemctl restart sends SIGUSR1 (the unit's RestartKillSignal=), systemctl stop
    SIGTERM: the first keeps every sealed object for the next daemon, the second frees."""
    from kvbroker._server.daemon import RESTART_SIGNAL

    assert RESTART_SIGNAL == signal.SIGUSR1
    d = daemons()
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
        c.put("big", {"kv": pattern("big", 3 << 20)})
        seg = c.pools[0]["name"]
    assert d.stop(signal.SIGUSR1) == 0
    assert "keeping the pools for the next daemon" in d.log() and "kept 1 pool(s)" in d.log()
    assert segment_exists(seg) and os.path.exists(journal_path(socket_path))
    d = daemons()
    with d.client() as c:
        assert c.pools[0]["name"] == seg and c.epoch == 2
        assert np.array_equal(c.get("a")["kv"], pattern("a", 100))
        assert np.array_equal(c.get("big")["kv"], pattern("big", 3 << 20))
    assert d.stop(signal.SIGTERM) == 0
    assert "then freeing the pools" in d.log()
    assert not segment_exists(seg)
    assert sorted(os.listdir(os.path.dirname(socket_path))) == ["kvb.log"]  # nothing left
    d = daemons()
    with d.client() as c:
        assert not c.exists("a") and c.epoch == 1


def test_a_restart_that_changes_the_pools_starts_empty(daemons, socket_path):
    d = daemons()
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
        seg = c.pools[0]["name"]
    assert d.stop(signal.SIGUSR1) == 0
    d = daemons("--pool-size", "32M", "--page-size", "4K")  # a config change, then restart
    with d.client() as c:
        assert not c.exists("a") and c.stat().pools[0].capacity == 32 << 20
    assert "dropping them, starting empty" in d.log() and "16.0 MiB" in d.log()
    assert not segment_exists(seg)


def test_torn_last_record_is_cut_off(daemons, socket_path):
    d = daemons()
    with d.client() as c:
        c.put("a", {"kv": pattern("a", 100)})
    d.stop(signal.SIGKILL)
    with open(journal_path(socket_path), "ab") as f:
        whole = _frame(msgpack.packb({"t": "s", "o": {"serial": 99, "namespace": "x"}}), 0)
        f.write(whole[: len(whole) // 2])
    d2 = daemons()
    with d2.client() as c:
        assert np.array_equal(c.get("a")["kv"], pattern("a", 100))
    assert "torn record" in d2.log()


def test_journal_replays_to_the_same_index(tmp_path):
    """In-process: random publish/replace/evict/consume, compactions between; a broker
    rebuilt from the journal has the same objects, extents and free space."""
    name = segment_prefix() + ".0"
    pool = HostPool(0, name, 4 << 20, 4096)
    try:
        b = Broker([pool])
        path = str(tmp_path / "j")
        b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
        s = b.open_session()
        b.handle(s, "hello", {"version": 1})
        rng = np.random.default_rng(1)
        arena = None
        for step in range(3000):
            key = f"k{rng.integers(0, 200)}"
            op = rng.integers(0, 13)
            if op == 10:  # a prefix chain, sealed together: parents before children
                keys = [f"p{rng.integers(0, 40)}" for _ in range(int(rng.integers(1, 5)))]
                blocks = [
                    {
                        "key": k,
                        "parent": keys[i - 1] if i else None,
                        "buffers": {"k": int(rng.integers(1, 9000))},
                    }
                    for i, k in enumerate(keys)
                ]
                try:
                    r = b.handle(s, "reserve_blocks", {"namespace": "pfx", "blocks": blocks})
                except PoolFull:
                    continue
                ids = [x["lease"] for x in r["results"] if "lease" in x]
                b.handle(s, "seal_many", {"leases": ids})
            elif op == 11:  # a put through a write arena
                if arena is None:
                    try:
                        arena = b.handle(s, "arena", {"nbytes": 200_000})["lease"]
                    except PoolFull:
                        continue
                try:
                    r = b.handle(
                        s,
                        "publish",
                        {
                            "arena": arena,
                            "key": key,
                            "replace": True,
                            "buffers": {"x": int(rng.integers(1, 30000))},
                            "next_arena": 200_000,
                        },
                    )
                    arena = r["lease"]
                except PoolFull:
                    arena = None
            elif op == 12:
                b.handle(s, "evict", {"namespace": "pfx", "key": f"p{rng.integers(0, 40)}"})
            elif op < 6:
                try:
                    r = b.handle(
                        s,
                        "reserve",
                        {
                            "key": key,
                            "replace": bool(rng.integers(0, 2)),
                            "buffers": {"x": int(rng.integers(1, 40000))},
                            "consumers": int(rng.integers(1, 3)),
                        },
                    )
                except (PoolFull, Exists):  # full, or the key is published and replace=False
                    continue
                if rng.integers(0, 8):
                    b.handle(s, "seal", {"lease": r["lease"]})
                else:
                    b.handle(s, "abort", {"lease": r["lease"]})
            elif op < 8:
                try:
                    r = b.handle(s, "claim", {"key": key, "consume": True})
                except NotFound:
                    continue
                b.handle(s, "release", {"lease": r["lease"]})
            else:
                b.handle(s, "evict", {"key": key})
            if step % 700 == 0:
                b.compact_journal()
        b.journal.close()
        rec = Journal.load(path)
        pool2 = HostPool.adopt(0, name, pool.size, 4096)
        b2 = Broker([pool2])
        assert b2.restore(rec.objects.values()) == len(b.objects)

        def index(br):
            return {
                k: (
                    o.start,
                    o.npages,
                    o.buffers,
                    o.consumers,
                    o.children,
                    o.parent.key if o.parent else None,
                )
                for k, o in br.objects.items()
            }

        assert index(b2) == index(b)
        assert any(o.children for o in b2.objects.values())  # chains were restored
        assert {o.serial for o in b2.directory.evictable()} == {
            o.serial for o in b.directory.evictable()
        }  # the same objects are evictable
        # Free space is the same once the (unsealed) arena's pages go back, as on a crash.
        if arena is not None:
            b.handle(s, "abort", {"lease": arena})
        assert pool2.allocator.free_extents() == pool.allocator.free_extents()
        assert rec.next_id > max(b.leases, default=0)
    finally:
        pool.unlink()


def test_a_journal_record_carries_every_persisted_field():
    """``to_record`` spells its fields out (it runs on every publish): it must keep naming
    what ``PERSISTED`` names, and give back an object equal in each of them."""
    from kvbroker._server.state import StoredObject

    name = segment_prefix() + ".0"
    pool = HostPool(0, name, 1 << 20, 4096)
    try:
        b = Broker([pool])
        s = b.open_session()
        b.handle(s, "hello", {"version": 1})
        b.handle(
            s,
            "reserve_blocks",
            {
                "namespace": "ns",
                "blocks": [
                    {"key": "p", "buffers": {"k": 10}},
                    {"key": "c", "parent": "p", "buffers": {"k": 10, "v": 20}, "tokens": [1, 2]},
                ],
            },
        )
        for lease in list(b.leases):
            b.handle(s, "seal", {"lease": lease, "checksums": None})
        obj = b.objects[("ns", "c")]
        obj.meta, obj.consumers = {"m": [1]}, 3
        rec = obj.to_record()
        assert set(rec) == set(StoredObject.PERSISTED) | {"pool", "buffers", "parent"}
        assert rec["parent"] == b.objects[("ns", "p")].serial and rec["pool"] == 0
        back = StoredObject.from_record(msgpack.unpackb(msgpack.packb(rec)), [pool])
        for field in StoredObject.PERSISTED:
            want = getattr(obj, field)
            assert getattr(back, field) == (tuple(want) if field == "tenants" else want), field
        assert back.buffers == obj.buffers
    finally:
        pool.unlink()


def test_allocator_with_live_rejects_overlaps():
    a = ExtentAllocator.with_live(100, [(10, 5), (0, 3), (50, 50)])
    assert a.used == 58 and a.free_extents() == [(3, 7), (15, 35)]
    assert a.alloc(35) == 15
    with pytest.raises(ValueError):
        ExtentAllocator.with_live(100, [(0, 10), (5, 10)])
    with pytest.raises(ValueError):
        ExtentAllocator.with_live(100, [(95, 10)])


def test_a_failing_journal_turns_itself_off(tmp_path):
    """A journal that cannot be written is removed (the next start is cold) rather than left
    missing records; the broker carries on serving."""
    name = segment_prefix() + ".0"
    pool = HostPool(0, name, 1 << 20, 4096)
    try:
        b = Broker([pool])
        path = str(tmp_path / "j")
        b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
        s = b.open_session()
        b.handle(s, "hello", {"version": 1})
        r = b.handle(s, "reserve", {"key": "a", "buffers": {"x": 10}})
        os.close(b.journal._fd)  # every later write fails (EBADF)
        b.journal._fd = os.open(os.devnull, os.O_RDONLY)
        b.handle(s, "seal", {"lease": r["lease"]})
        assert b.journal.failed and not os.path.exists(path)
        assert b.handle(s, "lookup", {"key": "a"})["nbytes"] == 10
        b.compact_journal()  # a no-op now
        assert not os.path.exists(path)
    finally:
        pool.unlink()


def test_client_remaps_pools_after_a_cold_restart(daemons):
    d = daemons()
    c = d.client(reconnect=10)
    c.put("a", {"kv": pattern("a", 5000)})
    old = c.pools[0]["name"]
    d.stop(signal.SIGKILL)
    daemons(*ARGS, "--cold")
    assert not c.exists("a")  # reconnects; the cold daemon has nothing
    assert c.pools[0]["name"] != old and c.epoch == 1
    c.put("b", {"kv": pattern("b", 5000)})  # through the new segment
    assert np.array_equal(c.get("b")["kv"], pattern("b", 5000))
    c.close()
    assert not segment_exists(old)
