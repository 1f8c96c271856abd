"""The monitor's sessions tab (key 4), driven by Pilot from a fake source: each pool's retained
bytes against its cap, the largest sessions first, updated in place; a daemon without sessions
says so."""

from __future__ import annotations

import pytest

pytest.importorskip("textual")

from kvbroker.tui._app import MonitorApp  # noqa: E402
from kvbroker.tui._meter import Meter  # noqa: E402
from kvbroker.tui._sessions import SessionsTable  # noqa: E402
from kvbroker.tui.testing import FakeSource, make_retention, make_snapshot  # noqa: E402

from tests.test_tui_app import SIZE, run_async, until  # noqa: E402

MIB = 1 << 20


@run_async
async def test_sessions_tab_shows_the_largest_sessions_and_the_retained_cap():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(3, pools=2, retention=make_retention(3, pools=2, sessions=4)))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("4")
        await pilot.pause()
        assert app.query_one("TabbedContent").active == "tab-sessions"
        table = app.query_one(SessionsTable)
        assert app.focused is table
        # largest first: conv-3 holds 16 MiB, conv-0 4 MiB
        assert [k.split("\x1f")[1] for k in table.keys_shown] == [
            "conv-3",
            "conv-2",
            "conv-1",
            "conv-0",
        ]
        assert str(table.get_cell("chat\x1fconv-3", "bytes")) == "16.0 MiB"
        assert str(table.get_cell("chat\x1fconv-3", "idle")) == "30.0s"
        meter = app.query_one("#retained-0", Meter)
        assert meter.fraction == pytest.approx(40 / 256)  # 4+8+12+16 MiB of a 256 MiB pool
        assert meter.marks == (0.5, 0.5)  # the cap: 128 of 256 MiB
        assert "40.0 MiB of 128.0 MiB (31%)" in meter.value_text
        assert app.query_one("#retained-1", Meter).fraction == 0
        summary = str(app.query_one("#sessions-summary").render())
        assert "4 sessions" in summary and "pool_full 3" in summary and "expired 6" in summary
        # the next snapshot: a session ends, one grows; rows change in place
        clears = []
        table.clear = lambda *a, **k: clears.append(a)
        nxt = make_retention(4, pools=2, sessions=3)
        source.feed(make_snapshot(4, pools=2, retention=nxt))
        await until(pilot, lambda: app.snapshots_seen == 2)
        await pilot.pause()
        assert clears == [] and len(table.keys_shown) == 3
        assert "evicted: pool_full 4" in str(app.query_one("#sessions-summary").render())


@run_async
async def test_a_daemon_without_sessions_says_so():
    source = FakeSource()
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        source.feed(make_snapshot(1))
        await until(pilot, lambda: app.snapshots_seen == 1)
        await pilot.press("4")
        await pilot.pause()
        assert app.query_one(SessionsTable).row_count == 0
        assert not app.query("#retained-meters Meter")
        assert "no sessions" in str(app.query_one("#sessions-summary").render())
