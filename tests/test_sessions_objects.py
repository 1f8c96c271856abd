"""Sessions on plain objects: ``reserve`` and ``publish`` (a write arena's put) take the same
``retain`` as ``reserve_blocks`` and ``match_prefix`` (one rule in the op table), in-process;
the client's ``put``/``reserve`` through a daemon are in test_sessions_client.py."""

import os
import secrets

import pytest
from _fakes import Clock
from test_sessions import PAGE, burst, connect, held

from kvbroker._server.broker import Broker
from kvbroker._server.pool import HostPool
from kvbroker._server.policy import parse_isolation, user_name
from kvbroker._server.retention import RetentionSettings
from kvbroker.errors import BadRequest, Exists, Forbidden, NotFound


@pytest.fixture
def new_broker():
    pools = []

    def make(npages=64, **kw):
        pool = HostPool(0, f"/kvbs.{os.getpid()}.{secrets.token_hex(3)}.0", npages * PAGE, PAGE)
        pools.append(pool)
        b = Broker([pool], clock=Clock(), **kw)
        b.retention.clock = Clock()
        return b

    yield make
    for p in pools:
        p.unlink()


def reserve(b, s, key, ns="default", **more):
    r = b.handle(s, "reserve", {"namespace": ns, "key": key, "buffers": {"x": PAGE}, **more})
    b.handle(s, "seal", {"lease": r["lease"]})
    return key


def arena_put(b, s, key, ns="default", **more):
    """A put through a write arena: one page published out of it, the rest given back."""
    lent = b.handle(s, "arena", {"nbytes": 4 * PAGE})
    try:
        b.handle(
            s,
            "publish",
            {"arena": lent["lease"], "namespace": ns, "key": key, "buffers": {"x": PAGE}, **more},
        )
    except BaseException:
        b.handle(s, "abort", {"lease": lent["lease"]})  # a refused publish leaves the arena
        raise
    return key


def test_reserved_and_published_objects_of_a_session_outlive_a_burst(new_broker):
    b = new_broker(npages=64)
    s = connect(b)
    kept = [reserve(b, s, f"r{i}", retain={"session": "agent", "priority": 2}) for i in range(4)]
    kept += [arena_put(b, s, f"p{i}", retain={"session": "agent"}) for i in range(4)]
    plain = [reserve(b, s, "plain-r"), arena_put(b, s, "plain-p")]
    burst(b, s, 200)
    assert held(b, kept) == kept and held(b, plain) == []
    (info,) = b.handle(s, "sessions", {})["sessions"]
    assert (info["name"], info["blocks"], info["priority"]) == ("agent", 8, 2)
    assert b.statistics().retention.evicted == {}


def test_a_publish_that_finds_its_key_retains_the_object_there(new_broker):
    # What a put of the session's object returns False for is the object it needs kept, as
    # reserve_blocks retains the blocks the node held already.
    b = new_broker(npages=64)
    s = connect(b)
    there = [reserve(b, s, "a"), reserve(b, s, "b")]
    with pytest.raises(Exists):
        reserve(b, s, "a", retain={"session": "conv"})
    with pytest.raises(Exists):
        arena_put(b, s, "b", retain={"session": "conv"})
    entry = b.retention.sessions[("default", "conv")]
    assert sorted(o.key for o in entry.objects.values()) == there
    burst(b, s, 200)
    assert held(b, there) == there


def test_objects_keep_within_the_bounds_as_blocks_do(new_broker):
    b = new_broker(npages=64, retention=RetentionSettings(tenant_quota=3 * PAGE))
    s = connect(b, uid=1001)
    for i in range(5):
        reserve(b, s, f"r{i}", retain={"session": "x"})
    entry = b.retention.sessions[("default", "x")]
    assert sorted(o.key for o in entry.objects.values()) == ["r2", "r3", "r4"]  # oldest shed
    assert b.statistics().retention.dropped == {"tenant_quota": 2}


def test_another_uid_can_neither_see_nor_steer_a_session_by_publishing(new_broker):
    policy = parse_isolation(
        {"mode": "tenant", "shared": {"chat": {"read": ["*"], "write": ["*"]}}}
    )
    b = new_broker(npages=64, policy=policy)
    alice, bob = connect(b, uid=60051), connect(b, uid=60052)
    own = user_name(60051)
    mine = reserve(b, alice, "secret-0", ns=own, retain={"session": "private", "priority": 4})
    shared = arena_put(b, alice, "c0", ns="chat", retain={"session": "conv", "priority": 5})
    # Her own namespace: bob sees no session there, and may not publish into it at all.
    assert [r["name"] for r in b.handle(bob, "sessions", {})["sessions"]] == ["conv"]
    with pytest.raises(NotFound):
        b.handle(bob, "retain", {"name": "private", "seconds": 60})
    for put in (reserve, arena_put):
        with pytest.raises(Forbidden):
            put(b, bob, "x", ns=own, retain={"session": "private"})
    # A shared namespace shares names, not sessions: his publishes may not name hers, and
    # nothing of his is published or retained for trying.
    for put, key in ((reserve, "b0"), (arena_put, "b1")):
        with pytest.raises(Forbidden, match="belongs to uid 60051"):
            put(b, bob, key, ns="chat", retain={"session": "conv", "priority": 0})
        assert ("chat", key) not in b.objects
    with pytest.raises(Forbidden):  # nor retain her object into her session by finding it
        reserve(b, bob, "c0", ns="chat", retain={"session": "conv"})
    entry = b.retention.sessions[("chat", "conv")]
    assert (entry.uid, entry.priority, [o.key for o in entry.objects.values()]) == (
        60051,
        5,
        [shared],
    )
    assert b.retention.tenant_bytes == {60051: 2 * PAGE}
    assert b.retention.sessions[(own, "private")].priority == 4 and held(b, [mine], ns=own)


@pytest.mark.parametrize(
    "retain",
    [{"session": ""}, {"session": "x", "for": 0}, {"session": "x", "priority": 101}, {"n": 1}],
)
def test_a_bad_retain_on_a_publish_is_refused_before_anything_is_lent(new_broker, retain):
    b = new_broker()
    s = connect(b)
    lent = b.handle(s, "arena", {"nbytes": 4 * PAGE})
    with pytest.raises(BadRequest, match="retain: (session|for|priority|unknown)"):
        reserve(b, s, "k", retain=retain)
    with pytest.raises(BadRequest, match="retain: (session|for|priority|unknown)"):
        b.handle(
            s,
            "publish",
            {"arena": lent["lease"], "key": "k", "buffers": {"x": PAGE}, "retain": retain},
        )
    assert not b.retention.sessions and not b.objects and not b.pending
    b.handle(s, "publish", {"arena": lent["lease"], "key": "k", "buffers": {"x": PAGE}})
    assert list(b.objects) == [("default", "k")]  # the arena was left as it was
