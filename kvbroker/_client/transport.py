"""Transport: a blocking Unix stream socket to the daemon, with timeouts."""

from __future__ import annotations

import os
import socket
import struct
import time
import weakref

from .._cpu import cpu_spare
from ..errors import BrokerUnavailable, Timeout

__all__ = ["DEFAULT_BUSY_POLL", "UnixTransport", "forked_error"]

_RECV_SIZE = 64 * 1024
# Long enough to catch the reply of a long request polling too: a 512-block match_prefix
# keeps the daemon ~150-200 us on the 2-core VM, and a client that had stopped polling at
# 100 us paid a wake-up on top (match p50 234-309 us against 155-177 us at 300 us,
# alternated in one session). Polling stops at once when the host has no CPU to spare.
DEFAULT_BUSY_POLL = 300e-6
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO / SO_SNDTIMEO


def _timeval(timeout: float | None) -> bytes:
    """``timeout`` seconds as a struct timeval; None: 0, which the kernel reads as forever."""
    if timeout is None:
        return _TIMEVAL.pack(0, 0)
    usec = max(1, round(timeout * 1e6))  # 0 would mean forever: the shortest wait instead
    return _TIMEVAL.pack(usec // 1_000_000, usec % 1_000_000)


class UnixTransport:
    """Bytes in and out of the daemon's socket. Knows nothing of messages.

    The socket is in blocking mode and the kernel keeps the timeouts (SO_RCVTIMEO,
    SO_SNDTIMEO): a Python socket timeout makes every send and recv a poll(2) first, five
    system calls more per put+get, for waits that end in time almost always."""

    def __init__(
        self, path: str, timeout: float | None = 30.0, busy_poll: float = DEFAULT_BUSY_POLL
    ) -> None:
        self.path = path
        # Set in a process forked from this one (os.register_at_fork below): the socket is
        # shared with the parent, whose connection it is. The child neither sends, reads,
        # nor sets its options (SO_RCVTIMEO would change the parent's timeouts too).
        self.forked = False
        _transports.add(self)
        # Poll for the reply this long before sleeping in recv, while the host has a CPU to
        # spare (kvbroker._cpu): on VMs a cross-CPU wake-up costs more than a whole request
        # (a bare round trip: 12 us sleeping, 5 us polling). 0 turns it off.
        self.busy_poll = busy_poll
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(min(timeout, 5.0) if timeout else 5.0)
        try:
            sock.connect(path)
        except FileNotFoundError:
            sock.close()
            raise BrokerUnavailable(f"no kvbroker daemon: {path} does not exist") from None
        except (TimeoutError, ConnectionRefusedError) as exc:
            sock.close()
            raise BrokerUnavailable(f"no kvbroker daemon answers on {path} ({exc})") from None
        except PermissionError:
            sock.close()
            raise BrokerUnavailable(f"permission denied connecting to {path}") from None
        sock.settimeout(None)
        self._sock = sock
        self.timeout: float | None = None
        self.settimeout(timeout)
        # recv_into one reused buffer: recv(n) would allocate n bytes on every call.
        self._buf = bytearray(_RECV_SIZE)
        self._view = memoryview(self._buf)

    def send(self, data: bytes) -> None:
        if self.forked:
            raise forked_error()
        try:
            self._sock.sendall(data)
        except BlockingIOError:  # SO_SNDTIMEO ran out
            raise Timeout(f"sending to the daemon on {self.path} timed out") from None
        except OSError as exc:
            raise BrokerUnavailable(f"lost the daemon on {self.path}: {exc}") from None

    def recv(self) -> memoryview:
        """Some bytes (never empty), valid until the next call; raises BrokerUnavailable
        when the daemon hung up."""
        if self.forked:
            raise forked_error()
        try:
            n = self._poll() if self.busy_poll > 0 else None
            if n is None:
                n = self._sock.recv_into(self._buf)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise Timeout(f"the daemon on {self.path} did not answer in time") from None
        except OSError as exc:
            raise BrokerUnavailable(f"lost the daemon on {self.path}: {exc}") from None
        if not n:
            raise BrokerUnavailable(f"the daemon on {self.path} closed the connection")
        return self._view[:n]

    def _poll(self) -> int | None:
        if not cpu_spare():
            return None  # spinning would take the CPU the daemon needs to answer
        recv_into, buf, dontwait = self._sock.recv_into, self._buf, socket.MSG_DONTWAIT
        yield_cpu = os.sched_yield
        deadline = time.perf_counter() + self.busy_poll
        while True:
            try:
                return recv_into(buf, 0, dontwait)
            except BlockingIOError:
                if time.perf_counter() > deadline:
                    return None
                # The daemon may be waiting for this very CPU: let it run (returns at once
                # when nothing else waits here).
                yield_cpu()

    def settimeout(self, timeout: float | None) -> None:
        """Seconds a send or a recv may wait from now on (None: forever)."""
        if self.forked:
            return  # the parent's socket: its options are the parent's
        tv = _timeval(timeout)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self.timeout = timeout

    def close(self) -> None:
        self._sock.close()


def forked_error() -> BrokerUnavailable:
    return BrokerUnavailable(
        "this connection was opened by the process this one forked from; "
        "a forked process uses a connection of its own"
    )


_transports: weakref.WeakSet[UnixTransport] = weakref.WeakSet()


def _mark_forked() -> None:
    for transport in list(_transports):
        transport.forked = True


os.register_at_fork(after_in_child=_mark_forked)
