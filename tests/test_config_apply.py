"""A setting's consumers follow from its declaration (kvbroker._server.config_apply): the start
and every SIGHUP reload set each copy a ``Key`` names, the GPU rings' included (they once kept
the lease_ttl of the start: their copy was passed by hand, and the reload did not know it)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import time

import pytest

from kvbroker._server.broker import Broker
from kvbroker._server.config import SETTINGS, DaemonConfig, apply_to_owners, reload_into
from kvbroker._server.config_apply import OWNERS, Into
from kvbroker._server.daemon import Daemon
from kvbroker._server.pool import HostPool
from kvbroker._server.rings import RING_ALIGN, FakeRings, RingService

PAGE = 4096
_OWNED = [key for key in SETTINGS if isinstance(key.reload, Into)]


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
# not reachable here (Into skips an absent owner; the disk tier's own tests reload it).
_OPTIONAL_OWNERS = {"disk"}


def _places(daemon):
    """Every copy of a setting its Key declares whose owner this daemon has:
    (key, owner object, attribute). An absent owner must be an optional one."""
    places = []
    for key in _OWNED:
        for owner, attr in key.reload.places(key.attr):
            obj = OWNERS[owner](daemon)
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
    apply_to_owners(built)
    assert built.broker.rings.object_ttl == built.broker.lease_ttl == 7.0
    for key, owner, attr in places:
        assert getattr(owner, attr) == getattr(built.config, key.attr), (key.name, attr)
    # every owned setting changed at once, each to its Key's example value
    new = dataclasses.replace(built.config)
    for key in _OWNED:
        setattr(new, key.attr, key.parse(key.example))
    changed, restart = reload_into(built.config, new, built)
    assert len(changed) == len(_OWNED) and not restart
    for key, owner, attr in places:
        assert getattr(owner, attr) == key.parse(key.example), (key.name, attr)
    assert built.broker.rings.object_ttl == 90.0  # lease_ttl's example, "90s"


def test_a_declared_copy_names_an_owner_the_daemon_has():
    with pytest.raises(ValueError, match="not OWNER.attribute"):
        Into("nobody.lease_ttl")
    with pytest.raises(ValueError, match="not OWNER.attribute"):
        Into("broker")


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
