"""Hostile and dying clients (issue 16): each test here failed on the code before its fix.

Dead peers seen at once, bounded waits, per-connection waiter state, meta bounds, global and
per-uid limits, fairness, quotas per tenant, group membership on SIGHUP, vanished pools.
"""

from __future__ import annotations

import os
import socket
import time

import msgpack
import posix_ipc
import pytest

from kvbroker import Client
from kvbroker._wire.protocol import PROTOCOL_VERSION
from kvbroker.errors import Timeout


def raw(path: str, hello: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    if hello:
        s.sendall(
            msgpack.packb(
                {"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION, "name": "raw"}}
            )
        )
        assert recv_one(s)["ok"]
    return s


def recv_one(s: socket.socket, timeout: float = 60.0) -> dict:
    s.settimeout(timeout)
    u = msgpack.Unpacker(raw=False)
    while True:
        data = s.recv(65536)
        if not data:
            raise EOFError("the daemon closed the connection")
        u.feed(data)
        for msg in u:
            return msg


def wait_until(pred, timeout: float = 60.0, step: float = 0.02) -> float | None:
    """Seconds until ``pred()`` held, or None if it never did within ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def n_clients(c: Client) -> int:
    return len(c.stat().clients)


# -- 1. dying waiters, bounded waits ----------------------------------------------------
def test_a_waiter_that_dies_is_seen_at_once(daemon, client):
    s = raw(daemon.socket_path)
    s.sendall(msgpack.packb({"id": 2, "op": "claim", "args": {"key": "never", "wait": 1e9}}))
    assert wait_until(lambda: n_clients(client) == 2)
    s.close()
    took = wait_until(lambda: n_clients(client) == 1)
    assert took is not None, "a client that died inside claim(wait=1e9) still holds its slot"


def test_requests_pipelined_behind_a_wait_are_answered_in_order(daemon, client):
    s = raw(daemon.socket_path)
    before = client.stat().counters.requests  # (counts this stat itself)
    s.sendall(
        msgpack.packb({"id": 2, "op": "claim", "args": {"key": "k", "wait": 30}})
        + msgpack.packb({"id": 3, "op": "lookup", "args": {"key": "k"}})
    )
    # Until the daemon has handled the claim (one request besides our stats): it waits then,
    # with the lookup queued behind it, and the put below is what ends the wait.
    polls = iter(range(1, 1 << 30))
    assert wait_until(lambda: client.stat().counters.requests - before - next(polls) >= 1)
    client.put("k", {"a": b"x"})
    u = msgpack.Unpacker(raw=False)
    got = []
    s.settimeout(10)
    while len(got) < 2:
        u.feed(s.recv(65536))
        got += list(u)
    assert [m["id"] for m in got] == [2, 3] and all(m["ok"] for m in got)
    assert got[1]["result"]["key"] == "k"
    s.close()


def test_waits_are_bounded_by_max_wait(make_daemon):
    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_WAIT": "1s"})
    with d.client() as c:
        # the daemon's own account of the wait it kept: 1 s, not the 1e6 asked
        with pytest.raises(Timeout, match=r"within 1 s \(this daemon waits at most 1 s: max_wait"):
            c.claim("never", wait=1e6)


# -- 2. waiter state is per connection, freed with it ------------------------------------
def test_waiting_connections_hold_little_memory_and_free_it(daemon, client):
    n = 300
    before = rss(daemon.proc.pid)
    socks = []
    for i in range(n):
        s = raw(daemon.socket_path)
        s.sendall(
            msgpack.packb({"id": 2, "op": "claim", "args": {"key": f"never-{i}", "wait": 600}})
        )
        socks.append(s)
    assert wait_until(lambda: n_clients(client) == n + 1, timeout=30)
    grown = rss(daemon.proc.pid) - before
    for s in socks:
        s.close()
    assert wait_until(lambda: n_clients(client) == 1) is not None
    # 64 KiB of read buffer and a task per waiting connection was ~20 MiB here.
    assert grown < 8 << 20, f"{n} waiting connections grew the daemon by {grown >> 20} MiB"


# -- 3. one object's meta cannot break ls, verify or evict for everyone ------------------
def nested(depth: int):
    meta = {"leaf": 1}
    for _ in range(depth - 1):
        meta = {"m": meta}
    return meta


@pytest.mark.parametrize("depth", [505, 1021])
def test_deeply_nested_meta_is_refused_at_reserve(daemon, client, depth):
    from kvbroker.errors import BadRequest

    s = raw(daemon.socket_path)
    s.sendall(
        msgpack.packb(
            {
                "id": 2,
                "op": "reserve",
                "args": {"key": "deep", "buffers": {"x": 10}, "meta": nested(depth)},
            }
        )
    )
    reply = recv_one(s)
    assert not reply["ok"] and reply["error"]["code"] == BadRequest.code, reply
    assert "nests deeper" in reply["error"]["message"]
    s.close()
    client.put("ok", {"x": b"1"}, meta=nested(8))
    assert [o.key for o in client.list()] == ["ok"]  # ls works for everyone
    assert client.evict(all=True).count == 1


# -- 4, 6. limits that hold globally and per uid -------------------------------------------
def flood_unread(path: str, n_requests: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(path)
    s.setblocking(False)
    data = msgpack.packb({"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION}})
    data += msgpack.packb({"id": 2, "op": "stat", "args": {}}) * n_requests
    try:
        s.sendall(data)
    except (BlockingIOError, OSError):
        pass
    return s


def test_unread_replies_are_bounded_across_connections(make_daemon):
    d = make_daemon(
        "--pool-size",
        "8M",
        "--page-size",
        "4K",
        env={"KVBROKER_MAX_WRITE_BUFFER": "8M", "KVBROKER_MAX_WRITE_BUFFERS_TOTAL": "4M"},
    )
    with d.client() as c:
        for i in range(30):  # fatter stat replies
            c.put(f"k{i}", {"x": b"1"})
        before = rss(d.proc.pid)
        socks = [flood_unread(d.socket_path, 6000) for _ in range(8)]
        assert wait_until(lambda: "max_write_buffers_total" in d.log(), timeout=30), d.log()
        time.sleep(1)
        grown = rss(d.proc.pid) - before
        assert c.lookup("k1") is not None  # the daemon serves on
    for s in socks:
        s.close()
    # Measured on the 2-core VM: 15.1-15.3 MiB with the 4M total (the parsed requests queued
    # and the allocator's slack come on top of the replies), 68-69 MiB without it (each of the
    # 8 under its own 8M). 16 MiB flaked once in a full run (16.3 MiB); 24 still tells them apart.
    assert grown < 24 << 20, f"unread replies grew the daemon by {grown >> 20} MiB"


def test_connections_per_uid_are_limited(make_daemon):
    from kvbroker.errors import LimitExceeded

    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_CONNECTIONS_PER_UID": "6"}
    )
    socks = [raw(d.socket_path) for _ in range(5)]  # and wait_ready's probe has gone
    with d.client() as c:  # the sixth
        with pytest.raises(LimitExceeded, match="max_connections_per_uid"):
            with d.client(reconnect=0) as seventh:
                seventh.stat()
        assert n_clients(c) == 6
    for s in socks:
        s.close()


def test_half_a_hello_is_closed_after_hello_timeout(make_daemon):
    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_HELLO_TIMEOUT": "1s"})
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket_path)
    s.sendall(msgpack.packb({"id": 1, "op": "hello", "args": {"version": 1}})[:5])
    msg = recv_one(s, timeout=60)  # (a bound against a hang only)
    assert "hello_timeout" in msg["error"]["message"]
    assert s.recv(100) == b""  # closed
    s.close()


def test_idle_connections_holding_nothing_are_closed_and_clients_come_back(make_daemon):
    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_IDLE_TIMEOUT": "1s"})
    idle = raw(d.socket_path)
    holder = raw(d.socket_path)
    with d.client() as c:
        c.put("k", {"x": b"1"})
        holder.sendall(msgpack.packb({"id": 2, "op": "claim", "args": {"key": "k", "ttl": 60}}))
        assert recv_one(holder)["ok"]
        msg = recv_one(idle, timeout=60)
        assert "idle_timeout" in msg["error"]["message"]
        with d.client() as quiet:  # holds nothing (c's put left it a write arena)
            first = quiet.session_id
            # Until the daemon has closed quiet's connection too (as the holder sees it):
            # quiet then reconnects by itself.
            asks = iter(range(3, 1 << 30))

            def sessions_seen_by_holder():
                holder.sendall(msgpack.packb({"id": next(asks), "op": "stat", "args": {}}))
                return {cl["session"] for cl in recv_one(holder)["result"]["clients"]}

            assert wait_until(lambda: first not in sessions_seen_by_holder(), timeout=60)
            assert quiet.get("k")["x"].tobytes() == b"1"
            assert quiet.session_id != first
        assert c.stat().read_leases == 1  # the holder was not closed
    idle.close()
    holder.close()


def test_regex_cache_memory_is_bounded(daemon, client):
    for i in range(50):
        client.put(f"key-{i}-" + "ab" * 100, {"x": b"1"})
    before = rss(daemon.proc.pid)
    for i in range(600):  # distinct heavy patterns, each compiled and cached
        client.list(match=r"(\w{30}|[a-z]{20}\d{5}){8}" + f"x{{{i % 50 + 1}}}" + "y" * (i % 7))
    grown = rss(daemon.proc.pid) - before
    assert grown < 35 << 20, f"600 regexes grew the daemon by {grown >> 20} MiB (46 before)"


# -- 5. fairness -------------------------------------------------------------------------
HAMMER = """
import msgpack, socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(msgpack.packb({"id": 1, "op": "hello", "args": {"version": 1}}))
req = msgpack.packb({"id": 9, "op": "list", "args": {"namespace": "tenant0", "limit": 5}})


def drain():  # reads every reply (so it is never cut off), unparsed
    while s.recv(1 << 22):
        pass


threading.Thread(target=drain, daemon=True).start()
batch = req * 3000  # 64 KiB of pipelined lists at a time, for ever
while True:
    s.sendall(batch)
"""


def served_between(client, n=300):
    """Per round trip of the honest client (a lookup, then a stat), how many other requests
    the daemon served meanwhile (its request counter, less the honest client's own two)."""
    counts = []
    last = client.stat().counters.requests
    for _ in range(n):
        assert client.lookup("mine", namespace="honest") is not None
        now = client.stat().counters.requests
        counts.append(now - last - 2)
        last = now
    counts.sort()
    return counts[len(counts) // 2], counts[int(len(counts) * 0.99)]


def test_an_honest_client_is_served_between_slices_of_another_that_pipelines_lists(daemon, client):
    """A client pipelining 64 KiB of lists at a time (3,000 requests a read) is served a slice
    of requests at a time (8, or 0.5 ms), the honest client's request between two slices:
    while it waits, the daemon serves a few dozen of the other's requests, not the rest of a
    64 KiB read (before: every request of a read served without yielding, 442 ms p50). What
    the daemon served, counted by its own request counter, not how long the machine took."""
    import subprocess
    import sys

    for i in range(3800):
        client.put(f"obj-{i}", {"x": b"1"}, namespace=f"tenant{i % 4}")
    client.put("mine", {"x": b"1"}, namespace="honest")
    hammer = subprocess.Popen([sys.executable, "-c", HAMMER, daemon.socket_path])
    try:
        before = client.stat().counters.requests
        assert wait_until(lambda: client.stat().counters.requests - before > 10_000, timeout=60)
        p50, p99 = served_between(client, 1000)
        # It reads every reply: it must be served, not cut off (before, a 64 KiB read of
        # lists was served in one go, 32 MiB of replies queued, and the client dropped).
        assert hammer.poll() is None, "the pipelining client was cut off"
        assert "left unread" not in daemon.log()
    finally:
        hammer.kill()
        hammer.wait()
    print(
        f"requests of the pipelining client served per honest round trip (lookup + stat): "
        f"p50 {p50}, p99 {p99}"
    )
    # A round trip waits for at most a slice or two per request; the rest is the honest
    # client's own time between them, the other's requests going on meanwhile.
    assert p50 < 300, (p50, p99)


def test_list_and_evict_of_one_namespace_do_not_scan_the_others(tmp_path):
    from kvbroker._server.broker import Broker
    from kvbroker._server.pool import HostPool, segment_prefix

    pool = HostPool(0, segment_prefix() + ".0", 4 << 20, 4096)
    try:
        b = Broker([pool])
        s = b.open_session()
        b.handle(s, "hello", {"version": 1})
        for ns, n in (("big", 300), ("small", 3)):
            for i in range(n):
                r = b.handle(s, "reserve", {"namespace": ns, "key": f"k{i}", "buffers": {"x": 10}})
                b.handle(s, "seal", {"lease": r["lease"]})

        class NoScan(dict):
            def values(self):
                raise AssertionError("scanned every object for one namespace")

            def __iter__(self):
                raise AssertionError("scanned every object for one namespace")

        b.directory.objects = NoScan(b.directory.objects)
        listed = b.handle(s, "list", {"namespace": "small"})["objects"]
        assert [o["key"] for o in listed] == ["k0", "k1", "k2"]
        assert b.handle(s, "evict", {"namespace": "small", "key": "k1"})["count"] == 1
        assert b.handle(s, "evict", {"namespace": "small", "match": "k"})["count"] == 2
        assert not b.handle(s, "list", {"namespace": "small"})["objects"]
        assert "small" not in b.by_namespace and len(b.by_namespace["big"]) == 300
    finally:
        pool.unlink()


# -- 9. SIGHUP re-reads group membership ---------------------------------------------------
def test_a_reload_applies_group_membership_changes(monkeypatch):
    from kvbroker._server.broker import Broker
    from kvbroker._server.policy import Quotas, parse_isolation
    from kvbroker._server.pool import HostPool, segment_prefix
    from kvbroker.errors import Forbidden

    member = {"yes": True}

    def grouplist(user, gid):
        return [gid, 4242] if member["yes"] else [gid]

    monkeypatch.setattr(os, "getgrouplist", grouplist)
    uid = 54321  # no such user on this host: its namespace is "54321"
    policy = parse_isolation({"mode": "tenant", "shared": {"team": {"write": [4242]}}})
    pool = HostPool(0, segment_prefix() + ".0", 1 << 20, 4096)
    try:
        monkeypatch.setattr("pwd.getpwuid", lambda u: type("P", (), {"pw_name": "ghost"})())
        b = Broker([pool], policy=policy)
        s = b.open_session(1, uid, 100)
        b.handle(s, "hello", {"version": 1})
        b.handle(s, "reserve", {"namespace": "team", "key": "a", "buffers": {"x": 1}})
        member["yes"] = False  # removed from the group, then SIGHUP
        b.set_policy(policy, Quotas())
        with pytest.raises(Forbidden):
            b.handle(s, "reserve", {"namespace": "team", "key": "b", "buffers": {"x": 1}})
    finally:
        pool.unlink()


# -- 8. quotas per tenant, across its namespaces, arenas charged ---------------------------
def test_a_tenant_quota_holds_across_namespaces_and_arenas():
    from kvbroker._server.broker import Broker
    from kvbroker._server.policy import parse_quotas
    from kvbroker._server.pool import HostPool, segment_prefix
    from kvbroker._wire.paths import parse_size
    from kvbroker.errors import PoolFull, QuotaExceeded

    pool = HostPool(0, segment_prefix() + ".0", 32 << 20, 4096)
    try:
        b = Broker([pool], quotas=parse_quotas({"user:*": "1M"}, parse_size))
        s = b.open_session(1, 1000, 1000)
        b.handle(s, "hello", {"version": 1})
        for i in range(200):  # 20 MiB across 10 namespaces
            r = b.handle(
                s,
                "reserve",
                {"namespace": f"1000/sub{i % 10}", "key": f"k{i}", "buffers": {"x": 100 << 10}},
            )
            b.handle(s, "seal", {"lease": r["lease"]})
        held = sum(n for k, n in b.accounts.statistics().charged.items() if isinstance(k, str))
        assert held <= 1 << 20, f"a tenant with a 1 MiB quota holds {held} bytes"
        assert b.accounts.statistics().charged[("user", 1000)] == held
        other = b.open_session(2, 2000, 2000)  # another tenant has its own MiB
        b.handle(other, "hello", {"version": 1})
        b.handle(other, "reserve", {"namespace": "x", "key": "y", "buffers": {"x": 900 << 10}})
        # an arena is charged, and takes at most a quarter of the quota (768 KiB asked):
        # with 256 KiB lent, 800 KiB more do not fit once its objects go
        b.handle(s, "evict", {"all": True})
        ar = b.handle(s, "arena", {"nbytes": 768 << 10})
        assert (
            ar["arena"][2] == 256 << 10
            and b.accounts.statistics().charged[("user", 1000)] == 256 << 10
        )
        with pytest.raises(QuotaExceeded, match="user"):
            b.handle(s, "reserve", {"namespace": "n", "key": "big", "buffers": {"x": 800 << 10}})
        pub = b.handle(
            s,
            "publish",
            {
                "arena": ar["lease"],
                "namespace": "n",
                "key": "p",
                "buffers": {"x": 256 << 10},
                "next_arena": 512 << 10,
            },
        )
        assert (
            b.accounts.statistics().charged[("user", 1000)] == 512 << 10
        )  # the object took over its pages' charge
        b.handle(s, "abort", {"lease": pub["lease"]})
        assert b.accounts.statistics().charged[("user", 1000)] == 256 << 10
        b.close_session(s)
        assert (
            b.accounts.statistics().charged.get(("user", 1000)) == 256 << 10
        )  # its sealed object stays charged
        b.handle(other, "evict", {"namespace": "n", "key": "p"})
        assert ("user", 1000) not in b.accounts.statistics().charged
        # a quota its objects fill leaves no room for an arena: refused, nothing evicted
        s = b.open_session(3, 1000, 1000)
        b.handle(s, "hello", {"version": 1})
        r = b.handle(s, "reserve", {"namespace": "n", "key": "full", "buffers": {"x": 1 << 20}})
        b.handle(s, "seal", {"lease": r["lease"]})
        with pytest.raises(PoolFull, match="quota"):
            b.handle(s, "arena", {"nbytes": 64 << 10})
        assert b.accounts.statistics().charged[("user", 1000)] == 1 << 20 and len(b.objects) == 1
    finally:
        pool.unlink()


# -- 11. a pool segment unlinked under the daemon --------------------------------------------
def test_a_vanished_pool_is_noticed_and_clients_get_a_typed_error(daemon, client):
    from kvbroker._server.config import load_config
    from kvbroker._server.doctor import check_pools
    from kvbroker.errors import PoolFull

    client.put("k", {"x": b"1"})
    name = client.stat().pools[0].name
    posix_ipc.unlink_shared_memory(name)
    assert wait_until(lambda: "POOL LOST" in daemon.log()), daemon.log()
    import subprocess
    import sys

    fresh = subprocess.run(  # a new process maps the pool for its first get
        [
            sys.executable,
            "-c",
            "import sys; from kvbroker import Client; Client(sys.argv[1]).get('k')",
            daemon.socket_path,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh.returncode != 0
    last = fresh.stderr.strip().splitlines()[-1]
    assert last.startswith("kvbroker.errors.BrokerUnavailable") and "gone" in last, last
    with pytest.raises(PoolFull, match="gone"):
        client.put("k2", {"x": b"1"})
    cfg = load_config(env={"KVBROKER_SOCKET": daemon.socket_path})
    check = check_pools(cfg)
    assert check.status == "fail" and "gone" in check.detail


# -- 10. kernel-enforced separation: a tenant's own pool -----------------------------------
OPEN_AS = """
import os, sys, posix_ipc
os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
for name in sys.argv[2:]:
    try:
        posix_ipc.SharedMemory(name).close_fd()
        print("open", name)
    except posix_ipc.PermissionsError:
        print("denied", name)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="creating pools owned by another uid needs root")
def test_a_tenant_pool_is_mapped_by_its_tenant_only(make_daemon, tmp_path):
    import stat
    import subprocess
    import sys

    conf = tmp_path / "kvbroker.toml"
    conf.write_text(
        '[tenant_pools.nobody]\nsize = "4M"\nuser = 65534\nnamespaces = ["nobody", "nobody/*"]\n'
    )
    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_CONFIG": str(conf)})
    with d.client() as c:
        shared, own = [p.name for p in c.stat().pools]
        c.put("k", {"x": b"tenant bytes"}, namespace="nobody/a")
        c.put("k", {"x": b"shared bytes"}, namespace="other")
        with c.claim("k", namespace="nobody/a") as lease:
            assert lease._extents["x"][0] == 1  # in the tenant's pool
        with c.claim("k", namespace="other") as lease:
            assert lease._extents["x"][0] == 0
        assert c.get("k", namespace="nobody/a")["x"].tobytes() == b"tenant bytes"
    st = os.stat("/dev/shm" + own)
    assert st.st_uid == 65534 and stat.S_IMODE(st.st_mode) == 0o600
    out = subprocess.run(
        [sys.executable, "-c", OPEN_AS, "65534", shared, own],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split("\n")
    assert out[:2] == [f"denied {shared}", f"open {own}"], out
    out = subprocess.run(
        [sys.executable, "-c", OPEN_AS, "65533", own], capture_output=True, text=True, timeout=60
    ).stdout.split("\n")
    assert out[0] == f"denied {own}", out


def test_a_waiter_with_a_full_backlog_that_dies_is_seen(daemon, client):
    """Pipelined far behind a blocking claim, the connection stops reading; its peer's
    hang-up is still seen (poll), not only when the wait ends."""
    s = raw(daemon.socket_path)
    before = client.stat().counters.requests  # (counts this stat itself)
    s.sendall(
        msgpack.packb({"id": 2, "op": "claim", "args": {"key": "never", "wait": 600}})
        + msgpack.packb({"id": 3, "op": "lookup", "args": {"key": "x"}}) * 2000
    )
    # Until the daemon has handled the claim (one request besides our stats): the lookups
    # read with it (more than the 256 a connection may queue) wait behind it, unread past
    # that, and the connection has stopped reading.
    polls = iter(range(1, 1 << 30))
    assert wait_until(lambda: client.stat().counters.requests - before - next(polls) >= 1)
    s.close()
    took = wait_until(lambda: n_clients(client) == 1)
    assert took is not None, "a dead peer with a backlog behind its wait still holds its slot"
