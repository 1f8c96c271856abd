"""What a start builds and who frees it (kvbroker._server.startup): ``Startup.start`` returns
one frozen ``Started`` the daemon serves from; ``Startup.stop`` frees all of it, or what a
start that failed half-way got to, keeping a warm restart's adopted pools as it found them.
And the daemon's status line: the broker's own brief statistics, which agree with its full
``statistics()``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import socket

import pytest

from kvbroker._server.broker import Broker
from kvbroker._server.config import DaemonConfig
from kvbroker._server.daemon import Daemon
from kvbroker._server.journal import journal_path
from kvbroker._server.pool import HostPool
from kvbroker._server.startup import KEPT, DaemonError, Started, Startup
from kvbroker.testing import drop_leftover_pools

PAGE = 4096


@pytest.fixture
def config(tmp_path):
    path = str(tmp_path / "kvb.sock")
    cfg = DaemonConfig(socket_path=path, pool_size=64 * PAGE, page_size=PAGE)
    yield cfg
    drop_leftover_pools(path)


def _segments(started_or_names) -> list[bool]:
    names = started_or_names
    if isinstance(started_or_names, Started):
        names = [p.name for p in started_or_names.pools]
    return [os.path.exists("/dev/shm" + name) for name in names]


def _session(broker: Broker):
    s = broker.open_session(os.getpid(), os.getuid(), os.getgid())
    s.greeted = True
    return s


def _publish(broker: Broker, key: str) -> None:
    s = _session(broker)
    r = broker.handle(s, "reserve", {"key": key, "buffers": {"x": PAGE}})
    broker.handle(s, "seal", {"lease": r["lease"]})


def test_start_returns_what_the_daemon_serves_from_and_stop_frees_it(config):
    startup = Startup(config)
    started = startup.start(None, on_sealed=lambda key: None)
    assert isinstance(started, Started)
    with pytest.raises(dataclasses.FrozenInstanceError):
        started.broker = None
    assert list(started.pools) == started.broker.pools and len(started.pools) == 1
    assert (started.adopted, started.activated, started.rings, started.disk) == (
        False,
        False,
        None,
        None,
    )
    assert started.broker.journal is not None  # it holds the socket's lock
    assert started.sock.getsockname() == config.socket_path
    # Bound, not listening: a client that comes before the daemon serves is refused (and
    # retries), never left waiting on a start that may take seconds (NIXL, a fleet).
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        probe.connect(config.socket_path)
    probe.close()
    record = open(config.socket_path + ".lock").read().split("\n")
    assert record[0] == str(os.getpid()) and record[1] == started.pools[0].name
    assert _segments(started) == [True]
    started.sock.close()
    assert not startup.keeps(wanted=False, serving=True)
    asyncio.run(startup.stop(kept=False))
    assert _segments(started) == [False]
    for left in (
        config.socket_path,
        config.socket_path + ".lock",
        journal_path(config.socket_path),
    ):
        assert not os.path.exists(left), left


def test_a_start_refused_half_way_frees_what_it_built(config):
    """The socket is taken by something else: the pools, the journal and the lock the start
    had got to are freed by stop, as after a served run."""
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(config.socket_path)
    squatter.listen(1)
    try:
        startup = Startup(config)
        with pytest.raises(DaemonError, match="already listening"):
            startup.start(None, on_sealed=lambda key: None)
        names = [p.name for p in startup.pools]
        assert startup.broker is not None and _segments(names) == [True]
        kept = startup.keeps(wanted=False, serving=False)
        assert not kept  # fresh pools: nothing to keep
        asyncio.run(startup.stop(kept))
        assert _segments(names) == [False]
        assert not os.path.exists(journal_path(config.socket_path))
        assert not os.path.exists(config.socket_path + ".lock")
        assert os.path.exists(config.socket_path)  # the squatter's, not ours to unlink
    finally:
        squatter.close()


def test_a_warm_start_refused_half_way_keeps_the_pools_it_adopted(config):
    first = Startup(config)
    started = first.start(None, on_sealed=lambda key: None)
    _publish(started.broker, "kept")
    started.sock.close()
    assert first.keeps(wanted=True, serving=True)  # a restart
    asyncio.run(first.stop(kept=True))
    assert open(config.socket_path + ".lock").readline().strip() == KEPT

    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(config.socket_path)
    squatter.listen(1)
    try:
        second = Startup(config)
        with pytest.raises(DaemonError, match="already listening"):
            second.start(None, on_sealed=lambda key: None)
        assert second.adopted and second.broker.brief_statistics().objects == 1
        kept = second.keeps(wanted=False, serving=False)
        assert kept  # adopted, never served: left as it found them
        asyncio.run(second.stop(kept))
        assert _segments(started) == [True]
        assert os.path.exists(journal_path(config.socket_path))
    finally:
        squatter.close()
        os.unlink(config.socket_path)
    third = Startup(config)  # and the next start adopts them
    again = third.start(None, on_sealed=lambda key: None)
    assert again.adopted and again.broker.objects.keys() == {("default", "kept")}
    again.sock.close()
    asyncio.run(third.stop(kept=False))
    assert _segments(started) == [False]


def test_the_brief_statistics_agree_with_the_full_ones():
    pool = HostPool(0, f"/kvbst.{os.getpid()}.{secrets.token_hex(3)}", 64 * PAGE, PAGE)
    try:
        b = Broker([pool])

        def both():
            st = b.statistics(occupancy_cells=0)
            full = (len(st.clients), st.objects, st.read_leases + st.write_leases)
            brief = b.brief_statistics()
            assert (brief.used, brief.capacity) == (st.used, st.capacity)
            return full, (brief.clients, brief.objects, brief.leases)

        assert both()[0] == both()[1] == (0, 0, 0)
        s = _session(b)
        for i in range(3):
            _publish(b, f"o{i}")
        b.handle(s, "reserve", {"key": "writing", "buffers": {"x": 2 * PAGE}})
        b.handle(s, "claim", {"key": "o1"})
        full, brief = both()
        assert full == brief == (4, 3, 2)
        assert b.brief_statistics().used == 5 * PAGE  # three objects and a reservation of two
    finally:
        pool.unlink()


def test_the_status_line_reads_the_brokers_statistics():
    pool = HostPool(0, f"/kvbst.{os.getpid()}.{secrets.token_hex(3)}", 64 * PAGE, PAGE)
    try:
        d = Daemon(DaemonConfig(page_size=PAGE))
        assert d.summary() == "starting"
        d.broker = Broker([pool])
        _publish(d.broker, "one")
        assert d.summary() == (
            "serving: 1 client(s), 1 object(s), 0 lease(s), 4.0 KiB of 256.0 KiB used"
        )
        d.draining = True
        assert d.summary().startswith("draining: 1 client(s)")
    finally:
        pool.unlink()
