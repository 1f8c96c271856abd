"""A one-line bar with a label, a value and optional tick marks (the watermarks).

ProgressBar shows progress toward a goal; a pool's use is a level with limits on it, so the
bar draws the eviction watermarks over the fill where the daemon would start and stop.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

__all__ = ["Meter"]

_LABEL_WIDTH = 14
_VALUE_WIDTH = 26


class Meter(Widget):
    """``label  ████████░░░░┃░░  value``; ``fraction`` in [0, 1]."""

    COMPONENT_CLASSES = {"meter--fill", "meter--empty", "meter--high", "meter--low"}

    fraction: reactive[float] = reactive(0.0)
    value_text: reactive[str] = reactive("")
    marks: reactive[tuple[float, float] | None] = reactive(None)  # (low, high)

    def __init__(self, label: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label

    def show(self, fraction: float, value_text: str, marks=None) -> None:
        self.fraction = min(1.0, max(0.0, fraction))
        self.value_text = value_text
        self.marks = marks

    def render(self) -> Text:
        width = max(4, self.size.width - _LABEL_WIDTH - _VALUE_WIDTH - 2)
        fill = self.get_component_rich_style("meter--fill")
        empty = self.get_component_rich_style("meter--empty")
        filled = round(self.fraction * width)
        cells = [("█", fill)] * filled + [("░", empty)] * (width - filled)
        if self.marks is not None:
            low, high = self.marks
            for at, name in ((low, "meter--low"), (high, "meter--high")):
                i = min(width - 1, max(0, round(at * width) - 1))
                cells[i] = ("┃", self.get_component_rich_style(name))
        text = Text(f"{self.label:<{_LABEL_WIDTH}}", no_wrap=True)
        for ch, style in cells:
            text.append(ch, style)
        text.append(f"  {self.value_text:>{_VALUE_WIDTH}}")
        return text
