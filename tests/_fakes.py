"""Stand-ins the in-process broker tests share."""

from __future__ import annotations


class Clock:
    """A broker clock that stands still until a test moves ``now``."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now
