"""The read lease of a prefix match (kvbroker._server.prefix_leases), in-process: a block
under it is never freed nor reused, whatever path would unlink or evict it, and every
figure that counts readers stays what it was when each block was pinned one by one.

A match over a chain pins only its last block; these tests attack the others through
every path that frees or reports them: re-publish (replace), consume, explicit evict, LRU
and quota eviction, TTL expiry, a closed connection, ``list``/``lookup``/``stat``.
"""

import mmap
import os
import secrets

import posix_ipc
import pytest
from _fakes import Clock

from kvbroker._server import prefix_leases
from kvbroker._server.broker import Broker
from kvbroker._server.policy import parse_quotas
from kvbroker._server.pool import HostPool
from kvbroker._wire.paths import parse_size
from kvbroker.errors import PoolFull, QuotaExceeded

PAGE = 4096
NS = "p"


@pytest.fixture(params=["C pass", "Python passes"])
def make_broker(request, monkeypatch):
    """Brokers on private pools; every test twice: with the C twins of the per-block passes
    (kvbroker._prefixscan) and with their Python twins."""
    if request.param == "C pass":
        pytest.importorskip("kvbroker._prefixscan", reason="C pass not built here")
    else:
        monkeypatch.setattr(prefix_leases, "_run", prefix_leases._run_py)
        monkeypatch.setattr(prefix_leases, "_lend_scan", prefix_leases._lend_scan_py)
    made = []

    def make(npages=32, quotas=None):
        pool = HostPool(0, f"/kvbpl.{os.getpid()}.{secrets.token_hex(3)}", npages * PAGE, PAGE)
        shm = posix_ipc.SharedMemory(pool.name)
        mm = mmap.mmap(shm.fd, pool.size)
        shm.close_fd()
        made.append((pool, mm))
        q = parse_quotas(quotas, parse_size) if quotas is not None else None
        # No watermark eviction: pages go only when a reservation needs them.
        b = Broker([pool], clock=Clock(), quotas=q, high_watermark=1.0, low_watermark=1.0)
        b.test_mm = mm
        return b

    yield make
    for pool, mm in made:
        mm.close()
        pool.unlink()


def session(b):
    s = b.open_session(pid=1, uid=0, gid=0)
    b.handle(s, "hello", {"version": 1, "name": "t"})
    return s


def write(b, extent, fill):
    _, off, n = extent
    b.test_mm[off : off + n] = bytes([fill]) * n


def read(b, obj):
    off, n = obj.buffers["x"]
    return bytes(b.test_mm[off : off + n])


def publish_chain(b, s, keys, fill=0x10, ns=NS):
    """One block per key (a page each), each the child of the one before; block i holds
    the byte fill + i."""
    r = b.handle(
        s,
        "reserve_blocks",
        {
            "namespace": ns,
            "blocks": [
                {"key": k, "parent": keys[i - 1] if i else None} for i, k in enumerate(keys)
            ],
            "buffers": {"x": PAGE},
        },
    )
    for i, res in enumerate(r["results"]):
        write(b, res["buffers"]["x"], fill + i)
    b.handle(s, "seal_many", {"leases": [res["lease"] for res in r["results"]], "checksums": None})


def put(b, s, key, fill, ns=NS, pages=1, **kw):
    r = b.handle(s, "reserve", {"namespace": ns, "key": key, "buffers": {"x": pages * PAGE}, **kw})
    write(b, r["buffers"]["x"], fill)
    b.handle(s, "seal", {"lease": r["lease"]})


def match(b, s, keys, ns=NS, **kw):
    reply = b.handle(s, "match_prefix", {"namespace": ns, "keys": keys, **kw})
    assert reply["matched"] == len(keys)
    return reply["lease"]


def fill_pool(b):
    """Publish one-page objects, each written with 0xEE (pages handed out again would show
    it) and claimed by a connection of their own (so that they stay; returned), until
    nothing more fits: whatever the LRU offered was evicted for them."""
    s = session(b)
    with pytest.raises(PoolFull):
        for n in range(b.pools[0].allocator.capacity + 1):
            put(b, s, f"filler-{n}", 0xEE, ns="filler")
            b.handle(s, "claim", {"namespace": "filler", "key": f"filler-{n}"})
    return s


def used(b):
    return b.pools[0].allocator.used


KEYS = ["k0", "k1", "k2", "k3"]


def test_a_republished_middle_block_is_neither_freed_nor_reused_until_release(make_broker):
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    old = b.objects[NS, "k1"]
    put(b, s, "k1", 0x77, replace=True)
    assert b.objects[NS, "k1"] is not old
    fill_pool(b)
    assert read(b, old) == bytes([0x11]) * PAGE
    assert b.pages.owners[0][old.start] is old
    before = used(b)
    b.handle(s, "release", {"lease": lease})
    assert used(b) == before - 1 and old.start not in b.pages.owners[0]


def test_a_republished_leaf_keeps_its_ancestors_out_of_the_lru(make_broker):
    # The leaf's replacement takes its parent's last child: the parent must not become
    # evictable while the match holds it.
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    held = [b.objects[NS, k] for k in KEYS]
    put(b, s, "k3", 0x77, replace=True)
    fill_pool(b)
    for i, obj in enumerate(held):
        assert read(b, obj) == bytes([0x10 + i]) * PAGE
    assert all((NS, k) in b.objects for k in KEYS[:3])
    b.handle(s, "release", {"lease": lease})
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 3  # the new k3 made room


def test_a_consumed_middle_block_is_kept_until_the_match_is_released(make_broker):
    b = make_broker()
    s, consumer = session(b), session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    old = b.objects[NS, "k2"]
    got = b.handle(consumer, "claim", {"namespace": NS, "key": "k2", "consume": True})
    b.handle(consumer, "release", {"lease": got["lease"]})
    assert (NS, "k2") not in b.objects  # consumed: unlinked ...
    fill_pool(b)
    assert read(b, old) == bytes([0x12]) * PAGE  # ... but not freed under the match
    assert b.pages.owners[0][old.start] is old
    before = used(b)
    b.handle(s, "release", {"lease": lease})
    assert used(b) == before - 1


def test_evict_reports_every_matched_block_as_leased(make_broker):
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    got = b.handle(s, "evict", {"namespace": NS})
    assert (got["count"], got["skipped_leased"], got["skipped_parents"]) == (0, 4, 0)
    got = b.handle(s, "evict", {"namespace": NS, "key": "k1"})
    assert (got["count"], got["skipped_leased"]) == (0, 1)
    assert all((NS, k) in b.objects for k in KEYS)
    b.handle(s, "release", {"lease": lease})
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 4
    assert used(b) == 0


def test_pool_pressure_evicts_no_matched_block(make_broker):
    b = make_broker(npages=16)
    s = session(b)
    publish_chain(b, s, KEYS)
    for i in range(4):
        put(b, s, f"other-{i}", 0x50)
    lease = match(b, s, KEYS)
    fill_pool(b)
    for i, k in enumerate(KEYS):
        assert read(b, b.objects[NS, k]) == bytes([0x10 + i]) * PAGE
    assert not any((NS, f"other-{i}") in b.objects for i in range(4))
    b.handle(s, "release", {"lease": lease})
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 4


def test_a_match_of_blocks_that_are_no_chain_pins_each_of_them(make_broker):
    b = make_broker(npages=16)
    s = session(b)
    for i, k in enumerate(KEYS):  # no parents: nothing keeps one out of the LRU
        put(b, s, k, 0x10 + i)
    lease = match(b, s, KEYS)
    fill_pool(b)
    for i, k in enumerate(KEYS):
        assert read(b, b.objects[NS, k]) == bytes([0x10 + i]) * PAGE
    b.handle(s, "release", {"lease": lease})
    put(b, s, "big", 0x60, pages=4)
    assert not any((NS, k) in b.objects for k in KEYS)


def test_a_chain_matched_from_its_middle_holds_only_what_it_names(make_broker):
    # k1-k3 matched: k0 is no block of the lease and stays evictable once k1 goes.
    b = make_broker(npages=8)
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS[1:])
    put(b, s, "k1", 0x77, replace=True)  # k0 loses its last child: evictable
    fill_pool(b)
    assert (NS, "k0") not in b.objects
    assert [read(b, o) for o in b.leases[lease].objects()] == [
        bytes([0x11 + i]) * PAGE for i in range(3)
    ]
    b.handle(s, "release", {"lease": lease})


def test_quota_eviction_spares_the_matched_blocks(make_broker):
    b = make_broker(quotas={NS: "20K"})
    s = session(b)
    publish_chain(b, s, KEYS)
    put(b, s, "loose", 0x50)
    lease = match(b, s, KEYS)
    put(b, s, "next", 0x60)  # over 20K: "loose" makes room
    assert (NS, "loose") not in b.objects
    b.handle(s, "claim", {"namespace": NS, "key": "next"})
    with pytest.raises(QuotaExceeded):  # nothing else of the namespace may go
        put(b, s, "more", 0x61)
    for i, k in enumerate(KEYS):
        assert read(b, b.objects[NS, k]) == bytes([0x10 + i]) * PAGE
    b.handle(s, "release", {"lease": lease})
    put(b, s, "more", 0x61)  # now the chain's leaf gives way
    assert (NS, "k3") not in b.objects


def test_an_expired_match_unpins_the_chain(make_broker):
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    match(b, s, KEYS, ttl=1)
    b.test_clock = b.clock
    b.clock.now += 2
    assert b.expire() == 1 and b.counters["expired_leases"] == 1
    assert all(b.objects[NS, k].readers == 0 for k in KEYS)
    before = used(b)
    put(b, s, "k1", 0x77, replace=True)  # nothing holds the old k1: freed at once
    assert used(b) == before
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 4


def test_a_closed_connection_ends_its_match(make_broker):
    b = make_broker()
    s, reader = session(b), session(b)
    publish_chain(b, s, KEYS)
    match(b, reader, KEYS)
    b.close_session(reader)
    assert not b.leases and all(b.objects[NS, k].readers == 0 for k in KEYS)
    before = used(b)
    put(b, s, "k2", 0x77, replace=True)
    assert used(b) == before
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 4


def test_list_lookup_and_stat_count_every_matched_block(make_broker):
    b = make_broker(npages=64)  # one occupancy cell per page
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    assert b.handle(s, "lookup", {"namespace": NS, "key": "k1"})["readers"] == 1
    b.handle(s, "release", {"lease": lease})
    lease = match(b, s, KEYS)
    listed = b.handle(s, "list", {"namespace": NS})["objects"]
    assert [o["readers"] for o in listed] == [1, 1, 1, 1]
    pool = b.snapshot()["pools"][0]
    assert pool["leased_read"] == 4 * PAGE
    assert all(pool["occupancy"][b.objects[NS, k].start] == "r" for k in KEYS)
    b.handle(s, "release", {"lease": lease})
    assert [o["readers"] for o in b.handle(s, "list", {"namespace": NS})["objects"]] == [0] * 4
    pool = b.snapshot()["pools"][0]
    assert pool["leased_read"] == 0 and "r" not in pool["occupancy"]


def test_list_and_evict_count_every_matched_block_nothing_materialized(make_broker):
    # Reporting readers changes nothing: a materialized lease would cost its release a
    # step per block, for every match alive when anyone listed.
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS + ["k4"])
    whole = match(b, s, KEYS)  # k0-k3
    middle = match(b, s, KEYS[1:3])  # k1-k2
    again = match(b, s, KEYS[1:3])  # the same span twice: counted once, times two
    lazy = dict(b.lazy_leases)
    assert set(lazy) == {whole, middle, again}
    listed = b.handle(s, "list", {"namespace": NS})["objects"]
    assert [(o["key"], o["readers"]) for o in listed] == [
        ("k0", 1),
        ("k1", 3),
        ("k2", 3),
        ("k3", 1),
        ("k4", 0),
    ]
    got = b.handle(s, "evict", {"namespace": NS, "dry_run": True})
    assert (got["count"], got["skipped_leased"], got["skipped_parents"]) == (1, 4, 0)
    got = b.handle(s, "evict", {"namespace": NS, "key": "k0"})
    assert (got["count"], got["skipped_leased"]) == (0, 1)
    assert b.lazy_leases == lazy and all(ls.lazy for ls in lazy.values())
    assert [b.objects[NS, k].readers for k in KEYS] == [0, 0, 2, 1]  # the leaves only
    b.handle(s, "release_many", {"leases": [whole, middle, again]})
    assert all(o.readers == 0 for o in b.objects.values())
    assert [o["readers"] for o in b.handle(s, "list", {"namespace": NS})["objects"]] == [0] * 5
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 5


def test_stat_counts_every_block_of_a_match_nothing_materialized(make_broker):
    # The occupancy map reads the leases, not the blocks' reader counts.
    b = make_broker(npages=64)
    s = session(b)
    publish_chain(b, s, KEYS)
    lease = match(b, s, KEYS)
    pool = b.snapshot()["pools"][0]
    assert all(pool["occupancy"][b.objects[NS, k].start] == "r" for k in KEYS)
    b.handle(s, "release", {"lease": lease})
    assert "r" not in b.snapshot()["pools"][0]["occupancy"]


@pytest.mark.parametrize("hold", [True, False])
def test_matched_blocks_stay_recent(make_broker, hold):
    # A match that holds nothing (a scheduler's lookup) keeps them recent too: a prefix
    # found again and again is not the first evicted.
    b = make_broker(npages=16)
    s = session(b)
    publish_chain(b, s, KEYS)  # the oldest objects ...
    for i in range(4):
        put(b, s, f"other-{i}", 0x50)
    reply = b.handle(s, "match_prefix", {"namespace": NS, "keys": KEYS, "hold": hold})
    if hold:  # ... but the most recently used
        b.handle(s, "release", {"lease": reply["lease"]})
    put(b, s, "big", 0x60, pages=12)  # 4 pages must go: the others, not the chain
    assert all((NS, k) in b.objects for k in KEYS)
    assert not any((NS, f"other-{i}") in b.objects for i in range(4))


def test_matches_sharing_blocks_each_hold_theirs(make_broker):
    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    whole = match(b, s, KEYS)
    head = match(b, s, KEYS[:2])
    k1, k3 = b.objects[NS, "k1"], b.objects[NS, "k3"]
    put(b, s, "k3", 0x77, replace=True)  # only the whole match holds k3
    b.handle(s, "release", {"lease": whole})
    assert k3.start not in b.pages.owners[0]  # its last reader left: freed
    put(b, s, "k1", 0x78, replace=True)  # the head match still holds k1
    b.close_session(fill_pool(b))
    assert read(b, k1) == bytes([0x11]) * PAGE and b.pages.owners[0][k1.start] is k1
    b.handle(s, "release", {"lease": head})
    assert k1.start not in b.pages.owners[0]
    assert not b.leases and all(o.readers == 0 for o in b.objects.values())


def test_blocks_of_other_sizes_or_names_reply_and_count_their_own(make_broker):
    b = make_broker()
    s = session(b)
    sizes = [PAGE, 100, PAGE, 200]
    r = b.handle(
        s,
        "reserve_blocks",
        {
            "namespace": NS,
            "blocks": [
                {"key": k, "parent": KEYS[i - 1] if i else None, "buffers": {"x": sizes[i]}}
                for i, k in enumerate(KEYS)
            ],
        },
    )
    b.handle(s, "seal_many", {"leases": [res["lease"] for res in r["results"]], "checksums": None})
    y = b.handle(s, "reserve", {"namespace": NS, "key": "other-names", "buffers": {"y": 10}})
    b.handle(s, "seal", {"lease": y["lease"]})
    for _ in range(2):  # the first match builds the rows, the second reads them
        before = b.counters["bytes_out"]
        reply = b.handle(s, "match_prefix", {"namespace": NS, "keys": KEYS})
        assert reply["names"] == ["x"] and len(reply["packed"]) == 4 * 3 * 8
        assert b.counters["bytes_out"] - before == sum(sizes)
        b.handle(s, "release", {"lease": reply["lease"]})
    reply = b.handle(s, "match_prefix", {"namespace": NS, "keys": ["k0", "other-names"]})
    assert "packed" not in reply and [set(blk) for blk in reply["blocks"]] == [{"x"}, {"y"}]
    b.handle(s, "release", {"lease": reply["lease"]})


def _lookup_time(b, s, key, rounds=5, n=200):
    """Best of ``rounds`` of the mean time of ``n`` lookups of ``key`` (seconds)."""
    import time

    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            b.handle(s, "lookup", {"namespace": NS, "key": key})
        best = min(best, (time.perf_counter() - t) / n)
    return best


def test_lookups_cost_no_scan_of_every_block_of_every_live_match(make_broker):
    # lookup (exists()) and unlinks find the lazy leases holding a block: a scan of every
    # block of every live match (1.25 ms per lookup of any object beside 256 matches of 512
    # blocks, on the daemon's one thread) made one client's matches slow every other one.
    b = make_broker(npages=1200)
    b.max_leases_per_client = 1 << 20
    s, reader = session(b), session(b)
    long = [f"L{i}" for i in range(512)]
    short = [f"S{i}" for i in range(2)]
    other = [f"O{i}" for i in range(4)]  # a chain no match holds: its blocks have children
    for chain in (long, short, other):
        r = b.handle(
            s,
            "reserve_blocks",
            {
                "namespace": NS,
                "blocks": [
                    {"key": k, "parent": chain[i - 1] if i else None} for i, k in enumerate(chain)
                ],
                "buffers": {"x": 64},
            },
        )
        b.handle(
            s, "seal_many", {"leases": [res["lease"] for res in r["results"]], "checksums": None}
        )
    put(b, s, "lone", 0x50)

    def beside(chain):  # lookups beside 256 matches of `chain`, then none
        leases = [match(b, reader, chain) for _ in range(256)]
        times = _lookup_time(b, s, "lone"), _lookup_time(b, s, "O1")
        b.handle(reader, "release_many", {"leases": leases})
        return times

    for _ in range(2):  # interleaved: the load of the machine is the same for each
        (lone_long, chained_long), (_, chained_short) = beside(long), beside(short)
        alone = _lookup_time(b, s, "lone")
        if lone_long < 4 * alone and chained_long < 4 * chained_short:
            break
    assert lone_long < 4 * alone  # an object no match can hold: no scan at all
    assert chained_long < 4 * chained_short  # per match, not per block
    assert not b.lazy_leases and all(o.readers == 0 for o in b.objects.values())


def test_a_restored_chain_under_a_match_keeps_its_republished_middle_block(make_broker):
    # After a warm restart the blocks' depths come from their restored parents: the match's
    # lease must still be found holding a middle block when that block is replaced.
    old = make_broker()
    publish_chain(old, session(old), KEYS)
    b = Broker(old.pools, clock=Clock(), high_watermark=1.0, low_watermark=1.0)
    b.test_mm = old.test_mm
    assert b.restore([o.to_record() for o in old.objects.values()]) == 4
    s = session(b)
    lease = match(b, s, KEYS)
    middle = b.objects[NS, "k2"]
    put(b, s, "k2", 0x77, replace=True)
    fill_pool(b)
    assert read(b, middle) == bytes([0x12]) * PAGE and b.pages.owners[0][middle.start] is middle
    b.handle(s, "release", {"lease": lease})
    assert middle.start not in b.pages.owners[0]


def test_a_match_that_holds_nothing_counts_the_run_and_takes_no_lease(make_broker):
    # What a scheduler asks (match_prefix hold=False): how far the prefix goes, nothing
    # pinned, no lease to release, none of the connection's lease budget used.
    from kvbroker.errors import BadRequest

    b = make_broker()
    s = session(b)
    publish_chain(b, s, KEYS)
    b.max_leases_per_client = 0  # a held match would be refused
    before = dict(b.counters)
    reply = b.handle(
        s,
        "match_prefix",
        {"namespace": NS, "keys": KEYS[:3] + ["nope", "k3"], "hold": False, "block_tokens": 16},
    )
    assert (reply["matched"], reply["lease"], reply["blocks"]) == (3, None, [])
    assert "packed" not in reply
    assert not b.leases and not b.lazy_leases
    assert all(o.readers == 0 for o in b.objects.values())
    assert b.counters["bytes_out"] == before["bytes_out"]
    assert b.counters["prefix_queries"] == before["prefix_queries"] + 1
    assert b.counters["prefix_hit_tokens"] == before["prefix_hit_tokens"] + 3 * 16
    with pytest.raises(BadRequest, match="peer needs hold"):
        b.handle(
            s,
            "match_prefix",
            {"namespace": NS, "keys": KEYS, "hold": False, "peer": "10.0.0.1:7000"},
        )
