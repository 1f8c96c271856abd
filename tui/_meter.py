"""A one-line bar with a label, a value and optional tick marks (the watermarks).

ProgressBar shows progress toward a goal; a pool's use is a level with limits on it, so the
bar draws the eviction watermarks over the fill where the daemon would start and stop.
The value is never cut: on a narrow panel the label shortens and the bar gives way.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

__all__ = ["Meter"]

_LABEL_WIDTH, _SHORT_LABEL_WIDTH = 14, 7
_VALUE_WIDTH = 24
_NARROW = 64  # below this many columns: short labels


class Meter(Widget):
    """``label  ████████░░░░┃░░  value``; ``fraction`` in [0, 1]."""

    COMPONENT_CLASSES = {"meter--fill", "meter--empty", "meter--high", "meter--low"}

    fraction: reactive[float] = reactive(0.0)
    value_text: reactive[str] = reactive("")
    marks: reactive[tuple[float, float] | None] = reactive(None)  # (low, high)

    def __init__(self, label: str, short_label: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.label = label
        self.short_label = short_label or label[: _SHORT_LABEL_WIDTH - 1]

    def show(self, fraction: float, value_text: str, marks=None) -> None:
        self.fraction = min(1.0, max(0.0, fraction))
        self.value_text = value_text
        self.marks = marks

    def render(self) -> Text:
        total = self.size.width
        narrow = total < _NARROW
        label = self.short_label if narrow else self.label
        label_w = _SHORT_LABEL_WIDTH if narrow else _LABEL_WIDTH
        value = self.value_text
        value_w = max(len(value), min(_VALUE_WIDTH, max(0, total - label_w - 6)))
        width = total - label_w - value_w - 2
        text = Text(no_wrap=True)
        if width < 3:  # no room for a bar: the value alone, then the label if it fits
            room = total - len(value)
            if room > len(label):
                text.append(f"{label:<{room}}")
            text.append(value.rjust(min(total, max(len(value), total - len(text)))))
            return text
        fill = self.get_component_rich_style("meter--fill")
        empty = self.get_component_rich_style("meter--empty")
        filled = round(self.fraction * width)
        cells = [("█", fill)] * filled + [("░", empty)] * (width - filled)
        if self.marks is not None:
            low, high = self.marks
            for at, name in ((low, "meter--low"), (high, "meter--high")):
                i = min(width - 1, max(0, round(at * width) - 1))
                cells[i] = ("┃", self.get_component_rich_style(name))
        text.append(f"{label:<{label_w}}")
        for ch, style in cells:
            text.append(ch, style)
        text.append(f"  {value:>{value_w}}")
        return text
