"""DataTables that follow a snapshot in place: rows are added, changed cell by cell, or
removed by key, so a refresh never clears the table (no flicker, the cursor stays put)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from textual.widgets import DataTable

from kvbroker._wire.stats import Statistics

from ._cells import Bytes, Seconds, plain

__all__ = ["KeyedTable", "ClientsTable", "LeasesTable", "TransfersTable"]


class KeyedTable(DataTable):
    """A table whose rows are identified by stable keys; :meth:`sync` diffs against them."""

    #: (column key, header) pairs.
    COLUMNS: Sequence[tuple[str, str]] = ()
    #: Column to keep the rows ordered by after each sync, and whether descending.
    ORDER_BY: str | None = None
    ORDER_DESCENDING = False

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._rows: dict[str, tuple] = {}

    def on_mount(self) -> None:
        for key, label in self.COLUMNS:
            self.add_column(label, key=key)

    def sync(self, rows: Mapping[Hashable, Sequence[object]]) -> None:
        """Make the table show exactly ``rows`` (row key -> cells in column order)."""
        wanted = {str(k): tuple(cells) for k, cells in rows.items()}
        for key in [k for k in self._rows if k not in wanted]:
            self.remove_row(key)
            del self._rows[key]
        columns = [key for key, _ in self.COLUMNS]
        added = False
        for key, cells in wanted.items():
            old = self._rows.get(key)
            if old is None:
                self.add_row(*cells, key=key)
                added = True
            elif old != cells:
                for column, before, after in zip(columns, old, cells, strict=True):
                    if before != after:
                        self.update_cell(key, column, after, update_width=True)
            self._rows[key] = cells
        if self.ORDER_BY is not None and added:  # updates never change the order
            self.sort(self.ORDER_BY, reverse=self.ORDER_DESCENDING)

    @property
    def keys_shown(self) -> list[str]:
        """Row keys in display order (tests and the objects view read this)."""
        return [row.key.value for row in self.ordered_rows]


class ClientsTable(KeyedTable):
    # Most telling first: at 80 columns the names give way (ending in "…") until every column
    # up to CLAIMED fits; what the table scrolls to is the role and the uid (`kvbroker stat`
    # prints both). A CLAIMED cut to "48" had read as 48 bytes.
    COLUMNS = (
        ("session", "SESSION"),
        ("pid", "PID"),
        ("name", "NAME"),
        ("age", "CONNECTED"),
        ("leases", "LEASES"),
        ("published", "PUBLISHED"),
        ("claimed", "CLAIMED"),
        ("role", "ROLE"),
        ("uid", "UID"),
    )
    ORDER_BY = "session"
    WIDE = 100  # columns: from here on client names are never cut
    MIN_NAME = 12

    def show(self, snap: Statistics) -> None:
        rows = {
            c.session: (
                c.session,
                c.pid,
                c.name,
                Seconds(snap.taken_at - c.connected_at),
                c.read_leases + c.write_leases,
                Bytes(c.bytes_published),
                Bytes(c.bytes_claimed),
                c.role or "-",
                c.uid,
            )
            for c in snap.clients
        }
        width = self.name_width(list(rows.values()))
        name = [key for key, _ in self.COLUMNS].index("name")
        self.sync(
            {
                k: tuple(
                    plain(_cut(v, width)) if i == name else plain(v) if isinstance(v, str) else v
                    for i, v in enumerate(cells)
                )
                for k, cells in rows.items()
            }
        )

    def name_width(self, rows: list[tuple]) -> int | None:
        """How long a name may be so that every column up to CLAIMED stays on screen (None:
        as long as it is). Under WIDE columns a longer name ends in "…"; the PID beside it
        tells two cut names apart."""
        if self.app.size.width >= self.WIDE:
            return None
        room = self.scrollable_content_region.width or self.app.size.width - 2
        keys = [key for key, _ in self.COLUMNS]
        for i, (key, label) in enumerate(self.COLUMNS[: keys.index("claimed") + 1]):
            if key != "name":
                room -= max([len(label)] + [len(str(r[i])) for r in rows]) + 2
        return max(self.MIN_NAME, room - 2)


def _cut(text: str, width: int | None) -> str:
    return text if width is None or len(text) <= width else text[: width - 1] + "…"


class LeasesTable(KeyedTable):
    COLUMNS = (
        ("lease", "LEASE"),
        ("kind", "KIND"),
        ("session", "SESSION"),
        ("namespace", "NAMESPACE"),
        ("key", "KEY"),
        ("size", "SIZE"),
        ("expires", "EXPIRES IN"),
    )
    ORDER_BY = "lease"

    def show(self, snap: Statistics) -> None:
        self.sync(
            {
                ls.lease: (
                    ls.lease,
                    plain(ls.kind),
                    ls.session,
                    plain(ls.namespace),
                    plain(ls.key),
                    Bytes(ls.nbytes),
                    Seconds(ls.expires_in),
                )
                for ls in snap.leases
            }
        )


class TransfersTable(KeyedTable):
    COLUMNS = (
        ("age", "AGO"),
        ("op", "OP"),
        ("session", "SESSION"),
        ("namespace", "NAMESPACE"),
        ("key", "KEY"),
        ("size", "SIZE"),
    )
    ORDER_BY = "age"  # newest first

    def show(self, snap: Statistics) -> None:
        # Transfers carry no id; when and what together name one.
        self.sync(
            {
                f"{t.at!r}/{t.op}/{t.session}/{t.namespace}/{t.key}": (
                    Seconds(max(0.0, snap.taken_at - t.at)),
                    plain(t.op),
                    t.session,
                    plain(t.namespace),
                    plain(t.key),
                    Bytes(t.nbytes),
                )
                for t in snap.transfers
            }
        )
