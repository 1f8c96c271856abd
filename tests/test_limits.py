"""Robustness limits against a real daemon: connections, leases per client, and peers that
stop reading (cut off once max_write_buffer of replies waits for them, never stalling others).
"""

import socket
import threading
import time

import msgpack
import pytest

from kvbroker import Client, LimitExceeded
from kvbroker._wire.protocol import PROTOCOL_VERSION


def raw_connect(path, rcvbuf=None):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(path)
    s.sendall(
        msgpack.packb(
            {"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION, "name": "stuck"}}
        )
    )
    unpacker = msgpack.Unpacker(raw=False)
    while True:
        unpacker.feed(s.recv(65536))
        for msg in unpacker:
            assert msg["ok"], msg
            return s, msg["result"]["session"]


def wait_until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def sessions(c):
    return {cl.session for cl in c.stat().clients}


def test_pipelining_client_that_never_reads_is_cut_off(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_WRITE_BUFFER": "64K"}
    )
    with d.client() as other:
        other.put("k", {"a": b"x" * 1000})
        stuck, sid = raw_connect(d.socket_path, rcvbuf=4096)
        # The stuck client holds a lease: it must end with the connection.
        stuck.sendall(msgpack.packb({"id": 2, "op": "claim", "args": {"key": "k"}}))
        assert wait_until(lambda: other.stat().read_leases == 1)
        flood_error = []

        def flood():
            req = msgpack.packb({"id": 3, "op": "stat", "args": {}})
            try:
                for _ in range(200_000):
                    stuck.sendall(req)
            except OSError as exc:
                flood_error.append(exc)

        t = threading.Thread(target=flood, daemon=True)
        t.start()
        worst = 0.0
        while t.is_alive() and len(flood_error) == 0:
            t0 = time.monotonic()
            assert other.lookup("k") is not None  # timeout=30 s would raise if stalled
            worst = max(worst, time.monotonic() - t0)
            if sid not in sessions(other):
                break
        t.join(30)
        assert not t.is_alive(), "the flooding client was never cut off"
        assert sid not in sessions(other)
        assert other.stat().read_leases == 0  # its lease ended with it
        assert other.get("k")["a"].tobytes() == b"x" * 1000
        print(f"worst lookup latency while another client flooded: {worst * 1e3:.1f} ms")
    stuck.close()
    assert "bytes of replies left unread (max_write_buffer 65536)" in d.log()


def test_watch_subscriber_that_stops_reading_is_cut_off(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_WRITE_BUFFER": "64K"}
    )
    with d.client() as other:
        for i in range(64):  # big snapshots: 64 transfers, 200 leases listed in each
            other.put(f"k{i}", {"a": b"x"})
        held = [other.claim(f"k{i % 64}") for i in range(200)]
        watcher, sid = raw_connect(d.socket_path, rcvbuf=4096)
        watcher.sendall(msgpack.packb({"id": 2, "op": "watch", "args": {"interval": 0.05}}))
        assert wait_until(lambda: sid not in sessions(other)), "watcher never cut off"
        assert other.lookup("k0") is not None
        for lease in held:
            lease.release()
    watcher.close()
    assert "disconnected" in d.log()


def test_a_slow_but_reading_watcher_is_kept(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_WRITE_BUFFER": "64K"}
    )
    with d.client() as watcher, d.client() as other:
        stream = watcher.watch(0.05)
        for _ in range(10):
            next(stream)
            time.sleep(0.1)  # slower than the pushes, but reading
        assert watcher.session_id in sessions(other)


def test_lease_limit_per_client(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_LEASES_PER_CLIENT": "3"}
    )
    with d.client() as c, d.client() as other:
        c.put("k", {"a": b"x"})
        leases = [c.claim("k") for _ in range(3)]
        with pytest.raises(LimitExceeded, match="max_leases_per_client"):
            c.claim("k")
        with pytest.raises(LimitExceeded):
            c.reserve("new", {"a": 10})
        assert c.stat().write_leases == 0 and c.stat().objects == 1  # nothing half-made
        with other.claim("k"):  # another connection has its own count
            pass
        leases.pop().release()
        with c.reserve("new", {"a": 10}) as w:
            w["a"][:] = 1
        for lease in leases:
            lease.release()


def test_lease_limit_per_uid_across_connections(make_daemon):
    """One uid's connections together hold at most max_leases_per_uid leases (each
    connection under its own max_leases_per_client): the next read or write lease of any of
    them is refused until one ends, released or with its connection."""
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_LEASES_PER_UID": "5"}
    )
    with d.client() as a, d.client() as b, d.client() as c:
        a.put("k", {"a": b"x"})
        mine = [a.claim("k"), a.claim("k"), c.claim("k")]
        bs = [b.claim("k"), b.claim("k")]
        for who in (a, b, c):
            with pytest.raises(LimitExceeded, match="max_leases_per_uid"):
                who.claim("k")
        with pytest.raises(LimitExceeded, match="max_leases_per_uid"):
            c.reserve("new", {"a": 10})
        s = c.stat()
        assert s.read_leases == 5 and s.write_leases == 0 and s.objects == 1  # nothing made
        mine.pop(0).release()
        mine.append(a.claim("k"))  # after its release on the same connection: in order
        b.close()  # its 2 leases end with it (once the daemon has seen it go)
        deadline = time.monotonic() + 30
        while c.stat().read_leases != 3:
            assert time.monotonic() < deadline, c.stat().leases
            time.sleep(0.01)
        mine += [c.claim("k"), c.claim("k")]
        with pytest.raises(LimitExceeded, match="max_leases_per_uid"):
            a.claim("k")
        for lease in mine:
            lease.release()
        del bs


def test_connection_limit(make_daemon):
    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_CONNECTIONS": "2"})
    a = b = None
    try:
        # The readiness probe's connection may still be closing: retry until two are ours.
        assert wait_until(lambda: _try_connect(d) is not None, 60)
        a = d.client(map_pools=False)
        b = _retry_connect(d)
        with pytest.raises(LimitExceeded, match="max_connections"):
            Client(d.socket_path, map_pools=False, timeout=30)
        a.close()
        a = _retry_connect(d)  # a freed slot is usable again
        assert a.stat().objects == 0
    finally:
        for c in (a, b):
            if c is not None:
                c.close()


def test_refused_connection_says_why_even_when_hello_goes_out_late(make_daemon, monkeypatch):
    # The daemon refuses a connection past max_connections at once, then hangs up. A client
    # that sends its hello only after that (it was descheduled) gets a broken pipe writing:
    # it must still report the refusal, not "lost the daemon".
    import select

    from kvbroker._client import transport as _transport

    d = make_daemon("--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_MAX_CONNECTIONS": "1"})
    real_send = _transport.UnixTransport.send

    def send_after_the_refusal(self, data):
        assert select.select([self._sock], [], [], 60)[0], "no refusal came"
        time.sleep(0.1)  # and the hang-up after it
        return real_send(self, data)

    with _retry_connect(d):
        monkeypatch.setattr(_transport.UnixTransport, "send", send_after_the_refusal)
        with pytest.raises(LimitExceeded, match="max_connections"):
            Client(d.socket_path, map_pools=False, timeout=30)


def _try_connect(d):
    try:
        c = d.client(map_pools=False)
    except LimitExceeded:
        return None
    c.close()
    return True


def _retry_connect(d):
    deadline = time.monotonic() + 60
    while True:
        try:
            return d.client(map_pools=False)
        except LimitExceeded:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
