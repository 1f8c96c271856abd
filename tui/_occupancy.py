"""The occupancy map: the daemon's one-character-per-cell string, drawn in colour.

Each cell stands for an equal slice of the pool and shows its busiest state: free, sealed,
leased for read, leased for write, quarantined. Cells are widened to fill the line, so a
64-cell map spans the panel rather than a corner of it.
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

__all__ = ["OccupancyMap", "STATES"]

# Map character -> (component class, legend name).
STATES = {
    ".": ("occupancy--free", "free"),
    "s": ("occupancy--sealed", "sealed"),
    "r": ("occupancy--read", "read-leased"),
    "w": ("occupancy--write", "write-leased"),
    "q": ("occupancy--quarantined", "quarantined"),
}


def legend_lines(width: int) -> list[list[tuple[str, str]]]:
    """The legend's (component class, name) items, line by line: an item is never split."""
    lines: list[list[tuple[str, str]]] = [[]]
    used = 0
    for cls, name in STATES.values():
        need = len(f"▇ {name}") + (2 if lines[-1] else 0)
        if lines[-1] and used + need > width:
            lines.append([])
            used, need = 0, len(f"▇ {name}")
        lines[-1].append((cls, name))
        used += need
    return lines


class OccupancyMap(Widget):
    """The map, wrapped to the widget's width, and a legend line under it."""

    COMPONENT_CLASSES = {cls for cls, _ in STATES.values()}

    occupancy: reactive[str] = reactive("", layout=True)

    def render(self) -> Text:
        text = Text()
        cells = self.occupancy
        width = max(1, self.size.width)
        per_cell = max(1, width // len(cells)) if cells else 1
        for i, ch in enumerate(cells):
            cls = STATES.get(ch, STATES["."])[0]
            if i and (i * per_cell) % width == 0:
                text.append("\n")
            text.append("▇" * per_cell, self.get_component_rich_style(cls))
        if not cells:
            text.append("(no occupancy map)")
        for items in legend_lines(width):
            text.append("\n")
            for i, (cls, name) in enumerate(items):
                text.append(("  " if i else "") + "▇ ", self.get_component_rich_style(cls))
                text.append(name)
        return text

    def get_content_height(self, container, viewport, width: int) -> int:
        n = len(self.occupancy)
        per_cell = max(1, width // n) if n else 1
        map_lines = max(1, -(-n * per_cell // max(1, width)))
        return map_lines + len(legend_lines(max(1, width)))
