"""The status line: what the monitor is connected to, or that it is not and is retrying."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from kvbroker._wire.paths import format_size
from kvbroker._wire.stats import Statistics

from ._cells import Seconds

__all__ = ["StatusLine"]


class StatusLine(Static):
    def connecting(self, label: str) -> None:
        self.set_classes("-connecting")
        self.update(Text(f"◌ connecting to {label} …"))

    def connected(self, snap: Statistics, label: str, interval: float, paused: bool) -> None:
        self.set_classes("-connected")
        text = Text()
        text.append("● ", "bold")
        text.append(
            f"{label}  daemon {snap.pid} v{snap.version}  up {Seconds(snap.uptime)}  "
            f"objects {snap.objects}  pending {snap.pending}  "
            f"leases {snap.read_leases}r/{snap.write_leases}w  clients {len(snap.clients)}  "
            f"used {format_size(snap.used)} of {format_size(snap.capacity)}  "
            f"every {interval:g}s"
        )
        t = getattr(snap, "transfer", None)
        if t is not None:  # [transfer]: peers, pulls in flight, bytes pulled and served
            text.append(
                f"\n  fleet {t.node}: peers {sum(p.connected for p in t.peers)}/{len(t.peers)}"
                f" pulled {format_size(t.bytes_pulled)} ({t.pulls}, {t.in_flight} in flight,"
                f" {t.failures} failed)  served {format_size(t.bytes_served)} to "
                f"{t.serving} peer(s)"
            )
        if paused:
            text.append("   ❚❚ PAUSED (p resumes)", "bold reverse")
        self.update(text)

    def disconnected(self, label: str, reason: str, retry_in: float, attempt: int) -> None:
        self.set_classes("-disconnected")
        self.update(Text(
            f"✖ disconnected — retrying every {retry_in:g}s (attempt {attempt}): {reason}   "
            f"[{label}]"
        ))  # fmt: skip
