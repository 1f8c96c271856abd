"""Extent allocator: never two live extents overlap, frees coalesce, accounting is exact."""

from itertools import pairwise
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvbroker._server.allocator import ExtentAllocator


def test_best_fit_and_coalescing():
    a = ExtentAllocator(100)
    x = a.alloc(10)
    y = a.alloc(20)
    z = a.alloc(30)
    assert (x, y, z) == (0, 10, 30)
    a.free_extent(y, 20)  # hole of 20 at 10
    assert a.alloc(15) == 10  # best fit: the 20-page hole, not the 40-page tail
    a.free_extent(10, 15)
    a.free_extent(x, 10)
    a.free_extent(z, 30)
    assert a.free_extents() == [(0, 100)]
    assert a.used == 0 and a.fragmentation == 0.0


def test_fragmentation_reported():
    a = ExtentAllocator(8)
    starts = [a.alloc(1) for _ in range(8)]
    for s in starts[::2]:
        a.free_extent(s, 1)
    assert a.free == 4 and a.largest_free == 1
    assert a.fragmentation == pytest.approx(0.75)
    assert a.alloc(2) is None  # 4 pages free, none contiguous


def test_rejects_bad_frees():
    a = ExtentAllocator(10)
    s = a.alloc(4)
    with pytest.raises(ValueError):
        a.free_extent(s, 3)
    a.free_extent(s, 4)
    with pytest.raises(ValueError):
        a.free_extent(s, 4)  # double free
    with pytest.raises(ValueError):
        a.alloc(0)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.a = ExtentAllocator(64)
        self.live: dict[int, int] = {}

    @rule(n=st.integers(1, 20))
    def alloc(self, n):
        start = self.a.alloc(n)
        if start is None:
            # Refusing is only allowed when no free run is long enough.
            assert all(size < n for _, size in self.a.free_extents())
            return
        assert 0 <= start and start + n <= 64
        self.live[start] = n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        start = data.draw(st.sampled_from(sorted(self.live)))
        self.a.free_extent(start, self.live.pop(start))

    @invariant()
    def no_overlap_and_exact_accounting(self):
        runs = sorted(list(self.live.items()) + self.a.free_extents())
        pos = 0
        for start, size in runs:
            assert start == pos, "live and free extents must tile the pool exactly"
            pos += size
        assert pos == 64
        assert self.a.used == sum(self.live.values())
        free = self.a.free_extents()
        for (s1, n1), (s2, _) in pairwise(free):
            assert s1 + n1 < s2, "adjacent free extents must have been coalesced"


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=40))
def test_free_everything_restores_one_extent(sizes):
    a = ExtentAllocator(2000)
    got = [(a.alloc(n), n) for n in sizes]
    for start, n in reversed(got):
        a.free_extent(start, n)
    assert a.free_extents() == [(0, 2000)]
