"""The strict ring allocator: never overlapping live data, FIFO reuse, wrap, oversize, resets."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker._server.ring_allocator import RingAllocator, RingOversize
from kvbroker.errors import Timeout


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 80), st.integers(0, 1000)), max_size=60),
)
def test_never_overlaps_live_data(size, ops):
    ring = RingAllocator(size)
    live = []
    for is_alloc, n, pick in ops:
        if is_alloc or not live:
            if n > size:
                with pytest.raises(RingOversize):
                    ring.alloc(n)
                continue
            try:
                r = ring.alloc(n)
            except Timeout:
                continue
            assert 0 <= r.offset and r.end <= size
            for o in live:
                assert r.end <= o.offset or o.end <= r.offset, (r, o)
            live.append(r)
        else:
            ring.free(live.pop(pick % len(live)))
            if not live:
                assert ring.used == 0
                assert ring.alloc(1).offset == 0  # an empty ring restarts at 0
                ring.free(ring.live()[0])


def test_fifo_reuse_wrap_and_reset():
    ring = RingAllocator(100)
    a, b, c = ring.alloc(40), ring.alloc(40), ring.alloc(10)
    assert (a.offset, b.offset, c.offset) == (0, 40, 80)
    ring.free(b)  # not the oldest: its space is not reusable yet
    with pytest.raises(Timeout):
        ring.alloc(20)
    ring.free(a)  # frontier moves past a and b
    d = ring.alloc(20)  # 10 left at the end: wraps to 0, the tail is wasted
    assert d.offset == 0
    e = ring.alloc(60)
    assert e.offset == 20
    with pytest.raises(Timeout):
        ring.alloc(1)  # wrapped: head (80) has met the oldest live region, c at 80
    ring.free(c), ring.free(d), ring.free(e)
    assert ring.used == 0 and ring.alloc(100).offset == 0


def test_oversize_fails_at_once_even_with_a_long_wait():
    ring = RingAllocator(10)
    t0 = time.monotonic()
    with pytest.raises(RingOversize):
        ring.alloc(11, timeout=30)
    assert time.monotonic() - t0 < 1


def test_bounded_wait_is_woken_by_a_free_and_aborts_free():
    ring = RingAllocator(10)
    with pytest.raises(RuntimeError):
        with ring.region(8):
            raise RuntimeError("aborted request")
    assert ring.used == 0  # the abort path freed its region
    r = ring.alloc(8)
    threading.Timer(0.1, ring.free, (r,)).start()
    got = ring.alloc(8, timeout=5)
    assert got.offset == 0
    t0 = time.monotonic()
    with pytest.raises(Timeout, match="within 0.2 s"):
        ring.alloc(5, timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 2
