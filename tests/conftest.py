"""Shared fixtures: a real daemon in a subprocess on a private socket, and clients of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbroker import BrokerUnavailable, Client


class DaemonProcess:
    """A ``kvbroker serve`` subprocess; stops it and checks it cleaned up."""

    def __init__(self, socket_path: str, *args: str, env: dict | None = None) -> None:
        self.socket_path = socket_path
        self.log_path = Path(socket_path).with_suffix(".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbroker", "serve", "--socket", socket_path, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                Client(self.socket_path, map_pools=False, timeout=5).close()
                return
            except BrokerUnavailable:
                time.sleep(0.02)
        raise RuntimeError(f"daemon not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> Client:
        return Client(self.socket_path, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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
    for proc in made:
        proc.stop()
