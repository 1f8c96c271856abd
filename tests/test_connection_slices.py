"""One connection's slice of pipelined requests, in-process: a real broker and journal behind a
real Connection, the socket replaced by a recorder. A put+get loop sends a pipelined release
and the next publish in one read; the daemon answers them with one journal write, then one
reply write (not two of each), and never a reply before the record of what it acknowledges."""

import os
import secrets

import msgpack
import pytest

from kvbroker._server import connection as connection_module
from kvbroker._server.broker import Broker
from kvbroker._server.config import DaemonConfig
from kvbroker._server.connection import Connection
from kvbroker._server.daemon import Daemon
from kvbroker._server.journal import Journal
from kvbroker._server.pool import HostPool
from kvbroker._wire.protocol import PROTOCOL_VERSION

PAGE = 4096


class RecordingTransport:
    """What a connection writes, in order, into ``events`` (shared with the journal)."""

    def __init__(self, events):
        self.events = events
        self._peer = None

    def write(self, data):
        self.events.append(("reply", bytes(data)))

    def get_write_buffer_size(self):
        return 0

    def set_write_buffer_limits(self, high):
        pass

    def get_extra_info(self, name):
        import socket

        if name != "socket":
            return None
        mine, self._peer = socket.socketpair(socket.AF_UNIX)
        return mine

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


@pytest.fixture
def served(tmp_path, monkeypatch):
    pool = HostPool(0, f"/kvbcs.{os.getpid()}.{secrets.token_hex(3)}", 256 * PAGE, PAGE)
    events = []
    try:
        daemon = Daemon(DaemonConfig(busy_poll=0))
        daemon.broker = Broker([pool])
        journal = Journal(str(tmp_path / "journal"), 1, [pool.describe()])
        daemon.broker.attach_journal(journal, 1)
        real_write = journal._write

        def journal_write(data, records):
            events.append(("journal", records))
            real_write(data, records)

        monkeypatch.setattr(journal, "_write", journal_write)
        conn = Connection(daemon)
        conn.connection_made(RecordingTransport(events))
        unpacker = msgpack.Unpacker(raw=False)
        ids = iter(range(1, 1 << 30))

        def send(*requests, ok=True):
            """Feed ``requests`` ((op, args) pairs) to the connection as one read; return
            the results, in order (``ok`` False: the replies, failed ones included)."""
            data = b"".join(
                msgpack.packb({"id": next(ids), "op": op, "args": args}) for op, args in requests
            )
            connection_module._RBUF[: len(data)] = data
            start = len(events)
            conn.buffer_updated(len(data))
            for kind, payload in events[start:]:
                if kind == "reply":
                    unpacker.feed(payload)
            replies = list(unpacker)
            if not ok:
                return replies
            assert all(r["ok"] for r in replies), replies
            return [r["result"] for r in replies]

        send(("hello", {"version": PROTOCOL_VERSION, "name": "t"}))
        send.daemon = daemon
        yield send, events
    finally:
        pool.unlink()


def _publish(arena, key):
    return (
        "publish",
        {
            "arena": arena,
            "key": key,
            "buffers": {"kv": 2 * PAGE},
            "checksums": {"kv": [1, 7]},
            "next_arena": 16 * PAGE,
        },
    )


def test_a_pipelined_slice_is_one_journal_write_then_one_reply_write(served):
    send, events = served
    (arena,) = send(("arena", {"nbytes": 16 * PAGE}))
    (published,) = send(_publish(arena["lease"], "k0"))
    (claimed,) = send(("claim", {"key": "k0", "consume": True}))
    start = len(events)
    # What Client.get then Client.put send: the release, pipelined, and the next publish.
    released, published = send(
        ("release", {"lease": claimed["lease"], "consume": True}),
        _publish(published["lease"], "k1"),
    )
    assert released == {} and published["key"] == "k1"
    kinds = [kind for kind, _ in events[start:]]
    # The release's unlink record and the publish's seal record, in one write, before the
    # replies, both in one write.
    assert kinds == ["journal", "reply"], kinds
    assert events[start][1] >= 2
    (gone,) = send(("claim", {"key": "k0"}), ok=False)
    assert gone["error"]["code"] == "not_found"  # consumed: the release took effect


def test_the_busy_poll_window_runs_from_the_reply(served, monkeypatch):
    """The daemon keeps polling for busy_poll after it answers, not only after a request
    came: a client answered after a long request (a 512-block match) asks again at once,
    and found the loop asleep (the next round trip after such a match: 64 us p50 on the
    2-core VM against 21 us once the window ran from the reply)."""
    send, events = served
    marks = []  # len(events) at each note_activity
    monkeypatch.setattr(send.daemon, "note_activity", lambda: marks.append(len(events)))
    start = len(events)
    send(("ping", {}))
    replies = [i for i in range(start, len(events)) if events[i][0] == "reply"]
    assert replies, "no reply written"
    assert any(m > replies[-1] for m in marks), (marks, replies)
