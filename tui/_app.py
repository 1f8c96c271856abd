"""The monitor App: one stream of snapshots in, every widget updated in place from it."""

from __future__ import annotations

import asyncio

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.reactive import reactive
from textual import events
from textual.widgets import Footer, TabbedContent, TabPane, Tabs

from kvbroker._wire.stats import Statistics
from kvbroker.errors import KVBrokerError

from ._modals import HelpScreen
from ._objects import ObjectsView
from ._pool_panel import PoolPanel
from ._pool_view import PoolView
from ._rates import RateHistory
from ._sessions import SessionsView
from ._source import MonitorSource
from ._status import StatusLine
from ._tables import ClientsTable, LeasesTable, TransfersTable
from ._throughput import ThroughputPanel

__all__ = ["MonitorApp"]

# Which widget takes the keys when a tab is shown.
_TAB_FOCUS = {
    "tab-pools": "#pools",
    "tab-clients": "#clients",
    "tab-objects": "#objects-table",
    "tab-sessions": "#sessions-table",
}


class MonitorApp(App):
    CSS_PATH = "monitor.tcss"
    TITLE = "kvbroker"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "toggle_pause", "pause"),
        Binding("question_mark", "help", "help"),
        # The tab labels carry their keys ("1 pools"...): the footer leaves them out, so the
        # objects bindings fit at 80 columns.
        Binding("1", "show_tab('tab-pools')", "pools", show=False),
        Binding("2", "show_tab('tab-clients')", "clients", show=False),
        Binding("3", "show_tab('tab-objects')", "objects", show=False),
        Binding("4", "show_tab('tab-sessions')", "sessions", show=False),
    ]
    ENABLE_COMMAND_PALETTE = False
    NARROW = 100  # columns: below this the pools tab stacks pools above throughput

    paused: reactive[bool] = reactive(False)

    def __init__(
        self, source: MonitorSource, interval: float = 1.0, retry_delay: float = 1.0
    ) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.retry_delay = retry_delay
        self.history = RateHistory()
        self.latest: Statistics | None = None
        self.connected = False
        self.snapshots_seen = 0

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        with TabbedContent(initial="tab-pools"):
            with TabPane("1 pools", id="tab-pools"):
                with Horizontal(id="pools-row"):
                    yield VerticalScroll(id="pools")
                    yield ThroughputPanel(id="throughput")
            with TabPane("2 clients & leases", id="tab-clients"):
                yield ClientsTable(id="clients")
                yield LeasesTable(id="leases")
                yield TransfersTable(id="transfers")
            with TabPane("3 objects", id="tab-objects"):
                yield ObjectsView(self.source, id="objects")
            with TabPane("4 sessions", id="tab-sessions"):
                yield SessionsView(id="sessions")
        yield Footer()

    def on_mount(self) -> None:
        for table_id, title in (
            ("clients", "clients"),
            ("leases", "active leases"),
            ("transfers", "recent transfers"),
        ):
            self.query_one(f"#{table_id}").border_title = title
        self.query_one(StatusLine).connecting(self.source.label)
        # Tab moves between the widgets of a tab (the filter and the objects table), never to
        # the tab bar, where the tab's bindings would vanish; 1/2/3 and the mouse switch tabs.
        self.query_one(Tabs).can_focus = False
        self.screen.set_class(self.size.width < self.NARROW, "-narrow")
        # exclusive: there is only ever one stream, so snapshots never overlap or interleave.
        self.run_worker(self._stream(), exclusive=True, group="stream", name="stream")

    async def _stream(self) -> None:
        # On exit Textual removes the widgets before it cancels this worker: what arrives in
        # between (a snapshot, a lost connection) is not drawn, or the app fails (NoMatches).
        attempt = 0
        while True:
            try:
                await self.source.connect(self.interval)
                attempt = 0
                while True:
                    snap = await self.source.next_snapshot()
                    if not self.is_running:
                        return
                    self._take(snap)
            except (KVBrokerError, OSError) as exc:
                if not self.is_running:
                    return
                attempt += 1
                self._lost(str(exc) or type(exc).__name__, attempt)
            await self.source.close()
            await asyncio.sleep(self.retry_delay)

    def on_resize(self, event: events.Resize) -> None:
        self.screen.set_class(event.size.width < self.NARROW, "-narrow")

    # -- state changes ---------------------------------------------------------------------
    def _take(self, snap: Statistics) -> None:
        # Rates are fed while paused too, so resuming shows no gap and no false spike.
        self.history.add(snap)
        self.latest = snap
        self.snapshots_seen += 1
        if not self.connected:
            self.connected = True
            self.screen.remove_class("-disconnected")
        if not self.paused:
            self._show(snap)

    def _lost(self, reason: str, attempt: int) -> None:
        self.connected = False
        self.screen.add_class("-disconnected")
        self.query_one(StatusLine).disconnected(
            self.source.label, reason, self.retry_delay, attempt
        )

    def watch_paused(self, paused: bool) -> None:
        if self.latest is not None and self.connected:
            self._show(self.latest)

    # -- drawing ---------------------------------------------------------------------------
    def _show(self, snap: Statistics) -> None:
        self.query_one(StatusLine).connected(snap, self.source.label, self.interval, self.paused)
        self._show_pools(snap)
        self.query_one(ThroughputPanel).show(self.history)
        self.query_one(ClientsTable).show(snap)
        self.query_one(LeasesTable).show(snap)
        self.query_one(TransfersTable).show(snap)
        self.query_one(SessionsView).show(snap)
        objects = self.query_one(ObjectsView)
        objects.now = snap.taken_at
        if self.query_one(TabbedContent).active == "tab-objects":
            objects.refresh_objects()

    def _show_pools(self, snap: Statistics) -> None:
        views = [PoolView.from_pool(p) for p in snap.pools]
        views += [PoolView.from_ring(i, r) for i, r in enumerate(snap.rings)]
        container = self.query_one("#pools", VerticalScroll)
        panels = {panel.id: panel for panel in container.query_children(PoolPanel)}
        for view in views:
            panel = panels.pop(view.key, None)
            if panel is None:
                container.mount(PoolPanel(view))
            else:
                panel.show(view)
        for gone in panels.values():  # a restarted daemon may have fewer pools
            gone.remove()

    # -- actions ---------------------------------------------------------------------------
    def action_toggle_pause(self) -> None:
        self.paused = not self.paused

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_show_tab(self, tab: str) -> None:
        # A widget left focused in the old pane would pull TabbedContent back to it.
        self.screen.set_focus(None)
        self.query_one(TabbedContent).active = tab
        self.query_one(_TAB_FOCUS[tab]).focus()
        if tab == "tab-objects":
            self.query_one(ObjectsView).refresh_objects()
