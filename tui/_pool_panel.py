"""A panel per host pool or GPU ring: the bars, a line of figures, the occupancy map."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from kvbroker._wire.paths import format_size

from ._meter import Meter
from ._occupancy import OccupancyMap
from ._pool_view import PoolView

__all__ = ["PoolPanel"]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


class PoolPanel(Vertical):
    """Built once per pool; :meth:`show` updates its widgets in place."""

    def __init__(self, view: PoolView) -> None:
        super().__init__(id=view.key, classes="pool-panel")
        self._latest = view
        self._ready = False  # mounting is asynchronous: snapshots may come before children
        self.border_title = view.title

    def compose(self) -> ComposeResult:
        yield Static(classes="pool-figures")
        yield Meter("used", classes="meter-used")
        yield Meter("leased", classes="meter-leased")
        yield Meter("free", classes="meter-free")
        yield Meter("fragmentation", "frag", classes="meter-frag")
        yield OccupancyMap()

    def on_mount(self) -> None:
        self._ready = True
        self.show(self._latest)

    def show(self, v: PoolView) -> None:
        self._latest = v
        if not self._ready:
            return
        cap = v.capacity
        self.border_title = v.title
        self.border_subtitle = f"{format_size(cap)}  ·  {v.objects} objects"
        self.query_one(".pool-figures", Static).update(
            f"evicts above {v.high_watermark:.0%} down to {v.low_watermark:.0%} · "
            f"largest free {format_size(v.largest_free)}"
            + (f" · quarantined {format_size(v.quarantined)}" if v.quarantined else "")
        )
        used = _share(v.used, cap)
        self.set_class(used >= v.high_watermark, "-over-high")
        self.query_one(".meter-used", Meter).show(
            used, f"{format_size(v.used)}  {used:6.1%}", marks=(v.low_watermark, v.high_watermark)
        )
        self.query_one(".meter-leased", Meter).show(
            _share(v.leased, cap),
            f"r {format_size(v.leased_read)}  w {format_size(v.leased_write)}",
        )
        self.query_one(".meter-free", Meter).show(
            _share(v.free, cap), f"{format_size(v.free)}  {_share(v.free, cap):6.1%}"
        )
        self.query_one(".meter-frag", Meter).show(v.fragmentation, f"{v.fragmentation:6.1%}")
        self.query_one(OccupancyMap).occupancy = v.occupancy
