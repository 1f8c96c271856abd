"""The monitor driven by key presses (Pilot), fed by a fake source with fixed snapshots."""

from __future__ import annotations

import asyncio
import functools
import re

import pytest

pytest.importorskip("textual")

from kvbroker.errors import BrokerUnavailable  # noqa: E402
from kvbroker.tui._app import MonitorApp  # noqa: E402
from kvbroker.tui._meter import Meter  # noqa: E402
from kvbroker.tui._modals import HELP, ConfirmScreen, HelpScreen  # noqa: E402
from kvbroker.tui._objects import ObjectsTable  # noqa: E402
from kvbroker.tui._pool_panel import PoolPanel  # noqa: E402
from kvbroker.tui._status import StatusLine  # noqa: E402
from kvbroker.tui._tables import ClientsTable, TransfersTable  # noqa: E402
from kvbroker.tui.testing import FakeSource, make_object, make_snapshot  # noqa: E402

SIZE = (140, 45)


def run_async(test):
    """Run an async test on a fresh event loop (no asyncio plugin is needed for Pilot)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))

    return wrapper


MIB = 1 << 20


async def until(pilot, condition, timeout: float = 60.0) -> None:
    """Let the app run until ``condition()`` holds (snapshots and lists are asynchronous)."""
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await pilot.pause(0.02)
    raise AssertionError("condition not reached in time")


def objects_source() -> FakeSource:
    return FakeSource(
        [
            make_object("layer-1", 3 * MIB, age=30),
            make_object("layer-2", 1 * MIB, age=10),
            make_object("layer-10", 2 * MIB, age=20),
            make_object("prompt", 5 * MIB, age=5),
        ]
    )


def status_text(app) -> str:
    return str(app.query_one(StatusLine).render())


@run_async
async def test_snapshots_fill_pools_rates_and_tables():
    source = FakeSource()
    app = MonitorApp(source, interval=0.5)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0), make_snapshot(1), make_snapshot(2))
        await until(pilot, lambda: app.snapshots_seen == 3)
        await pilot.pause()
        assert source.intervals == [0.5]
        panel = app.query_one("#pool-0", PoolPanel)
        used = panel.query_one(".meter-used", Meter)
        assert used.fraction == pytest.approx(112 / 256)  # step 2: 96 + 16 MiB used
        assert used.marks == (0.90, 0.95)
        rates = app.history.latest
        assert rates.publish_gbps == pytest.approx(1.0)
        assert rates.claim_gbps == pytest.approx(2.0)
        assert rates.hit_rate == pytest.approx(250 / (250 + 50))  # step 2: 50 misses
        assert app.query_one(ClientsTable).keys_shown == ["1", "2"]
        transfers = app.query_one(TransfersTable)
        assert transfers.row_count == 6  # steps 0..2, a publish and a claim each
        newest = transfers.get_row_at(0)
        assert str(newest[0]) == "0.0s" and newest[4].plain == "req-2"
        assert "daemon 4000" in status_text(app)


@run_async
async def test_tables_update_cells_in_place_without_clearing():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(1))
        await until(pilot, lambda: app.snapshots_seen == 1)
        clients = app.query_one(ClientsTable)
        clears = []
        clients.clear = lambda *a, **k: clears.append(a)  # a rebuild would flicker
        source.feed(make_snapshot(2))
        await until(pilot, lambda: app.snapshots_seen == 2)
        assert clears == []
        assert str(clients.get_cell("1", "published")) == "1.9 GiB"  # 2e9 bytes
        assert clients.keys_shown == ["1", "2"]


@run_async
async def test_ring_gets_its_own_panel():
    source = FakeSource()
    app = MonitorApp(source)
    ring = {
        "index": 0,
        "device": "cuda:0",
        "capacity": 1 << 30,
        "used": 1 << 29,
        "occupancy": "ssww" * 16,
    }
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0, rings=[ring]))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.pause()
        panel = app.query_one("#ring-0", PoolPanel)
        assert panel.border_title == "ring 0  cuda:0"
        assert panel.query_one(".meter-used", Meter).fraction == 0.5


@run_async
async def test_filter_typing_lists_matching_objects():
    source = objects_source()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 4)
        await pilot.press("slash", *"layer-1")
        await until(pilot, lambda: table.row_count == 2)
        assert source.list_calls[-1] == "layer-1"
        assert sorted(table.keys_shown) == ["default\x00layer-1", "default\x00layer-10"]
        # An unfinished regex is flagged and not sent; the table keeps its rows.
        calls = len(source.list_calls)
        await pilot.press(*"[0")
        await pilot.pause()
        assert app.query_one("#filter").has_class("-invalid")
        assert len(source.list_calls) == calls and table.row_count == 2
        await pilot.press("backspace", "backspace", "escape")
        await until(pilot, lambda: not app.query_one("#filter").has_class("-invalid"))
        assert app.focused is table


@run_async
async def test_sort_cycles_columns_and_reverses():
    source = objects_source()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 4)
        keys = lambda: [k.split("\x00")[1] for k in table.keys_shown]  # noqa: E731
        assert keys() == ["layer-1", "layer-10", "layer-2", "prompt"]
        await pilot.press("s")  # size
        assert keys() == ["layer-2", "layer-10", "layer-1", "prompt"]
        await pilot.press("r")
        assert keys() == ["prompt", "layer-1", "layer-10", "layer-2"]
        await pilot.press("s")  # age, still descending: oldest first
        assert keys() == ["layer-1", "layer-10", "layer-2", "prompt"]


async def _select(pilot, table: ObjectsTable, key: str) -> None:
    await pilot.press("home")
    while table.selected.key != key:
        await pilot.press("down")


@run_async
async def test_evict_asks_and_evicts_on_yes():
    source = objects_source()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 4)
        await _select(pilot, table, "layer-2")
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "default/layer-2" in app.screen.question
        assert source.evicted == []  # nothing goes before the answer
        await pilot.press("y")
        await until(pilot, lambda: table.row_count == 3)
        assert source.evicted == [("default", "layer-2")]
        assert "default\x00layer-2" not in table.keys_shown


@run_async
async def test_evict_cancelled_keeps_the_object():
    source = objects_source()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("3")
        table = app.query_one(ObjectsTable)
        await until(pilot, lambda: table.row_count == 4)
        await pilot.press("delete")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        await pilot.press("d")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("enter")  # the focused button is Cancel: enter must not evict
        await until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        await pilot.pause(0.1)
        assert source.evicted == [] and table.row_count == 4


@run_async
async def test_pause_freezes_the_display_and_resume_catches_up():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.pause()
        used = app.query_one("#pool-0").query_one(".meter-used", Meter)
        before = used.fraction
        await pilot.press("p")
        assert app.paused and "PAUSED" in status_text(app)
        source.feed(make_snapshot(1))
        await until(pilot, lambda: app.snapshots_seen == 2)
        assert used.fraction == before  # frozen while paused
        assert len(app.history.samples) == 1  # ...but the rates kept counting
        await pilot.press("p")
        assert not app.paused and "PAUSED" not in status_text(app)
        assert used.fraction == pytest.approx(104 / 256)


@run_async
async def test_disconnected_state_then_reconnects_by_itself():
    source = FakeSource()
    app = MonitorApp(source, retry_delay=0.05)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(0))
        await until(pilot, lambda: app.snapshots_seen == 1)
        source.drop()
        await until(pilot, lambda: app.screen.has_class("-disconnected"))
        text = status_text(app)  # why (this drop, or a failed reconnect), then the retry note
        assert "disconnected  " in text and "  retrying every" in text
        await pilot.pause(0.2)  # several failed attempts while the daemon is away
        assert "attempt" in status_text(app) and source.connects == 1
        source.restore()
        source.feed(make_snapshot(1))
        await until(pilot, lambda: app.snapshots_seen == 2)
        assert source.connects == 2
        assert not app.screen.has_class("-disconnected")
        assert "daemon 4000" in status_text(app)


@run_async
async def test_help_screen_lists_keys_and_closes():
    app = MonitorApp(FakeSource())
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.pause()  # laid out
        shown = app.screen.query_one("#help-box Static")
        help_text = str(shown.render())
        for key in ("pause", "evict", "regex", "quit"):
            assert key in help_text
        lines = help_text.splitlines()
        for _, keys in HELP:  # each key apart from what it does, on a line of its own
            for key, what in keys:
                assert any(
                    re.fullmatch(rf"  {re.escape(key)}  +{re.escape(what)}", line) for line in lines
                ), (key, lines)
        assert shown.content_size.width >= max(map(len, lines))  # no line wraps
        await pilot.press("escape")
        await until(pilot, lambda: not isinstance(app.screen, HelpScreen))


class _PushDuringShutdown(FakeSource):
    """A daemon whose next snapshot (or lost connection) arrives while the app shuts down,
    once the status line is gone: Textual removes the widgets before it stops the workers."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.app: MonitorApp | None = None

    async def next_snapshot(self):
        if not self.app.snapshots_seen:
            return await super().next_snapshot()
        status = self.app.query_one(StatusLine)
        while status.is_attached:
            await asyncio.sleep(0.001)
        if self.fail:
            raise BrokerUnavailable("the daemon closed the connection")
        return make_snapshot(1)


@pytest.mark.parametrize("fail", [False, True], ids=["snapshot", "disconnect"])
def test_a_push_arriving_during_shutdown_is_not_drawn(fail):
    # Drawing it failed the app on exit (NoMatches: no StatusLine), which a user quitting
    # the monitor saw as a traceback, and the live-daemon test as a flake.
    async def scenario() -> None:
        source = _PushDuringShutdown(fail)
        app = source.app = MonitorApp(source, retry_delay=3600)
        async with app.run_test(size=SIZE) as pilot:
            source.feed(make_snapshot(0))
            await until(pilot, lambda: app.snapshots_seen == 1)
        assert app.snapshots_seen == 1 and app.connected

    asyncio.run(asyncio.wait_for(scenario(), 60))
