"""Talking to systemd without libsystemd: sd_notify(3), socket activation, journal levels.

Written the way gunicorn does it: a datagram to ``$NOTIFY_SOCKET`` per state change, and the
listening sockets systemd passed as fds 3, 4, ... (``$LISTEN_FDS`` for ``$LISTEN_PID``).
Everything here is a no-op outside systemd, so ``kvbroker serve`` in a shell behaves the same.
"""

from __future__ import annotations

import logging
import os
import socket
import time

__all__ = ["Notifier", "listen_fds", "JournalFormatter", "under_journal"]

log = logging.getLogger("kvbroker.systemd")

SD_LISTEN_FDS_START = 3


def listen_fds() -> list[socket.socket]:
    """The sockets systemd passed to this process, or [] when not socket-activated.

    LISTEN_* are removed from the environment either way: they name fds of this process only,
    and a child that inherited them would try to serve our listening socket.
    """
    env = {k: os.environ.pop(k, None) for k in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")}
    try:
        count, pid = int(env["LISTEN_FDS"] or 0), int(env["LISTEN_PID"] or 0)
    except ValueError:
        return []
    if pid != os.getpid():  # meant for the process that exec'd us, not for us
        return []
    socks = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)  # systemd hands them over without O_CLOEXEC
        socks.append(socket.socket(fileno=fd))  # family and type are read from the fd
    return socks


class Notifier:
    """Sends sd_notify states to the service manager; does nothing without ``NOTIFY_SOCKET``."""

    def __init__(self, address: str | None = None, watchdog_usec: int = 0) -> None:
        if address and address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self.address = address or None
        self.watchdog_usec = watchdog_usec

    @classmethod
    def from_environ(cls) -> Notifier:
        """Take NOTIFY_SOCKET and WATCHDOG_* out of the environment (nothing we start may
        notify on our behalf) and remember them."""
        address = os.environ.pop("NOTIFY_SOCKET", None)
        usec = os.environ.pop("WATCHDOG_USEC", "")
        wpid = os.environ.pop("WATCHDOG_PID", "")
        watchdog = int(usec) if usec.isdigit() else 0
        if wpid and wpid != str(os.getpid()):
            watchdog = 0  # the watchdog is armed for another process
        return cls(address, watchdog)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between WATCHDOG=1 pings: half the timeout, as sd_watchdog_enabled(3) advises."""
        return self.watchdog_usec / 2e6 if self.address and self.watchdog_usec else None

    def notify(self, *states: str) -> bool:
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(self.address)
                s.sendall("\n".join(states).encode())
            return True
        except OSError:
            log.debug("sd_notify(%r) failed", states, exc_info=True)
            return False

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={_one_line(status)}")

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={_one_line(status)}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        # systemd >= 253 wants MONOTONIC_USEC with RELOADING=1 to tell reloads apart.
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}")

    def stopping(self, status: str) -> bool:
        return self.notify("STOPPING=1", f"STATUS={_one_line(status)}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def under_journal() -> bool:
    """True when stderr is connected to the journal ($JOURNAL_STREAM names its device:inode)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


class JournalFormatter(logging.Formatter):
    """``<priority>logger: message``: the journal stamps the time itself, and reads the
    syslog priority prefix so ``journalctl -p warning`` works."""

    _PRIORITY = {
        logging.CRITICAL: 2,
        logging.ERROR: 3,
        logging.WARNING: 4,
        logging.INFO: 6,
        logging.DEBUG: 7,
    }

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prio = self._PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())
