"""A real broker for your tests: a private ``kvbroker serve`` in a subprocess.

Engine code that talks to kvbroker is best tested against the real daemon (it is small and
starts in well under a second), on a private socket with a small pool, so tests never touch
the node's production broker::

    from kvbroker.testing import running_daemon

    def test_my_connector():
        with running_daemon(pool_size="64M") as daemon, daemon.client() as client:
            my_connector(client).save_kv(...)
            assert client.exists("req-1")

With pytest, ``pytest_plugins = ["kvbroker.testing"]`` in a ``conftest.py`` adds two
fixtures: ``kvbroker_daemon`` (a :class:`DaemonProcess` with one 64 MiB pool of 4 KiB pages
and no read replicas, stopped after the test, which fails if the daemon did not exit
cleanly) and ``kvbroker_client`` (a :class:`~kvbroker.Client` of it).

Ownership: the daemon, its socket, journal and shared-memory pools belong to the
:class:`DaemonProcess`; :meth:`DaemonProcess.stop` (or leaving ``running_daemon``) ends the
daemon with SIGTERM, which unlinks the pools, and removes the temporary directory. A daemon
that was killed instead leaves its pools to the next daemon of its socket (a warm restart);
a test's private socket gets none, so :func:`drop_leftover_pools` frees them at teardown
(``running_daemon`` does it for you).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ._client.client import Client
from .errors import BrokerUnavailable

__all__ = ["DaemonProcess", "drop_leftover_pools", "peer_certificates", "running_daemon"]


class DaemonProcess:
    """A ``kvbroker serve --socket SOCKET_PATH ARGS...`` subprocess, ready when constructed.

    Its output goes to ``SOCKET_PATH`` with the suffix ``.log`` (:meth:`log`).
    """

    def __init__(
        self, socket_path: str, *args: str, env: dict | None = None, ready_timeout: float = 15.0
    ) -> None:
        self.socket_path = socket_path
        self.log_path = Path(socket_path).with_suffix(".log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbroker", "serve", "--socket", socket_path, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 15.0) -> None:
        """Return once a client can connect; RuntimeError (with the log) if it exits first."""
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
        """What the daemon has printed so far (also after :meth:`stop`)."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> Client:
        """A new client of this daemon (the caller closes it)."""
        return Client(self.socket_path, **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait (SIGKILL after ``timeout``); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def drop_leftover_pools(socket_path: str) -> list[str]:
    """Unlink the pools a dead daemon of ``socket_path`` left for its successor, and its
    journal, as ``kvbroker serve --cold`` would; returns the segment names removed.

    Only once no daemon serves ``socket_path`` and none will: for a test's private socket
    at teardown, where a killed daemon's pools (they outlive it, in /dev/shm) would
    otherwise stay until the machine reboots.
    """
    import posix_ipc

    from ._server.journal import Journal, JournalError, journal_path

    path = journal_path(socket_path)
    try:
        recovered = Journal.load(path)
    except JournalError:
        recovered = None
    removed = []
    for pool in recovered.pools if recovered else ():
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(pool["name"])
            removed.append(pool["name"])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return removed


def peer_certificates(
    folder: str | os.PathLike, names: dict[str, list[str]], *, ca_name: str = "kvbroker test CA"
) -> dict[str, dict[str, str]]:
    """Throwaway certificates for a test fleet's peer channel (``[transfer] cert_file``,
    ``key_file``, ``ca_file``): one CA, and for each node of ``names`` a certificate signed
    by it whose subject alternative names are that node's hosts (IP addresses or DNS
    names, as its peers list it). Written to ``folder`` (keys mode 0600); returns
    ``{node: {"cert_file", "key_file", "ca_file"}}``. Needs the ``cryptography`` package.
    For tests only: production certificates come from the fleet's own CA."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def write_key(path: Path, key) -> str:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)
        return str(path)

    def build(subject: str, key, issuer, issuer_key, ca: bool, sans=()):
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if ca:
            b = b.add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                critical=True,
            )
        else:
            alt = []
            for host in sans:
                try:
                    alt.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    alt.append(x509.DNSName(host))
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
            b = b.add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = build(ca_name, ca_key, ca_subject, ca_key, True)
    ca_file = folder / "ca.pem"
    ca_file.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    out = {}
    for node, hosts in names.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = build(node, key, ca_subject, ca_key, False, hosts)
        cert_file = folder / f"{node}.pem"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[node] = {
            "cert_file": str(cert_file),
            "key_file": write_key(folder / f"{node}.key", key),
            "ca_file": str(ca_file),
        }
    return out


@contextlib.contextmanager
def running_daemon(
    *args: str, pool_size: str = "64M", page_size: str | None = "4K", env: dict | None = None
) -> Iterator[DaemonProcess]:
    """A private daemon on a socket in a fresh temporary directory, stopped on exit.

    ``args`` are more ``kvbroker serve`` flags; ``page_size`` None keeps the daemon's default.
    Raises RuntimeError if the daemon does not exit cleanly (status 0) when stopped, so a test
    cannot pass over a daemon that crashed.

    Read replicas: none unless ``args`` (``--read-replicas N``), ``env`` or this process's
    environment (``KVBROKER_READ_REPLICAS``) ask for them. With replicas (``auto`` starts
    them on 8 CPUs or more), what they answer reaches the daemon's counters and LRU up to
    50 ms later, so a test reading a counter right after a match would pass on a laptop and
    fail on a CI runner.
    """
    # Unix socket paths are limited to ~107 bytes: a short directory under /tmp.
    tmp = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    sizes = ("--pool-size", pool_size) + (("--page-size", page_size) if page_size else ())
    asked = any(
        a == "--read-replicas" or a.startswith("--read-replicas=") for a in args
    ) or "KVBROKER_READ_REPLICAS" in {**os.environ, **(env or {})}
    replicas = () if asked else ("--read-replicas", "0")
    daemon = DaemonProcess(os.path.join(tmp, "kvb.sock"), *sizes, *replicas, *args, env=env)
    try:
        yield daemon
    finally:
        status = daemon.stop()
        log = daemon.log_path.read_text(errors="replace")
        drop_leftover_pools(daemon.socket_path)
        shutil.rmtree(tmp, ignore_errors=True)
    if status != 0:
        raise RuntimeError(f"kvbroker daemon exited with {status}:\n{log}")


try:  # pytest fixtures, for `pytest_plugins = ["kvbroker.testing"]`
    import pytest
except ImportError:  # pragma: no cover - pytest is not a runtime dependency
    pass
else:

    @pytest.fixture
    def kvbroker_daemon() -> Iterator[DaemonProcess]:
        """A private daemon with one 64 MiB pool of 4 KiB pages."""
        with running_daemon() as daemon:
            yield daemon

    @pytest.fixture
    def kvbroker_client(kvbroker_daemon: DaemonProcess) -> Iterator[Client]:
        """A client of ``kvbroker_daemon``."""
        with kvbroker_daemon.client() as client:
            yield client
