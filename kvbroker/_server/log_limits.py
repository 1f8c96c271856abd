"""Warnings that cannot flood the log: at most one per kind every so many seconds, saying how
many like it were held back (a peer sending garbage in a loop must not fill the log)."""

from __future__ import annotations

import logging
import time


class RateLimitedWarnings:
    """At most one warning per kind every ``interval`` seconds, to ``log``, saying how many
    were held back."""

    def __init__(self, log: logging.Logger, interval: float) -> None:
        self.log = log
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._last[kind] = now
        held = self._held.pop(kind, 0)
        if held:
            msg, args = msg + " (and %d more like it in the last %.0f s)", (*args, held, now - last)
        self.log.warning(msg, *args, exc_info=exc_info)
