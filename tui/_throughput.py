"""Throughput: a sparkline per rate, with the latest value beside it.

Rates are drawn against their own recent range (Textual's Sparkline). The hit rate is a
fraction, drawn on a fixed 0..100 % scale instead: a steady 100 % is a full bar, a steady 0 %
an empty baseline, and an interval with no lookups a gap.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Label, Sparkline

from ._rates import RateHistory, Rates

__all__ = ["ThroughputPanel", "FractionSparkline"]

# (Rates field, label, how to print the latest value)
SERIES = (
    ("publish_gbps", "publish GB/s", "{:8.3f}"),
    ("claim_gbps", "claim GB/s", "{:8.3f}"),
    ("publish_ops", "publish ops/s", "{:8.1f}"),
    ("claim_ops", "claim ops/s", "{:8.1f}"),
    ("hit_rate", "hit rate", "{:8.1%}"),
    ("evictions", "evictions/s", "{:8.1f}"),
)
FIXED_SCALE = {"hit_rate"}
# Which rates go first when the panel has fewer rows than rates (a terminal under 24 rows).
DROP_FIRST = ("publish_ops", "claim_ops", "evictions", "hit_rate", "claim_gbps", "publish_gbps")
_BLOCKS = " ▁▂▃▄▅▆▇█"


class FractionSparkline(Widget):
    """Bars for values in [0, 1] on a fixed scale, as many rows high as the widget; None
    (nothing measured) leaves a gap, 0 draws a thin baseline."""

    COMPONENT_CLASSES = {"sparkline--max-color"}
    DEFAULT_CSS = "FractionSparkline { height: 1; }"

    data: reactive[list[float | None]] = reactive(list, always_update=True)

    def render(self) -> Text:
        width, height = max(1, self.size.width), max(1, self.size.height)
        values = self.data[-width:]
        style = self.get_component_rich_style("sparkline--max-color")
        rows = []
        for row in range(height - 1, -1, -1):  # top row first
            line = Text(no_wrap=True)
            for v in values:
                if v is None:
                    line.append(" ")
                    continue
                level = max(1, round(min(1.0, max(0.0, v)) * 8 * height))  # 0 % still shows
                line.append(_BLOCKS[min(8, max(0, level - row * 8))], style)
            rows.append(line)
        return Text("\n").join(rows)


class ThroughputPanel(Vertical):
    def compose(self) -> ComposeResult:
        for field, label, _ in SERIES:
            with Horizontal(classes="rate-row", id=f"rate-{field}"):
                yield Label(label, classes="rate-label")
                if field in FIXED_SCALE:
                    yield FractionSparkline(classes="rate-spark")
                else:
                    yield Sparkline([], classes="rate-spark")
                yield Label("       -", classes="rate-value")

    def on_mount(self) -> None:
        self.border_title = "throughput"

    def on_resize(self) -> None:
        self.share_rows(self.content_size.height)

    def share_rows(self, space: int) -> None:
        """Give each rate an even share of ``space`` rows (the first ones one more), or with
        fewer rows than rates, one row to each of the most telling. (Textual's ``1fr`` with
        ``min-height: 1`` gave all of 4 rows to the first rate and drew the rest below the
        panel's edge.)"""
        n = len(SERIES)
        dropped = set(DROP_FIRST[: max(0, n - space)])
        shown = [field for field, _, _ in SERIES if field not in dropped]
        base, extra = divmod(space, len(shown)) if shown else (0, 0)
        for field, _, _ in SERIES:
            row = self.query_one(f"#rate-{field}", Horizontal)
            if field in dropped:
                row.display = False
                continue
            row.display = True
            row.styles.height = base + (1 if shown.index(field) < extra else 0)

    def show(self, history: RateHistory) -> None:
        latest: Rates | None = history.latest
        for field, _, fmt in SERIES:
            row = self.query_one(f"#rate-{field}", Horizontal)
            if field in FIXED_SCALE:
                row.query_one(FractionSparkline).data = history.raw_series(field)
            else:
                row.query_one(Sparkline).data = history.series(field)
            value = None if latest is None else getattr(latest, field)
            row.query_one(".rate-value", Label).update(
                "       -" if value is None else fmt.format(value)
            )
