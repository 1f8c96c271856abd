"""The vLLM connector passes sessions through (issue 41): a request's
``{"kvbroker": {"session", "retain", "priority"}}`` (in its extra arguments, or in
``kv_transfer_params``) makes its saved blocks retained by that session, and its lookup renew
the session and retain what it finds. Driven through vLLM's own Scheduler with the harness's
fake model (no model forward); a malformed session is warned about and the request served."""

from __future__ import annotations

import logging

from tests.test_vllm_connector import (  # noqa: F401 - fixtures
    BLOCK,
    P,
    _engine,
    _stat,
    broker,
    model,
)
from tests.vllm_helpers.common import needs_vllm

pytestmark = needs_vllm


def _sessions(broker) -> dict[str, dict]:
    with broker.client() as c:
        return {s["name"]: s for s in c.ops.sessions()["sessions"]}


def test_saved_and_looked_up_blocks_are_retained_by_the_requests_session(
    model, broker, monkeypatch, caplog
):
    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch, batched_tokens=64)
    prod.add(P, extra_args={"kvbroker": {"session": "conv-42", "retain": "10m", "priority": 2}})
    steps = prod.run()
    saved = _stat(steps, "saved_blocks")
    assert saved > 0
    got = _sessions(broker)
    assert set(got) == {"conv-42"}
    assert (got["conv-42"]["blocks"], got["conv-42"]["priority"]) == (saved, 2)
    assert 590 < got["conv-42"]["expires_in"] <= 600

    # A consumer's request of another session: its lookup retains what it finds there.
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    cons.add(P, extra_args={"kv_transfer_params": {"kvbroker": {"session": "conv-43"}}})
    steps = cons.run()
    assert _stat(steps, "loaded_blocks") > 0
    got = _sessions(broker)
    assert got["conv-43"]["blocks"] == _stat(steps, "loaded_blocks")

    # The flat form an OpenAI server's vllm_xargs can carry (its values cannot be maps).
    cons.add(P, extra_args={"kvbroker_session": "conv-44", "kvbroker_priority": 1})
    cons.run()
    assert _sessions(broker)["conv-44"]["priority"] == 1

    # A malformed session: warned about, the request served, nothing retained for it.
    with caplog.at_level(logging.WARNING):
        cons.add(P[:80], extra_args={"kvbroker": {"session": "bad", "priority": "high"}})
        cons.run()
    assert "bad" not in _sessions(broker)
    assert "not retained" in caplog.text
