"""Sessions (kvbroker._server.retention) in-process: retained blocks outlive what evicts
everything else, expire, keep their bounds (tenant quota, pool share, time), survive a
restart through the journal, and stay invisible to other tenants."""

import os
import secrets

import pytest
from _fakes import Clock

from kvbroker._server.broker import Broker
from kvbroker._server.journal import Journal
from kvbroker._server.policy import parse_isolation
from kvbroker._server.pool import HostPool
from kvbroker._server.retention import RetentionSettings
from kvbroker.errors import BadRequest, Forbidden, LimitExceeded, NotFound

PAGE = 4096


@pytest.fixture
def make_broker():
    pools = []

    def make(npages=64, npools=1, **kw):
        mine = [
            HostPool(i, f"/kvbs.{os.getpid()}.{secrets.token_hex(3)}.{i}", npages * PAGE, PAGE)
            for i in range(npools)
        ]
        pools.extend(mine)
        b = Broker(mine, clock=Clock(), **kw)
        b.retention.clock = Clock()  # wall-clock in the daemon; still here until moved
        return b

    yield make
    for p in pools:
        p.unlink()


def connect(b, uid=0):
    s = b.open_session(pid=1, uid=uid, gid=uid)
    b.handle(s, "hello", {"version": 1, "name": "t"})
    return s


def chain(b, s, prefix, n, ns="default", retain=None):
    """Publish a chain of ``n`` one-page blocks ``prefix0..`` (parents first)."""
    blocks = [
        {"key": f"{prefix}{i}", "parent": f"{prefix}{i - 1}" if i else None, "buffers": {"x": PAGE}}
        for i in range(n)
    ]
    args = {"namespace": ns, "blocks": blocks}
    if retain is not None:
        args["retain"] = retain
    r = b.handle(s, "reserve_blocks", args)
    leases = [x["lease"] for x in r["results"] if "lease" in x]
    if leases:
        b.handle(s, "seal_many", {"leases": leases})
    return [f"{prefix}{i}" for i in range(n)]


def burst(b, s, n, prefix="burst", ns="default"):
    """``n`` one-shot objects of one page each (unretained)."""
    for i in range(n):
        r = b.handle(s, "reserve", {"namespace": ns, "key": f"{prefix}{i}", "buffers": {"x": PAGE}})
        b.handle(s, "seal", {"lease": r["lease"]})


def held(b, keys, ns="default"):
    return [k for k in keys if (ns, k) in b.objects]


def test_retained_blocks_outlive_a_burst_that_evicts_everything_else(make_broker):
    b = make_broker(npages=64)
    s = connect(b)
    kept = chain(b, s, "conv", 8, retain={"session": "conv-42", "for": 600})
    plain = chain(b, s, "other", 8)  # the same kind of blocks, no session
    burst(b, s, 200)  # three pools' worth of one-shot prompts
    assert held(b, kept) == kept
    assert held(b, plain) == []
    assert b.counters["evictions"] > 150
    st = b.statistics().retention
    assert st.sessions == 1 and st.retained_objects == 8 and st.retained_bytes == (8 * PAGE,)
    assert st.evicted == {}  # no retained block was evicted


def test_retained_go_last_lowest_priority_first_then_least_recent(make_broker):
    b = make_broker(
        npages=32,
        high_watermark=1.0,
        low_watermark=1.0,
        retention=RetentionSettings(pool_share=1.0),
    )
    s = connect(b)
    low = chain(b, s, "low", 8, retain={"session": "low", "priority": 0})
    high = chain(b, s, "high", 8, retain={"session": "high", "priority": 5})
    low2 = chain(b, s, "lowb", 8, retain={"session": "low2", "priority": 0})
    # 8 pages are free; 12 write leases (never evictable) need 4 pages of retained blocks:
    # the lowest priority go first, the least recently used session first, a chain from
    # its leaf.
    for i in range(12):
        b.handle(s, "reserve", {"key": f"w{i}", "buffers": {"x": PAGE}})
    assert held(b, low) == low[:4] and held(b, high) == high and held(b, low2) == low2
    for i in range(8):
        b.handle(s, "reserve", {"key": f"v{i}", "buffers": {"x": PAGE}})
    assert held(b, low) == [] and held(b, high) == high and held(b, low2) == low2[:4]
    assert b.statistics().retention.evicted == {"pool_full": 12}


def test_each_request_renews_and_matched_blocks_are_retained(make_broker):
    b = make_broker(npages=64)
    s = connect(b)
    keys = chain(b, s, "shared", 6)  # published without a session (a system prompt)
    clock = b.retention.clock
    r = b.handle(
        s, "match_prefix", {"keys": keys, "hold": False, "retain": {"session": "chat", "for": 60}}
    )
    assert r["matched"] == 6
    clock.now += 50
    r = b.handle(s, "match_prefix", {"keys": keys[:2], "retain": {"session": "chat", "for": 60}})
    b.handle(s, "release", {"lease": r["lease"]})  # a held match, read and released
    clock.now += 50  # 100 s after the first request, 50 after the second: still retained
    assert b.retention.expire() == 0
    burst(b, s, 200)
    assert held(b, keys) == keys
    clock.now += 11
    assert b.retention.expire() == 1  # 61 s after its last request
    burst(b, s, 200, prefix="again")
    assert held(b, keys) == []
    assert b.statistics().retention.dropped["expired"] == 6


def test_retention_is_capped_at_max_retain_and_expires(make_broker):
    b = make_broker(npages=64, retention=RetentionSettings(max_retain=120))
    s = connect(b)
    kept = chain(b, s, "c", 4, retain={"session": "s", "for": 3600})  # capped at 120 s
    (info,) = b.handle(s, "sessions", {})["sessions"]
    assert info["expires_in"] == 120 and info["blocks"] == 4 and info["bytes"] == 4 * PAGE
    b.retention.clock.now += 121
    assert b.retention.expire() == 1
    assert b.handle(s, "sessions", {})["sessions"] == []
    burst(b, s, 200)
    assert held(b, kept) == []


def test_tenant_over_its_quota_loses_its_own_lowest_priority_retention_first(make_broker):
    b = make_broker(npages=64, retention=RetentionSettings(tenant_quota=8 * PAGE))
    alice, bob = connect(b, uid=1001), connect(b, uid=1002)
    bobs = chain(b, bob, "bob", 6, retain={"session": "b", "priority": 0})
    important = chain(b, alice, "imp", 4, retain={"session": "imp", "priority": 3})
    old = chain(b, alice, "old", 4, retain={"session": "old", "priority": 1})
    new = chain(b, alice, "new", 4, retain={"session": "new", "priority": 1})
    r = b.retention
    assert r.tenant_bytes[1001] <= 8 * PAGE
    # alice's priority-3 session stays; of her priority-1 sessions the older lost retention.
    assert r.sessions[("default", "imp")].nbytes == 4 * PAGE
    assert r.sessions[("default", "old")].nbytes == 0
    assert r.sessions[("default", "new")].nbytes == 4 * PAGE
    assert r.sessions[("default", "b")].nbytes == 6 * PAGE  # another tenant: untouched
    assert b.statistics().retention.dropped == {"tenant_quota": 4}
    # Nothing was refused or freed: the blocks that lost retention are still cached...
    assert held(b, old) == old
    burst(b, bob, 200)  # ...and are the first to go under pressure
    assert held(b, old) == [] and held(b, important) == important and held(b, new) == new
    assert held(b, bobs) == bobs


def test_a_tenant_over_its_quota_sheds_without_walking_the_others_retention(make_broker):
    # Each request of a tenant past its quota sheds its own retention. Finding it must not
    # look at what every other tenant retains: the event loop pays for that walk, so one
    # tenant holding its blocks at the recent end of a big tier made every client wait
    # (20,000 retained by another uid: 19 ms a request, against 0.15 ms without the walk).
    b = make_broker(npages=256, retention=RetentionSettings(tenant_quota=3 * PAGE))
    alice, bob = connect(b, uid=60031), connect(b, uid=60032)
    for i in range(2):
        chain(b, alice, f"a{i}-", 3, retain={"session": f"a{i}"})  # older: the tier's front
    theirs = {o.serial for e in b.retention.sessions.values() for o in e.objects.values()}

    class Counting(dict):
        looked = 0

        def __getitem__(self, serial):
            Counting.looked += serial in theirs
            return super().__getitem__(serial)

        def get(self, serial, default=None):
            Counting.looked += serial in theirs
            return super().get(serial, default)

    mine = chain(b, bob, "b", 3, retain={"session": "b"})
    b.retention.holders = Counting(b.retention.holders)
    more = chain(b, bob, "c", 2, retain={"session": "b"})  # past his quota by two blocks
    assert Counting.looked == 0
    kept = b.retention.sessions[("default", "b")].objects.values()
    assert sorted(o.key for o in kept) == sorted(mine[:1] + more)  # his oldest, leaf first
    assert b.retention.tenant_bytes == {60031: 3 * PAGE, 60032: 3 * PAGE}


def test_retained_bytes_keep_within_the_pool_share(make_broker):
    b = make_broker(npages=64, retention=RetentionSettings(pool_share=0.25))
    s = connect(b)
    for i in range(6):
        chain(b, s, f"s{i}-", 6, retain={"session": f"s{i}", "priority": i % 2})
        assert b.retention.pool_bytes[0] <= 16 * PAGE
    st = b.statistics().retention
    assert st.retained_cap == (16 * PAGE,) and st.retained_bytes[0] <= 16 * PAGE
    assert st.dropped["pool_share"] >= 36 - 16
    # Plain traffic keeps the rest of the pool, and the retained blocks stay.
    retained = [o.key for o in b.objects.values() if b.retention.keeps(o)]
    assert sum(b.objects[("default", k)].npages for k in retained) == 16
    burst(b, s, 200)
    assert held(b, retained) == retained
    assert sum(1 for ns, k in b.objects if k.startswith("burst")) >= int(0.9 * 64) - 16 - 1


def test_restart_keeps_retention_and_drops_what_expired(make_broker, tmp_path):
    b = make_broker(npages=64)
    path = str(tmp_path / "j")
    b.attach_journal(Journal(path, 1, [b.pools[0].describe()]), 1)
    s = connect(b, uid=1001)
    kept = chain(b, s, "keep", 5, retain={"session": "keep", "for": 600, "priority": 2})
    chain(b, s, "short", 3, retain={"session": "short", "for": 10})
    b.handle(s, "match_prefix", {"keys": kept[:2], "retain": {"session": "keep", "for": 900}})
    chain(b, s, "gone", 2, retain={"session": "gone"})
    b.handle(s, "unretain", {"name": "gone"})
    b.compact_journal()  # the rewrite carries the sessions too
    more = chain(b, s, "keepb", 2, retain={"session": "keep"})  # after the compaction
    b.journal.close()
    rec = Journal.load(path)
    pool2 = HostPool.adopt(0, b.pools[0].name, b.pools[0].size, PAGE)
    b2 = Broker([pool2], clock=Clock())
    b2.retention.clock = Clock()
    b2.retention.clock.now = b.retention.clock.now + 60  # "short" expired meanwhile
    b2.restore(rec.objects.values(), (), rec.sessions.values())
    assert set(b2.retention.sessions) == {("default", "keep")}
    entry = b2.retention.sessions[("default", "keep")]
    assert entry.uid == 1001 and entry.priority == 2
    assert sorted(o.key for o in entry.objects.values()) == sorted(kept + more)
    assert entry.expires_at == pytest.approx(b.retention.clock.now + 900)  # the longest asked
    s2 = connect(b2)
    burst(b2, s2, 200)
    assert held(b2, kept + more) == kept + more


@pytest.mark.parametrize(
    "bad",
    [
        {"u": float("inf")},
        {"u": True},
        {"u": -1},
        {"c": "yesterday"},
        {"c": float("nan")},
        {"x": float("nan")},
        {"p": float("inf")},
        {"p": 1000},
        {"n": "x" * 600},
    ],
)
def test_a_crafted_session_record_is_skipped_and_the_restart_keeps_the_rest(
    make_broker, tmp_path, bad
):
    # A journal record that passes its checksum but says nonsense (a bug, a hand-edited
    # file) must neither stop the warm restart of every tenant's objects nor leave a session
    # that never expires and disorders the others' expiry.
    b = make_broker(npages=64)
    path = str(tmp_path / "j")
    b.attach_journal(Journal(path, 1, [b.pools[0].describe()]), 1)
    s = connect(b, uid=1001)
    kept = chain(b, s, "keep", 3, retain={"session": "keep", "for": 600})
    now = b.retention.clock.now
    b.journal.retention(
        {
            "t": "r",
            "ns": "default",
            "n": "evil",
            "u": 1002,
            "p": 1,
            "x": now + 600,
            "c": now,
            "a": [],
            **bad,
        }
    )
    b.journal.close()
    rec = Journal.load(path)
    pool2 = HostPool.adopt(0, b.pools[0].name, b.pools[0].size, PAGE)
    b2 = Broker([pool2], clock=Clock())
    b2.retention.clock = Clock()
    b2.retention.clock.now = now
    assert b2.restore(rec.objects.values(), (), rec.sessions.values()) == 3
    assert set(b2.retention.sessions) == {("default", "keep")}
    assert b2.retention.per_uid == {1001: 1}
    assert held(b2, kept) == kept
    b2.retention.clock.now = now + 601
    assert b2.retention.expire() == 1 and not b2.retention.sessions


def test_another_tenants_session_is_invisible(make_broker):
    b = make_broker(npages=64, policy=parse_isolation({"mode": "tenant"}))
    from kvbroker._server.policy import user_name

    alice, bob = connect(b, uid=60011), connect(b, uid=60012)
    ns = user_name(60011)
    chain(b, alice, "a", 3, ns=ns, retain={"session": "secret"})
    assert [x["name"] for x in b.handle(alice, "sessions", {})["sessions"]] == ["secret"]
    assert b.handle(bob, "sessions", {})["sessions"] == []
    for op, args in (
        ("retain", {"name": "secret", "seconds": 60}),
        ("unretain", {"name": "secret"}),
        ("retain", {"name": "secret", "seconds": 60, "namespace": ns}),
    ):
        with pytest.raises(NotFound):
            b.handle(bob, op, args)
    assert b.statistics_for(bob).retention.largest == ()
    assert [x.name for x in b.statistics_for(alice).retention.largest] == ["secret"]
    with pytest.raises(Forbidden):  # naming a session in another tenant's namespace
        b.handle(
            bob, "match_prefix", {"namespace": ns, "keys": ["a0"], "retain": {"session": "secret"}}
        )
    assert ("default", "secret") not in b.retention.sessions
    assert b.retention.sessions[(ns, "secret")].nbytes == 3 * PAGE


def test_another_uid_cannot_spend_a_sessions_quota_by_naming_it(make_broker):
    # A shared namespace shares names: bob naming alice's session on his publishes would
    # count his blocks against alice's tenant_quota (shedding her own retention) and escape
    # his. Refused, and nothing changes.
    b = make_broker(npages=64, retention=RetentionSettings(tenant_quota=4 * PAGE))
    alice, bob = connect(b, uid=60021), connect(b, uid=60022)
    mine = chain(b, alice, "a", 4, retain={"session": "conv", "priority": 5})
    for op, args in (
        (
            "reserve_blocks",
            {
                "blocks": [{"key": "b0", "buffers": {"x": PAGE}}],
                "retain": {"session": "conv", "priority": 0},
            },
        ),
        ("match_prefix", {"keys": mine, "retain": {"session": "conv"}}),
    ):
        with pytest.raises(Forbidden, match="belongs to uid 60021"):
            b.handle(bob, op, args)
    entry = b.retention.sessions[("default", "conv")]
    assert sorted(o.key for o in entry.objects.values()) == mine
    assert (entry.priority, b.retention.tenant_bytes) == (5, {60021: 4 * PAGE})
    assert not b.pending and ("default", "b0") not in b.objects
    chain(b, bob, "b", 2, retain={"session": "bobs"})  # his own session, his own quota
    assert b.retention.tenant_bytes == {60021: 4 * PAGE, 60022: 2 * PAGE}


def test_operators_retain_and_release(make_broker):
    b = make_broker(npages=64, retention=RetentionSettings(max_retain=7200))
    s = connect(b)
    kept = chain(b, s, "c", 4, retain={"session": "conv", "for": 30})
    info = b.handle(s, "retain", {"name": "conv", "seconds": 3600, "priority": 7})
    assert info["expires_in"] == 3600 and info["priority"] == 7 and info["blocks"] == 4
    with pytest.raises(NotFound):
        b.handle(s, "retain", {"name": "nope", "seconds": 10})
    with pytest.raises(BadRequest):
        b.handle(s, "retain", {"name": "conv", "seconds": -1})
    chain(b, s, "d", 1, ns="other", retain={"session": "conv"})  # the same name elsewhere
    with pytest.raises(BadRequest, match="namespace"):
        b.handle(s, "unretain", {"name": "conv"})
    gone = b.handle(s, "unretain", {"name": "conv", "namespace": "default"})
    assert gone["blocks"] == 4
    burst(b, s, 200)
    assert held(b, kept) == []
    assert b.statistics().retention.dropped["released"] == 4


@pytest.mark.parametrize(
    "retain",
    [
        {"session": ""},
        {"session": 3},
        {"session": "x", "for": -1},
        {"session": "x", "for": True},
        {"session": "x", "priority": 1000},
        {"session": "x", "priority": 1.5},
        {"session": "x", "until": 3},
        {"session": "x" * 600},
    ],
)
def test_a_bad_retain_is_refused_and_changes_nothing(make_broker, retain):
    b = make_broker()
    s = connect(b)
    with pytest.raises(BadRequest):
        chain(b, s, "c", 2, retain=retain)
    with pytest.raises(BadRequest):
        b.handle(s, "match_prefix", {"keys": ["c0"], "retain": retain})
    assert not b.retention.sessions and not b.objects and not b.pending


def test_sessions_per_uid_are_bounded(make_broker):
    b = make_broker(retention=RetentionSettings(max_per_uid=3))
    s, other = connect(b, uid=1001), connect(b, uid=1002)
    for i in range(3):
        b.handle(s, "match_prefix", {"keys": ["x"], "retain": {"session": f"s{i}"}})
    with pytest.raises(LimitExceeded, match="max_per_uid"):
        b.handle(s, "match_prefix", {"keys": ["x"], "retain": {"session": "s3"}})
    b.handle(s, "match_prefix", {"keys": ["x"], "retain": {"session": "s0"}})  # a renewal
    b.handle(other, "match_prefix", {"keys": ["x"], "retain": {"session": "o"}})


def test_a_reload_lowering_the_share_applies_at_once(make_broker):
    b = make_broker(npages=64)
    s = connect(b)
    chain(b, s, "c", 20, retain={"session": "big"})
    assert b.retention.pool_bytes[0] == 20 * PAGE
    b.retention.configure(RetentionSettings(pool_share=0.125))
    assert b.retention.pool_bytes[0] <= 8 * PAGE
    assert b.statistics().retention.retained_cap == (8 * PAGE,)


def test_a_replaced_or_evicted_block_leaves_its_session(make_broker):
    b = make_broker(npages=64)
    s = connect(b)
    chain(b, s, "c", 3, retain={"session": "x"})
    b.handle(s, "evict", {"key": "c2"})
    entry = b.retention.sessions[("default", "x")]
    assert sorted(o.key for o in entry.objects.values()) == ["c0", "c1"]
    assert entry.nbytes == 2 * PAGE and b.retention.pool_bytes[0] == 2 * PAGE
    assert b.statistics().retention.evicted == {"operator": 1}


def test_a_request_extends_a_session_never_shortens_it_and_keeps_its_priority(make_broker):
    b = make_broker()
    s = connect(b)
    chain(b, s, "c", 2, retain={"session": "x", "for": 3000, "priority": 4})
    b.handle(
        s, "match_prefix", {"keys": ["c0"], "hold": False, "retain": {"session": "x", "for": 60}}
    )
    (info,) = b.handle(s, "sessions", {})["sessions"]
    assert (info["expires_in"], info["priority"]) == (3000, 4)
    assert (
        b.handle(s, "retain", {"name": "x", "seconds": 60})["expires_in"] == 60
    )  # an operator sets it


def test_prometheus_shows_retention_and_why_retained_blocks_went(make_broker):
    from kvbroker._server.metrics import BrokerCollector

    b = make_broker(
        npages=16,
        high_watermark=1.0,
        low_watermark=1.0,
        retention=RetentionSettings(pool_share=0.75),
    )
    s = connect(b)
    chain(b, s, "a", 8, retain={"session": "a"})
    chain(b, s, "b", 6, retain={"session": "b"})  # 14 pages: a's 2 oldest lose retention

    def scrape():
        out = {}
        for fam in BrokerCollector(b.statistics).collect():
            for smp in fam.samples:
                out[(smp.name, *sorted(smp.labels.values()))] = smp.value
        return out

    m = scrape()
    assert m[("kvbroker_retained_cap_bytes", "0")] == 12 * PAGE
    assert m[("kvbroker_retained_bytes", "0")] == 12 * PAGE
    assert m[("kvbroker_sessions",)] == 2 and m[("kvbroker_retained_objects",)] == 12
    assert m[("kvbroker_retention_dropped_total", "pool_share")] == 2
    for i in range(10):  # 2 pages free, then a's 2 unretained blocks, then 6 retained
        b.handle(s, "reserve", {"key": f"w{i}", "buffers": {"x": PAGE}})
    b.retention.clock.now += 601
    b.retention.expire()
    m = scrape()
    assert m[("kvbroker_retained_evictions_total", "pool_full")] == 6
    assert m[("kvbroker_retention_dropped_total", "expired")] == 6
    assert m[("kvbroker_retained_bytes", "0")] == 0 and m[("kvbroker_sessions",)] == 0


def test_a_match_naming_a_session_is_never_sent_to_a_read_replica():
    from kvbroker._client.replica import answers

    assert answers("match_prefix", {"keys": ["k"], "hold": False})  # the control
    assert not answers("match_prefix", {"keys": ["k"], "hold": False, "retain": {"session": "s"}})


def test_another_uid_cannot_steer_a_session_in_a_namespace_both_write(make_broker):
    # Both may write the shared namespace "chat", so both see and reach each other's session
    # names; but a shared namespace shares names, not sessions: bob may neither end alice's
    # conversation (her blocks to the oldest end of the LRU, the first a burst evicts), nor
    # lower its priority or cut its time, nor raise them at her quota's expense. An admin
    # (root here) still steers any session.
    policy = parse_isolation(
        {"mode": "tenant", "shared": {"chat": {"read": ["*"], "write": ["*"]}}}
    )
    b = make_broker(npages=64, policy=policy)
    alice, bob, root = connect(b, uid=60041), connect(b, uid=60042), connect(b, uid=0)
    mine = chain(b, alice, "a", 4, ns="chat", retain={"session": "conv", "for": 600, "priority": 5})
    entry = b.retention.sessions[("chat", "conv")]
    before = (entry.priority, entry.expires_at, len(entry.objects))
    for op, args in (
        ("unretain", {"name": "conv", "namespace": "chat"}),
        ("unretain", {"name": "conv"}),
        ("retain", {"name": "conv", "seconds": 0.001, "priority": 0, "namespace": "chat"}),
        ("retain", {"name": "conv", "seconds": 3600, "priority": 100}),
    ):
        with pytest.raises(Forbidden, match="belongs to uid 60041"):
            b.handle(bob, op, args)
    assert b.retention.sessions[("chat", "conv")] is entry
    assert (entry.priority, entry.expires_at, len(entry.objects)) == before
    burst(b, bob, 200, ns="chat")  # plain traffic: alice's conversation is still there
    assert held(b, mine, ns="chat") == mine
    assert (
        b.handle(alice, "retain", {"name": "conv", "seconds": 60, "priority": 6})["priority"] == 6
    )
    assert b.handle(root, "unretain", {"name": "conv", "namespace": "chat"})["blocks"] == 4


def restarted(b, path, now=None, **kw):
    """A broker over ``b``'s pools as a warm restart leaves them: the journal at ``path``
    replayed, the objects and sessions it records restored."""
    b.journal.close()
    rec = Journal.load(path)
    pools = [HostPool.adopt(p.index, p.name, p.size, PAGE) for p in b.pools]
    b2 = Broker(pools, clock=Clock(), **kw)
    b2.retention.clock = Clock()
    b2.retention.clock.now = b.retention.clock.now if now is None else now
    b2.restore(rec.objects.values(), (), rec.sessions.values())
    return b2


def journaled(b, tmp_path):
    path = str(tmp_path / "j")
    b.attach_journal(Journal(path, 1, [p.describe() for p in b.pools]), 1)
    return path


def retained_keys(b, name, ns="default"):
    return sorted(o.key for o in b.retention.sessions[(ns, name)].objects.values())


def test_retention_a_tenant_quota_took_stays_lost_after_a_restart(make_broker, tmp_path):
    # alice past her quota lost the retention of her oldest priority-1 session. A restart
    # must not give it back because the quota has room again (her newer session released
    # meanwhile): the live daemon would not have either.
    settings = RetentionSettings(tenant_quota=8 * PAGE)
    b = make_broker(npages=64, retention=settings)
    path = journaled(b, tmp_path)
    alice = connect(b, uid=1001)
    important = chain(b, alice, "imp", 4, retain={"session": "imp", "priority": 3})
    chain(b, alice, "old", 4, retain={"session": "old", "priority": 1})
    chain(b, alice, "new", 4, retain={"session": "new", "priority": 1})
    assert retained_keys(b, "old") == []
    b.handle(alice, "unretain", {"name": "new"})
    assert b.retention.tenant_bytes[1001] == 4 * PAGE  # room again; "old" stays unretained
    b2 = restarted(b, path, retention=settings)
    assert set(b2.retention.sessions) == {("default", "imp"), ("default", "old")}
    assert retained_keys(b2, "old") == [] and retained_keys(b2, "imp") == important
    assert b2.retention.tenant_bytes == {1001: 4 * PAGE}


def test_retention_the_pool_share_took_stays_lost_after_a_restart(make_broker, tmp_path):
    settings = RetentionSettings(pool_share=0.25)  # 16 of 64 pages
    b = make_broker(npages=64, retention=settings)
    path = journaled(b, tmp_path)
    s = connect(b)
    first = chain(b, s, "a", 12, retain={"session": "a"})
    chain(b, s, "b", 12, retain={"session": "b"})  # 24 retained: 8 of a's lose it
    kept = retained_keys(b, "a")
    assert len(kept) == 4
    b.handle(s, "unretain", {"name": "b"})  # room again; a's 8 stay unretained...
    # ...but for the one a later request of the session retains again (records in order)
    again = sorted(set(first) - set(kept))[0]
    b.handle(
        s,
        "reserve_blocks",
        {"blocks": [{"key": again, "buffers": {"x": PAGE}}], "retain": {"session": "a"}},
    )
    kept = retained_keys(b, "a")
    assert again in kept and len(kept) == 5
    b2 = restarted(b, path, retention=settings)
    assert retained_keys(b2, "a") == kept
    assert b2.retention.pool_bytes[0] == 5 * PAGE


def test_a_reload_shortening_max_retain_is_kept_by_a_restart(make_broker, tmp_path):
    b = make_broker(npages=64, retention=RetentionSettings(max_retain=7200))
    path = journaled(b, tmp_path)
    s = connect(b)
    chain(b, s, "c", 3, retain={"session": "conv", "for": 3600})
    t0 = b.retention.clock.now
    b.retention.configure(RetentionSettings(max_retain=60))  # SIGHUP: ends at t0 + 60
    b2 = restarted(b, path, now=t0 + 50, retention=RetentionSettings(max_retain=60))
    assert b2.retention.sessions[("default", "conv")].expires_at == pytest.approx(t0 + 60)
    assert b2.retention.expire(t0 + 61) == 1


def test_a_chain_loses_retention_from_its_leaf_so_the_pool_share_holds_in_fact(make_broker):
    # A block with a retained child cannot be evicted before it: had the roots of a chain
    # lost their retention first, its retained leaves would keep them all, and the pool
    # would hold far more than its share for the sessions.
    b = make_broker(npages=64, retention=RetentionSettings(pool_share=0.25))  # 16 pages
    s = connect(b)
    first = chain(b, s, "a", 12, retain={"session": "a"})
    second = chain(b, s, "b", 12, retain={"session": "b"})
    assert retained_keys(b, "a") == sorted(first[:4])
    burst(b, s, 200)
    assert held(b, first) == first[:4] and held(b, second) == second


def test_a_tenant_over_its_quota_sheds_a_chain_from_its_leaf(make_broker):
    b = make_broker(npages=64, retention=RetentionSettings(tenant_quota=8 * PAGE))
    alice, bob = connect(b, uid=1001), connect(b, uid=1002)
    old = chain(b, alice, "old", 6, retain={"session": "old", "priority": 1})
    new = chain(b, alice, "new", 6, retain={"session": "new", "priority": 1})
    assert retained_keys(b, "old") == sorted(old[:2])
    burst(b, bob, 200)
    assert held(b, old) == old[:2] and held(b, new) == new


def test_a_later_turn_extending_its_chain_loses_its_own_blocks_first(make_broker):
    # Turn 2 finds turn 1's blocks (retained again, most recent) and publishes the blocks
    # that extend them. A lowered share then takes turn 2's leaf end, never the blocks its
    # retained children would keep anyway.
    b = make_broker(npages=64)
    s = connect(b)
    turn1 = chain(b, s, "t", 4, retain={"session": "conv"})
    b.handle(s, "match_prefix", {"keys": turn1, "hold": False, "retain": {"session": "conv"}})
    blocks = [{"key": f"t{i}", "parent": f"t{i - 1}", "buffers": {"x": PAGE}} for i in range(4, 8)]
    r = b.handle(s, "reserve_blocks", {"blocks": blocks, "retain": {"session": "conv"}})
    b.handle(s, "seal_many", {"leases": [x["lease"] for x in r["results"]]})
    b.retention.configure(RetentionSettings(pool_share=6 / 64))  # 6 pages
    assert retained_keys(b, "conv") == [f"t{i}" for i in range(6)]
    burst(b, s, 200)
    assert held(b, [f"t{i}" for i in range(8)]) == [f"t{i}" for i in range(6)]


def test_a_tenant_sees_its_own_largest_sessions_however_many_others_have(make_broker):
    # stat and the TUI show the largest sessions the caller may see: not the daemon's 64
    # largest with other tenants' left out (then nothing, for a tenant whose sessions are
    # smaller than 64 of another's).
    b = make_broker(
        npages=256,
        policy=parse_isolation({"mode": "tenant"}),
        retention=RetentionSettings(pool_share=1.0),
    )
    from kvbroker._server.policy import user_name

    alice, bob = connect(b, uid=60061), connect(b, uid=60062)
    for i in range(70):
        chain(b, alice, f"a{i}-", 2, ns=user_name(60061), retain={"session": f"big{i}"})
    chain(b, bob, "b", 1, ns=user_name(60062), retain={"session": "small"})
    assert [x.name for x in b.statistics_for(bob).retention.largest] == ["small"]
    seen = b.statistics_for(alice).retention.largest
    assert len(seen) == 64 and {x.namespace for x in seen} == {user_name(60061)}
