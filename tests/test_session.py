"""Session: the layer that matches replies to requests, here over a scripted stream."""

import time

from kvbroker._wire.protocol import PROTOCOL_VERSION
from kvbroker._client.session import Session


class _Transport:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def settimeout(self, timeout: float | None) -> None:
        self.timeouts.append(timeout)


class ScriptedStream:
    """Answers hello, then plays ``script`` (a callable giving the next message)."""

    def __init__(self, script) -> None:
        self.transport = _Transport()
        self.sent: list[dict] = []
        self.closed = False
        self._script = script

    def send(self, message: dict) -> None:
        self.sent.append(message)

    def receive(self) -> dict:
        last = self.sent[-1]
        if last["op"] == "hello" and len(self.sent) == 1 and not getattr(self, "_greeted", 0):
            self._greeted = 1
            return {
                "id": last["id"],
                "ok": True,
                "result": {"version": PROTOCOL_VERSION, "session": 1},
            }
        return self._script(self)

    def close(self) -> None:
        self.closed = True


def test_close_reads_the_replies_to_pipelined_requests():
    stream = ScriptedStream(lambda s: {"id": s.sent[-1]["id"], "ok": True, "result": None})
    session = Session(stream)
    session.send_only("release", lease=7)
    assert session._unanswered
    session.close()
    assert not session._unanswered and stream.closed


def test_close_is_bounded_when_only_pushes_arrive():
    # A watch connection whose pipelined reply never comes: the pushes every interval must
    # not keep close waiting past its bound.
    def pushes(s):
        time.sleep(0.01)
        return {"push": "stat", "result": {}}

    session = Session(ScriptedStream(pushes))
    session.send_only("release", lease=7)
    started = time.monotonic()
    session.close(drain_timeout=0.2)
    # bounded (without the bound the pushes keep it reading forever); the margin is for a
    # loaded machine, which can take longer than 2 s over a 0.2 s bound
    assert time.monotonic() - started < 30
    assert session._stream.closed


def test_a_pending_result_asked_twice_answers_again_without_waiting():
    """``Pending.result()`` a second time (an error path that asks every pending request it
    knows of, the one that just raised included) gives the same answer at once: it must not
    wait on the stream for a reply that was already read (a hang until the call timeout)."""
    import pytest

    from kvbroker.errors import PoolFull

    replies = []

    def script(s):
        if not replies:
            raise AssertionError("read past the last reply: result() waited for a reply again")
        return replies.pop(0)

    session = Session(ScriptedStream(script))
    full = session.submit("reserve_blocks", blocks=[])
    ok = session.submit("ping")
    replies += [
        {"id": full._rid, "ok": False, "error": {"code": "pool_full", "message": "x"}},
        {"id": ok._rid, "ok": True, "result": {"pong": 1}},
    ]
    for _ in range(2):
        with pytest.raises(PoolFull):
            full.result()
    assert ok.result() == ok.result() == {"pong": 1}
    assert not session._replies and not session._submitted


def test_a_connection_level_error_reaches_the_pending_result_as_the_daemon_said_it():
    """The daemon answers a request it cannot read (a frame over its limit) with an error of
    no id, then closes: ``result()`` raises that error, as ``call`` does, not a complaint
    about an id."""
    import pytest

    from kvbroker.errors import ProtocolError

    session = Session(
        ScriptedStream(
            lambda s: {
                "id": None,
                "ok": False,
                "error": {"code": "protocol", "message": "frame exceeds the size limit"},
            }
        )
    )
    pending = session.submit("lookup", key="k")
    with pytest.raises(ProtocolError, match="frame exceeds the size limit"):
        pending.result()


def test_replies_nobody_will_take_are_not_kept():
    """A Pending dropped without asking for its result: its reply, read while another call
    waits, is not kept for ever in the session (a fire-and-forget caller would grow it
    without bound)."""
    import gc

    answered = iter(range(2, 103))  # the daemon answers in order: 100 pings, then the call
    session = Session(ScriptedStream(lambda s: {"id": next(answered), "ok": True, "result": None}))
    for _ in range(100):
        session.submit("ping")  # the Pending is dropped at once
    gc.collect()
    session.call("ping")
    assert not session._replies and not session._submitted and not session._unanswered
    answered = iter([103, 104, 105])
    kept = session.submit("ping")
    session.call("ping")  # reads the submitted ping's reply first: kept for its Pending
    assert list(session._replies) == [103]
    del kept
    gc.collect()
    session.call("ping")
    assert not session._replies and not session._submitted and not session._unanswered


def test_a_pipelined_reply_read_while_waiting_for_a_push_is_kept_for_its_result():
    """``next_push`` (a watch) reading the reply of a submitted request keeps it for its
    ``result()``, an error included (not raised at the watcher, not dropped)."""
    import pytest

    from kvbroker.errors import Exists

    messages = []
    session = Session(ScriptedStream(lambda s: messages.pop(0)))
    ok, clash = session.submit("ping"), session.submit("reserve", key="k")
    messages += [
        {"id": ok._rid, "ok": True, "result": {"epoch": 1}},
        {"id": clash._rid, "ok": False, "error": {"code": "exists", "message": "k"}},
        {"push": "stats", "result": {}},
    ]
    assert session.next_push()["push"] == "stats"
    assert ok.result() == {"epoch": 1}
    with pytest.raises(Exists):
        clash.result()


def test_a_call_that_timed_out_does_not_shift_every_later_reply():
    """A call gives up (the daemon stalled past the timeout); its reply comes later. The next
    call reads it first: dropped as the abandoned request's, not answered with
    'reply N does not answer request N+1' by this and every later call."""
    import pytest

    from kvbroker.errors import Timeout

    queue = []

    def script(s):
        if not queue:
            raise Timeout("the daemon did not answer in time")
        return queue.pop(0)

    session = Session(ScriptedStream(script))
    with pytest.raises(Timeout):
        session.call("ping")
    late = session._stream.sent[-1]["id"]
    queue += [
        {"id": late, "ok": True, "result": "late"},
        {"id": late + 1, "ok": True, "result": "a"},
    ]
    assert session.call("ping") == "a"
    queue += [{"id": late + 2, "ok": True, "result": "b"}]
    assert session.call("ping") == "b"
    assert not session._unanswered
    stalled = Session(ScriptedStream(script))  # and closing does not wait for a late reply
    with pytest.raises(Timeout):
        stalled.call("ping")
    stalled._stream._script = lambda s: pytest.fail("close waited for the abandoned reply")
    stalled.close()
    assert stalled._stream.closed


def test_close_does_not_wait_on_a_daemon_that_just_timed_out():
    """A request timed out (the daemon hangs): closing does not wait ``drain_timeout`` more
    for the replies to pipelined requests (the vLLM connector closes its client on a
    timeout: one stall, not two)."""
    import pytest

    from kvbroker.errors import Timeout

    def hung(s):
        raise Timeout("the daemon did not answer in time")

    session = Session(ScriptedStream(hung))
    pending = session.submit("ping")
    session.send_only("release", lease=7)
    with pytest.raises(Timeout):
        pending.result()
    session._stream._script = lambda s: pytest.fail("close waited on the hung daemon")
    session.close()
    assert session._stream.closed


def test_request_sends_the_args_dict_it_is_given_and_call_is_the_same_by_keywords():
    """The op stubs build a request's arguments once (kvbroker._client.ops) and every layer
    below passes that dict on: sent as given, not copied into keywords and back, not kept,
    not changed. ``call``/``send_only``/``submit`` with keywords send the same requests."""
    import pytest

    stream = ScriptedStream(lambda s: {"id": s.sent[-1]["id"], "ok": True, "result": 5})
    session = Session(stream)
    args = {"namespace": "default", "key": "k"}
    assert session.request("exists", args) == 5
    assert stream.sent[-1]["args"] is args and args == {"namespace": "default", "key": "k"}
    assert session.call("exists", namespace="default", key="k") == 5
    assert stream.sent[-1]["args"] == args
    session.post("release", {"lease": 3, "consume": True})
    session.send_only("release", lease=4, consume=True)
    assert [m["args"] for m in stream.sent[-2:]] == [
        {"lease": 3, "consume": True},
        {"lease": 4, "consume": True},
    ]
    assert session.submit("ping", {}).result() == 5
    assert session.submit("lookup", key="k").result() == 5
    assert stream.sent[-1]["args"] == {"key": "k"}
    assert session.submit(op="lookup", key="j").result() == 5  # the op by keyword, as before
    assert stream.sent[-1]["op"] == "lookup" and stream.sent[-1]["args"] == {"key": "j"}
    with pytest.raises(TypeError, match="not both"):
        session.submit("lookup", {"key": "k"}, namespace="x")
