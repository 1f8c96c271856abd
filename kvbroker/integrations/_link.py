"""An adapter's connection to the daemon: down and full are normal states, not errors.

Shared by the engine adapters (the vLLM connector's scheduler and workers, SGLang's HiCache
backend). An engine must keep serving when the broker is down, restarting or full.
:class:`BrokerLink` hands out a :class:`kvbroker.Client` or None: None while the daemon is
unreachable, retried with exponential backoff (``retry_min`` doubling up to ``retry_max``
seconds) so a down daemon costs one failed ``connect`` per backoff period and no call ever
waits for it. Calls have a timeout (``timeout`` seconds; a hung daemon stalls one call that
long, then the link is down for a backoff period). The client does not reconnect by itself
(``reconnect=0``): the link does, on its own schedule, under a lock, so threads sharing the
link (SGLang calls its backend from three) never connect twice nor drop it twice.

:class:`Warnings` logs the first occurrence of each kind of trouble with what it means for
serving (each adapter says it in its engine's words: :class:`LinkWords`), then at most one
line per ``interval`` seconds with the count since, and a line when the broker is reachable
again. No engine import.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

from kvbroker import Client
from kvbroker.errors import BrokerUnavailable, KVBrokerError, LeaseExpired, ProtocolError, Timeout

log = logging.getLogger("kvbroker.integrations")

__all__ = ["CONNECTION_ERRORS", "BrokerLink", "LinkWords", "Warnings"]

# Errors that mean the connection (or the daemon) is gone: the link goes down.
CONNECTION_ERRORS = (BrokerUnavailable, Timeout, ProtocolError, LeaseExpired, OSError, EOFError)


@dataclass(frozen=True)
class LinkWords:
    """What the broker going away and coming back means for the engine, in its words."""

    down: str = "the engine keeps serving without it"  # after "broker at X unavailable (...): "
    back: str = "the adapter uses it again"  # after "reachable again after N s; "


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
    """A lazily (re)connected client of the daemon at ``socket``, shared by threads.

    ``map_pools``: the client maps the daemon's pools (data-path clients) or not (a
    scheduler that only looks up). Warnings go to ``warnings`` (and its logger), worded
    with ``words``.
    """

    def __init__(
        self,
        socket: str | None,
        *,
        name: str,
        role: str,
        map_pools: bool = True,
        timeout: float = 5.0,
        retry_min: float = 1.0,
        retry_max: float = 30.0,
        warnings: Warnings | None = None,
        words: LinkWords = LinkWords(),
    ) -> None:
        if not (timeout > 0 and 0 < retry_min <= retry_max):
            raise ValueError(
                f"kvbroker: timeout ({timeout}) and retry_min <= retry_max "
                f"({retry_min}, {retry_max}) must be positive seconds"
            )
        self.socket, self.name, self.role = socket, name, role
        self.map_pools, self.timeout = map_pools, timeout
        self.retry_min, self.retry_max = retry_min, retry_max
        self.warnings = warnings or Warnings()
        self.words = words
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._next_try = 0.0
        self._delay = retry_min
        self.down_since: float | None = None
        self.connects = 0  # successful connections (the first one included)
        self.failures = 0  # times the link went down

    @property
    def up(self) -> bool:
        return self._client is not None

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
                self._client = Client(
                    self.socket,
                    name=self.name,
                    role=self.role,
                    timeout=self.timeout,
                    map_pools=self.map_pools,
                    reconnect=0,
                    arena_size=0,
                )
            except (KVBrokerError, OSError) as exc:
                self._down(exc, now)
                return None
            self.connects += 1
            if self.down_since is not None:
                self.warnings.log.warning(
                    "kvbroker: broker at %s is reachable again after %.1f s; %s",
                    self._where(),
                    now - self.down_since,
                    self.words.back,
                )
            self.down_since = None
            self._delay = self.retry_min
            return self._client

    def holds(self, client: Client) -> bool:
        """Whether ``client`` is still the link's current client."""
        return client is self._client

    def fail(self, exc: BaseException, client: Client | None = None) -> None:
        """``client`` (None: the current one) hit ``exc``: drop it if the connection is gone,
        once, whichever thread saw it first; an earlier client's error changes nothing."""
        if not isinstance(exc, CONNECTION_ERRORS):
            return
        with self._lock:
            if self._client is None or (client is not None and client is not self._client):
                return  # already dropped (by another thread, or an earlier client's error)
            client, self._client = self._client, None
            self._down(exc, time.monotonic())
        _close(client)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close(client)

    def _where(self) -> str:
        return self.socket or "the default socket"

    def _down(self, exc: BaseException, now: float) -> None:
        if self.down_since is None:
            self.down_since = now
            self.failures += 1
            self.warnings.warn(
                "broker_down",
                "broker at %s unavailable (%s): %s and retries in %.0f s",
                self._where(),
                exc,
                self.words.down,
                self._delay,
            )
        self._next_try = now + self._delay
        self._delay = min(self._delay * 2, self.retry_max)


def _close(client: Client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken connection
        pass
