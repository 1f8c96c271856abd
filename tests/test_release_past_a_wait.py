"""A blocking claim waits in the daemon; releases on the same connection are not held back.

A GPU landing's finisher thread releases leases on the client's one connection while the
engine's thread may be in a claim that waits for a prefill (``claim(..., wait=...)``). The
daemon answers a connection's requests in order, but serves releases (the op table's
``passes_a_wait``) past a waiting claim, and the client sends a one-way release without
waiting for the call in progress on the other thread.
"""

from __future__ import annotations

import threading
import time

from kvbroker._wire.protocol import OPS


# A release held behind the claim would wait for the claim's end: WAIT, far longer than what
# a release past it may take on a loaded machine (BOUND, within which the tests expect it).
WAIT, BOUND = 300.0, 60.0


def _gone(client, key: str, within: float = BOUND) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not client.exists(key):
            return True
        time.sleep(0.01)
    return False


def test_only_lease_ending_ops_pass_a_wait():
    assert {name for name, op in OPS.items() if op.passes_a_wait} == {
        "release",
        "release_many",
        "abort",
    }


def test_the_daemon_serves_a_release_queued_behind_a_waiting_claim(daemon):
    with daemon.client() as c, daemon.client() as other:
        c.put("held", {"x": b"abc"})
        lease = c.claim("held", consume=True)
        session = c._session
        waiting = session.submit(
            "claim",
            {
                "namespace": "default",
                "key": "later",
                "select": None,
                "consume": False,
                "wait": WAIT,
                "ttl": None,
            },
        )
        lease._drop_views()
        session.post("release", {"lease": lease.id, "consume": True})
        lease.ended = True
        # the consume-release freed the object while the claim behind which it was sent waits
        assert _gone(other, "held")
        assert not other.exists("later")
        other.put("later", {"x": b"def"})
        got = waiting.result()
        assert got["buffers"]["x"][2] == 3
        session.post("release", {"lease": got["lease"], "consume": False})
        assert c.stat().pools[0].leased_read == 0  # after the release on its connection


def test_a_release_from_another_thread_does_not_wait_for_a_blocking_claim(daemon):
    with daemon.client() as c, daemon.client() as other:
        c.put("held", {"x": b"abc"})
        lease = c.claim("held", consume=True)
        claimed = []
        session = c._session
        before = session._next_id
        waiter = threading.Thread(target=lambda: claimed.append(c.claim("later", wait=WAIT)))
        waiter.start()
        # Until the claim has gone out (its request id taken, under the client's reading
        # lock, which it holds until its reply): the release below then follows it on the
        # one connection, and the daemon reads the claim (and starts its wait) first.
        deadline = time.monotonic() + 30
        while session._next_id == before or not session._lock.locked():
            assert waiter.is_alive() and time.monotonic() < deadline
            time.sleep(0.001)
        assert session._next_id == before + 1  # the claim alone
        releaser = threading.Thread(target=lease.release)
        releaser.start()
        releaser.join(BOUND)  # a release held behind the claim would wait for its WAIT
        assert not releaser.is_alive()
        assert _gone(other, "held")
        assert waiter.is_alive()  # still waiting: the release went past it
        other.put("later", {"x": b"def"})
        waiter.join(BOUND)
        assert not waiter.is_alive()
        with claimed[0] as later:
            assert bytes(later["x"]) == b"def"
        assert c.ping() > 0  # the connection carries on, every reply read
        assert other.stat().pools[0].leased_read == 0


def test_a_release_does_not_pass_a_deferred_request_sent_before_it(make_daemon):
    """An evict matching buffer names over more than 20,000 of them runs in slices (deferred):
    a release sent after it must not take effect first (the leased object is skipped)."""
    d = make_daemon("--pool-size", "256M", "--page-size", "4K")
    with d.client() as c:
        for i in range(3):
            c.put(f"o{i}", {f"b{j}": b"x" for j in range(7500)})
        lease = c.claim("o0")
        session = c._session
        evict = session.submit(
            "evict",
            {
                "namespace": "default",
                "key": None,
                "match": None,
                "match_buffers": "b7499",
                "older_than": None,
                "all": False,
                "dry_run": False,
            },
        )
        lease._drop_views()
        session.post("release", {"lease": lease.id, "consume": False})
        lease.ended = True
        result = evict.result()
        assert result["skipped_leased"] == 1
        assert c.exists("o0")


def test_a_post_that_cannot_be_sent_leaves_nothing_to_wait_for(daemon):
    import pytest

    with daemon.client() as c:
        session = c._session
        with pytest.raises(TypeError):
            session.post("release", {"lease": object(), "consume": True})
        assert session.settled
        started = time.monotonic()
    assert time.monotonic() - started < 1.0  # close did not wait for a reply never coming
