"""Throughput: a sparkline per rate, with the latest value beside it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from ._rates import RateHistory, Rates

__all__ = ["ThroughputPanel"]

# (Rates field, label, how to print the latest value)
SERIES = (
    ("publish_gbps", "publish GB/s", "{:8.3f}"),
    ("claim_gbps", "claim GB/s", "{:8.3f}"),
    ("publish_ops", "publish ops/s", "{:8.1f}"),
    ("claim_ops", "claim ops/s", "{:8.1f}"),
    ("hit_rate", "hit rate", "{:8.1%}"),
    ("evictions", "evictions/s", "{:8.1f}"),
)


class ThroughputPanel(Vertical):
    def compose(self) -> ComposeResult:
        for field, label, _ in SERIES:
            with Horizontal(classes="rate-row", id=f"rate-{field}"):
                yield Label(label, classes="rate-label")
                yield Sparkline([], classes="rate-spark")
                yield Label("       -", classes="rate-value")

    def on_mount(self) -> None:
        self.border_title = "throughput"

    def show(self, history: RateHistory) -> None:
        latest: Rates | None = history.latest
        for field, _, fmt in SERIES:
            row = self.query_one(f"#rate-{field}", Horizontal)
            row.query_one(Sparkline).data = history.series(field)
            value = None if latest is None else getattr(latest, field)
            row.query_one(".rate-value", Label).update(
                "       -" if value is None else fmt.format(value)
            )
