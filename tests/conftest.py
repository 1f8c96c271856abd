"""Shared fixtures: a real daemon in a subprocess on a private socket, and clients of it."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvbroker.testing import DaemonProcess, drop_leftover_pools

# pytester: tests/test_testing.py runs a user's test file against kvbroker.testing's fixtures.
pytest_plugins = ["pytester"]

# Read replicas answer exists and match_prefix(hold=False) beside the daemon where it has 8
# CPUs or more (read_replicas = auto): a test's daemon runs none unless the test asks
# (tests/test_replicas.py), so a test behaves the same on a 2-core machine and a 16-core one.
os.environ.setdefault("KVBROKER_READ_REPLICAS", "0")

# No per-example deadline: Hypothesis' default (200 ms) is a timing assertion, and on a loaded
# 2-core CI machine one stalled example fails a property that holds ("Unreliable test timings").
settings.register_profile("kvbroker", deadline=None)
settings.load_profile("kvbroker")


@pytest.fixture
def socket_path(tmp_path_factory) -> str:
    # Unix socket paths are limited to ~107 bytes: keep them short.
    d = tmp_path_factory.mktemp("kvb", numbered=True)
    return str(d / "kvb.sock")


@pytest.fixture
def daemon(socket_path):
    """A daemon with one 64 MiB pool of 4 KiB pages."""
    d = DaemonProcess(socket_path, "--pool-size", "64M", "--page-size", "4K")
    yield d
    rc = d.stop()
    assert rc == 0, d.log()


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture
def make_daemon(tmp_path_factory):
    """Factory for daemons with custom arguments; all are stopped at teardown."""
    made: list[DaemonProcess] = []

    def make(*args: str, env: dict | None = None) -> DaemonProcess:
        d = tmp_path_factory.mktemp("kvb", numbered=True)
        proc = DaemonProcess(str(d / "kvb.sock"), *args, env=env)
        made.append(proc)
        return proc

    yield make
    unclean = []
    for proc in made:
        # A daemon the test stopped or killed itself is the test's to judge; one still
        # running here must stop cleanly, or the test passed over a broken daemon.
        running = proc.proc.poll() is None
        status = proc.stop()
        drop_leftover_pools(proc.socket_path)  # one socket each: no successor will adopt them
        if running and status != 0:
            unclean.append(f"daemon {proc.socket_path} exited with {status}:\n{proc.log()}")
    assert not unclean, "\n".join(unclean)
