"""The monitor against a real daemon subprocess: what clients publish shows up, live."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("textual")

from conftest import DaemonProcess  # noqa: E402

from kvbroker.tui._app import MonitorApp  # noqa: E402
from kvbroker.tui._modals import ConfirmScreen  # noqa: E402
from kvbroker.tui._objects import ObjectsTable  # noqa: E402
from kvbroker.tui._pool_panel import PoolPanel  # noqa: E402
from kvbroker.tui._source import DaemonSource  # noqa: E402
from kvbroker.tui._tables import ClientsTable, TransfersTable  # noqa: E402

MIB = 1 << 20


async def until(pilot, condition, timeout: float = 60.0) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not reached in time")


def test_monitor_follows_a_live_daemon(daemon):
    async def scenario() -> None:
        app = MonitorApp(DaemonSource(daemon.socket_path), interval=0.1, retry_delay=0.1)
        with daemon.client(name="prefill-test", role="producer") as producer:
            for i in range(3):
                producer.put(f"layer-{i}", {"k": np.full(MIB, i, np.uint8)}, namespace="t")
            async with app.run_test(size=(140, 45)) as pilot:
                await until(pilot, lambda: app.latest is not None and app.latest.objects == 3)
                await pilot.pause()
                assert app.query_one("#pool-0", PoolPanel) is not None
                names = [
                    str(app.query_one(ClientsTable).get_cell(k, "name"))
                    for k in app.query_one(ClientsTable).keys_shown
                ]
                assert "prefill-test" in names
                assert any(name.startswith("kvbroker-tui:") for name in names)
                assert app.query_one(TransfersTable).row_count >= 3

                await pilot.press("3")
                table = app.query_one(ObjectsTable)
                await until(pilot, lambda: table.row_count == 3)
                assert sorted(table.keys_shown) == [f"t\x00layer-{i}" for i in range(3)]

                # A publish made while watching appears without any key press.
                producer.put("layer-3", {"k": np.zeros(2 * MIB, np.uint8)}, namespace="t")
                await until(pilot, lambda: "t\x00layer-3" in table.keys_shown)
                seen = app.snapshots_seen
                await until(pilot, lambda: app.snapshots_seen >= seen + 2)
                assert app.history.latest is not None

                # Evict from the keyboard, confirmed: the daemon really frees it.
                await pilot.press("home")
                while table.selected.key != "layer-0":
                    await pilot.press("down")
                await pilot.press("d")
                await until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
                await pilot.press("y")
                await until(pilot, lambda: "t\x00layer-0" not in table.keys_shown)
                assert not producer.exists("layer-0", namespace="t")
                assert producer.exists("layer-1", namespace="t")

    asyncio.run(scenario())


def test_monitor_reconnects_when_the_daemon_returns(daemon):
    async def scenario() -> None:
        app = MonitorApp(DaemonSource(daemon.socket_path), interval=0.1, retry_delay=0.1)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.latest is not None)
            first_pid = app.latest.pid
            assert daemon.stop() == 0
            await until(pilot, lambda: app.screen.has_class("-disconnected"))
            replacement = DaemonProcess(daemon.socket_path, "--pool-size", "32M")
            try:
                await until(pilot, lambda: app.connected and app.latest.pid != first_pid)
                assert not app.screen.has_class("-disconnected")
                assert app.latest.pools[0].capacity == 32 * MIB
            finally:
                assert replacement.stop() == 0

    asyncio.run(scenario())
