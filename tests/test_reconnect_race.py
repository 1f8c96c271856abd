"""A reconnect seen by other threads of the same client: they must get the new connection
only once it is complete (generation bumped, pools mapped), never a half-made one."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvbroker.errors import LeaseExpired


def test_calls_during_reconnect_wait_for_the_complete_connection(daemon):
    c = daemon.client(reconnect=10)
    observer = daemon.client(arena_size=0, map_pools=False)
    c.put("warm", {"x": np.ones(1000, np.uint8)})  # an arena on the first connection
    assert c.generation == 0

    # Hold the reconnecting thread inside the pool (re-)mapping, the slow part of a
    # reconnect after a cold restart, until the other thread has had its chance.
    in_window, go_on = threading.Event(), threading.Event()
    mapping, armed = c._mapping, [False]

    def held_mapping(index):
        if armed[0]:
            armed[0] = False
            in_window.set()
            go_on.wait(60)
        return mapping(index)

    c._mapping = held_mapping
    armed[0] = True
    c._session._stream.transport._sock.shutdown(socket.SHUT_RDWR)
    errors: list[BaseException] = []

    def run(fn):
        def body():
            try:
                fn()
            except BaseException as exc:  # surfaced by the assertion below
                errors.append(exc)

        return threading.Thread(target=body)

    reconnecting = run(c.stat)
    reconnecting.start()
    assert in_window.wait(60)

    got: dict = {}

    def lease_and_put():
        got["lease"] = c.reserve("k", {"x": 4096})
        c.put("small", {"x": np.full(1000, 7, np.uint8)})  # through the arena

    other = run(lease_and_put)
    other.start()
    other.join(0.5)  # with the bug it finishes here, on the half-made connection
    go_on.set()
    reconnecting.join(60)
    other.join(60)
    assert not errors, errors
    assert c.generation == 1

    lease = got["lease"]
    try:
        with lease:
            lease["x"][:] = 3
    except LeaseExpired as exc:
        raise AssertionError(f"a live lease was refused at seal: {exc}") from None
    c.put("small2", {"x": np.full(1000, 9, np.uint8)})

    assert np.array_equal(c.get("k")["x"], np.full(4096, 3, np.uint8))
    assert np.array_equal(c.get("small")["x"], np.full(1000, 7, np.uint8))
    assert np.array_equal(c.get("small2")["x"], np.full(1000, 9, np.uint8))
    s = observer.stat()
    assert s.pending == 0  # no reservation left behind
    assert s.arenas == 1  # the one arena of c's live connection, not a leaked second
    assert s.write_leases == 0  # the reservation was sealed, not leaked
    c.close()
    observer.close()
