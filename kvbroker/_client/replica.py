"""The client's side of the daemon's read replicas (:mod:`kvbroker._server.replica`).

A daemon that runs replicas names their sockets in its ``hello`` reply. A client then sends
``exists`` and ``match_prefix(hold=False)`` without a peer to one of them (chosen by process
id, so a node's engine processes spread over them) and everything else to the daemon. A
replica answers what the daemon would have (it has read every change acknowledged before the
request was sent), so this changes no result, only who computes it.

A replica is a shortcut, never a dependency: when it cannot answer (it is restarting, the
daemon is draining and stopped it, it cannot follow the journal) the request goes to the
daemon, and the replica is tried again after :data:`RETRY_AFTER` seconds.

Ownership: the :class:`ReadReplica` owns its one connection (opened on first use, closed
with the client); it holds no leases, so losing it loses nothing.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from .._wire.protocol import REPLICA_ROUTED_OPS, answered_by_a_replica
from ..errors import BrokerUnavailable, ProtocolError, Timeout
from .framing import MessageStream
from .session import Session
from .transport import UnixTransport

__all__ = ["ASK_DAEMON", "RETRY_AFTER", "ReadReplica", "answers"]

RETRY_AFTER = 1.0  # seconds without the replica after it could not answer
# A replica answers in microseconds; one that takes this long is hung (stopped, starting,
# swamped): the daemon answers instead.
REPLICA_TIMEOUT = 1.0
ASK_DAEMON = object()  # what ReadReplica.call returns when the daemon must answer


def answers(op: str, args: dict[str, Any]) -> bool:
    """Whether to send this request to a read replica: the op table's ``replica`` column."""
    return op in REPLICA_ROUTED_OPS and answered_by_a_replica(op, args)


class ReadReplica:
    """One connection to one of the daemon's replicas, thread-safe like :class:`Session`.

    A process forked from the client's opens its own connection (to the replica its own
    process id picks) instead of sharing its parent's."""

    def __init__(self, paths: list[str], *, name: str, busy_poll: float) -> None:
        self.paths = list(paths)
        self._name, self._busy_poll = name, busy_poll
        self._session: Session | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self.fallbacks = 0  # requests the daemon answered because the replica could not

    def after_fork(self) -> None:
        """In a forked child: a fresh lock (the parent's may be held); the connection is
        replaced on first use, as the process id says."""
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        return self.paths[os.getpid() % len(self.paths)]

    def call(self, op: str, args: dict[str, Any]) -> Any:
        """The replica's answer, or :data:`ASK_DAEMON`."""
        session = self._session
        if session is None or self._pid != os.getpid():
            session = self._open()
            if session is None:
                self.fallbacks += 1
                return ASK_DAEMON
        try:
            return session.request(op, args)
        except (BrokerUnavailable, ProtocolError, Timeout, OSError):
            self._drop(session)
            self.fallbacks += 1
            return ASK_DAEMON

    def _open(self) -> Session | None:
        """A connection to the replica, greeted outside the lock (a hung replica holds up
        no other thread); None while it is not to be tried."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's connection is not ours
                self._pid, self._session, self._retry_at = os.getpid(), None, 0.0
            if self._session is not None:
                return self._session
            if time.monotonic() < self._retry_at:
                return None
            self._retry_at = time.monotonic() + RETRY_AFTER  # one thread tries at a time
        try:
            transport = UnixTransport(self.path, REPLICA_TIMEOUT, self._busy_poll)
            stream = MessageStream(transport, sender="a read replica")
        except BrokerUnavailable:
            return None
        try:
            session = Session(stream, name=self._name, role="replica-client")
        except (BrokerUnavailable, ProtocolError, Timeout, OSError):
            stream.close()
            return None
        with self._lock:
            if self._session is None and self._pid == os.getpid():
                self._session, self._retry_at = session, 0.0
                return session
            current = self._session
        session.close(drain_timeout=0)
        return current

    def _drop(self, session: Session) -> None:
        with self._lock:
            if self._session is session:
                self._session = None
                self._retry_at = time.monotonic() + RETRY_AFTER
        session.close(drain_timeout=0)

    def close(self) -> None:
        with self._lock:
            session, self._session = self._session, None
            inherited = self._pid != os.getpid()
        if session is not None and not inherited:
            session.close(drain_timeout=0)
