"""The sessions tab: how close each pool is to its retained cap, and the largest sessions.

A session's blocks are kept past plain LRU while it lasts (kvbroker._server.retention); the
daemon caps what all sessions together retain per pool ([sessions] pool_share). Everything
here comes from the snapshot's ``retention`` (the largest sessions the caller may see), so
the view needs no call of its own.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from kvbroker._wire.paths import format_size
from kvbroker._wire.stats import Statistics

from ._cells import Bytes, Seconds, plain
from ._meter import Meter
from ._tables import KeyedTable

__all__ = ["SessionsTable", "SessionsView"]


class SessionsTable(KeyedTable):
    COLUMNS = (
        ("namespace", "NAMESPACE"),
        ("session", "SESSION"),
        ("bytes", "RETAINED"),
        ("blocks", "BLOCKS"),
        ("priority", "PRIO"),
        ("idle", "IDLE"),
        ("expires", "EXPIRES IN"),
        ("uid", "UID"),
    )
    ORDER_BY = "bytes"
    ORDER_DESCENDING = True  # the largest first

    def show(self, snap: Statistics) -> None:
        r = snap.retention
        self.sync(
            {
                f"{s.namespace}\x1f{s.name}": (
                    plain(s.namespace),
                    plain(s.name),
                    Bytes(s.bytes),
                    s.blocks,
                    s.priority,
                    Seconds(max(0.0, snap.taken_at - s.last_use)),
                    Seconds(s.expires_in),
                    s.uid,
                )
                for s in (r.largest if r is not None else ())
            }
        )


class SessionsView(Vertical):
    """One meter per pool (retained bytes, a tick at the cap), a summary, the table."""

    def compose(self) -> ComposeResult:
        yield Vertical(id="retained-meters")
        yield Static(id="sessions-summary")
        yield SessionsTable(id="sessions-table")

    def show(self, snap: Statistics) -> None:
        r = snap.retention
        box = self.query_one("#retained-meters", Vertical)
        meters = list(box.query_children(Meter))
        pools = snap.pools if r is not None else ()
        for i, pool in enumerate(pools):
            if i >= len(meters):
                meters.append(
                    Meter(f"pool {pool.index} kept", f"p{pool.index}", id=f"retained-{pool.index}")
                )
                box.mount(meters[-1])
            used = r.retained_bytes[i] if i < len(r.retained_bytes) else 0
            cap = r.retained_cap[i] if i < len(r.retained_cap) else 0
            share = cap / pool.capacity if pool.capacity else 0.0
            of_cap = f" ({used / cap:.0%})" if cap else ""
            meters[i].show(
                used / pool.capacity if pool.capacity else 0.0,
                f"{format_size(used)} of {format_size(cap)}{of_cap}",
                (share, share),
            )
        for gone in meters[len(pools) :]:
            gone.remove()
        self.query_one("#sessions-summary", Static).update(_summary(snap))
        self.query_one(SessionsTable).show(snap)


def _summary(snap: Statistics) -> Text:
    r = snap.retention
    if r is None:
        return Text("this daemon keeps no sessions")
    quota = format_size(r.tenant_quota) if r.tenant_quota is not None else "off"
    parts = [f"{r.sessions} sessions, {r.retained_objects} retained blocks, tenant quota {quota}"]
    for what, counts in (("evicted", r.evicted), ("lost retention", r.dropped)):
        if counts:
            parts.append(f"{what}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())))
    return Text(" · ".join(parts))
