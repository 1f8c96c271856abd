"""The monitor at 80×24 and 120×40 (issue 19's TUI list), driven by a fake source."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import tempfile

import pytest

pytest.importorskip("textual")

from textual import events  # noqa: E402
from textual.widgets import Input  # noqa: E402
from textual.widgets._footer import FooterKey  # noqa: E402

from kvbroker.tui._app import MonitorApp  # noqa: E402
from kvbroker.tui._meter import Meter  # noqa: E402
from kvbroker.tui._objects import ObjectsTable  # noqa: E402
from kvbroker.tui._occupancy import STATES, OccupancyMap, legend_lines  # noqa: E402
from kvbroker.tui._source import DaemonSource  # noqa: E402
from kvbroker.tui._status import StatusLine  # noqa: E402
from kvbroker.tui._tables import ClientsTable  # noqa: E402
from kvbroker.tui._throughput import SERIES  # noqa: E402
from kvbroker.tui.testing import FakeSource, make_object, make_snapshot  # noqa: E402

SIZES = [(80, 24), (120, 40)]
IDS = ["80x24", "120x40"]
MIB = 1 << 20


def run_async(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return wrapper


async def until(pilot, condition, timeout: float = 60.0, message=lambda: "") -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError(f"condition not reached in time {message()}".rstrip())


async def fed(pilot, app, source, steps: int = 3) -> None:
    source.feed(*(make_snapshot(i) for i in range(steps)))
    await until(pilot, lambda: app.snapshots_seen == steps)
    await pilot.pause()


def plain(widget) -> str:
    return str(widget.render())


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_status_line_keeps_what_matters_and_shows_paused(size):
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        await fed(pilot, app, source)
        status = app.query_one(StatusLine)
        text = plain(status)
        assert len(text) <= size[0] - 2 and "…" not in text
        assert "fake.sock" in text and "used 112.0 MiB of 256.0 MiB" in text and "objects" in text
        await pilot.press("p")
        await pilot.pause()
        text = plain(status)
        assert text.startswith("❚❚ PAUSED") and len(text) <= size[0] - 2


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_meters_keep_their_values(size):
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        await fed(pilot, app, source)
        panel = app.query_one("#pool-0")
        for meter in panel.query(Meter):
            text = plain(meter)
            assert meter.value_text in text, (meter.label, text)
            assert len(text) <= meter.size.width
            assert "█" in text or "░" in text  # a bar is still drawn
        assert "%" in plain(panel.query_one(".meter-used", Meter))
        assert "12.5%" in plain(panel.query_one(".meter-frag", Meter))
        assert "w 8.0 MiB" in plain(panel.query_one(".meter-leased", Meter))


def test_legend_never_splits_an_item():
    names = [name for _, name in STATES.values()]
    for width in range(12, 120):
        lines = legend_lines(width)
        assert [n for line in lines for _, n in line] == names
        for line in lines:
            assert len("  ".join(f"▇ {n}" for _, n in line)) <= width or len(line) == 1


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_legend_rows_are_whole_items_on_screen(size):
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        await fed(pilot, app, source)
        legend = plain(app.query_one(OccupancyMap)).splitlines()[
            -len(legend_lines(app.query_one(OccupancyMap).size.width)) :
        ]
        for line in legend:
            for item in line.split("  "):
                assert item.startswith("▇ ") and item[2:] in {n for _, n in STATES.values()}


@run_async
async def test_no_blank_rows_on_the_pools_tab_at_80x24():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await fed(pilot, app, source)
        throughput = app.query_one("#throughput")
        footer_top = app.size.height - 1
        assert throughput.region.bottom == footer_top  # the rates take the rows left
        pool = app.query_one("#pool-0")
        assert pool.region.width >= 78  # full width: stacked above the rates
        assert throughput.region.y <= pool.region.bottom + 1


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@pytest.mark.parametrize("pools", [1, 2, 3])
@run_async
async def test_every_rate_is_on_screen_however_many_pools(size, pools):
    # At 80x24 with two pools the pools took 70% of the tab and the rates the 4 rows left, all
    # of them given to "publish GB/s": the other five rates were drawn below the panel's edge.
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        source.feed(*(make_snapshot(i, pools=pools) for i in range(3)))
        await until(pilot, lambda: app.snapshots_seen == 3)
        await pilot.pause()
        inside = app.query_one("#throughput").content_region
        rows = list(app.query(".rate-row"))
        assert len(rows) == len(SERIES)
        for row in rows:
            assert row.region.height >= 1 and inside.contains_region(row.region), (
                row.id,
                row.region,
                inside,
            )
        heights = [row.region.height for row in rows]
        assert max(heights) - min(heights) <= 1  # shared out evenly
        assert sum(heights) == inside.height  # and no row left blank
        # The first pool stays whole; the others scroll.
        assert app.query_one("#pools").region.contains_region(app.query_one("#pool-0").region)


@run_async
async def test_a_short_terminal_keeps_the_most_telling_rates_a_row_each():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=(80, 18)) as pilot:
        source.feed(*(make_snapshot(i, pools=2) for i in range(3)))
        await until(pilot, lambda: app.snapshots_seen == 3)
        await pilot.pause()
        inside = app.query_one("#throughput").content_region
        shown = [row for row in app.query(".rate-row") if row.display]
        assert len(shown) == inside.height < len(SERIES)
        assert {"rate-publish_gbps", "rate-claim_gbps", "rate-hit_rate"} <= {r.id for r in shown}
        for row in shown:
            assert row.region.height == 1 and inside.contains_region(row.region)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_footer_fits_on_the_objects_tab(size):
    source = FakeSource([make_object("layer-1", MIB)])
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        await fed(pilot, app, source, 1)
        await pilot.press("3")
        await pilot.pause()
        keys = list(app.query(FooterKey))
        descriptions = {k.description for k in keys}
        assert {"sort", "evict", "filter", "quit", "help"} <= descriptions
        assert all(k.region.right <= size[0] for k in keys)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_clients_connected_column_is_on_screen(size):
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        await fed(pilot, app, source)
        await pilot.press("2")
        await pilot.pause()
        table = app.query_one(ClientsTable)
        right = 0
        for column in table.ordered_columns:
            right += column.get_render_width(table)
            if column.key.value == "age":
                break
        assert right <= table.scrollable_content_region.width


def _vllm_clients_snapshot():
    """Clients named as vLLM's connector and the monitor name themselves, with 7-digit pids
    and sizes of 10 characters: the widest rows the clients table meets."""
    snap = make_snapshot(3)
    names = [
        ("vllm-scheduler-4194301", "kv_both"),
        ("vllm-worker-tp0of8", "kv_producer"),
        ("vllm-worker-tp1of8", "kv_consumer"),
        ("kvbroker-tui:4194304", "monitor"),
    ]
    clients = tuple(
        dataclasses.replace(
            snap.clients[0],
            session=100 + i,
            pid=4194301 + i,
            name=name,
            role=role,
            bytes_published=1023 * 2**30 + 2**29,
            bytes_claimed=1023 * 2**30 + 2**29,
        )
        for i, (name, role) in enumerate(names)
    )
    return dataclasses.replace(snap, clients=clients)


@pytest.mark.parametrize("size", SIZES, ids=IDS)
@run_async
async def test_clients_numbers_are_never_cut(size):
    # At 80 columns CLAIMED showed "CL" and "48" for 48.0 MiB: the role sat before the
    # numbers and vLLM's names (vllm-scheduler-PID) and roles (kv_consumer) are long.
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=size) as pilot:
        source.feed(_vllm_clients_snapshot())
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("2")
        await pilot.pause()
        table = app.query_one(ClientsTable)
        right = 0
        for column in table.ordered_columns:
            right += column.get_render_width(table)
            if column.key.value == "claimed":
                break
        assert right <= table.scrollable_content_region.width
        names = [str(table.get_cell(k, "name")) for k in table.keys_shown]
        assert all(n.startswith("vllm-") or n.startswith("kvbroker-tui:") for n in names)
        assert str(table.get_cell("101", "pid")) == "4194302"
        if size[0] >= 100:
            assert "vllm-scheduler-4194301" in names  # whole where there is room
        else:
            assert any(n.endswith("…") for n in names)
        assert str(table.get_cell("101", "claimed")) == "1023.5 GiB"


@run_async
async def test_disconnected_banner_keeps_the_socket_path_at_80x24():
    source = FakeSource()
    source.label = "/run/kvbroker/a-rather-long-directory/kvbroker.sock"
    app = MonitorApp(source, retry_delay=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await fed(pilot, app, source, 1)
        source.drop("the daemon closed the connection")
        await until(pilot, lambda: app.screen.has_class("-disconnected"))
        await pilot.pause()
        text = plain(app.query_one(StatusLine))
        assert source.label in text and "disconnected" in text and len(text) <= 78


@pytest.mark.parametrize(
    "label, reason, shown",
    [
        ("/tmp/ops19/kvb.sock", "the daemon closed the connection", "whole"),
        (
            "/run/kvbroker/kvbroker.sock",
            "lost the daemon: [Errno 104] Connection reset by peer",
            "cut",
        ),
        (
            "/run/kvbroker/a-rather-long-directory/kvbroker.sock",
            "the daemon closed the connection",
            "none",
        ),
    ],
)
@run_async
async def test_disconnected_banner_says_why_at_80x24(label, reason, shown):
    # Captured in tmux: "✖ /tmp/ops19/kvb.sock  disconnected  retrying every 1s (attempt 4):"
    # - the reason did not fit whole, so it was left out, and the retry note kept its colon.
    source = FakeSource()
    source.label = label
    app = MonitorApp(source, retry_delay=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await fed(pilot, app, source, 1)
        source.drop(reason)
        await until(pilot, lambda: app.screen.has_class("-disconnected"))
        await pilot.pause()
        text = plain(app.query_one(StatusLine))
        assert len(text) <= 78 and not text.endswith(":"), text
        head = f"✖ {label}  disconnected"
        assert text.startswith(head)
        why = text.removeprefix(head).removeprefix("  ").split("  retrying")[0]
        if shown == "whole":
            assert why == reason
        elif shown == "cut":
            assert len(why) >= 12 and why.endswith("…") and reason.startswith(why[:-1])
        else:  # no room for a useful part of it: the line ends with the state
            assert text == head


@run_async
async def test_disconnected_banner_from_a_missing_socket_fits_80_columns():
    # The TUI's own reasons name no path (the banner starts with it): "no kvbroker daemon:
    # /tmp/ops19/kvb.sock does not exist" after the same path did not fit at 80 columns.
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvb-") as short:  # like a real path
        path = os.path.join(short, "kvbroker.sock")
        app = MonitorApp(DaemonSource(path), retry_delay=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.screen.has_class("-disconnected"))
            await pilot.pause()
            text = plain(app.query_one(StatusLine))
            assert text.startswith(f"✖ {path}  disconnected  no daemon: no such socket"), text
            assert text.count(path) == 1


def _hits_snapshot(step: int, hits_per_step: int, misses_per_step: int):
    snap = make_snapshot(step)
    counters = dataclasses.replace(
        snap.counters, hits=hits_per_step * step, misses=misses_per_step * step
    )
    return dataclasses.replace(snap, counters=counters)


@run_async
async def test_hit_rate_of_100_percent_is_not_drawn_like_0_percent():
    drawn = {}
    for name, hits, misses in (("all", 100, 0), ("none", 0, 100)):
        source = FakeSource()
        app = MonitorApp(source)
        async with app.run_test(size=(120, 40)) as pilot:
            source.feed(*(_hits_snapshot(i, hits, misses) for i in range(8)))
            await until(pilot, lambda app=app: app.snapshots_seen == 8)
            await pilot.pause()
            spark = app.query_one("#rate-hit_rate").query_one(".rate-spark")
            drawn[name] = plain(spark)
    assert drawn["all"] != drawn["none"]
    assert "█" in drawn["all"] and "█" not in drawn["none"]


@run_async
async def test_objects_bindings_survive_tab():
    source = FakeSource([make_object("layer-1", MIB), make_object("layer-2", MIB)])
    app = MonitorApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await fed(pilot, app, source, 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 2)
        await pilot.press("tab")
        assert isinstance(app.focused, Input)  # the filter, not the tab bar
        await pilot.press("tab")
        assert app.focused is table
        shown = {b.binding.description for b in app.active_bindings.values()}
        assert {"sort", "evict", "filter"} <= shown
        await pilot.press("s")
        assert table.sort_by == "size"


def burst(app, keys: list[str]) -> None:
    """Post ``keys`` to the app back to back, as a terminal delivers what it read at once.

    (``pilot.press`` waits for the app to go idle after each key, so it never sees keys
    overtake one another.) Names of one character are the character itself."""
    for key in keys:
        char = {"backspace": "\x7f", "escape": "\x1b", "left": None}.get(key, key)
        name = {"-": "minus"}.get(key, key)
        event = events.Key(name, char)
        event.set_sender(app)
        app.post_message(event)


@run_async
async def test_fast_typing_into_the_filter_after_backspaces_keeps_every_key():
    # Textual ran the binding of a backspace only after the key had bubbled up to the App,
    # while the letters behind it were inserted at once: "layer-1", 7 backspaces and "prompt"
    # in one read left "", not "prompt" (the backspaces deleted the new letters).
    source = FakeSource(
        [make_object(f"layer-{i}", MIB) for i in range(30)] + [make_object("prompt-7", MIB)]
    )
    app = MonitorApp(source)
    async with app.run_test(size=(80, 24)) as pilot:
        await fed(pilot, app, source, 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 31)
        await pilot.press("slash")
        box = app.query_one("#filter", Input)
        burst(app, [*"layer-1", *["backspace"] * 7, *"prompt"])
        await until(pilot, lambda: box.value == "prompt", message=lambda: repr(box.value))
        await until(pilot, lambda: table.row_count == 1)
        assert source.list_calls[-1] == "prompt"
        assert table.keys_shown == ["default\x00prompt-7"]
        # Cursor keys keep their place too; escape, typed at once behind, leaves for the table.
        burst(app, [*["backspace"] * 6, *"layer-2", "left", "left", *"x", "escape"])
        await until(pilot, lambda: app.focused is table)
        await until(pilot, lambda: box.value == "layerx-2", message=lambda: repr(box.value))


@run_async
async def test_status_line_shows_read_replicas_only_where_they_run():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=(160, 30)) as pilot:
        await fed(pilot, app, source)
        assert "replicas" not in plain(app.query_one(StatusLine))  # none: no part
        snap = make_snapshot(3)
        snap = dataclasses.replace(
            snap, read_replicas=4, counters=dataclasses.replace(snap.counters, replica_exits=2)
        )
        source.feed(snap)
        await until(pilot, lambda: app.snapshots_seen == 4)
        await pilot.pause()
        assert "replicas 4 (2 exited)" in plain(app.query_one(StatusLine))
