"""Tenant isolation and quotas: the policy in the broker, the configuration, a real daemon,
and clients of another uid (forked children that drop root, when the tests run as root)."""

import json
import os
import secrets
import stat
import textwrap

import posix_ipc
import pytest

from kvbroker import BadRequest, Client, Forbidden, QuotaExceeded
from kvbroker._server.broker import Broker
from kvbroker._server.config import ConfigError, load_config
from kvbroker._server.policy import Policy, Quotas, parse_isolation, parse_quotas, user_name
from kvbroker._wire.paths import parse_size
from kvbroker._server.pool import HostPool
from kvbroker._wire.protocol import PROTOCOL_VERSION
from kvbroker._wire.stats import Statistics

PAGE = 4096
ALICE, BOB, CAROL = 50001, 50002, 50003  # uids with no passwd entry: they own "<uid>/..."
TEAM = 60001  # a group


@pytest.fixture
def broker():
    made = []

    def make(npages=64, isolation=None, quotas=None, **kw):
        pool = HostPool(0, f"/kvbiso.{os.getpid()}.{secrets.token_hex(3)}", npages * PAGE, PAGE)
        made.append(pool)
        policy = parse_isolation(isolation) if isolation is not None else None
        q = parse_quotas(quotas, parse_size) if quotas is not None else None
        return Broker([pool], policy=policy, quotas=q, **kw)

    yield make
    for p in made:
        p.unlink()


def connect(b, uid, gid=None):
    s = b.open_session(pid=1, uid=uid, gid=uid if gid is None else gid)
    b.handle(s, "hello", {"version": PROTOCOL_VERSION})
    return s


def put(b, s, ns, key, nbytes=100):
    lease = b.handle(s, "reserve", {"namespace": ns, "key": key, "buffers": {"a": nbytes}})
    b.handle(s, "seal", {"lease": lease["lease"]})


TENANT = {
    "mode": "tenant",
    "shared": {"shared-prefix": {"read": ["*"], "write": [TEAM]}, "team/*": {"read": [TEAM]}},
}


def test_open_mode_lets_everyone_do_everything(broker):
    b = broker()
    a, c = connect(b, ALICE), connect(b, BOB)
    put(b, a, "default", "k")
    assert b.handle(c, "lookup", {"key": "k"}) is not None
    assert b.handle(c, "evict", {"key": "k"})["count"] == 1


def test_tenant_owns_its_namespaces_and_is_denied_others(broker):
    b = broker(isolation=TENANT)
    a, c = connect(b, ALICE), connect(b, BOB)
    put(b, a, str(ALICE), "k")
    put(b, a, f"{ALICE}/pd", "k")
    with pytest.raises(Forbidden) as err:
        b.handle(c, "claim", {"namespace": str(ALICE), "key": "k"})
    msg = str(err.value)
    assert f"uid {BOB}" in msg and repr(str(ALICE)) in msg and "no [isolation.shared] grant" in msg
    with pytest.raises(Forbidden, match="may not write"):
        b.handle(c, "reserve", {"namespace": f"{ALICE}/pd", "key": "x", "buffers": {"a": 1}})
    with pytest.raises(Forbidden):
        b.handle(
            c,
            "reserve_blocks",
            {
                "namespace": str(ALICE),
                "blocks": [{"key": "b0", "parent": None, "buffers": {"a": 1}}],
            },
        )
    with pytest.raises(Forbidden):  # "default" belongs to nobody: only admins may use it
        put(b, c, "default", "k")
    # A prefix of a namespace name is not ownership: 5000 does not own 50001.
    assert not b.policy.access(5000, 5000).can(str(ALICE))
    assert b.pending == {} and b.pools[0].allocator.used == 2  # denials took no pages


def test_other_tenants_namespaces_are_invisible(broker):
    b = broker(isolation=TENANT)
    a, c = connect(b, ALICE), connect(b, BOB)
    put(b, a, str(ALICE), "k")
    put(b, c, str(BOB), "k")
    assert b.handle(c, "lookup", {"namespace": str(ALICE), "key": "k"}) is None
    listed = b.handle(c, "list", {})["objects"]
    assert [(o["namespace"], o["key"]) for o in listed] == [(str(BOB), "k")]
    assert b.handle(c, "list", {"namespace": str(ALICE)})["objects"] == []
    assert b.handle(c, "match_prefix", {"namespace": str(ALICE), "keys": ["k"]})["matched"] == 0
    ev = b.handle(c, "evict", {"all": True})
    assert ev["count"] == 1 and ev["evicted"][0]["namespace"] == str(BOB)
    assert (str(ALICE), "k") in b.objects  # untouched
    assert b.handle(c, "evict", {"namespace": str(ALICE), "all": True})["count"] == 0
    # stat: the other tenant's namespace, leases and connection are left out.
    lease = b.handle(a, "claim", {"namespace": str(ALICE), "key": "k"})
    snap = Statistics.from_dict(b.handle(c, "stat", {}))
    assert snap.objects == 0 and snap.leases == ()
    assert {cl.uid for cl in snap.clients} == {BOB}
    assert all(n.namespace != str(ALICE) for n in snap.namespaces)
    assert all(t.namespace != str(ALICE) for t in snap.transfers)
    b.handle(a, "release", {"lease": lease["lease"]})
    # An admin (root) sees everything.
    root = connect(b, 0)
    snap = Statistics.from_dict(b.handle(root, "stat", {}))
    assert snap.objects == 1 and {cl.uid for cl in snap.clients} == {ALICE, BOB, 0}


def test_shared_namespaces_by_group(broker):
    b = broker(isolation=TENANT)
    member, reader, outsider = connect(b, ALICE, TEAM), connect(b, BOB), connect(b, CAROL)
    put(b, member, "shared-prefix", "blk")  # TEAM may write
    assert b.handle(reader, "claim", {"namespace": "shared-prefix", "key": "blk"})  # "*" reads
    with pytest.raises(Forbidden, match="give uid 50002 no write access"):
        put(b, reader, "shared-prefix", "other")
    with pytest.raises(Forbidden, match="may not write"):  # visible but read-only: say so
        b.handle(reader, "evict", {"namespace": "shared-prefix", "all": True})
    root = connect(b, 0)
    put(b, root, "team/a", "k")
    assert b.handle(member, "lookup", {"namespace": "team/a", "key": "k"}) is not None
    assert b.handle(outsider, "lookup", {"namespace": "team/a", "key": "k"}) is None
    with pytest.raises(Forbidden):
        put(b, member, "team/a", "mine")  # read-only grant


def test_a_read_only_grant_cannot_free_through_a_consume_claim(broker):
    b = broker(isolation=TENANT)
    member, reader = connect(b, ALICE, TEAM), connect(b, BOB)
    put(b, member, "shared-prefix", "sys")
    with pytest.raises(Forbidden, match="consume-claim: uid 50002 .* may not write"):
        b.handle(reader, "claim", {"namespace": "shared-prefix", "key": "sys", "consume": True})
    lease = b.handle(
        reader, "claim", {"namespace": "shared-prefix", "key": "sys"}
    )  # reading is fine
    b.handle(reader, "release", {"lease": lease["lease"]})
    assert ("shared-prefix", "sys") in b.objects
    lease = b.handle(member, "claim", {"namespace": "shared-prefix", "key": "sys", "consume": True})
    b.handle(member, "release", {"lease": lease["lease"]})  # a writer may consume it
    assert ("shared-prefix", "sys") not in b.objects


def test_gpu_ring_ops_obey_the_namespace_policy(broker):
    from kvbroker._server.rings import FakeRings, RingService

    b = broker(isolation=TENANT)
    b.attach_rings(RingService(FakeRings(1), 1 << 20, registry=b.registry))
    alice, bob = connect(b, ALICE), connect(b, BOB)
    mine = user_name(ALICE)
    r = b.handle(
        alice, "ring_reserve", {"device": 0, "nbytes": 4096, "namespace": mine, "key": "req1"}
    )
    b.handle(alice, "ring_seal", {"lease": r["lease"]})
    for consume in (False, True):
        with pytest.raises(Forbidden):
            b.handle(bob, "ring_claim", {"namespace": mine, "key": "req1", "consume": consume})
    with pytest.raises(Forbidden):  # no squatting, and no Exists telling which keys exist
        b.handle(
            bob, "ring_reserve", {"device": 0, "nbytes": 4096, "namespace": mine, "key": "req1"}
        )
    got = b.handle(alice, "ring_claim", {"namespace": mine, "key": "req1", "consume": True})
    b.handle(alice, "ring_release", {"lease": got["lease"]})
    r = b.handle(bob, "ring_reserve", {"device": 0, "nbytes": 4096})  # keyless scratch: allowed
    b.handle(bob, "ring_release", {"lease": r["lease"]})


def test_reload_applies_a_new_policy_to_connected_clients(broker):
    b = broker()
    c = connect(b, BOB)
    put(b, c, "default", "k")
    b.set_policy(parse_isolation({"mode": "tenant"}), Quotas())
    assert b.handle(c, "lookup", {"key": "k"}) is None
    with pytest.raises(Forbidden):
        put(b, c, "default", "k2")


def test_quota_enforced_at_reservation(broker):
    b = broker(npages=64, quotas={"capped": "8K", "team/*": "4K"})
    s = connect(b, 0)
    lease = b.handle(s, "reserve", {"namespace": "capped", "key": "a", "buffers": {"x": 5000}})
    with pytest.raises(QuotaExceeded) as err:  # 8 KiB charged, leased: nothing evictable
        b.handle(s, "reserve", {"namespace": "capped", "key": "b", "buffers": {"x": 1}})
    msg = str(err.value)
    assert "'capped'" in msg and "quota of 8192" in msg and "8192 used" in msg
    assert b.pools[0].allocator.used == 2  # the refusal took nothing
    b.handle(s, "abort", {"lease": lease["lease"]})
    assert b.accounts.statistics().charged.get("capped", 0) == 0
    # Each namespace matching a glob has its own quota; others have none.
    put(b, s, "team/x", "k", 4096)
    put(b, s, "team/y", "k", 4096)
    held = b.handle(s, "claim", {"namespace": "team/x", "key": "k"})  # not evictable now
    used = b.pools[0].allocator.used
    with pytest.raises(QuotaExceeded):
        b.handle(
            s,
            "reserve_blocks",
            {
                "namespace": "team/x",
                "blocks": [{"key": "b1", "parent": None, "buffers": {"a": 10}}],
            },
        )
    assert b.pools[0].allocator.used == used and b.accounts.statistics().charged["team/x"] == 4096
    b.handle(s, "release", {"lease": held["lease"]})
    # Unleased, the old block makes room: the namespace's own LRU object is evicted.
    b.handle(
        s,
        "reserve_blocks",
        {"namespace": "team/x", "blocks": [{"key": "b1", "parent": None, "buffers": {"a": 10}}]},
    )
    assert ("team/x", "k") not in b.objects and ("team/y", "k") in b.objects
    put(b, s, "free", "k", 40 * PAGE)


def test_quota_evicts_the_namespaces_own_lru_objects_first(broker):
    b = broker(npages=64, quotas={"capped": "12K"})
    s = connect(b, 0)
    put(b, s, "other", "k", PAGE)
    for i in range(3):
        put(b, s, "capped", f"k{i}", PAGE)
    held = b.handle(s, "claim", {"namespace": "capped", "key": "k0"})
    put(b, s, "capped", "k3", 2 * PAGE)  # needs 8K: k0 is leased, so k1 then k2 go
    assert {k for ns, k in b.objects if ns == "capped"} == {"k0", "k3"}
    assert ("other", "k") in b.objects
    usage = {r["namespace"]: r for r in b.snapshot()["namespaces"]}
    assert usage["capped"]["used"] == 3 * PAGE and usage["capped"]["quota"] == 12 * 1024
    assert usage["capped"]["objects"] == 2 and usage["other"]["quota"] is None
    b.handle(s, "release", {"lease": held["lease"]})


def test_expired_write_leases_stay_charged_until_their_connection_ends(broker):
    now = [0.0]
    b = broker(isolation={"mode": "tenant"}, quotas={str(ALICE): "32K"}, clock=lambda: now[0])
    alice = connect(b, ALICE)
    for i in range(8):  # the whole quota, reserved and then left to expire (quarantined)
        b.handle(
            alice,
            "reserve",
            {"namespace": str(ALICE), "key": f"k{i}", "buffers": {"x": PAGE}, "ttl": 1},
        )
    now[0] += 2
    b.expire()
    assert b.pools[0].allocator.used == 8  # quarantined, not reused
    with pytest.raises(QuotaExceeded):  # the quota is not handed back by letting leases expire
        b.handle(alice, "reserve", {"namespace": str(ALICE), "key": "more", "buffers": {"x": PAGE}})
    b.handle(alice, "arena", {"nbytes": 4 * PAGE})
    with pytest.raises(BadRequest, match="already holds write arena"):
        b.handle(alice, "arena", {"nbytes": 4 * PAGE})
    b.close_session(alice)
    assert b.pools[0].allocator.used == 0 and b.accounts.statistics().charged == {}
    again = connect(b, ALICE)
    put(b, again, str(ALICE), "fresh", 32 * 1024)  # the whole quota is usable again


def test_quota_accounting_is_exact_after_churn(broker):
    b = broker(npages=32, quotas={"*": "64K"})
    s = connect(b, 0)
    for i in range(40):
        put(b, s, f"ns{i % 3}", f"k{i}", 3000 + i * 100)
        if i % 5 == 0:
            b.handle(s, "evict", {"namespace": f"ns{i % 3}", "all": True})
    charged = {}
    for (ns, _), obj in b.objects.items():
        charged[ns] = charged.get(ns, 0) + obj.npages * PAGE
    assert b.accounts.statistics().charged == charged
    b.handle(s, "evict", {"all": True})
    assert b.accounts.statistics().charged == {} and b.pools[0].allocator.used == 0


def test_policy_and_quotas_from_the_config_file(tmp_path):
    path = tmp_path / "kvbroker.toml"
    path.write_text(
        textwrap.dedent("""
        max_leases_per_client = 100
        max_write_buffer = "1M"
        require_checksums = true
        [isolation]
        mode = "tenant"
        admins = ["root"]
        [isolation.shared."prefix-cache"]
        read = ["*"]
        write = ["0", "user:root"]
        [quotas]
        "prefix-cache" = "2G"
        "*" = "512M"
    """)
    )
    cfg = load_config(str(path), env={})
    assert cfg.isolation.mode == "tenant" and cfg.isolation.admin_uids == {0}
    (grant,) = cfg.isolation.shared
    assert grant.everyone == "read" and grant.write_gids == {0} and grant.write_uids == {0}
    assert cfg.quotas.limit("prefix-cache") == 2 << 30 and cfg.quotas.limit("x") == 512 << 20
    assert cfg.max_leases_per_client == 100 and cfg.max_write_buffer == 1 << 20
    assert cfg.require_checksums is True
    assert Policy().open and not Quotas()


@pytest.mark.parametrize(
    "text, message",
    [
        ('[isolation]\nmode = "closed"', "isolation: mode: expected one of open, tenant"),
        ('[isolation]\nmodes = "open"', "isolation: modes: unknown key"),
        ('[isolation.shared.x]\nread = ["no-such-group-xyz"]', "no group 'no-such-group-xyz'"),
        ('[isolation.shared.x]\nreed = ["root"]', "expected read = [groups]"),
        ('[quotas]\nx = "lots"', "quotas: 'x'"),
        ("[limits]\nx = 1", "the only sections are [isolation] and [quotas]"),
    ],
)
def test_bad_policy_names_the_key(tmp_path, text, message):
    path = tmp_path / "kvbroker.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        load_config(str(path), env={})
    assert message in str(err.value) and str(path) in str(err.value)


def test_policy_cannot_come_from_the_environment(tmp_path):
    with pytest.raises(ConfigError, match="KVBROKER_ISOLATION: set it as an"):
        load_config(None, env={"KVBROKER_ISOLATION": "tenant"})


# -- a real daemon ----------------------------------------------------------------------------
def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_socket_and_pools_are_private_by_default(make_daemon):
    d = make_daemon("--pool-size", "4M", "--page-size", "4K")
    assert _mode(d.socket_path) == 0o600
    with d.client(map_pools=False) as c:
        name = c.pools[0]["name"]
    st = os.stat("/dev/shm" + name)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()


def test_group_makes_socket_and_pools_group_accessible(make_daemon):
    gid = os.getgid() if os.getuid() else 65534
    d = make_daemon("--pool-size", "4M", "--page-size", "4K", "--group", str(gid))
    st = os.stat(d.socket_path)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid
    with d.client(map_pools=False) as c:
        st = os.stat("/dev/shm" + c.pools[0]["name"])
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid


def test_quota_over_the_wire(make_daemon, tmp_path):
    cfg = tmp_path / "q.toml"
    cfg.write_text('[quotas]\n"small" = "16K"\n')
    d = make_daemon("--config", str(cfg), "--pool-size", "4M", "--page-size", "4K")
    with d.client() as c:
        lease = c.reserve("a", {"x": 16 * 1024}, namespace="small")
        with pytest.raises(QuotaExceeded, match="namespace 'small'"):
            c.put("b", {"x": b"1"}, namespace="small")
        lease.abort()
        assert c.put("b", {"x": b"1"}, namespace="small")
        s = c.stat()
        (row,) = [n for n in s.namespaces if n.namespace == "small"]
        assert row.used == 4096 and row.quota == 16 * 1024 and row.objects == 1
    from typer.testing import CliRunner

    from kvbroker.cli import app

    r = CliRunner().invoke(app, ["stat", "--socket", d.socket_path])
    assert r.exit_code == 0 and "NAMESPACE" in r.output and "16.0 KiB" in r.output
    r = CliRunner().invoke(app, ["stat", "--json", "--socket", d.socket_path])
    assert json.loads(r.output)["namespaces"][0]["namespace"] == "small"


# -- another uid, for real ---------------------------------------------------------------------
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another uid")


def _as_user(uid, gid, fn):
    """Run ``fn()`` in a forked child that has dropped to uid/gid; returns what it returned
    (JSON-able) or raises RuntimeError with the child's exception."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "error" in out:
        raise RuntimeError(out["error"])
    return out["ok"]


NOBODY = 65534


@pytest.fixture
def open_dir_daemon():
    """make_daemon, but in a directory other users may traverse (pytest's are 0700), so only
    the socket's own mode keeps them out."""
    import shutil
    import tempfile

    from conftest import DaemonProcess

    made = []

    def make(*args):
        d = tempfile.mkdtemp(prefix="kvb-iso-", dir="/tmp")
        os.chmod(d, 0o755)
        proc = DaemonProcess(os.path.join(d, "kvb.sock"), *args)
        made.append((proc, d))
        return proc

    yield make
    for proc, d in made:
        proc.stop()
        shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_another_uid_cannot_connect_or_map_a_private_daemon(open_dir_daemon):
    d = open_dir_daemon("--pool-size", "4M", "--page-size", "4K")
    with d.client(map_pools=False) as c:
        seg = c.pools[0]["name"]

    def try_it():
        out = {}
        try:
            Client(d.socket_path, timeout=5).close()
            out["connect"] = "ok"
        except Exception as exc:
            out["connect"] = type(exc).__name__
        try:
            posix_ipc.SharedMemory(seg)
            out["shm"] = "ok"
        except Exception as exc:
            out["shm"] = type(exc).__name__
        return out

    out = _as_user(NOBODY, NOBODY, try_it)
    assert out == {"connect": "BrokerUnavailable", "shm": "PermissionsError"}, (
        out
    )  # posix_ipc's name


@needs_root
def test_another_uid_under_a_tenant_policy(open_dir_daemon, tmp_path):
    cfg = tmp_path / "iso.toml"
    cfg.write_text('[isolation]\nmode = "tenant"\n[quotas]\n"*" = "64K"\n')
    d = open_dir_daemon(
        "--config", str(cfg), "--pool-size", "4M", "--page-size", "4K", "--group", str(NOBODY)
    )

    me = user_name(NOBODY)
    with d.client() as root:
        root.put("secret", {"a": b"root's"}, namespace="default")

    def tenant():
        out = {}
        with Client(d.socket_path, timeout=30) as c:
            out["own"] = c.put("k", {"a": b"mine"}, namespace=me)
            out["own_sub"] = c.put("k", {"a": b"mine"}, namespace=f"{me}/pd")
            out["got"] = bytes(c.get("k", namespace=me, verify=True)["a"]).decode()
            for op, call in (
                ("claim", lambda: c.claim("secret", namespace="default")),
                ("put", lambda: c.put("x", {"a": b"x"}, namespace="default")),
            ):
                try:
                    call()
                    out[op] = "allowed"
                except Forbidden as exc:
                    out[op] = str(exc)
            out["lookup"] = c.lookup("secret", namespace="default")
            out["list"] = sorted((o.namespace, o.key) for o in c.list())
            out["evicted"] = c.evict(all=True, dry_run=True).count
            s = c.stat()
            out["stat_clients"] = sorted({cl.uid for cl in s.clients})
            out["stat_objects"] = s.objects
            try:
                c.put("big", {"a": b"x" * 70_000}, namespace=me)
                out["quota"] = "allowed"
            except QuotaExceeded as exc:
                out["quota"] = str(exc)
        return out

    out = _as_user(NOBODY, NOBODY, tenant)
    assert out["own"] and out["own_sub"] and out["got"] == "mine"
    assert f"uid {NOBODY} ({me}) may not read namespace 'default'" in out["claim"]
    assert "may not write namespace 'default'" in out["put"]
    assert out["lookup"] is None
    assert out["list"] == [[me, "k"], [f"{me}/pd", "k"]]
    assert out["evicted"] == 2 and out["stat_objects"] == 2
    assert out["stat_clients"] == [NOBODY]
    assert f"namespace {me!r}" in out["quota"] and "quota of 65536" in out["quota"]
    with d.client() as root:  # root is admin: sees both tenants, its object intact
        assert root.get("secret")["a"].tobytes() == b"root's"
        assert {o.namespace for o in root.list()} == {"default", me, f"{me}/pd"}


def test_sample_config_tables_are_valid_when_uncommented(tmp_path):
    from pathlib import Path

    text = (Path(__file__).parent.parent / "systemd" / "kvbroker.toml").read_text()
    # The sample names users this host may lack (the kvbroker account, a tenant's): root exists.
    text = text.replace('"kvbroker"', '"root"').replace('user = "alice"', 'user = "root"')
    lines = text.splitlines()
    start = lines.index("# [isolation]")
    for i in range(start, len(lines)):
        body = lines[i][2:]
        if lines[i].startswith("# ") and (body.startswith("[") or " = " in body):
            lines[i] = body
    (tmp_path / "k.toml").write_text("\n".join(lines) + "\n")
    cfg = load_config(str(tmp_path / "k.toml"), env={})
    assert cfg.isolation.mode == "open" and cfg.isolation.shared[0].pattern == "prefix-cache"
    assert cfg.quotas.limit("prefix-cache") == 64 << 30 and cfg.quotas.limit("x") == 16 << 30
    assert cfg.max_write_buffer == 32 << 20 and cfg.max_leases_per_client == 65536


def test_a_tenants_stat_names_nothing_of_another_tenant_failed_pulls_included(broker):
    """Every name in Alice's namespace (a key, a failed pull's message) is absent from
    everything Bob's stat carries; Alice sees her own pull's failure, an admin the latest."""
    import asyncio
    import types

    from kvbroker._server.config import DaemonConfig
    from kvbroker._server.fleet import Fleet
    from kvbroker.errors import NotFound

    b = broker(isolation=TENANT)
    a, c = connect(b, ALICE), connect(b, BOB)
    secret_ns, secret = f"{ALICE}/ns-of-alice", "alice-secret-key-7f3a"
    put(b, a, secret_ns, secret)
    lease = b.handle(a, "claim", {"namespace": secret_ns, "key": secret})
    put(b, c, str(BOB), "bobs")
    fleet = Fleet(types.SimpleNamespace(config=DaemonConfig(), broker=b))
    fleet.endpoint = object()  # pulling configured (statistics report transfers)
    b.fleet = fleet

    async def failing_pull(address, namespace, key, why):
        async def refused(*_args):
            raise NotFound(why)  # as the owner answers a pin of a key it does not hold

        fleet._pull_inner = refused
        with pytest.raises(NotFound):
            await fleet._pull(address, namespace, "pin", [key], False)

    asyncio.run(
        failing_pull(
            "10.0.0.9:7000",
            secret_ns,
            f"{secret}-2",
            f"{secret_ns}/{secret}-2 is not published on this broker",
        )
    )
    seen_by_bob = b.handle(c, "stat", {})
    assert secret not in repr(seen_by_bob) and "ns-of-alice" not in repr(seen_by_bob)
    snap = Statistics.from_dict(seen_by_bob)
    assert snap.transfer.failures == 1 and snap.transfer.last_failure == ""
    assert Statistics.from_dict(b.handle(a, "stat", {})).transfer.last_failure == (
        f"10.0.0.9:7000: {secret_ns}/{secret}-2 is not published on this broker"
    )
    asyncio.run(
        failing_pull(
            "10.0.0.9:7000", str(BOB), "gone", f"{BOB}/gone is not published on this broker"
        )
    )
    assert "gone" in Statistics.from_dict(b.handle(c, "stat", {})).transfer.last_failure
    assert secret in Statistics.from_dict(b.handle(a, "stat", {})).transfer.last_failure
    root = connect(b, 0)
    assert "gone" in Statistics.from_dict(b.handle(root, "stat", {})).transfer.last_failure
    b.handle(a, "release", {"lease": lease["lease"]})


def test_the_lease_cap_per_uid_counts_each_uid_alone(broker):
    """max_leases_per_uid adds up one uid's sessions (several connections, expiries, closes)
    and no one else's: Alice at her cap leaves Bob his."""
    from kvbroker import LimitExceeded

    b = broker(max_leases_per_client=3)
    b.max_leases_per_uid = 4
    a1, a2, bob = connect(b, ALICE), connect(b, ALICE), connect(b, BOB)
    put(b, a1, "default", "k")
    for s in (a1, a1, a2, a2):
        b.handle(s, "claim", {"key": "k", "ttl": 5.0})
    for s in (a1, a2):
        with pytest.raises(LimitExceeded, match="uid 50001 hold 4 leases"):
            b.handle(s, "claim", {"key": "k"})
    with pytest.raises(LimitExceeded, match="max_leases_per_uid"):
        b.handle(a2, "reserve", {"key": "x", "buffers": {"a": 10}})
    for _ in range(3):
        b.handle(bob, "claim", {"key": "k"})  # his own count
    b.close_session(a2)
    assert b.leases.statistics().per_uid == {ALICE: 2, BOB: 3}
    b.handle(a1, "claim", {"key": "k", "ttl": 60.0})
    b.expire(b.clock() + 30.0)  # Alice's two 5 s leases end
    assert b.leases.statistics().per_uid[ALICE] == 1
    b.handle(a1, "claim", {"key": "k"})
