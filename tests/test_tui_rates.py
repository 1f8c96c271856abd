"""Rates computed by the monitor from consecutive snapshots' counters."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbroker._wire.stats import Counters
from kvbroker.tui._rates import RateHistory, Rates
from kvbroker.tui.testing import make_snapshot


def with_counters(snap, at: float, **counters):
    return dataclasses.replace(snap, taken_at=at, counters=Counters(**counters))


def test_rates_between_two_snapshots():
    base = make_snapshot(0)
    a = with_counters(
        base,
        100.0,
        publishes=10,
        claims=5,
        bytes_in=10**9,
        bytes_out=0,
        hits=5,
        misses=0,
        evictions=1,
        requests=20,
    )
    b = with_counters(
        base,
        102.0,
        publishes=30,
        claims=25,
        bytes_in=5 * 10**9,
        bytes_out=3 * 10**9,
        hits=20,
        misses=5,
        evictions=5,
        requests=80,
    )
    r = Rates.between(a, b)
    assert r.publish_gbps == pytest.approx(2.0)
    assert r.claim_gbps == pytest.approx(1.5)
    assert r.publish_ops == pytest.approx(10.0)
    assert r.claim_ops == pytest.approx(10.0)
    assert r.hit_rate == pytest.approx(15 / 20)
    assert r.evictions == pytest.approx(2.0)


def test_no_lookups_means_no_hit_rate_not_zero():
    base = make_snapshot(0)
    r = Rates.between(with_counters(base, 1.0, hits=3), with_counters(base, 2.0, hits=3))
    assert r.hit_rate is None


def test_restarted_daemon_starts_a_new_history():
    history = RateHistory()
    for step in range(4):
        history.add(make_snapshot(step))
    assert len(history.samples) == 3
    reborn = dataclasses.replace(make_snapshot(5), pid=9999, started_at=make_snapshot(5).taken_at)
    assert history.add(reborn) is None
    assert len(history.samples) == 0
    assert history.add(make_snapshot(6)) is None  # back to the old pid: again not comparable
    assert len(history.samples) == 0


def test_counters_going_backwards_reset_the_history():
    history = RateHistory()
    history.add(make_snapshot(3))
    history.add(make_snapshot(4))
    assert history.add(make_snapshot(1)) is None  # earlier counters, same daemon identity
    assert len(history.samples) == 0


@given(
    steps=st.lists(
        st.tuples(st.floats(0.05, 10.0), st.integers(0, 10**10), st.integers(0, 10**4)),
        min_size=2,
        max_size=30,
    )
)
def test_rates_integrate_back_to_the_counters(steps):
    """Summing rate x interval over the history gives back the counters' growth."""
    history = RateHistory(length=100)
    base = make_snapshot(0)
    at, total_bytes, total_ops = 0.0, 0, 0
    for dt, nbytes, ops in steps:
        at, total_bytes, total_ops = at + dt, total_bytes + nbytes, total_ops + ops
        history.add(
            with_counters(base, at, bytes_in=total_bytes, publishes=total_ops, requests=total_ops)
        )
    dts = [dt for dt, _, _ in steps[1:]]
    grown_bytes = sum(nbytes for _, nbytes, _ in steps[1:])
    grown_ops = sum(ops for _, _, ops in steps[1:])
    assert len(history.samples) == len(steps) - 1
    assert sum(r.publish_gbps * 1e9 * dt for r, dt in zip(history.samples, dts, strict=True)) == (
        pytest.approx(grown_bytes, rel=1e-6, abs=1e-3)
    )
    assert sum(r.publish_ops * dt for r, dt in zip(history.samples, dts, strict=True)) == (
        pytest.approx(grown_ops, rel=1e-6, abs=1e-6)
    )
    assert all(r.publish_gbps >= 0 and r.publish_ops >= 0 for r in history.samples)
