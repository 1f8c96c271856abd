"""Screenshots of the monitor (pytest-textual-snapshot), fed fixed snapshots by a fake source.

Regenerate after an intended change with ``--snapshot-update`` and look at the SVGs.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from kvbroker.tui._app import MonitorApp  # noqa: E402
from kvbroker.tui.testing import (  # noqa: E402
    FakeSource,
    make_object,
    make_retention,
    make_snapshot,
)

MIB = 1 << 20
STEPS = 12  # enough history for the sparklines to show a shape


def _app_with_history() -> tuple[MonitorApp, FakeSource]:
    source = FakeSource(
        [make_object(f"llama/req-{i}", (i % 4 + 1) * 4 * MIB, age=60 - i * 5) for i in range(8)]
    )
    return MonitorApp(source), source


async def _feed(pilot, source: FakeSource, app: MonitorApp) -> None:
    source.feed(*(make_snapshot(step) for step in range(STEPS)))
    for _ in range(250):
        if app.snapshots_seen == STEPS:
            break
        await pilot.pause(0.02)
    await pilot.pause()


SIZES = pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])


@SIZES
def test_pools_tab(snap_compare, size):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        await _feed(pilot, source, app)

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_clients_tab(snap_compare, size):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        await _feed(pilot, source, app)
        await pilot.press("2")
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_objects_tab_sorted_by_size(snap_compare, size):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        await _feed(pilot, source, app)
        await pilot.press("3")
        for _ in range(100):
            if app.query_one("#objects-table").row_count == 8:
                break
            await pilot.pause(0.02)
        await pilot.press("s", "r")
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_sessions_tab(snap_compare, size):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        source.feed(
            *(
                make_snapshot(step, pools=2, retention=make_retention(step, pools=2))
                for step in range(STEPS)
            )
        )
        for _ in range(250):
            if app.snapshots_seen == STEPS:
                break
            await pilot.pause(0.02)
        await pilot.press("4")
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


@SIZES
def test_disconnected(snap_compare, size):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        await _feed(pilot, source, app)
        app.retry_delay = 3600  # stay on the first failed attempt for the picture
        source.drop("the daemon closed the connection")
        for _ in range(100):
            if app.screen.has_class("-disconnected"):
                break
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)


def test_paused_at_80x24(snap_compare):
    app, source = _app_with_history()

    async def run_before(pilot) -> None:
        await _feed(pilot, source, app)
        await pilot.press("p")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)
