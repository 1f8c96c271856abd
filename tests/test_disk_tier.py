"""The disk tier's owner on its own (kvbroker._server.disk_tier, disk_store): slots written
and read back bit-exact, one read shared by concurrent promotions, a damaged slot or index
record dropped and never served, the index read back by a new daemon, the O_DIRECT fallback,
and each tier's own quota share. Pools are memfd segments here; the daemon's use
of the tier is tests/test_disk_daemon.py."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
import zlib
from pathlib import Path

import pytest

from kvbroker._server import disk_store
from kvbroker._server.disk_store import INDEX_NAME, SLOTS_NAME, DiskStore, PoolPages
from kvbroker._server.disk_tier import DiskTier
from kvbroker._server.state import StoredObject
from kvbroker.errors import NotFound

PAGE = 4096
POOL_PAGES = 256


class _Pool:
    def __init__(self, index: int = 0) -> None:
        self.index, self.page_size = index, PAGE
        self.next = 0

    def alloc(self, npages: int) -> int:
        start, self.next = self.next, self.next + npages
        assert self.next <= POOL_PAGES
        return start


class _Lease:
    ids = iter(range(1, 1 << 30))

    def __init__(self, obj: StoredObject) -> None:
        self.id, self.obj = next(self.ids), obj


serials = iter(range(1, 1 << 30))


def _object(
    pool: _Pool,
    buf: mmap.mmap,
    key: str,
    sizes: dict[str, int],
    namespace: str = "ns",
    fill: bytes | None = None,
) -> StoredObject:
    span, layout = 0, {}
    for name, n in sizes.items():
        layout[name] = (span, n)
        span += -(-n // 256) * 256
    npages = -(-span // PAGE)
    start = pool.alloc(npages)
    base = start * PAGE
    obj = StoredObject(
        namespace,
        key,
        pool,
        start,
        npages,
        sum(sizes.values()),
        {k: (base + off, n) for k, (off, n) in layout.items()},
        {"m": key},
        next(serials),
    )
    data = fill if fill is not None else os.urandom(npages * PAGE)
    buf[base : base + npages * PAGE] = data[: npages * PAGE]
    obj.sealed = obj.linked = True
    obj.checksums = {name: 7 for name in sizes}
    return obj


def _bytes_of(buf: mmap.mmap, obj: StoredObject) -> dict[str, bytes]:
    return {name: bytes(buf[off : off + n]) for name, (off, n) in obj.buffers.items()}


class _Rig:
    """A tier over two pools (memfd segments): pool 0 is where objects are made,
    pool 1 where promotions land."""

    def __init__(self, dirs, size=1 << 20, direct=True, **kw) -> None:
        self.dirs = dirs
        fds = [os.memfd_create(f"pool{i}") for i in range(2)]  # (segments, as /dev/shm's)
        for fd in fds:
            os.ftruncate(fd, POOL_PAGES * PAGE)
        self.bufs = [mmap.mmap(fd, POOL_PAGES * PAGE) for fd in fds]
        self.pools = [_Pool(0), _Pool(1)]
        self.store = DiskStore(dirs, size, PAGE, direct=direct, threads=2)
        pages = [PoolPages(i, fd, POOL_PAGES * PAGE) for i, fd in enumerate(fds)]
        self.tier = DiskTier(self.store, pages, **kw)
        self.loaded = self.tier.open()
        self.reserved: list[_Lease] = []
        self.sealed: list[_Lease] = []
        self.discarded: list[_Lease] = []

    def reserve(self, e):
        rec = e.record
        npages = -(-e.length // PAGE)
        start = self.pools[1].alloc(npages)
        base = start * PAGE
        obj = StoredObject(
            e.ident[0],
            e.ident[1],
            self.pools[1],
            start,
            npages,
            rec["nbytes"],
            {k: (base + off, n) for k, (off, n) in rec["buffers"].items()},
            rec["meta"],
            next(serials),
        )
        lease = _Lease(obj)
        self.reserved.append(lease)
        return lease

    def seal(self, leases):
        for ls in leases:  # linked, as the broker's seal_all links them
            ls.obj.sealed = ls.obj.linked = True
        self.sealed.extend(leases)

    async def promote(self, *keys, namespace="ns"):
        return await self.tier.promote(
            [(namespace, k) for k in keys], self.reserve, self.seal, self.discarded.append
        )

    def close(self):
        self.tier.close()


def _flip(path: str, offset: int, mask: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def dirs(tmp_path):
    return [str(tmp_path / "a"), str(tmp_path / "b")]


def test_demoted_objects_come_back_bit_exact_and_their_digest_is_checked(dirs):
    async def main():
        rig = _Rig(dirs)
        objs = [
            _object(
                rig.pools[0], rig.bufs[0], f"k{i}", {"past_key.0": 5000 + i, "past_value.0": 3000}
            )
            for i in range(4)
        ]
        want = {o.key: _bytes_of(rig.bufs[0], o) for o in objs}
        for o in objs:
            assert rig.tier.demote(o)  # copied out of its pages: they may be reused now
        rig.bufs[0][:] = b"\0" * len(rig.bufs[0])
        await rig.tier.drain()
        for o in objs:
            assert await rig.promote(o.key) == 1
        assert [ls.obj.key for ls in rig.sealed] == [o.key for o in objs]
        for ls in rig.sealed:
            assert _bytes_of(rig.bufs[1], ls.obj) == want[ls.obj.key]
        st = rig.tier.statistics()
        assert (st.demoted, st.promoted, st.objects, st.only_on_disk) == (4, 4, 4, 0)
        assert st.o_direct and rig.store.used == 4 * 2 * PAGE  # 8120 bytes a slot
        rig.close()

    _run(main())


def test_concurrent_promotions_of_one_object_share_one_read(dirs):
    async def main():
        rig = _Rig(dirs)
        o = _object(rig.pools[0], rig.bufs[0], "k", {"past_key.0": 70000})
        assert rig.tier.demote(o)
        await rig.tier.drain()
        got = await asyncio.gather(*[rig.promote("k") for _ in range(5)])
        assert got == [1] * 5
        assert len(rig.reserved) == 1 and len(rig.sealed) == 1  # one reservation, one read
        assert rig.tier.statistics().promoted == 1
        rig.close()

    _run(main())


def test_a_damaged_slot_is_dropped_never_served(dirs):
    async def main():
        rig = _Rig(dirs[:1])
        a = _object(rig.pools[0], rig.bufs[0], "a", {"past_key.0": 9000})
        b = _object(rig.pools[0], rig.bufs[0], "b", {"past_key.0": 9000})
        for o in (a, b):
            rig.tier.demote(o)
        await rig.tier.drain()
        e = rig.tier.entries[("ns", "a")]
        _flip(os.path.join(dirs[0], SLOTS_NAME), e.start * PAGE + 100)  # one bit of a's slot
        with pytest.raises(NotFound):
            await rig.promote("a")
        assert rig.sealed == [] and len(rig.discarded) == 1  # the read pages given back
        assert not rig.tier.has(("ns", "a"))
        assert rig.tier.statistics().dropped_damaged == 1
        assert await rig.promote("b") == 1  # the other object is untouched
        await rig.tier.drain()
        rig.close()

    _run(main())


def test_a_new_daemon_reads_the_index_back_and_drops_what_it_cannot_vouch_for(dirs):
    async def first():
        rig = _Rig(dirs)
        objs = [
            _object(rig.pools[0], rig.bufs[0], f"k{i}", {"past_key.0": 20000}) for i in range(6)
        ]
        want = {o.key: _bytes_of(rig.bufs[0], o) for o in objs}
        for o in objs:
            rig.tier.demote(o)
        await rig.tier.drain()
        rig.tier.forget(("ns", "k5"))  # gone before the restart: not back after it
        await rig.tier.drain()
        rig.close()
        return want

    want = _run(first())
    index = os.path.join(dirs[0], INDEX_NAME)
    data = Path(index).read_bytes()
    _flip(index, data.find(b"k3"), 0x20)  # one record's body: its crc no longer matches

    async def second():
        rig = _Rig(dirs)
        loaded = rig.loaded
        assert loaded.damaged == 1 and loaded.reset is None
        assert sorted(k for _, k in rig.tier.entries) == ["k0", "k1", "k2", "k4"]
        for key in ("k0", "k1", "k2", "k4"):
            assert await rig.promote(key) == 1
        for ls in rig.sealed:
            assert _bytes_of(rig.bufs[1], ls.obj) == want[ls.obj.key]
        with pytest.raises(NotFound):
            await rig.promote("k5")
        st = rig.tier.statistics()
        assert (st.recovered, st.recovered_dropped) == (4, 1)
        rig.close()

    _run(second())


def test_a_changed_geometry_starts_the_tier_empty(dirs):
    async def first():
        rig = _Rig(dirs)
        rig.tier.demote(_object(rig.pools[0], rig.bufs[0], "k", {"past_key.0": 100}))
        await rig.tier.drain()
        rig.close()

    _run(first())
    rig = _Rig(dirs, size=2 << 20)
    loaded = rig.loaded
    assert loaded.reset and "geometry" in loaded.reset and not rig.tier.entries
    rig.close()


def test_index_records_on_overlapping_slots_are_both_dropped(tmp_path):
    d = str(tmp_path)
    geometry = [[64, PAGE]]
    idx = disk_store.DiskIndex(os.path.join(d, INDEX_NAME), geometry)
    rec = {"l": PAGE, "d": 1, "ns": "ns", "sr": 1, "tn": [], "o": {"nbytes": 1, "buffers": {}}}
    idx.rewrite(
        [
            {"t": "p", "f": 0, "s": 0, "n": 4, "k": "a", **rec},
            {"t": "p", "f": 0, "s": 2, "n": 4, "k": "b", **rec},
            {"t": "p", "f": 0, "s": 10, "n": 1, "k": "c", **rec},
            {"t": "p", "f": 0, "s": 63, "n": 2, "k": "d", **rec},
        ]
    )  # past the end
    idx.close()
    loaded = disk_store.DiskIndex(os.path.join(d, INDEX_NAME), geometry).load()
    assert [r["k"] for r in loaded.entries.values()] == ["c"]
    assert loaded.dropped == 3


def test_o_direct_fallback_when_the_file_system_refuses_it(dirs, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a)

    monkeypatch.setattr(disk_store.os, "open", no_direct)
    problem = disk_store.probe_direct(dirs[0] if os.path.isdir(dirs[0]) else "/tmp")
    assert problem and "Invalid argument" in problem

    async def main():
        rig = _Rig(dirs)
        assert not rig.store.direct and "O_DIRECT" in rig.store.direct_problem
        o = _object(rig.pools[0], rig.bufs[0], "k", {"past_key.0": 12345})
        want = _bytes_of(rig.bufs[0], o)
        assert rig.tier.demote(o)
        await rig.tier.drain()
        assert await rig.promote("k") == 1
        assert _bytes_of(rig.bufs[1], rig.sealed[0].obj) == want
        st = rig.tier.statistics()
        assert not st.o_direct and "Invalid argument" in st.o_direct_problem
        rig.close()

    _run(main())


def test_a_record_naming_a_slot_rewritten_since_is_not_served(dirs):
    # A crash after a slot was freed and rewritten, before the x record reached the index:
    # the stale p record names bytes another object wrote. Its digest catches it.
    index = os.path.join(dirs[0], INDEX_NAME)

    async def main():
        rig = _Rig(dirs[:1], size=4 * PAGE)  # room for exactly one 4-page object
        a = _object(rig.pools[0], rig.bufs[0], "a", {"past_key.0": 4 * PAGE})
        assert rig.tier.demote(a)
        await rig.tier.drain()
        stale = Path(index).read_bytes()  # the index as a crash right now would leave it
        rig.tier.forget(("ns", "a"))
        b = _object(rig.pools[0], rig.bufs[0], "b", {"past_key.0": 4 * PAGE})
        assert rig.tier.demote(b)  # the same slot, at once
        await rig.tier.drain()
        rig.close()
        return stale

    stale = _run(main())
    Path(index).write_bytes(stale)

    async def after_crash():
        rig = _Rig(dirs[:1], size=4 * PAGE)
        assert list(rig.tier.entries) == [("ns", "a")]  # the record itself is intact
        with pytest.raises(NotFound):
            await rig.promote("a")
        assert rig.sealed == [] and rig.tier.statistics().dropped_damaged == 1
        rig.close()

    _run(after_crash())


def test_forgotten_while_being_written_leaves_nothing_behind(dirs):
    async def main():
        rig = _Rig(dirs)
        o = _object(rig.pools[0], rig.bufs[0], "k", {"past_key.0": 50000})
        assert rig.tier.demote(o)
        assert rig.tier.forget(("ns", "k"))  # the write is still in flight
        await rig.tier.drain()
        assert rig.store.used == 0 and not rig.tier.has(("ns", "k"))
        with pytest.raises(NotFound):
            await rig.promote("k")
        rig.close()
        rig2 = _Rig(dirs)
        assert not rig2.tier.entries
        rig2.close()

    _run(main())


def test_each_tier_has_its_own_quota_share(dirs):
    # A namespace's pool quota of 2 pages, a disk 4x the pools: 8 pages of it on disk.
    async def main():
        rig = _Rig(
            dirs, quota_of=lambda acct: 2 * PAGE if acct == "capped" else None, quota_scale=4.0
        )
        objs = [
            _object(
                rig.pools[0], rig.bufs[0], f"k{i}", {"past_key.0": 2 * PAGE}, namespace="capped"
            )
            for i in range(6)
        ]
        for o in objs:
            assert rig.tier.demote(o)
            await rig.tier.drain()
        # Its own oldest went to make room; other namespaces are not limited.
        assert sorted(k for _, k in rig.tier.entries) == ["k2", "k3", "k4", "k5"]
        assert rig.tier.usage["capped"] == 8 * PAGE
        big = _object(
            rig.pools[0], rig.bufs[0], "big", {"past_key.0": 9 * PAGE}, namespace="capped"
        )
        assert not rig.tier.demote(big)  # more than its whole share: not kept
        free = _object(rig.pools[0], rig.bufs[0], "f", {"past_key.0": 9 * PAGE}, namespace="x")
        assert rig.tier.demote(free)
        await rig.tier.drain()
        rig.close()

    _run(main())


def test_a_full_disk_evicts_its_least_recently_used_first(dirs):
    async def main():
        rig = _Rig(dirs[:1], size=8 * PAGE)
        objs = [
            _object(rig.pools[0], rig.bufs[0], f"k{i}", {"past_key.0": 2 * PAGE}) for i in range(4)
        ]
        for o in objs:  # (one at a time: the disk's LRU order is the writes' completion's)
            rig.tier.demote(o)
            await rig.tier.drain()
        assert await rig.promote("k0") == 1  # k0 is the most recently used now
        await rig.tier.drain()
        assert rig.tier.demote(_object(rig.pools[0], rig.bufs[0], "k4", {"past_key.0": 2 * PAGE}))
        await rig.tier.drain()
        assert sorted(k for _, k in rig.tier.entries) == ["k0", "k2", "k3", "k4"]
        assert rig.tier.statistics().evicted == 1
        rig.close()

    _run(main())


def test_a_crafted_index_neither_stops_the_start_nor_gets_a_record_served(dirs):
    # Records whose frame checks out (anyone who can write the index can compute its crc)
    # but whose fields are not what the tier writes: each is dropped on its own, the start
    # goes on for every other object, and nothing a record says lies past the bytes its
    # digest vouches for (a layout reaching past them would lease pool bytes never read
    # from the slot: another object's, in a pool).
    index = os.path.join(dirs[0], INDEX_NAME)

    async def first():
        rig = _Rig(dirs)
        good = _object(rig.pools[0], rig.bufs[0], "good", {"past_key.0": 5000})
        bad = _object(rig.pools[0], rig.bufs[0], "bad", {"past_key.0": 5000})
        for o in (good, bad):
            assert rig.tier.demote(o)
        await rig.tier.drain()
        rig.close()
        return _bytes_of(rig.bufs[0], good)

    want = _run(first())
    geometry = [[128, PAGE], [128, PAGE]]
    records = {r["k"]: r for r in disk_store.DiskIndex(index, geometry).load().entries.values()}
    good, bad = records["good"], records["bad"]
    spare = {**good, "k": "spare", "f": 0, "s": 100, "n": 1, "l": PAGE}

    def with_object(**o):
        return {**spare, "o": {**good["o"], **o}}

    crafted = [
        {**bad, "o": {**bad["o"], "buffers": {"past_key.0": [0, 64 * PAGE]}}},
        {**spare, "f": float("inf")},
        {**spare, "s": float("-inf")},
        {**spare, "f": -1},
        {**spare, "f": True},
        {**spare, "f": 0.5},
        {**spare, "n": 2**64 - 1},
        {**spare, "ns": ["not", "a", "name"]},
        {**spare, "tn": [["user", "x"]]},
        {**spare, "sr": "x"},
        with_object(buffers={"past_key.0": "zz"}),
        with_object(buffers={"past_key.0": [-PAGE, 10]}),
        with_object(buffers={"past_key.0": [0, 10, 3]}),
        with_object(buffers={7: [0, 10]}),
        with_object(nbytes=-1),
        with_object(meta=[1, 2]),
        with_object(tokens="abc"),
        with_object(checksums=5),
        with_object(consumers=0),
        with_object(parent_key=7),
        {"t": "x", "f": float("nan"), "s": 0},
    ]
    for i, rec in enumerate(crafted[1:], 1):  # each on a slot of its own
        if rec["s"] == spare["s"]:
            rec["s"] += i
    idx = disk_store.DiskIndex(index, geometry)
    idx.rewrite([good, *crafted])
    body = b"\x81\x90\x01"  # a map whose key is a list: no dict can hold it
    idx.close()
    with open(index, "ab") as f:
        f.write(disk_store._FRAME.pack(disk_store.MAGIC, len(body), zlib.crc32(body, idx.seed)))
        f.write(body)

    async def second():
        rig = _Rig(dirs)  # (a crash here stopped the daemon's start, for every tenant)
        assert list(rig.tier.entries) == [("ns", "good")]
        assert rig.loaded.damaged + rig.loaded.dropped >= len(crafted)
        assert await rig.promote("good") == 1
        assert _bytes_of(rig.bufs[1], rig.sealed[0].obj) == want
        with pytest.raises(NotFound):
            await rig.promote("bad")
        assert rig.reserved == rig.sealed  # nothing but good was laid out in a pool
        rig.close()

    _run(second())


def _index_writes_fail(monkeypatch, rig, times: int = 1) -> list[int]:
    """The next ``times`` writes to the index file stop with ENOSPC (a full disk) after
    half their bytes went in (a short write first, as the kernel does); returns a list that
    counts the failures."""
    real_write, failed = os.write, []

    def write(fd, data):
        if fd != rig.store.index.fd or len(failed) >= times:
            return real_write(fd, data)
        failed.append(fd)
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_store.os, "write", write)
    return failed


def test_a_full_disk_under_the_index_never_brings_a_forgotten_object_back(dirs, monkeypatch):
    # A consumed (or replaced, or evicted) object's x record hits ENOSPC: the record is
    # written once there is room again, after what the failed write left is cut off, so a
    # restart never finds the object's p record standing alone and serves it again, nor
    # drops the next object written to its slot (two p records on one slot: both dropped).
    async def main():
        rig = _Rig(dirs)
        a = _object(rig.pools[0], rig.bufs[0], "a", {"past_key.0": 5000})
        assert rig.tier.demote(a)
        await rig.tier.drain()
        failed = _index_writes_fail(monkeypatch, rig)
        assert rig.tier.forget(("ns", "a"))  # consumed: gone for good
        await rig.tier.drain()
        assert failed and rig.tier.statistics().errors == 1
        monkeypatch.undo()  # room again
        rig.tier.sweep()  # (the daemon's tick, once a second): the records are tried again
        await rig.tier.drain()
        b = _object(  # a's slot, free again: b's record must not meet a's alone there
            rig.pools[0], rig.bufs[0], "b", {"past_key.0": 5000}
        )
        assert rig.tier.demote(b)
        await rig.tier.drain()
        rig.close()
        rig = _Rig(dirs)  # (the machine restarted)
        assert list(rig.tier.entries) == [("ns", "b")] and rig.loaded.damaged == 0
        with pytest.raises(NotFound):
            await rig.promote("a")
        rig.close()

    _run(main())


def test_records_appended_during_a_compaction_are_kept(dirs):
    # The index is compacted in an I/O thread while the loop keeps appending: what it
    # appends meanwhile (a forgotten object's x, a new object's p) is written after the
    # compacted file, under that file's seed, never dropped.
    async def main():
        rig = _Rig(dirs)
        a = _object(rig.pools[0], rig.bufs[0], "a", {"past_key.0": 5000})
        assert rig.tier.demote(a)
        await rig.tier.drain()
        index = rig.store.index
        entered, go = threading.Event(), threading.Event()
        real_rewrite = index.rewrite

        def rewrite(live):
            entered.set()
            assert go.wait(60)
            real_rewrite(live)

        index.rewrite = rewrite
        index.records = 10**6  # due for a compaction at the next sync
        b = _object(rig.pools[0], rig.bufs[0], "b", {"past_key.0": 5000})
        assert rig.tier.demote(b)
        for _ in range(6000):  # b's write, then its sync: the compaction, held
            if entered.is_set():
                break
            await asyncio.sleep(0.01)
        assert entered.is_set()
        assert rig.tier.forget(("ns", "a"))
        c = _object(rig.pools[0], rig.bufs[0], "c", {"past_key.0": 5000})
        assert rig.tier.demote(c)
        await asyncio.shield(rig.tier.entries[("ns", "c")].writing)
        go.set()
        await rig.tier.drain()
        rig.close()
        rig = _Rig(dirs)
        assert sorted(k for _, k in rig.tier.entries) == ["b", "c"]
        assert (rig.loaded.damaged, rig.loaded.dropped) == (0, 0)
        rig.close()

    _run(main())


def test_an_object_on_disk_occupies_at_least_its_index_entry_scaled_to_the_pools(dirs):
    # In a pool an object occupies at least the daemon memory its index entry takes (names,
    # meta, tokens), so what clients make the daemon hold is bounded by the pools. A slot
    # sized by the bytes alone broke that: 4096 names of empty buffers (~500 KiB of entry)
    # in one 4 KiB slot, so a disk of N bytes could make the daemon hold ~100 N of memory.
    # A slot holds at least the entry's footprint times disk/pools (``quota_scale``): the
    # disk tier's entries then take no more memory than the pools' could.
    from kvbroker._server.state import index_footprint

    async def main():
        rig = _Rig(dirs[:1], size=1 << 20, quota_scale=0.5)  # the disk is half the pools
        names = {f"b{j:05d}" + "x" * 40: 0 for j in range(2048)}
        o = _object(rig.pools[0], rig.bufs[0], "wide", names)
        entry = index_footprint(o.buffers, o.meta, o.tokens)
        assert entry > 64 * PAGE
        assert rig.tier.demote(o)
        await rig.tier.drain()
        assert rig.store.used >= entry * 0.5
        assert await rig.promote("wide") == 1  # and it comes back as it was
        assert rig.sealed[0].obj.buffers.keys() == o.buffers.keys()
        thin = _object(rig.pools[0], rig.bufs[0], "thin", {"past_key.0": 5000})
        before = rig.store.used
        assert rig.tier.demote(thin)
        await rig.tier.drain()
        assert rig.store.used - before == 2 * PAGE  # an ordinary object: its bytes only
        rig.close()

    _run(main())


def test_consume_claims_released_since_the_write_are_kept_across_a_restart(dirs):
    # An object sealed for 3 consume-claims is written to disk (policy sealed, or ahead of
    # its eviction), then one is released in the pool. A restart after a reboot read the
    # count written with the slot, 3: the object could be consumed 3 more times (4 in all).
    # The count goes to the index as it changes (the daemon's once-a-second sweep, and a
    # demotion).
    async def main():
        rig = _Rig(dirs)
        o = _object(rig.pools[0], rig.bufs[0], "k", {"past_key.0": 5000})
        o.consumers = 3
        ended = []
        assert rig.tier.write_back(o, lambda: ended.append(1))
        await rig.tier.drain()
        assert ended and rig.tier.copy_of(o) is not None
        o.consumers = 2  # one consume-claim released, in the pool
        rig.tier.sweep()  # (the daemon's tick)
        await rig.tier.drain()
        rig.close()
        rig = _Rig(dirs)  # a reboot
        assert rig.tier.entries[("ns", "k")].record["consumers"] == 2
        rig.close()

    _run(main())


@pytest.mark.parametrize("kind", [0, 1])
def test_pool_pages_hash_what_a_mapping_would_and_refuse_a_truncated_pool(tmp_path, kind):
    """PoolPages.matches (what the daemon checks pulled and restored bytes with, never
    through a mapping) agrees with checksum.matches over chunk edges for both kinds, sees a
    flipped bit, and says PoolUnusable, not SIGBUS, for bytes a truncation took."""
    from kvbroker._wire import checksum
    from kvbroker._server.disk_store import PoolUnusable

    chunk = checksum.CHUNK
    data = bytearray(os.urandom(3 * chunk + 4096))
    path = tmp_path / "segment"
    path.write_bytes(data)
    pages = PoolPages(0, os.open(path, os.O_RDWR), len(data))
    try:
        for off, n in [(0, 0), (5, 1), (0, chunk), (4096, chunk + 241), (1, 3 * chunk)]:
            value = (checksum.legacy_digest if kind == 0 else checksum.digest)(data[off : off + n])
            recorded = checksum.encode(value, kind)
            assert checksum.matches(data[off : off + n], recorded)
            assert pages.matches(off, n, recorded)
            if n:
                flipped = bytearray(data[off : off + n])
                flipped[n // 2] ^= 1
                assert not pages.matches(
                    off,
                    n,
                    checksum.encode(
                        (checksum.legacy_digest if kind == 0 else checksum.digest)(flipped), kind
                    ),
                )
        os.truncate(path, 2 * chunk)
        recorded = checksum.encode(checksum.digest(data[chunk : 3 * chunk]))
        with pytest.raises(PoolUnusable, match="pool 0 cannot be read at"):
            pages.matches(chunk, 2 * chunk, recorded)
        with pytest.raises(PoolUnusable, match="truncated"):
            pages.check()
    finally:
        pages.close()
