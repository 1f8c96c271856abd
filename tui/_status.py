"""The status line: what the monitor is connected to, or that it is not and is retrying.

It is one row however narrow the terminal: its parts have priorities, and those that do not
fit are left out, least important first. PAUSED comes first, so it is never the part cut.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvbroker._wire.paths import format_size
from kvbroker._wire.stats import Statistics

from ._cells import Seconds

__all__ = ["StatusLine", "fit_parts"]

_GAP = "  "


def _shorten_path(path: str, width: int) -> str:
    """``path`` with its start replaced by "…" to fit ``width`` (the socket's name stays)."""
    if len(path) <= width:
        return path
    return "…" + path[len(path) - max(1, width - 1) :]


MIN_CUT = 12  # a cuttable part shorter than this once cut is left out instead


def fit_parts(parts: list[tuple], width: int) -> Text:
    """``parts``: (priority, text, style[, cuttable]) in display order; lower priority numbers
    matter more. The parts that fit in ``width`` (by priority), in display order; a cuttable
    part that does not fit whole takes the room left, ending in "…"."""
    keep: dict[int, str] = {}
    used = 0
    for i in sorted(range(len(parts)), key=lambda i: parts[i][0]):
        text = parts[i][1]
        gap = len(_GAP) if keep else 0
        room = width - used - gap
        if len(text) > room and len(parts[i]) > 3 and parts[i][3] and room >= MIN_CUT:
            text = text[: room - 1] + "…"
        if len(text) <= room:
            keep[i] = text
            used += gap + len(text)
    line = Text(no_wrap=True, overflow="ellipsis")
    for i in sorted(keep):
        if len(line):
            line.append(_GAP)
        line.append(keep[i], parts[i][2])
    return line


class StatusLine(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._parts: list[tuple] = []

    def _show(self, parts: list[tuple]) -> None:
        self._parts = parts
        self.refresh()

    def render(self) -> Text:
        width = max(10, self.content_size.width or self.size.width or 80)
        return fit_parts(self._parts, width)

    def connecting(self, label: str) -> None:
        self.set_classes("-connecting")
        self._show([(0, f"◌ connecting to {label} …", "")])

    def connected(self, snap: Statistics, label: str, interval: float, paused: bool) -> None:
        self.set_classes("-connected")
        parts = []
        if paused:
            parts.append((0, "❚❚ PAUSED (p resumes)", "bold reverse"))
        parts += [
            (1, f"● {_shorten_path(label, 40)}", "bold"),
            (2, f"used {format_size(snap.used)} of {format_size(snap.capacity)}", ""),
            (3, f"objects {snap.objects}", ""),
            (4, f"leases {snap.read_leases}r/{snap.write_leases}w", ""),
            (5, f"clients {len(snap.clients)}", ""),
            (6, f"pending {snap.pending}", ""),
        ]
        if snap.read_replicas or snap.counters.replica_exits:  # (daemons without: no part)
            parts.append(
                (6, f"replicas {snap.read_replicas} ({snap.counters.replica_exits} exited)", "")
            )
        parts += [
            (7, f"up {Seconds(snap.uptime)}", ""),
            (8, f"daemon {snap.pid} v{snap.version}", ""),
            (9, f"every {interval:g}s", ""),
        ]
        t = snap.transfer
        if t is not None:  # [transfer]: peers, pulls in flight, bytes pulled and served
            parts.append(
                (
                    5,
                    f"fleet {t.node}: peers {sum(p.connected for p in t.peers)}/"
                    f"{len(t.peers)} pulled {format_size(t.bytes_pulled)} "
                    f"({t.in_flight} in flight, {t.failures} failed)",
                    "",
                )
            )
        d = snap.disk
        if d is not None:  # [tier.disk]: how full, how many on disk only, promotions
            parts.append(
                (
                    3,
                    f"disk {format_size(d.used)} of {format_size(d.capacity)}: "
                    f"{d.objects} objects ({d.only_on_disk} on disk only), promoted "
                    f"{d.promoted}"
                    + ("" if d.o_direct else ", buffered I/O")
                    + (f", {d.dropped_damaged} damaged" if d.dropped_damaged else ""),
                    "bold red" if d.dropped_damaged or d.errors else "",
                )
            )
        self._show(parts)

    def disconnected(self, label: str, reason: str, retry_in: float, attempt: int) -> None:
        # The path comes first and whole; then why, cut with "…" before it is left out; the
        # retrying note only where there is room after both.
        self.set_classes("-disconnected")
        self._show(
            [
                (0, f"✖ {label}", "bold"),
                (1, "disconnected", "bold"),
                (2, reason, "", True),
                (3, f"retrying every {retry_in:g}s (attempt {attempt})", ""),
            ]
        )
