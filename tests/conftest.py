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

# The vLLM-facing tests (marker `vllm`): every tests/test_vllm_*.py, and tests elsewhere
# marked by hand. `make test` runs them a second time on a newer vLLM's Python laid over the
# installed CPU build (tests/vllm_helpers/overlay_vllm.py), which sets TEST_VLLM_OVERLAY.
VLLM_OVERLAY = os.environ.get("TEST_VLLM_OVERLAY")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name.startswith("test_vllm_"):
            item.add_marker(pytest.mark.vllm)


def pytest_sessionstart(session):
    if VLLM_OVERLAY:
        # a pass meant for the overlay must not quietly test the installed vLLM instead
        import vllm

        found = vllm.__version__.split("+")[0]
        if found != VLLM_OVERLAY:
            raise pytest.UsageError(
                f"TEST_VLLM_OVERLAY={VLLM_OVERLAY} but `import vllm` "
                f"finds {vllm.__version__} at {vllm.__file__}"
            )


def pytest_report_header(config):
    if VLLM_OVERLAY:
        import vllm

        return f"vLLM {vllm.__version__}'s Python from {os.path.dirname(vllm.__file__)}"
    return None


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
