"""The backend's connection to the daemon, shared by SGLang's storage threads; down and full
are normal states, not errors.

SGLang calls a storage backend from three threads at once (the prefetch thread asks
``batch_exists``, the prefetch I/O thread ``batch_get_v1``, the backup thread
``batch_set_v1``). :class:`BrokerLink` hands all of them one :class:`kvbroker.Client` (its
calls are thread-safe) or None while the daemon is unreachable, retried with exponential
backoff (``retry_min`` doubling up to ``retry_max`` seconds), so a down daemon costs one
failed ``connect`` per backoff period and no call waits for it. Calls have a timeout
(``timeout`` seconds; a hung daemon stalls one call that long, then the link is down for a
backoff period). The client does not reconnect by itself (``reconnect=0``): the link does,
on its own schedule, under a lock so two threads never connect twice.

:class:`Warnings` logs the first occurrence of each kind of trouble with what it means for
serving, then at most one line per ``interval`` seconds with the count since, and a line when
the broker is reachable again. No SGLang import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kvbroker import Client
from kvbroker.errors import BrokerUnavailable, KVBrokerError, LeaseExpired, ProtocolError, Timeout

log = logging.getLogger("kvbroker.integrations.sglang")

__all__ = ["CONNECTION_ERRORS", "BrokerLink", "Warnings"]

# Errors that mean the connection (or the daemon) is gone: the link goes down.
CONNECTION_ERRORS = (BrokerUnavailable, Timeout, ProtocolError, LeaseExpired, OSError, EOFError)


class Warnings:
    """Rate-limited warnings, counted by kind; safe to call from any thread."""

    def __init__(self, logger: logging.Logger = log, interval: float = 30.0) -> None:
        self.log = logger
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._since: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            last = self._last.get(kind)
            due = last is None or now - last >= self.interval
            if due:
                extra, self._since[kind], self._last[kind] = self._since[kind], 0, now
            else:
                self._since[kind] += 1
        if due:
            suffix = f" ({extra} more since the last warning of this kind)" if extra else ""
            self.log.warning("kvbroker: " + message + suffix, *args)


class BrokerLink:
    """A lazily (re)connected client of the daemon at ``socket``, shared by threads."""

    def __init__(self, socket: str | None, *, name: str, role: str, timeout: float = 5.0,
                 retry_min: float = 1.0, retry_max: float = 30.0,
                 warnings: Warnings | None = None) -> None:  # fmt: skip
        if not (timeout > 0 and 0 < retry_min <= retry_max):
            raise ValueError(f"kvbroker: timeout ({timeout}) and retry_min <= retry_max "
                             f"({retry_min}, {retry_max}) must be positive seconds")  # fmt: skip
        self.socket, self.name, self.role, self.timeout = socket, name, role, timeout
        self.retry_min, self.retry_max = retry_min, retry_max
        self.warnings = warnings or Warnings()
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._next_try = 0.0
        self._delay = retry_min
        self.down_since: float | None = None
        self.connects = 0  # successful connections (the first one included)
        self.failures = 0  # times the link went down

    def get(self) -> Client | None:
        """The client, connecting first if due; None while the daemon is unreachable."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_try:
                return None
            try:
                self._client = Client(self.socket, name=self.name, role=self.role,
                                      timeout=self.timeout, reconnect=0, arena_size=0)  # fmt: skip
            except (KVBrokerError, OSError) as exc:
                self._down(exc, now)
                return None
            self.connects += 1
            if self.down_since is not None:
                log.warning("kvbroker: broker at %s is reachable again after %.1f s; HiCache "
                            "storage reads and writes resume", self._where(),
                            now - self.down_since)  # fmt: skip
            self.down_since = None
            self._delay = self.retry_min
            return self._client

    def _where(self) -> str:
        return self.socket or "the default socket"

    def _down(self, exc: BaseException, now: float) -> None:
        if self.down_since is None:
            self.down_since = now
            self.failures += 1
            self.warnings.warn(
                "broker_down", "broker at %s unavailable (%s): SGLang keeps serving without "
                "it (its storage tier misses, pages are not written) and retries in %.0f s",
                self._where(), exc, self._delay,
            )  # fmt: skip
        self._next_try = now + self._delay
        self._delay = min(self._delay * 2, self.retry_max)

    def fail(self, client: Client, exc: BaseException) -> None:
        """``client`` hit ``exc``: drop it if the connection is gone (once, whichever thread
        saw it first)."""
        if not isinstance(exc, CONNECTION_ERRORS):
            return
        with self._lock:
            if client is not self._client:
                return  # another thread already dropped it
            self._client = None
            self._down(exc, time.monotonic())
        _close(client)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close(client)


def _close(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass
