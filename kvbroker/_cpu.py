"""Whether this host has CPU to spare, for deciding to busy-poll instead of sleeping, and
whether a CPU is left idle by every other process, for the host copy engine's second thread.

Polling for a reply beats sleeping when a CPU is idle (a cross-CPU wake-up costs more than a
request on a VM), and loses badly when none is: the spinning process takes the CPU that the
process it waits for needs (measured on the 2-core VM under load: daemon spinning 262 µs p50
put+get against 227 µs without; client spinning 424 µs against 155 µs). Both the daemon and
the client ask :func:`cpu_spare` first. Both also yield their CPU between two polls, so a
spinning side no longer holds off a peer that shares its CPU, and polling pays up to a higher
pressure than before yielding: on the 2-core VM, polling regardless of pressure gave 92-94 µs
p50 put+get at 256 KiB where this gate at 10 % had turned it off (195-295 µs), with PSI 10-27 %
from other engineers' work and the polling itself (a spinning task that yields still counts as
waiting whenever another runs).

This module owns up to two file descriptors per process (``/proc/pressure/cpu``,
``/proc/stat``), kept open.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CpuPressure", "cpu_spare", "OthersBusy", "cpu_left_idle"]

_RECHECK = 0.1  # seconds a cpu_spare() answer is reused


class CpuPressure:
    """Linux PSI (``/proc/pressure/cpu``: share of the last 10 s in which runnable tasks
    waited for a CPU) under ``max_waiting`` percent; without PSI, the 1-minute load average
    under the number of CPUs this process may use."""

    def __init__(self, max_waiting: float = 30.0) -> None:
        self.max_waiting = max_waiting
        self.cpus = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
        try:
            self._fd: int | None = os.open("/proc/pressure/cpu", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def spare(self) -> bool:
        try:
            if self._fd is not None:
                line = os.pread(self._fd, 128, 0).split(b"\n", 1)[0]  # some avg10=... avg60=...
                return float(line.split()[1].split(b"=")[1]) < self.max_waiting
            return os.getloadavg()[0] < self.cpus
        except (OSError, ValueError, IndexError):
            return True


def cpu_spare() -> bool:
    """:meth:`CpuPressure.spare` for this process, re-read at most every 0.1 s (pread on the
    one descriptor, so a forked child may share it)."""
    return _spare.get()


class OthersBusy:
    """How many CPUs the other processes kept busy (stolen time included) between two calls
    of :meth:`cpus_busy`: the busy time of the CPUs this process may run on (the host's,
    unless it is pinned to some) from ``/proc/stat``, less this process's own (``os.times``,
    all its threads), over the time between them.

    Pressure (:class:`CpuPressure`) says whether tasks waited for a CPU; it stays low while one
    other process holds a core of two, which is what a second copy thread would then wait
    behind (measured on the 2-CPU VM beside a busy pytest: 32 MiB put+get at 0.64x of a
    memcpy split over 2 threads against 0.70x on 1, pressure at 7 %)."""

    def __init__(self) -> None:
        host = os.cpu_count() or 1  # /proc/stat's "cpu" line sums every online CPU
        try:
            mine = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            mine = []
        # Pinned to some of the host's CPUs (taskset, a cpuset): only theirs count, from
        # their "cpuN" lines; what other processes do on the rest takes nothing from us.
        self._lines = {b"cpu%d" % i for i in mine} if 0 < len(mine) < host else None
        # (a line is at most 6 + 10 * 21 bytes: the aggregate's and each CPU's up to ours)
        self._read = 256 if self._lines is None else 256 * (mine[-1] + 2)
        self.cpus = host if self._lines is None else len(mine)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        try:
            self._fd: int | None = os.open("/proc/stat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None
        self._last: tuple[int, int, float] | None = None
        self._pid = os.getpid()  # whose own time _last holds

    def _sample(self) -> tuple[int, int, float]:
        # "cpu  user nice system idle iowait irq softirq steal guest guest_nice", in ticks
        text = os.pread(self._fd, self._read, 0)
        if self._lines is None:
            ticks = [int(x) for x in text.split(b"\n", 1)[0].split()[1:9]]
        else:
            ticks = [0] * 8
            for line in text.split(b"\n"):
                fields = line.split()
                if fields and fields[0] in self._lines:
                    # strict=False: an old kernel's line has fewer fields
                    ticks = [a + int(b) for a, b in zip(ticks, fields[1:9], strict=False)]
        own = os.times()
        return sum(ticks), ticks[3] + ticks[4], (own.user + own.system) * self._tick

    def cpus_busy(self) -> float | None:
        """CPUs the other processes kept busy on average since the previous call (None on
        the first call, without /proc/stat, or when no tick has passed)."""
        if self._fd is None:
            return None
        try:
            now = self._sample()
        except (OSError, ValueError, IndexError):
            return None
        last, self._last = self._last, now
        if self._pid != os.getpid():  # a forked child: _last holds its parent's own time
            self._pid, last = os.getpid(), None
        if last is None or now[0] <= last[0]:
            return None
        total, idle, own = (a - b for a, b in zip(now, last, strict=True))
        return max(0.0, total - idle - own) / (total / self.cpus)


def cpu_left_idle(most: float = 0.25) -> bool:
    """Whether the other processes kept busy at most ``most`` of a CPU besides what this one
    uses, over the last 0.1 s or more (:class:`OthersBusy`; re-read at most every 0.1 s):
    whether a second thread of this process would find a core nobody else wants. False
    until a first interval has been measured."""
    return _left_idle.get(most)


def _others_left_idle(others: OthersBusy, last: bool, most: float) -> bool:
    busy = others.cpus_busy()
    return last if busy is None else busy <= most  # no interval measured: keep the last


class _Reread:
    """An answer reused for ``_RECHECK`` seconds, then re-read by ``read(source, last
    answer, *args)`` from a source that ``make()`` builds on first use (each opens a /proc
    file, kept open: two threads asking first at once must not both build one). One thread
    re-reads; one that finds it doing so returns the last answer rather than wait."""

    def __init__(self, make: Callable[[], Any], read: Callable[..., bool], first: bool) -> None:
        self._make = make
        self._read = read
        self._source: Any = None
        self.answer = first
        self._at = -1.0  # when the answer was read (time.monotonic)
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # (POSIX)
            # a thread that held it at a fork is not in the child: it would never be released
            os.register_at_fork(after_in_child=self._new_lock)

    def _new_lock(self) -> None:
        self._lock = threading.Lock()

    def get(self, *args: Any) -> bool:
        if time.monotonic() - self._at <= _RECHECK or not self._lock.acquire(blocking=False):
            return self.answer
        try:
            now = time.monotonic()
            if now - self._at > _RECHECK:  # (else another thread re-read it just before)
                if self._source is None:
                    self._source = self._make()
                self.answer = self._read(self._source, self.answer, *args)
                self._at = now
            return self.answer
        finally:
            self._lock.release()


_spare = _Reread(CpuPressure, lambda gate, last: gate.spare(), True)
_left_idle = _Reread(OthersBusy, _others_left_idle, False)
