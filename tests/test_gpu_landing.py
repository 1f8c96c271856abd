"""kvbroker._client.gpu_landing: who releases a landing claim's lease, when, and what a
failure does. CUDA events are replaced by stand-ins here (the CUDA side is tested in
tests/test_integration_transformers.py and tests/test_gpu.py on a GPU host)."""

from __future__ import annotations

import threading

import pytest

from kvbroker import KVBrokerError
from kvbroker._client.gpu_landing import Finisher, Landing


class FakeEvent:
    """A CUDA event stand-in: synchronize() blocks until the test lets the copy land."""

    def __init__(self, fails: bool = False) -> None:
        self.gate = threading.Event()
        self.fails = fails

    def synchronize(self) -> None:
        assert self.gate.wait(10), "the test never let this copy land"
        if self.fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def query(self) -> bool:
        return self.gate.is_set()


class FakeLease:
    def __init__(self, log: list, name: str, release_fails: bool = False) -> None:
        self.id, self.log, self.name, self.release_fails = name, log, name, release_fails

    def release(self, consume: bool = True) -> None:
        self.log.append(("release", self.name, consume))
        if self.release_fails:
            raise KVBrokerError("the daemon went away")


def _landing(log, name, *, fails=False, release_fails=False, after=True):
    done = FakeEvent(fails)
    lease = FakeLease(log, name, release_fails)
    run_after = (lambda: log.append(("after", name))) if after else None
    return Landing(lease, [done], done, run_after), done


def test_the_lease_is_released_after_the_copies_land_then_after_runs():
    log: list = []
    f = Finisher()
    landing, done = _landing(log, "a")
    f.submit(landing)
    assert not landing.finished and log == []  # still landing: the lease is held
    with pytest.raises(TimeoutError):
        landing.finish(timeout=0.05)
    done.gate.set()
    landing.finish(timeout=60)
    assert landing.landed and landing.finished
    assert log == [("release", "a", True), ("after", "a")]
    f.close()


def test_a_failed_copy_releases_without_consuming_skips_after_and_finish_raises():
    log: list = []
    f = Finisher()
    landing, done = _landing(log, "bad", fails=True)
    f.submit(landing)
    done.gate.set()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        landing.finish(timeout=60)
    assert log == [("release", "bad", False)]
    f.close()


def test_a_failed_release_is_kept_for_finish_and_the_next_landing_still_completes():
    log: list = []
    f = Finisher()
    first, d1 = _landing(log, "first", release_fails=True)
    second, d2 = _landing(log, "second")
    f.submit(first)
    f.submit(second)
    d1.gate.set()
    d2.gate.set()
    second.finish(timeout=60)
    with pytest.raises(KVBrokerError, match="went away"):
        first.finish(timeout=60)
    assert ("after", "first") not in log  # not counted: its release failed
    assert log[-2:] == [("release", "second", True), ("after", "second")]
    f.close()


def test_close_completes_every_queued_landing_in_order_and_refuses_new_ones():
    log: list = []
    f = Finisher()
    landings = [_landing(log, n) for n in ("x", "y", "z")]
    for landing, _ in landings:
        f.submit(landing)
    closer = threading.Thread(target=f.close)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive()  # close waits: the copies still read the pools
    for _, done in reversed(landings):
        done.gate.set()
    closer.join(60)
    assert not closer.is_alive()
    assert [e[1] for e in log if e[0] == "release"] == ["x", "y", "z"]
    assert all(landing.finished for landing, _ in landings)
    with pytest.raises(KVBrokerError, match="closed"):
        f.submit(_landing(log, "late")[0])


def test_close_without_any_landing_starts_no_thread():
    before = threading.active_count()
    f = Finisher()
    f.close()
    f.close()  # twice is fine
    assert threading.active_count() == before


def test_cancel_after_drops_what_has_not_run_yet_and_says_when_it_is_too_late():
    log: list = []
    f = Finisher()
    first, d1 = _landing(log, "cancelled")
    f.submit(first)
    assert first.cancel_after() is True  # the caller failed after handing the lease over
    d1.gate.set()
    first.finish(timeout=60)
    assert log == [("release", "cancelled", True)]  # released once landed, nothing counted
    second, d2 = _landing(log, "ran")
    f.submit(second)
    d2.gate.set()
    second.finish(timeout=60)
    assert second.cancel_after() is False  # too late: it ran
    assert log[-1] == ("after", "ran")
    f.close()


def test_a_finisher_that_cannot_make_its_device_current_still_completes_every_landing(caplog):
    log: list = []
    f = Finisher(device="cuda:99")  # no such device here (no CUDA at all, or too few GPUs)
    landing, done = _landing(log, "still")
    f.submit(landing)
    done.gate.set()
    landing.finish(timeout=60)  # a finisher thread that died here would leave this hanging
    assert log == [("release", "still", True), ("after", "still")]
    assert "cannot make cuda:99 current" in caplog.text
    f.close()


def test_a_finisher_whose_thread_could_not_start_starts_one_at_the_next_landing(monkeypatch):
    log: list = []
    f = Finisher()
    real_start = threading.Thread.start
    calls = []

    def start_once_failing(self):
        calls.append(self.name)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    first, _ = _landing(log, "refused")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        f.submit(first)  # nothing queued: the caller still holds the lease
    second, done = _landing(log, "served")
    f.submit(second)
    done.gate.set()
    second.finish(timeout=60)
    assert log == [("release", "served", True), ("after", "served")]
    f.close()  # joins the thread that did start
