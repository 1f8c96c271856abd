"""The connector's connection to the daemon: down and full are normal states, not errors.

An engine must keep serving when the broker is down, restarting or full. :class:`BrokerLink`
hands out a :class:`kvbroker.Client` or None: None while the daemon is unreachable, retried
with exponential backoff (``retry_min`` doubling up to ``retry_max`` seconds) so a down
daemon costs one failed ``connect`` per backoff period and no call ever waits for it. Calls
have a timeout (``timeout`` seconds; a hung daemon stalls one call that long, then the link
is down for a backoff period). The client does not reconnect by itself (``reconnect=0``):
the link does, on its own schedule.

:class:`Warnings` logs the first occurrence of each kind of trouble with what it means for
serving, then at most one line per ``interval`` seconds with the count since, and a line
when the broker is reachable again. No vLLM import.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from kvbroker import Client
from kvbroker.errors import BrokerUnavailable, KVBrokerError, LeaseExpired, ProtocolError, Timeout

log = logging.getLogger("kvbroker.integrations.vllm")

__all__ = ["CONNECTION_ERRORS", "BrokerLink", "Warnings"]

# Errors that mean the connection (or the daemon) is gone: the link goes down.
CONNECTION_ERRORS = (BrokerUnavailable, Timeout, ProtocolError, LeaseExpired, OSError, EOFError)


class Warnings:
    """Rate-limited warnings, counted by kind."""

    def __init__(self, logger: logging.Logger = log, interval: float = 30.0) -> None:
        self.log = logger
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self._last: dict[str, float] = {}
        self._since: Counter[str] = Counter()

    def warn(self, kind: str, message: str, *args) -> None:
        self.counts[kind] += 1
        now = time.monotonic()
        last = self._last.get(kind)
        if last is None or now - last >= self.interval:
            extra = self._since[kind]
            suffix = f" ({extra} more since the last warning of this kind)" if extra else ""
            self.log.warning("kvbroker: " + message + suffix, *args)
            self._last[kind] = now
            self._since[kind] = 0
        else:
            self._since[kind] += 1


class BrokerLink:
    """A lazily (re)connected client of the daemon at ``socket``."""

    def __init__(self, socket: str | None, *, name: str, role: str, map_pools: bool,
                 timeout: float = 5.0, retry_min: float = 1.0, retry_max: float = 30.0,
                 warnings: Warnings | None = None) -> None:  # fmt: skip
        self.socket, self.name, self.role = socket, name, role
        self.map_pools, self.timeout = map_pools, timeout
        self.retry_min, self.retry_max = retry_min, retry_max
        self.warnings = warnings or Warnings()
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
        if self._client is not None:
            return self._client
        now = time.monotonic()
        if now < self._next_try:
            return None
        try:
            self._client = Client(self.socket, name=self.name, role=self.role,
                                  timeout=self.timeout, map_pools=self.map_pools,
                                  reconnect=0, arena_size=0)  # fmt: skip
        except KVBrokerError as exc:
            self._down(exc, now)
            return None
        except OSError as exc:
            self._down(exc, now)
            return None
        self.connects += 1
        if self.down_since is not None:
            log.warning("kvbroker: broker at %s is reachable again after %.1f s; saving and "
                        "loading KV resume", self._where(), now - self.down_since)  # fmt: skip
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
                "broker_down", "broker at %s unavailable (%s): the engine keeps serving "
                "without it (prompts are computed, KV is not saved) and retries in %.0f s",
                self._where(), exc, self._delay,
            )  # fmt: skip
        self._next_try = now + self._delay
        self._delay = min(self._delay * 2, self.retry_max)

    def holds(self, client: Client) -> bool:
        """Whether ``client`` is still the link's current client."""
        return client is self._client

    def fail(self, exc: BaseException) -> None:
        """The current client hit ``exc``: drop it if the connection is gone."""
        if isinstance(exc, CONNECTION_ERRORS):
            client, self._client = self._client, None
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
            self._down(exc, time.monotonic())

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
