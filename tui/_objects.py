"""The objects view: the daemon's ``list`` under a regex filter, sortable, with evict."""

from __future__ import annotations

import re

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widgets import Input, Label

from kvbroker._wire.paths import format_size
from kvbroker._wire.stats import ObjectInfo
from kvbroker.errors import KVBrokerError

from ._cells import Bytes, Seconds, plain
from ._modals import ConfirmScreen
from ._source import MonitorSource
from ._tables import KeyedTable

__all__ = ["ObjectsView", "ObjectsTable", "FilterInput"]

LIST_LIMIT = 1000
SORTS = ("key", "size", "age", "readers")


# Longer names end in "…" so that the size, readers and age columns stay on screen (80
# columns included); `kvbroker show KEY` and `kvbroker ls --wide` give them whole.
_OTHER_COLUMNS = 44  # SIZE, BUFS, READERS, POOL, AGE with their padding, and the scrollbar


def name_widths(screen_width: int) -> tuple[int, int]:
    """(namespace, key) widths that leave the other columns on a screen this wide."""
    ns = 12 if screen_width < 100 else 20
    return ns, max(16, screen_width - _OTHER_COLUMNS - ns - 4)


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _sort_value(value: object) -> object:
    return value.plain if isinstance(value, Text) else value


class ObjectsTable(KeyedTable):
    COLUMNS = (
        ("namespace", "NAMESPACE"),
        ("key", "KEY"),
        ("size", "SIZE"),
        ("buffers", "BUFS"),
        ("readers", "READERS"),
        ("pool", "POOL"),
        ("age", "AGE"),
    )
    BINDINGS = [
        Binding("s", "cycle_sort", "sort"),
        Binding("r", "reverse_sort", "reverse"),
        Binding("d,delete", "evict", "evict"),
        Binding("slash", "edit_filter", "filter"),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sort_by = "key"
        self.descending = False
        self.infos: dict[str, ObjectInfo] = {}

    def show(self, objects: list[ObjectInfo], now: float) -> None:
        self.infos = {f"{o.namespace}\x00{o.key}": o for o in objects}
        ns_w, key_w = name_widths(self.app.size.width)
        self.sync(
            {
                k: (
                    plain(_cut(o.namespace, ns_w)),
                    plain(_cut(o.key, key_w)),
                    Bytes(o.nbytes),
                    o.buffers,
                    o.readers,
                    o.pool,
                    Seconds(max(0.0, now - o.created_at)),
                )
                for k, o in self.infos.items()
            }
        )
        self.apply_sort()

    def apply_sort(self) -> None:
        # Keep the cursor on the same object, not the same row number, across a re-sort.
        selected = self.selected
        self.sort(self.sort_by, key=_sort_value, reverse=self.descending)
        self.columns_titled()
        if selected is not None:
            key = f"{selected.namespace}\x00{selected.key}"
            if key in self.infos:
                self.move_cursor(row=self.get_row_index(key), animate=False)

    def columns_titled(self) -> None:
        arrow = " ▼" if self.descending else " ▲"
        for key, label in self.COLUMNS:
            self.columns[key].label = Text(label + (arrow if key == self.sort_by else ""))

    @property
    def selected(self) -> ObjectInfo | None:
        if not self.row_count:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return self.infos.get(row_key.value)

    def action_cycle_sort(self) -> None:
        self.sort_by = SORTS[(SORTS.index(self.sort_by) + 1) % len(SORTS)]
        self.apply_sort()

    def action_reverse_sort(self) -> None:
        self.descending = not self.descending
        self.apply_sort()

    def action_evict(self) -> None:
        view = self.parent
        if isinstance(view, ObjectsView):
            view.ask_evict()

    def action_edit_filter(self) -> None:
        self.screen.query_one("#filter", Input).focus()

    def on_data_table_header_selected(self, event: KeyedTable.HeaderSelected) -> None:
        key = event.column_key.value
        if key in SORTS:
            self.descending = (not self.descending) if key == self.sort_by else False
            self.sort_by = key
            self.apply_sort()


class FilterInput(Input):
    """The objects filter, whose keys take effect in the order they were typed.

    Textual inserts a printable key as the Input takes it from its queue, but runs the binding
    of any other key (backspace, delete, the arrows, enter) only once the key has bubbled from
    the Input up through every container to the App, one message queue after the other. Keys
    that came in one read behind a run of backspaces (fast typing) were inserted before the
    backspaces ran, which then deleted them: "layer-1", three backspaces and "xyz" left
    "layer-1". Here the Input's own bindings run where its printable keys do, in order.
    """

    BINDINGS = [Binding("escape", "leave", "table", show=False)]

    async def _on_key(self, event: events.Key) -> None:
        if event.is_printable:
            return  # Input._on_key inserts it (Textual calls each class's handler in turn)
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            if not binding.priority and await self.app.run_action(binding.action, self):
                event.stop()  # handled: the App must not run the binding again
                event.prevent_default()
                return

    def action_leave(self) -> None:
        self.screen.query_one(ObjectsTable).focus()


class ObjectsView(Vertical):
    """Lists run one at a time: a refresh asked for while one is in flight runs after it."""

    def __init__(self, source: MonitorSource, **kwargs) -> None:
        super().__init__(**kwargs)
        self.source = source
        self.now = 0.0  # time of the latest snapshot: ages are measured against it
        self.pattern: str | None = None
        self._listing = False
        self._again = False

    def compose(self) -> ComposeResult:
        yield FilterInput(placeholder="filter keys: a regex, e.g. ^layer-[0-9]+$", id="filter")
        yield Label("", id="objects-status")
        yield ObjectsTable(id="objects-table")

    @property
    def table(self) -> ObjectsTable:
        return self.query_one(ObjectsTable)

    def on_input_changed(self, event: Input.Changed) -> None:
        text = event.value
        try:
            re.compile(text)
        except re.error as exc:
            event.input.add_class("-invalid")
            self._status(f"not a valid regex: {exc}")
            return
        event.input.remove_class("-invalid")
        self.pattern = text or None
        self.refresh_objects()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.table.focus()

    def refresh_objects(self) -> None:
        if self._listing:
            self._again = True
            return
        self._listing = True
        self.run_worker(self._list(), group="objects")

    async def _list(self) -> None:
        try:
            objects = await self.source.list_objects(self.pattern, LIST_LIMIT)
        except KVBrokerError as exc:
            self._status(f"cannot list objects: {exc}")
        else:
            try:
                self.table.show(objects, self.now)
            except NoMatches:
                return  # the app shut down while the list was on its way
            more = f" (first {LIST_LIMIT})" if len(objects) >= LIST_LIMIT else ""
            shown = sum(o.nbytes for o in objects)
            self._status(
                f"{len(objects)} objects{more}, {format_size(shown)}"
                f"{'  matching ' + repr(self.pattern) if self.pattern else ''}"
            )
        finally:
            self._listing = False
            if self._again:
                self._again = False
                self.refresh_objects()

    def ask_evict(self) -> None:
        info = self.table.selected
        if info is None:
            self.app.bell()
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._evict(info), group="evict")

        question = (
            f"Evict {info.namespace}/{info.key} ({format_size(info.nbytes)}, "
            f"{info.buffers} buffers)?\nIts memory goes back to the pool at once."
        )
        self.app.push_screen(ConfirmScreen(question), answered)

    async def _evict(self, info: ObjectInfo) -> None:
        name = f"{info.namespace}/{info.key}"
        try:
            done = await self.source.evict(info.namespace, info.key)
        except KVBrokerError as exc:
            self.notify(f"evict {name} failed: {exc}", severity="error")
            return
        if done.count:
            self.notify(f"evicted {name} ({format_size(done.nbytes)})")
        elif done.skipped_leased:
            self.notify(f"kept {name}: it is leased", severity="warning")
        else:
            self.notify(f"{name} was already gone", severity="warning")
        self.refresh_objects()

    def _status(self, text: str) -> None:
        try:
            self.query_one("#objects-status", Label).update(Text(text))
        except NoMatches:
            pass  # the view is being torn down
