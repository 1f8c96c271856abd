"""A setting's consumers follow from its declaration (kvbroker._server.config_apply): the start
and every SIGHUP reload set each copy a ``Key`` names, the GPU rings' included (they once kept
the lease_ttl of the start: their copy was passed by hand, and the reload did not know it)."""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import signal
import time
import types

import pytest

from kvbroker._server.broker import Broker
from kvbroker._server.config import SETTINGS, DaemonConfig, apply_to_owners, reload_into
from kvbroker._server.config_apply import OWNERS, Call, Into
from kvbroker._server.daemon import Daemon
from kvbroker._server.disk_tier import DiskTier
from kvbroker._server.fleet_events import EventFeed
from kvbroker._server.pool import HostPool
from kvbroker._server.retention import Retention
from kvbroker._server.rings import RING_ALIGN, FakeRings, RingService

PAGE = 4096
_OWNED = [key for key in SETTINGS if isinstance(key.reload, Into)]
# Each Call once, in the order of its first key (several keys may share one: the policy).
_CALLS = list({id(k.reload): k.reload for k in SETTINGS if isinstance(k.reload, Call)}.values())
# What Daemon.owners() resolves each name a declaration may use to.
_OWNER_TYPES = {
    "daemon": Daemon,
    "broker": Broker,
    "retention": Retention,
    "rings": RingService,
    "disk": DiskTier,
    "events": EventFeed,
}


@pytest.fixture
def built(tmp_path):
    """A daemon's owners, in-process: a broker over one pool, and GPU rings on a fake GPU."""
    pool = HostPool(0, f"/kvbca.{os.getpid()}.{secrets.token_hex(3)}", 64 * PAGE, PAGE)
    try:
        daemon = Daemon(DaemonConfig(lease_ttl=7.0, page_size=PAGE))
        daemon.broker = Broker([pool])
        daemon.broker.rings = RingService(FakeRings(1), 4 * RING_ALIGN)
        yield daemon
    finally:
        pool.unlink()


# Owners a configuration may leave out: the fixture builds none of them, so their copies are
# not reachable here (Into and Call skip an absent owner; their own tests reload them).
_OPTIONAL_OWNERS = {"disk", "events"}


def _places(daemon):
    """Every copy of a setting its Key declares whose owner this daemon has:
    (key, owner object, attribute). An absent owner must be an optional one."""
    places, owners = [], daemon.owners()
    for key in _OWNED:
        for owner, attr in key.reload.places(key.attr):
            obj = owners[owner]
            if obj is None:
                assert owner in _OPTIONAL_OWNERS, f"{key.name}: owner {owner} is missing"
                continue
            places.append((key, obj, attr))
    return places


def test_lease_ttl_declares_the_rings_as_a_consumer():
    (lease_ttl,) = [key for key in _OWNED if key.name == "lease_ttl"]
    assert ("rings", "object_ttl") in lease_ttl.reload.places("lease_ttl")


def test_the_start_and_a_reload_set_every_declared_copy(built):
    places = _places(built)
    assert {owner for _, owner, _ in places} == {built.broker, built.broker.rings}
    for _, owner, attr in places:  # every declared copy is an attribute its owner has
        assert hasattr(owner, attr), f"{type(owner).__name__} has no {attr}"
    apply_to_owners(built.config, built.owners())
    assert built.broker.rings.object_ttl == built.broker.lease_ttl == 7.0
    for key, owner, attr in places:
        assert getattr(owner, attr) == getattr(built.config, key.attr), (key.name, attr)
    # every owned setting changed at once, each to its Key's example value
    new = dataclasses.replace(built.config)
    for key in _OWNED:
        setattr(new, key.attr, key.parse(key.example))
    changed, restart = reload_into(built.config, new, built.owners())
    assert len(changed) == len(_OWNED) and not restart
    for key, owner, attr in places:
        assert getattr(owner, attr) == key.parse(key.example), (key.name, attr)
    assert built.broker.rings.object_ttl == 90.0  # lease_ttl's example, "90s"


def test_a_declared_copy_names_an_owner_the_daemon_has():
    with pytest.raises(ValueError, match="not OWNER.attribute"):
        Into("nobody.lease_ttl")
    with pytest.raises(ValueError, match="not OWNER.attribute"):
        Into("broker")
    with pytest.raises(ValueError, match="not OWNER.method"):
        Call("daemon").then("nobody.set_policy")
    with pytest.raises(ValueError, match="not OWNER.method"):
        Call("broker.set_policy").then("rings")


def test_the_daemon_resolves_every_owner_a_declaration_may_name(built):
    """Before its start (no broker yet) and once built, Daemon.owners() answers every name
    of OWNERS, and nothing else; the parts not running are None."""
    assert set(_OWNER_TYPES) == set(OWNERS)
    bare = Daemon(DaemonConfig()).owners()
    assert set(bare) == set(OWNERS)
    assert {name for name, obj in bare.items() if obj is not None} == {"daemon"}
    owners = built.owners()
    assert set(owners) == set(OWNERS)
    for name, obj in owners.items():
        assert obj is None or isinstance(obj, _OWNER_TYPES[name]), name


def test_every_declared_method_exists_and_takes_settings_that_exist():
    """A Call names a method its owner's class has, with fields or methods of the
    configuration: a misspelt one would fail only at the first SIGHUP."""
    cfg = DaemonConfig()
    assert _CALLS
    for call in _CALLS:
        for owner, method, args in call.steps:
            assert callable(getattr(_OWNER_TYPES[owner], method, None)), (owner, method)
            for arg in args:
                assert hasattr(cfg, arg), (owner, method, arg)


class _Recorder:
    """An owner the fixture does not build (the disk tier, the event feed): takes any call
    and any copy."""

    def __getattr__(self, method):
        return lambda *args: None


def test_a_reload_calls_every_declared_method_once(built, monkeypatch):
    """Each method a Key's Call names is reached by a reload, once even where several keys
    share the Call ([isolation] and [quotas]), with the new configuration's values."""
    built.fleet = types.SimpleNamespace(events=_Recorder())  # an event feed: [events]
    built.broker.pages.tier = _Recorder()  # a disk tier: [tier.disk]
    owners = built.owners()
    seen = []
    for call in _CALLS:
        for owner, method in call.calls():
            real = getattr(owners[owner], method)

            def record(*args, _real=real, _where=(owner, method)):
                seen.append((_where, args))
                return _real(*args)

            monkeypatch.setattr(owners[owner], method, record)
    new = dataclasses.replace(built.config)
    for key in SETTINGS:
        if isinstance(key.reload, Call):
            setattr(new, key.attr, key.parse(key.example))
    level = logging.getLogger().level
    try:
        changed, _ = reload_into(built.config, new, owners)
    finally:
        logging.getLogger().setLevel(level)
    assert len(changed) == sum(isinstance(key.reload, Call) for key in SETTINGS)
    expected = [
        ((owner, method), tuple(Call.values(new, args)))
        for call in _CALLS
        for owner, method, args in call.steps
    ]
    assert [where for where, _ in seen] == [where for where, _ in expected]
    assert seen == expected
    assert ("events", "policy_changed") in [where for where, _ in seen]
    assert (built.broker.policy, built.broker.quotas) == (new.isolation, new.quotas)
    assert built.broker.retention.settings == new.retention_settings()


def test_a_reload_of_lease_ttl_reaches_the_gpu_rings(make_daemon, tmp_path):
    """Through a real daemon with a ring on a fake GPU: after SIGHUP sets lease_ttl to 1 s, a
    ring object nobody claims is dropped after 1 s, not after the 30 s of the start."""
    conf = tmp_path / "kvbroker.toml"
    conf.write_text('pool_size = "16M"\npage_size = "4K"\ngpu_ring = "1M"\nlease_ttl = "30s"\n')
    d = make_daemon("--config", str(conf), env={"KVBROKER_FAKE_GPUS": "1"})
    conf.write_text('pool_size = "16M"\npage_size = "4K"\ngpu_ring = "1M"\nlease_ttl = "1s"\n')
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "lease_ttl 30.0 -> 1.0" not in d.log():
        assert time.monotonic() < deadline, "the reload never happened"
        time.sleep(0.05)
    with d.client(map_pools=False) as c:
        assert c._session.hello["lease_ttl"] == 1.0
        c.ops.ring_seal(c.ops.ring_reserve(0, 4096, key="unclaimed")["lease"])
        assert c.ops.ring_lookup(["unclaimed"])["objects"][0] is not None
        # Gone once its 1 s has passed (the daemon's expiry runs 10 times a second); with
        # the old 30 s it would still be there when this gives up, well short of 30 s.
        deadline = time.monotonic() + 20
        while c.ops.ring_lookup(["unclaimed"])["objects"][0] is not None:
            assert time.monotonic() < deadline, "the ring object kept the old lease_ttl"
            time.sleep(0.1)
    assert d.stop() == 0
