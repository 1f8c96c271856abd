"""Table cells that show one way and sort another: sizes and ages keep their numbers.

DataTable sorts on cell values and prints ``str()`` of anything it cannot render, so a
size cell reads "1.5 MiB" yet sorts by bytes. Plain strings would be parsed as markup, so
text from the daemon (keys, client names) goes in as :class:`rich.text.Text`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text

from kvbroker._wire.paths import format_size

__all__ = ["Bytes", "Seconds", "plain"]


@dataclass(frozen=True, order=True)
class Bytes:
    value: int

    def __str__(self) -> str:
        return format_size(self.value)


@dataclass(frozen=True, order=True)
class Seconds:
    value: float

    def __str__(self) -> str:
        v = self.value
        for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
            if abs(v) >= secs:
                return f"{v / secs:.1f}{unit}"
        return f"{v:.1f}s"


def plain(text: object) -> Text:
    """Text shown as is, never as markup (keys may contain brackets)."""
    return Text(str(text))
