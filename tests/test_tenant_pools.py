"""Tenant pools (issue 16 item 10) across daemon restarts: a crash (SIGKILL) and a warm
restart, a clean restart (SIGUSR1), a stop (SIGTERM), a restart that changes who owns a pool.

Two tenants, for real: forked children that drop root to uid 65534 (``nobody``) and 65533 (no
passwd entry: it owns the namespaces ``65533`` and ``65533/...``), both with primary group
TEAM, which the socket and the shared pools belong to. Each has a pool of its own."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import tempfile
import zlib

import numpy as np
import posix_ipc
import pytest
from conftest import DaemonProcess, drop_leftover_pools
from test_isolation import NOBODY, _as_user, needs_root

from kvbroker import Client, Forbidden, QuotaExceeded
from kvbroker._server.journal import journal_path
from kvbroker._server.policy import user_name

pytestmark = needs_root

OTHER = 65533
TEAM = 60001
A, B = user_name(NOBODY), str(OTHER)  # each tenant's own namespace
ARGS = ("--pool-size", "4M", "--page-size", "4K", "--group", str(TEAM))
QUOTA = 256 << 10  # "user:*": each tenant, across its namespaces


def config(a_user: int = NOBODY, b_user: int = OTHER, a_spaces: str = f'"{A}", "{A}/*"') -> str:
    return f"""
[isolation]
mode = "tenant"
[quotas]
"user:*" = "{QUOTA}"
[tenant_pools.a]
size = "1M"
user = {a_user}
namespaces = [{a_spaces}]
[tenant_pools.b]
size = "1M"
user = {b_user}
namespaces = ["{B}", "{B}/*"]
"""


@pytest.fixture
def daemons():
    """Start daemons one after another on one socket, in a directory other uids may
    traverse (the socket's mode and group decide who connects); all stopped at the end."""
    where = tempfile.mkdtemp(prefix="kvb-ten-", dir="/tmp")
    os.chmod(where, 0o755)
    sock = os.path.join(where, "kvb.sock")
    started: list[DaemonProcess] = []

    def start(conf: str | None = None, *extra: str) -> DaemonProcess:
        path = os.path.join(where, "kvbroker.toml")
        with open(path, "w") as f:
            f.write(config() if conf is None else conf)
        d = DaemonProcess(sock, *ARGS, "--config", path, *extra)
        started.append(d)
        return d

    start.socket_path = sock
    yield start
    for d in started:
        d.stop()
    drop_leftover_pools(sock)
    shutil.rmtree(where, ignore_errors=True)


def pattern(seed: str, n: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(seed.encode())).integers(0, 256, n, np.uint8)


def as_tenant(uid: int, fn):
    return _as_user(uid, TEAM, fn)


def owners(names: list[str]) -> list[tuple[int, int, int]]:
    """(uid, gid, mode) of each segment."""
    out = []
    for name in names:
        st = os.stat("/dev/shm" + name)
        out.append((st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)))
    return out


def segment_exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


# What each tenant keeps: (key, nbytes) in its own namespace, and one under it.
OBJECTS = {A: [("k1", 40960), ("k2", 8192)], B: [("k1", 20480)]}


def publish(sock: str, ns: str):
    """As a tenant: put OBJECTS[ns] (once through reserve + seal, once through a write arena
    in the tenant's own pool); which pool each landed in."""

    def run():
        pools = {}
        with Client(sock, timeout=10, arena_size=64 << 10) as c:
            for i, (key, n) in enumerate(OBJECTS[ns]):
                where = ns if i == 0 else f"{ns}/sub"
                c.put(key, {"kv": pattern(where + key, n)}, namespace=where)
                with c.claim(key, namespace=where) as lease:
                    pools[where] = lease._extents["kv"][0]
        return pools

    return run


def check(sock: str, ns: str, other_ns: str, other_pool: str):
    """As a tenant, after a restart: its objects byte-exact in its own pool, the other
    tenant's namespace and pool out of reach, its quota charged with what it holds."""

    def run():
        out = {"intact": [], "pools": []}
        with Client(sock, timeout=10, arena_size=0) as c:
            out["epoch"] = c.epoch
            leases = []
            for i, (key, n) in enumerate(OBJECTS[ns]):
                where = ns if i == 0 else f"{ns}/sub"
                got = c.get(key, namespace=where, verify=True)["kv"]
                out["intact"].append(bool(np.array_equal(got, pattern(where + key, n))))
                lease = c.claim(key, namespace=where)  # held: not evictable below
                out["pools"].append(lease._extents["kv"][0])
                leases.append(lease)
            try:
                c.claim("k1", namespace=other_ns)
                out["other_ns"] = "allowed"
            except Forbidden:
                out["other_ns"] = "forbidden"
            try:
                posix_ipc.SharedMemory(other_pool).close_fd()
                out["other_pool"] = "open"
            except posix_ipc.PermissionsError:
                out["other_pool"] = "denied"
            held = sum(n for _, n in OBJECTS[ns])
            try:  # fits the quota only if what it holds were not charged any more
                c.put("big", {"kv": np.zeros(QUOTA - held + 4096, np.uint8)}, namespace=ns)
                out["quota"] = "allowed"
            except QuotaExceeded as exc:
                out["quota"] = str(exc)
            for lease in leases:
                lease.release()
        return out

    return run


def snapshot(d: DaemonProcess):
    """What root (an admin) sees: pool names, per-pool use, per-namespace charges."""
    with d.client(map_pools=False) as c:
        s = c.stat()
        names = [p.name for p in s.pools]
        return (
            names,
            [(p.used, p.objects) for p in s.pools],
            sorted((n.namespace, n.objects, n.bytes, n.used) for n in s.namespaces),
        )


def expected_owners():
    return [(0, TEAM, 0o660), (NOBODY, 0, 0o600), (OTHER, 0, 0o600)]


def test_a_crashed_daemon_comes_back_with_every_tenant_pool(daemons):
    d = daemons()
    sock = daemons.socket_path
    with d.client() as root:
        root.put("s", {"kv": pattern("shared", 5000)})
    assert as_tenant(NOBODY, publish(sock, A)) == {A: 1, f"{A}/sub": 1}
    assert as_tenant(OTHER, publish(sock, B)) == {B: 2}
    names, used, _ = before = snapshot(d)
    assert len(names) == 3 and owners(names) == expected_owners()
    assert [u for u, _ in used] == [8192, 49152, 20480]
    d.stop(signal.SIGKILL)

    d = daemons()
    assert snapshot(d) == before  # the same pools, objects in the same places, same charges
    assert owners(names) == expected_owners()
    a = as_tenant(NOBODY, check(sock, A, B, names[2]))
    b = as_tenant(OTHER, check(sock, B, A, names[1]))
    for out, pool in ((a, 1), (b, 2)):
        assert out["epoch"] == 2 and all(out["intact"]) and set(out["pools"]) == {pool}, out
        assert out["other_ns"] == "forbidden" and out["other_pool"] == "denied", out
    held = sum(n for _, n in OBJECTS[A])
    assert f"user {A}:" in a["quota"] and f"({held} used, 0 of them evictable)" in a["quota"]
    held = sum(n for _, n in OBJECTS[B])
    assert f"user {B}:" in b["quota"] and f"({held} used, 0 of them evictable)" in b["quota"]
    with d.client() as root:
        assert np.array_equal(root.get("s")["kv"], pattern("shared", 5000))
    assert "warm restart (epoch 2): adopted 3 pool(s) and 4 sealed object(s)" in d.log()


def test_a_restart_keeps_tenant_pools_and_a_stop_frees_them(daemons):
    sock = daemons.socket_path
    d = daemons()
    as_tenant(NOBODY, publish(sock, A))
    names, _, _ = before = snapshot(d)
    assert d.stop(signal.SIGUSR1) == 0  # systemctl restart: kept for the next daemon
    assert all(map(segment_exists, names)) and owners(names) == expected_owners()
    d = daemons()
    assert snapshot(d) == before and owners(names) == expected_owners()
    out = as_tenant(NOBODY, check(sock, A, B, names[2]))
    assert all(out["intact"]) and out["other_pool"] == "denied" and out["epoch"] == 2, out

    assert d.stop() == 0  # systemctl stop: every pool freed, the tenants' too
    assert not any(map(segment_exists, names)), d.log()
    assert not os.path.exists(journal_path(sock))
    d = daemons()  # a cold start: new pools, owned as configured
    fresh, used, spaces = snapshot(d)
    assert not set(fresh) & set(names) and owners(fresh) == expected_owners()
    assert used == [(0, 0)] * 3 and spaces == []

    assert d.stop() == 0
    assert not any(map(segment_exists, fresh))

    d = daemons(None, "--keep-pools-on-exit")
    as_tenant(NOBODY, publish(sock, A))
    kept, used, _ = before = snapshot(d)
    assert used[1] == (49152, 2)
    assert d.stop() == 0  # keep_pools_on_exit: a stop keeps them too
    assert all(map(segment_exists, kept)) and owners(kept) == expected_owners()
    d = daemons()
    assert snapshot(d) == before
    out = as_tenant(NOBODY, check(sock, A, B, kept[2]))
    assert all(out["intact"]) and out["other_pool"] == "denied" and out["epoch"] == 2, out
    assert d.stop() == 0
    assert not any(map(segment_exists, kept))


def test_a_restart_that_gives_a_tenant_pool_to_another_owner_keeps_none_of_its_bytes(daemons):
    """A segment keeps the owner it was made with. A configuration that gives a pool to
    someone else (here: the two tenants' pools swapped, same sizes) must not hand the new
    owner the old one's bytes, nor put them where the old owner still maps: a restart drops
    the kept cache, a start after a crash is refused (the operator decides: --cold)."""
    sock = daemons.socket_path
    d = daemons()
    as_tenant(NOBODY, publish(sock, A))
    names, _, _ = snapshot(d)
    swapped = config(a_user=OTHER, b_user=NOBODY)
    assert d.stop(signal.SIGUSR1) == 0
    d = daemons(swapped)
    fresh, used, spaces = snapshot(d)
    assert not set(fresh) & set(names) and used == [(0, 0)] * 3 and spaces == [], d.log()
    assert owners(fresh) == [(0, TEAM, 0o660), (OTHER, 0, 0o600), (NOBODY, 0, 0o600)]
    assert not any(map(segment_exists, names))
    assert "dropping them, starting empty" in d.log() and "owned by uid 65534" in d.log()

    with d.client(arena_size=0) as root:  # (an arena would hold root's whole quota)
        root.put("k", {"kv": pattern("k", 100)}, namespace=A)  # in the pool of uid 65533
    d.stop(signal.SIGKILL)
    with pytest.raises(RuntimeError, match="--cold to drop them") as refused:
        daemons()  # the original owners again
    assert "owned by uid 65533" in str(refused.value)
    assert all(map(segment_exists, fresh))  # refusing loses nothing
    d = daemons(None, "--cold")
    assert snapshot(d)[1] == [(0, 0)] * 3 and owners(snapshot(d)[0]) == expected_owners()
    assert not any(map(segment_exists, fresh))


def test_an_object_whose_namespace_moved_to_another_pool_is_not_restored(daemons):
    """Objects of a tenant pool's namespaces live only there: after a restart that gives a
    tenant pool a namespace whose objects sit in the shared pools, those are dropped (every
    member of the shared group can read them there), the others are kept."""
    sock = daemons.socket_path
    d = daemons(config(a_spaces=f'"{A}/*"'))
    assert as_tenant(NOBODY, publish(sock, A)) == {A: 0, f"{A}/sub": 1}
    d.stop(signal.SIGKILL)
    d = daemons()  # the tenant pool holds the namespace A too now
    with d.client() as root:
        assert not root.exists("k1", namespace=A)
        assert np.array_equal(
            root.get("k2", namespace=f"{A}/sub")["kv"], pattern(f"{A}/subk2", 8192)
        )
        assert root.stat().pools[0].used == 0
    assert "its namespace lives in another pool now" in d.log() and f"{A}/k1" in d.log()


# -- a daemon that is not root: its own user, with CAP_CHOWN (docs/security.md) -----------
DAEMON_UID = 60000  # no passwd entry


def _as_daemon_user(fn):
    """Run ``fn()`` in a forked child that is uid DAEMON_UID with CAP_CHOWN only, as
    docs/security.md asks of a daemon that makes pools owned by tenants (AmbientCapabilities=)."""
    import ctypes

    def run():
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(8, 1, 0, 0, 0) != 0:  # PR_SET_KEEPCAPS: setuid keeps the permitted set
            raise OSError(ctypes.get_errno(), "prctl")
        os.setgroups([])
        os.setgid(DAEMON_UID)
        os.setuid(DAEMON_UID)
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this pid
        data = (ctypes.c_uint32 * 6)(1, 1, 0, 0, 0, 0)  # effective, permitted: CAP_CHOWN (0)
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
        return fn()

    return _as_user(0, 0, run)  # _as_user forks; run() drops to DAEMON_UID itself


def test_a_daemon_that_is_not_root_frees_a_tenants_pool():
    """/dev/shm is sticky: only a file's owner may remove it, and a tenant pool is owned by
    its tenant. The daemon that made it so (CAP_CHOWN) still frees it at a stop."""
    from kvbroker._server.pool import HostPool, segment_prefix

    name = segment_prefix() + ".1"
    pool = HostPool(1, name, 8192, 4096, uid=NOBODY)
    try:
        _as_daemon_user(pool.unlink)
        assert not segment_exists(name)
    finally:
        if segment_exists(name):
            os.unlink("/dev/shm" + name)


def test_a_damaged_journal_with_a_tenant_pool_the_daemon_cannot_read(tmp_path):
    """After a damaged journal the restart hashes checksummed objects again, from the pools.
    A pool owned by its tenant's user (0600) is not the daemon's to read: its objects cannot
    be vouched for and are dropped; the start goes on, the shared pool's objects are kept."""
    import mmap

    from kvbroker._server.broker import Broker
    from kvbroker._server.policy import TenantPool
    from kvbroker._server.pool import HostPool, segment_prefix
    from kvbroker._wire.checksum import digest, encode

    prefix = segment_prefix()
    tenant = TenantPool("a", 8 << 12, NOBODY, None, (A,))
    pools = [
        HostPool(0, prefix + ".0", 8 << 12, 4096, uid=DAEMON_UID),
        HostPool(1, prefix + ".1", 8 << 12, 4096, uid=NOBODY, tenant=tenant),
    ]
    try:
        b = Broker(pools)
        s = b.open_session()
        b.handle(s, "hello", {"version": 1})
        for ns in ("default", A):
            r = b.handle(s, "reserve", {"namespace": ns, "key": "k", "buffers": {"x": 100}})
            pool, off, n = r["buffers"]["x"]
            shm = posix_ipc.SharedMemory(pools[pool].name)
            with mmap.mmap(shm.fd, pools[pool].size) as mm:
                mm[off : off + n] = data = os.urandom(n)
            shm.close_fd()
            b.handle(s, "seal", {"lease": r["lease"], "checksums": {"x": encode(digest(data))}})
        records = b.directory.records()
        assert [r["pool"] for r in records] == [0, 1]

        def restart():
            adopted = [HostPool.adopt(p.index, p.name, p.size, p.page_size) for p in pools]
            adopted[1].tenant = tenant
            b2 = Broker(adopted)
            report: dict = {}
            b2.restore(records, verify=True, report=report)
            return sorted(f"{ns}/{k}" for ns, k in b2.objects), report

        kept, report = _as_daemon_user(restart)
        assert kept == ["default/k"]
        assert list(report.values()) == [[f"{A}/k"]] and "cannot" in next(iter(report)), report
    finally:
        for p in pools:
            p.unlink()


# -- what hello tells a tenant -----------------------------------------------------------------
def work(sock: str, ns: str, other: int):
    """As a tenant: its hello and stat, then the data paths (a put through the write arena,
    one through reserve + seal, claim, get, a prefix cache) in its own namespace; and what
    addressing the other tenant's pool (index ``other``) says."""
    from kvbroker._server.config import load_config
    from kvbroker._server.doctor import check_pools
    from kvbroker._wire.protocol import check_reply
    from kvbroker.prefix import PrefixCache

    def run():
        out = {}
        with Client(sock, timeout=10, arena_size=64 << 10) as c:
            out["hello"] = c.pools
            out["hello_type"] = check_reply("hello", c._session.hello)  # None: a Hello
            out["stat"] = [p.name for p in c.stat().pools]
            sizes = {"small": 1000, "big": 60000}  # through the arena; reserve + seal
            for key, n in sizes.items():
                c.put(key, {"kv": pattern(ns + key, n)}, namespace=ns)
            out["arena"] = c._arena.extent[0] if c._arena.extent else None
            out["intact"] = [
                bool(np.array_equal(c.get(k, namespace=ns, verify=True)["kv"], pattern(ns + k, n)))
                for k, n in sizes.items()
            ]
            with c.claim("big", namespace=ns) as lease:
                out["pool"] = lease._extents["kv"][0]
            tokens = list(range(1, 50))
            blocks = [{"k": pattern(f"{ns}{i}", 256)} for i in range(len(tokens) // 16)]
            pc = PrefixCache(c, namespace=ns, block_size=16)
            pc.publish(tokens, blocks)
            with pc.match(tokens + [0]) as m:
                out["prefix"] = [
                    bool(np.array_equal(b["k"], blocks[i]["k"])) for i, b in enumerate(m.blocks)
                ]
            try:
                c._mapping(other)
                out["other"] = "mapped"
            except Forbidden as exc:
                out["other"] = str(exc)
        check = check_pools(load_config(env={"KVBROKER_SOCKET": sock}))
        out["doctor"] = [check.status, check.detail]
        return out

    return run


def test_hello_names_a_tenant_only_the_pools_it_may_map(daemons):
    """Pool indices stay put (extents on the wire are [pool, offset, nbytes]): a pool of
    another tenant is a placeholder, without its segment's name or size, in hello and stat;
    the data paths work for both tenants, root (an admin) is told every pool."""
    import json

    sock = daemons.socket_path
    d = daemons()
    with d.client(map_pools=False) as root:
        everything = root.pools
        names = [p["name"] for p in everything]
    assert len(names) == 3 and [p["index"] for p in everything] == [0, 1, 2]
    a = as_tenant(NOBODY, work(sock, A, 2))
    b = as_tenant(OTHER, work(sock, B, 1))
    for out, own, other in ((a, 1, 2), (b, 2, 1)):
        hidden = {"index": other, "hidden": True}
        told = sorted([everything[0], everything[own], hidden], key=lambda p: p["index"])
        assert out["hello"] == told and out["hello_type"] is None, out
        assert names[other] not in json.dumps(out), out
        assert out["stat"][own] == names[own] and out["stat"][other] == ""
        assert out["pool"] == own and out["arena"] == own and all(out["intact"]), out
        assert out["prefix"] == [True, True, True], out
        assert f"pool {other} belongs to another tenant" in out["other"], out
        assert out["doctor"][0] == "ok" and "2 pool(s) present" in out["doctor"][1], out
    with d.client() as root:
        assert [p.name for p in root.stat().pools] == names
        assert sorted((o.namespace, o.key) for o in root.list() if o.key in ("small", "big")) == [
            (B, "big"),
            (B, "small"),
            (A, "big"),
            (A, "small"),
        ]


def test_pools_made_as_configured_are_owned_as_configured():
    """The warm-restart owner check against pools as create_pools makes them: no false
    alarm for a group's tenant pool or a shared group, and each change is named."""
    from types import SimpleNamespace

    from kvbroker._server.policy import TenantPool
    from kvbroker._server.pool import HostPool, segment_prefix
    from kvbroker._server.startup import _owners_changed

    prefix = segment_prefix()
    tenants = [
        TenantPool("u", 8192, NOBODY, None, ("u",)),
        TenantPool("g", 8192, None, TEAM, ("g",)),
    ]
    pools = [
        HostPool(0, prefix + ".0", 8192, 4096, mode=0o660, gid=TEAM),
        HostPool(1, prefix + ".1", 8192, 4096, uid=NOBODY),
        HostPool(2, prefix + ".2", 8192, 4096, mode=0o660, gid=TEAM),
    ]
    old = [p.describe() for p in pools]
    try:
        cfg = SimpleNamespace(pools=1, group=TEAM)
        assert _owners_changed(cfg, old, tenants) == []
        moved = [tenants[0], TenantPool("g", 8192, None, TEAM + 1, ("g",))]
        assert _owners_changed(SimpleNamespace(pools=1, group=None), old, moved) == [
            (
                "pool 0 (shared) is owned by uid 0, gid 60001, mode 0660; the configuration asks "
                "for uid 0, mode 0600"
            ),
            (
                "pool 2 (tenant_pools.g) is owned by uid 0, gid 60001, mode 0660; the "
                "configuration asks for uid 0, gid 60002, mode 0660"
            ),
        ]
    finally:
        for p in pools:
            p.unlink()


def test_the_start_up_line_gives_each_pool_its_own_size(daemons):
    """The "serving on" line tells the shared pools from the tenant pools and gives each
    tenant pool its size, at a cold start and after a warm restart alike."""
    conf = config().replace('size = "1M"\nuser = 65533', 'size = "2M"\nuser = 65533')
    assert 'size = "2M"' in conf
    d = daemons(conf)
    want = ": 1 shared pool(s) of 4.0 MiB, tenant pools a 1.0 MiB, b 2.0 MiB, pages of 4.0 KiB"
    assert want in d.log()
    d.stop(signal.SIGKILL)  # a crash: the next daemon adopts the pools
    d = daemons(conf)
    assert "adopted 3 pool(s)" in d.log()
    assert d.log().count(want) == 1, d.log()


def test_a_write_arena_leaves_room_in_a_small_tenant_quota(daemons):
    """A tenant whose namespace A lives in its own pool and A/sub in the shared ones, with
    a 256 KiB quota and the default 2 MiB write arena: small puts into both namespaces fit
    (the arena may not take the quota they need), and the quota still holds."""
    sock = daemons.socket_path
    daemons(config(a_spaces=f'"{A}"'))

    def run():
        out = {}
        with Client(sock, timeout=10) as c:
            leases = []
            for i in range(6):  # 96 KiB in all, through the arena and reserve + seal
                where = A if i % 2 else f"{A}/sub"
                c.put(f"k{i}", {"kv": pattern(f"{where}{i}", 16 << 10)}, namespace=where)
                leases.append(c.claim(f"k{i}", namespace=where))  # held: not evictable
            out["pools"] = sorted({lease._extents["kv"][0] for lease in leases})
            try:
                c.put("big", {"kv": pattern("big", 200 << 10)}, namespace=f"{A}/sub")
                out["big"] = "stored"
            except QuotaExceeded as exc:
                out["big"] = str(exc)
        return out

    out = as_tenant(NOBODY, run)
    assert out["pools"] == [0, 1], out
    assert out["big"].startswith(f"user {A}:"), out


def test_a_daemon_that_is_not_root_maps_a_tenants_pool_for_transfers():
    """[transfer] maps every pool in the daemon to register it with NIXL. A pool owned by
    its tenant's user (0600) is not the daemon's to open: the daemon (CAP_CHOWN) takes it
    back for the open and gives it back; the mapping sees the tenant's bytes."""
    from types import SimpleNamespace

    from kvbroker._server.fleet import Fleet
    from kvbroker._server.pool import HostPool, segment_prefix

    prefix = segment_prefix()
    pools = [
        HostPool(0, prefix + ".0", 8192, 4096, uid=DAEMON_UID),
        HostPool(1, prefix + ".1", 8192, 4096, uid=NOBODY),
    ]
    try:
        shm = posix_ipc.SharedMemory(pools[1].name)  # as root: the tenant's bytes
        os.pwrite(shm.fd, b"tenant", 4096)
        shm.close_fd()
        before = owners([p.name for p in pools])

        def run():
            fleet = SimpleNamespace(
                broker=SimpleNamespace(pools=pools), _maps=[], bases=[], pages=[]
            )
            Fleet._map_pools(fleet)
            # the daemon's own reads go through the segment (PoolPages), NIXL's the mapping
            segment = [bytes(os.pread(p.fd, 6, 4096)).decode() for p in fleet.pages]
            return [bytes(m[4096:4102]).decode() for m in fleet._maps] + segment

        assert _as_daemon_user(run) == ["\0" * 6, "tenant"] * 2
        assert (
            owners([p.name for p in pools])
            == before
            == [(DAEMON_UID, 0, 0o600), (NOBODY, 0, 0o600)]
        )
    finally:
        for p in pools:
            p.unlink()
