"""The TUI's asyncio session (kvbroker.tui._wire) against a real daemon: the same typed op
stubs as the blocking client, the wire's one codec, the same typed errors."""

from __future__ import annotations

import asyncio

import pytest

from kvbroker._wire.protocol import MAX_REQUEST
from kvbroker.errors import BadRequest, BrokerUnavailable, NotFound
from kvbroker.tui._wire import AsyncSession


def test_the_tuis_session_asks_through_the_op_stubs(daemon):
    with daemon.client() as c:
        c.put("seen", {"x": b"1"}, namespace="tui")

    async def scenario() -> None:
        s = await AsyncSession.open(daemon.socket_path, name="tui-test")
        try:
            assert s.hello["session"] > 0
            # several in flight at once, each answered by its own id
            ping, listed, info = await asyncio.gather(
                s.ops.ping(), s.ops.list(namespace="tui"), s.ops.lookup("seen", namespace="tui")
            )
            assert ping["server_pid"] == daemon.proc.pid
            assert [o["key"] for o in listed["objects"]] == ["seen"]
            assert info["nbytes"] == 1
            with pytest.raises(NotFound):
                await s.ops.claim("missing", namespace="tui")
            # too large for a daemon to read: refused here, the connection kept
            with pytest.raises(BadRequest, match="more than the"):
                await s.ops.report({"x": "y" * MAX_REQUEST})
            assert (await s.ops.watch(0.05))["interval"] == 0.05
            push = await asyncio.wait_for(s.next_push(), 10)
            assert push["push"] == "stats" and push["result"]["objects"] == 1
            evicted = await s.ops.evict(namespace="tui", key="seen")
            assert evicted["count"] == 1
        finally:
            await s.close()
        with pytest.raises(BrokerUnavailable):
            await s.ops.ping()

    asyncio.run(scenario())
