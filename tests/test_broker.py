"""The broker state machine in-process: leases, fencing, quarantine, eviction."""

import os
import secrets

import pytest
from _fakes import Clock

from kvbroker._server.broker import Broker, WouldWait
from kvbroker._server.pool import HostPool
from kvbroker.errors import (
    BadRequest,
    Exists,
    Forbidden,
    LeaseExpired,
    NotFound,
    PoolFull,
    ProtocolError,
)

PAGE = 4096


@pytest.fixture
def make_broker():
    pools = []

    def make(npages=64, npools=1, **kw):
        clock = Clock()
        mine = [
            HostPool(i, f"/kvbt.{os.getpid()}.{secrets.token_hex(3)}.{i}", npages * PAGE, PAGE)
            for i in range(npools)
        ]
        pools.extend(mine)
        b = Broker(mine, clock=clock, **kw)
        b.test_clock = clock
        return b

    yield make
    for p in pools:
        p.unlink()


def session(b):
    s = b.open_session(pid=1, uid=0, gid=0)
    b.handle(s, "hello", {"version": 1, "name": "t"})
    return s


def publish(b, s, key, pages=1, ns="default", **kw):
    r = b.handle(s, "reserve", {"namespace": ns, "key": key, "buffers": {"x": pages * PAGE}, **kw})
    b.handle(s, "seal", {"lease": r["lease"]})
    return r


def used(b):
    return sum(p.allocator.used for p in b.pools)


def test_hello_required_and_version_checked(make_broker):
    b = make_broker()
    s = b.open_session()
    with pytest.raises(ProtocolError):
        b.handle(s, "stat", {})
    with pytest.raises(ProtocolError, match="version"):
        b.handle(s, "hello", {"version": 999})


def test_unsealed_object_is_invisible_then_atomic(make_broker):
    b = make_broker()
    w, r = session(b), session(b)
    res = b.handle(w, "reserve", {"key": "k", "buffers": {"a": 10, "b": 5000}})
    assert set(res["buffers"]) == {"a", "b"}
    (_, oa, na), (_, ob, nb) = res["buffers"]["a"], res["buffers"]["b"]
    assert (na, nb) == (10, 5000) and oa % 256 == 0 and ob % 256 == 0 and ob >= oa + na
    with pytest.raises(NotFound):
        b.handle(r, "claim", {"key": "k"})
    assert b.handle(r, "lookup", {"key": "k"}) is None
    b.handle(w, "seal", {"lease": res["lease"]})
    got = b.handle(r, "claim", {"key": "k"})
    assert got["buffers"] == res["buffers"]


def test_exists_and_replace(make_broker):
    b = make_broker()
    s, reader = session(b), session(b)
    publish(b, s, "k")
    with pytest.raises(Exists):
        b.handle(s, "reserve", {"key": "k", "buffers": {"x": 1}})
    held = b.handle(reader, "claim", {"key": "k"})
    before = used(b)
    publish(b, s, "k", replace=True)
    # the old version stays alive for its reader, then goes
    assert used(b) == before + 1
    b.handle(reader, "release", {"lease": held["lease"]})
    assert used(b) == before


def test_concurrent_publish_of_same_key_refused(make_broker):
    b = make_broker()
    s1, s2 = session(b), session(b)
    b.handle(s1, "reserve", {"key": "k", "buffers": {"x": 1}})
    with pytest.raises(Exists, match="being published"):
        b.handle(s2, "reserve", {"key": "k", "buffers": {"x": 1}, "replace": True})


def test_abort_and_disconnect_free_everything(make_broker):
    b = make_broker()
    s = session(b)
    r = b.handle(s, "reserve", {"key": "a", "buffers": {"x": 3 * PAGE}})
    b.handle(s, "abort", {"lease": r["lease"]})
    assert used(b) == 0
    publish(b, s, "sealed")
    c = session(b)
    b.handle(c, "reserve", {"key": "b", "buffers": {"x": PAGE}})
    b.handle(c, "claim", {"key": "sealed"})
    b.close_session(c)
    assert used(b) == 1 and not b.leases and b.objects["default", "sealed"].readers == 0


def test_consume_frees_after_release_and_consumers_count(make_broker):
    b = make_broker()
    s = session(b)
    publish(b, s, "once")
    lease = b.handle(s, "claim", {"key": "once", "consume": True})["lease"]
    assert b.handle(s, "lookup", {"key": "once"}) is not None
    b.handle(s, "release", {"lease": lease})
    assert b.handle(s, "lookup", {"key": "once"}) is None and used(b) == 0
    publish(b, s, "twice", consumers=2)
    for left in (1, 0):
        lease = b.handle(s, "claim", {"key": "twice", "consume": True})["lease"]
        b.handle(s, "release", {"lease": lease})
        assert (b.handle(s, "lookup", {"key": "twice"}) is not None) == bool(left)


def test_crashed_consumer_does_not_count(make_broker):
    b = make_broker()
    s, d = session(b), session(b)
    publish(b, s, "k")
    b.handle(d, "claim", {"key": "k", "consume": True})
    b.close_session(d)
    assert b.handle(s, "lookup", {"key": "k"}) is not None


def test_write_lease_expiry_quarantines_until_writer_leaves(make_broker):
    b = make_broker(npages=4, lease_ttl=5.0)
    w = session(b)
    r = b.handle(w, "reserve", {"key": "slow", "buffers": {"x": 4 * PAGE}})
    b.test_clock.now += 6
    assert b.expire() == 1
    # the object is gone and its lease fenced ...
    with pytest.raises(LeaseExpired, match="TTL"):
        b.handle(w, "seal", {"lease": r["lease"]})
    assert ("default", "slow") not in b.pending
    # ... but its pages stay out of circulation while the slow writer may still write
    other = session(b)
    with pytest.raises(PoolFull):
        b.handle(other, "reserve", {"key": "next", "buffers": {"x": PAGE}})
    snap = b.snapshot()
    assert snap["pools"][0]["quarantined"] == 4 * PAGE
    assert "q" in snap["pools"][0]["occupancy"]
    b.close_session(w)
    b.handle(other, "reserve", {"key": "next", "buffers": {"x": 4 * PAGE}})


def test_read_lease_expiry_fences_the_holder(make_broker):
    b = make_broker(lease_ttl=5.0)
    s = session(b)
    publish(b, s, "k")
    lease = b.handle(s, "claim", {"key": "k"})["lease"]
    b.test_clock.now += 3
    b.handle(s, "renew", {"leases": [lease]})
    b.test_clock.now += 3
    assert b.expire() == 0  # renewed
    b.test_clock.now += 6
    assert b.expire() == 1
    with pytest.raises(LeaseExpired):
        b.handle(s, "release", {"lease": lease})
    with pytest.raises(LeaseExpired):
        b.handle(s, "renew", {"leases": [lease]})
    # once the lease is gone the object is evictable again
    assert b.handle(s, "evict", {"key": "k"})["count"] == 1


def test_leases_belong_to_their_connection(make_broker):
    b = make_broker()
    s, t = session(b), session(b)
    publish(b, s, "k")
    lease = b.handle(s, "claim", {"key": "k"})["lease"]
    with pytest.raises(Forbidden):
        b.handle(t, "release", {"lease": lease})
    with pytest.raises(BadRequest):
        b.handle(s, "seal", {"lease": lease})  # a read lease cannot seal
    with pytest.raises(BadRequest, match="no lease"):
        b.handle(s, "release", {"lease": 123456})


def test_lru_eviction_order_and_leased_never_evicted(make_broker):
    b = make_broker(npages=4, high_watermark=1.0, low_watermark=1.0)
    s = session(b)
    for k in "abcd":
        publish(b, s, k)
    held = b.handle(s, "claim", {"key": "a"})["lease"]  # oldest, but leased
    b.handle(s, "release", {"lease": b.handle(s, "claim", {"key": "b"})["lease"]})  # b now MRU
    publish(b, s, "e")
    assert b.handle(s, "lookup", {"key": "c"}) is None  # least recently used unleased
    assert all(b.handle(s, "lookup", {"key": k}) for k in "abde")
    publish(b, s, "f")
    assert b.handle(s, "lookup", {"key": "d"}) is None
    assert b.handle(s, "lookup", {"key": "a"}) is not None
    assert b.counters["evictions"] == 2
    b.handle(s, "release", {"lease": held})


def test_pool_full_fails_at_once_without_evicting(make_broker):
    b = make_broker(npages=4)
    s = session(b)
    publish(b, s, "a", pages=2)
    b.handle(s, "claim", {"key": "a"})
    publish(b, s, "b", pages=1)
    with pytest.raises(PoolFull, match="larger than any pool"):
        b.handle(s, "reserve", {"key": "huge", "buffers": {"x": 5 * PAGE}})
    with pytest.raises(PoolFull, match="leased or unsealed"):
        b.handle(s, "reserve", {"key": "big", "buffers": {"x": 4 * PAGE}})
    assert b.handle(s, "lookup", {"key": "b"}) is not None  # nothing evicted in vain
    assert b.counters["evictions"] == 0


def test_high_watermark_evicts_down_to_low(make_broker):
    b = make_broker(npages=20, high_watermark=0.8, low_watermark=0.5)
    s = session(b)
    for i in range(16):
        publish(b, s, f"k{i}")
    assert used(b) == 16
    publish(b, s, "k16")  # 17 > 0.8 * 20: down to 10
    assert used(b) == 10
    assert b.handle(s, "lookup", {"key": "k0"}) is None
    assert b.handle(s, "lookup", {"key": "k16"}) is not None


def test_sealing_a_chain_past_the_high_watermark_keeps_the_chain_whole(make_broker):
    """seal_many of a chain crossing the high watermark evicts the least recently used
    objects, never the chain's first blocks: sealed first, they were leaves (evictable) until
    their children were sealed a moment later in the same request."""
    b = make_broker(npages=20, high_watermark=0.8, low_watermark=0.5)
    s = session(b)

    def chain(keys):
        r = b.handle(
            s,
            "reserve_blocks",
            {
                "blocks": [
                    {"key": k, "parent": keys[i - 1] if i else None} for i, k in enumerate(keys)
                ],
                "buffers": {"x": PAGE},
            },
        )
        b.handle(
            s, "seal_many", {"leases": [res["lease"] for res in r["results"]], "checksums": None}
        )

    old, new = [f"old{i}" for i in range(8)], [f"new{i}" for i in range(10)]
    chain(old)
    chain(new)
    assert used(b) == 10  # 18 > 0.8 * 20: down to 10, the old chain from its leaf
    assert [k for k in new if b.handle(s, "lookup", {"key": k}) is None] == []
    assert all(b.handle(s, "lookup", {"key": k}) is None for k in old)
    assert b.handle(s, "match_prefix", {"keys": new, "hold": False})["matched"] == 10
    # One chain alone past the watermark: it shrinks from its leaf, its root stays
    b.handle(s, "evict", {"all": True})
    alone = [f"alone{i}" for i in range(18)]
    chain(alone)
    assert used(b) == 10
    assert b.handle(s, "match_prefix", {"keys": alone, "hold": False})["matched"] == 10


def test_evict_filters_and_dry_run(make_broker):
    b = make_broker()
    s = session(b)
    publish(b, s, "req-1", ns="a")
    publish(b, s, "req-2", ns="a")
    publish(b, s, "blk-1", ns="b")
    r = b.handle(s, "evict", {"match": "^req-", "dry_run": True})
    assert r["count"] == 2 and r["dry_run"] and used(b) == 3
    assert b.handle(s, "evict", {"namespace": "b"})["count"] == 1
    assert b.handle(s, "evict", {"match_buffers": "^x$", "namespace": "a"})["count"] == 2
    with pytest.raises(BadRequest, match="name what"):
        b.handle(s, "evict", {})
    with pytest.raises(BadRequest, match="bad regex"):
        b.handle(s, "evict", {"match": "("})


def test_evict_older_than(make_broker):
    b = make_broker()
    s = session(b)
    publish(b, s, "old")
    b.objects["default", "old"].created_at -= 3600
    publish(b, s, "new")
    assert b.handle(s, "evict", {"older_than": 60})["count"] == 1
    assert b.handle(s, "lookup", {"key": "new"}) is not None


def test_claim_select_regex_is_full_match(make_broker):
    b = make_broker()
    s = session(b)
    bufs = {"past_key.0": 8, "past_value.0": 8, "past_key.0_x": 8, "vision_embeds": 8}
    r = b.handle(s, "reserve", {"key": "k", "buffers": bufs})
    b.handle(s, "seal", {"lease": r["lease"]})
    got = b.handle(s, "claim", {"key": "k", "select": r"past_(key|value)\.\d+"})
    assert set(got["buffers"]) == {"past_key.0", "past_value.0"}


def test_claim_wait_defers_to_the_daemon(make_broker):
    b = make_broker()
    s = session(b)
    with pytest.raises(WouldWait):
        b.handle(s, "claim", {"key": "later", "wait": 1.0})


@pytest.mark.parametrize(
    "op,args,match",
    [
        ("reserve", {"key": "k", "buffers": {}}, "at least one buffer"),
        ("reserve", {"key": "", "buffers": {"x": 1}}, "key must not be empty"),
        ("reserve", {"key": "k", "buffers": {"x": -1}}, "non-negative"),
        ("reserve", {"key": "k", "buffers": {"x": "1"}}, "non-negative"),
        ("reserve", {"key": 5, "buffers": {"x": 1}}, "key must be str"),
        ("reserve", {"key": "k", "buffers": {"x": 1}, "ttl": -1}, "ttl"),
        ("reserve", {"key": "k", "buffers": {"x": 1}, "bogus": 1}, "unexpected argument"),
        ("claim", {}, "missing argument 'key'"),
        ("claim", {"key": "k", "consume": 1}, "consume must be bool"),
        ("release", {"lease": True}, "lease must be int"),
        ("frobnicate", {}, "unknown op"),
        ("stat", [1, 2], "args must be a map"),
    ],
)
def test_bad_requests_are_refused_clearly(make_broker, op, args, match):
    b = make_broker()
    s = session(b)
    with pytest.raises(BadRequest, match=match):
        b.handle(s, op, args)
    assert not b.leases and used(b) == 0


def test_snapshot_accounts_leases(make_broker):
    b = make_broker(npages=16)
    s = session(b)
    publish(b, s, "r", pages=2)
    b.handle(s, "claim", {"key": "r"})
    b.handle(s, "reserve", {"key": "w", "buffers": {"x": 3 * PAGE}})
    snap = b.snapshot(occupancy_cells=16)
    pool = snap["pools"][0]
    assert pool["used"] == 5 * PAGE and pool["free"] == 11 * PAGE
    assert pool["leased_read"] == 2 * PAGE and pool["leased_write"] == 3 * PAGE
    assert pool["occupancy"] == "rrwww" + "." * 11
    assert snap["read_leases"] == 1 and snap["write_leases"] == 1 and snap["pending"] == 1
    assert snap["clients"][0]["read_leases"] == 1
