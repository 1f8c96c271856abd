"""``kvbroker tui``: a live Textual monitor. Installed as ``kvbroker.tui``.

Importing this package is cheap; Textual is loaded by :func:`run` and the modules it uses.
"""

from __future__ import annotations

__all__ = ["run"]


def run(socket_path: str | None = None, interval: float = 1.0) -> None:
    """Monitor the daemon on ``socket_path`` until the user quits."""
    from ._app import MonitorApp
    from ._source import DaemonSource

    MonitorApp(DaemonSource(socket_path), interval=interval).run()
