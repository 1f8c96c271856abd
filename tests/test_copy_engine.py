"""The host copy engine (kvbroker._client.engine): copies and chunk checksums over threads,
bit for bit the single-threaded definition."""

from __future__ import annotations

import multiprocessing
import os
import struct
import threading
import time

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

from kvbroker._client import engine as E
from kvbroker._client import integrity
from kvbroker._wire import checksum as cs


def reference(data, chunk: int) -> int:
    data = bytes(data)
    digests = [xxhash.xxh3_64_intdigest(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(digests)}Q", len(data), *digests))


@pytest.fixture
def small_chunks():
    """A 4 KiB chunk for the duration of a test: many chunks, and many threads' worth of
    ranges, in small arrays (the engine and the definition read CHUNK at call time)."""
    old = cs.CHUNK
    cs.CHUNK = 4096
    yield 4096
    cs.CHUNK = old


def require_c_loops() -> None:
    """For a test of the C loops: a skip only where they are absent on purpose (the extension
    was not built: no compiler at install; or KVBROKER_NATIVE_COPY=0), a failure where it was
    built and the engine refused it (it does not import, or its digests are wrong)."""
    if E.NATIVE:
        return
    if os.environ.get("KVBROKER_NATIVE_COPY", "1") == "0":
        pytest.skip("KVBROKER_NATIVE_COPY=0 turns the C loops off")
    if E.C_LOOPS_REFUSED == "not built":
        pytest.skip("C extension not built")
    pytest.fail(f"kvbroker._copyhash was built, but the engine refused it: {E.C_LOOPS_REFUSED}")


# A test (or a parameter) of the C loops: require_c_loops() first (the autouse fixture below).
needs_native = pytest.mark.c_loops
# Both loops: the C extension's (one call per range) and Python's (the fallback where it
# was not built).
NATIVE_MODES = [pytest.param(True, id="C-loops"), pytest.param(False, id="Python-loops")]


@pytest.fixture(autouse=True)
def _c_loops_where_asked(request):
    callspec = getattr(request.node, "callspec", None)
    if request.node.get_closest_marker("c_loops") is not None or (
        callspec is not None and callspec.params.get("native") is True
    ):
        require_c_loops()


# the fixture only sets a constant, the same for every example
@pytest.mark.parametrize("native", NATIVE_MODES)
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(0, 70_000),
    src_off=st.integers(0, 15),
    dst_off=st.integers(0, 15),
    threads=st.integers(1, 5),
    split_chunks=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_copies_and_checksums_equal_the_single_threaded_definition(
    small_chunks, native, n, src_off, dst_off, threads, split_chunks, seed
):
    rng = np.random.default_rng(seed)
    src_buf = rng.integers(0, 256, n + 32, dtype=np.uint8)
    dst_buf = rng.integers(0, 256, n + 32, dtype=np.uint8)
    before = dst_buf.copy()
    src = src_buf[src_off : src_off + n]  # any alignment
    dst = dst_buf[dst_off : dst_off + n]
    e = E.CopyEngine(threads, split_min=split_chunks * small_chunks, native=native)
    assert e.native is native
    try:
        want = reference(src, small_chunks)
        assert e.hash(src) == want
        assert e.copy_hashed(dst, src) == want
        assert np.array_equal(dst, src)
        # nothing outside the destination was written
        assert np.array_equal(dst_buf[:dst_off], before[:dst_off])
        assert np.array_equal(dst_buf[dst_off + n :], before[dst_off + n :])
        dst[:] = 0
        e.copy(dst, src)
        assert np.array_equal(dst, src)
    finally:
        e.close()


@given(n=st.integers(0, 10**9), threads=st.integers(1, 64), split=st.integers(1, 64))
def test_ranges_cover_the_copy_in_whole_chunks(n, threads, split):
    e = E.CopyEngine(threads, split_min=split * cs.CHUNK)
    rs = e.ranges(n)
    assert rs[0][0] == 0 and rs[-1][1] == n
    assert all(a < b for a, b in rs) or rs == [(0, 0)]
    assert all(rs[i][1] == rs[i + 1][0] for i in range(len(rs) - 1))
    assert all(a % cs.CHUNK == 0 for a, _ in rs)
    assert len(rs) <= threads
    if len(rs) > 1:
        assert n // len(rs) >= e.split_min // 2  # split only where each thread gets a fair share


@pytest.mark.parametrize("native", NATIVE_MODES)
def test_real_chunk_size_over_threads(native):
    n = 5 * cs.CHUNK + 12345
    src = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
    dst = np.empty(n, dtype=np.uint8)
    e = E.CopyEngine(4, split_min=cs.CHUNK, native=native)
    try:
        assert len(e.ranges(n)) == 4
        assert e.copy_hashed(dst, src) == cs.digest(src) == reference(src, cs.CHUNK)
        assert np.array_equal(dst, src)
    finally:
        e.close()


@pytest.mark.parametrize("native", NATIVE_MODES)
def test_errors_in_workers_reach_the_caller(small_chunks, native):
    src = np.arange(40_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    e = E.CopyEngine(3, split_min=small_chunks, native=native)
    try:
        with pytest.raises(ValueError, match="copy of 40000 bytes into a view of 39999"):
            e.copy(dst[1:], src)
        dst.flags.writeable = False
        # numpy says "read-only", the buffer protocol "not writable"; nothing is copied
        with pytest.raises((ValueError, BufferError), match="read-only|not writable"):
            e.copy_hashed(dst, src)
        assert not dst.any()
        dst.flags.writeable = True
        assert e.copy_hashed(dst, src) == reference(src, small_chunks)  # still usable
    finally:
        e.close()


def _child(q):
    src = np.arange(3 * cs.CHUNK, dtype=np.uint8)
    dst = np.empty_like(src)
    q.put(E.default_engine().copy_hashed(dst, src) == cs.digest(src) and bool((dst == src).all()))


def test_the_engine_works_in_a_forked_child():
    e = E._default
    E._default = E.CopyEngine(3, split_min=cs.CHUNK)
    try:
        src = np.arange(3 * cs.CHUNK, dtype=np.uint8)
        E.default_engine().copy_hashed(np.empty_like(src), src)  # the parent's workers exist
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(q,))
        p.start()
        assert q.get(timeout=60) is True  # not hung on the parent's (absent) workers
        p.join(60)
        assert p.exitcode == 0
    finally:
        E._default.close()
        E._default = e


def test_default_threads(monkeypatch):
    monkeypatch.delenv("KVBROKER_COPY_THREADS", raising=False)
    from kvbroker._cpu import cpu_left_idle

    for cpus, want in ((1, 1), (2, 2), (3, 3), (8, 8), (64, E.MAX_THREADS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert E.default_threads() == want
        # on 2 CPUs or fewer the second is shared: split only while nobody else needs it
        assert E.default_gate() is (cpu_left_idle if cpus <= E.SHARED_CPUS else None)
    monkeypatch.setenv("KVBROKER_COPY_THREADS", "5")
    assert E.default_threads() == 5
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert E.default_gate() is None  # threads asked for are used
    for bad in ("0", "-1", "many"):
        monkeypatch.setenv("KVBROKER_COPY_THREADS", bad)
        with pytest.raises(ValueError, match="KVBROKER_COPY_THREADS"):
            E.default_threads()


def test_others_busy_leaves_out_this_process(monkeypatch):
    from kvbroker import _cpu

    o = _cpu.OthersBusy()
    if o._fd is None:
        pytest.skip("no /proc/stat")
    assert o.cpus_busy() is None  # nothing to compare with yet
    spin_until = time.perf_counter() + 0.05
    while time.perf_counter() < spin_until:  # this process's own work
        pass
    real = o.cpus_busy()
    assert real is None or 0.0 <= real <= o.cpus
    # (total, idle, own) ticks: 2 CPUs over 100 ticks, 50 idle, 50 this process's
    samples = iter([(1000, 400, 100.0), (1200, 450, 150.0), (1200, 450, 150.0)])
    monkeypatch.setattr(o, "_sample", lambda: next(samples))
    o.cpus, o._last = 2, None
    assert o.cpus_busy() is None
    assert o.cpus_busy() == pytest.approx(1.0)  # the other 100 busy ticks: one CPU
    assert o.cpus_busy() is None  # no tick passed


def test_others_busy_counts_only_the_cpus_this_process_may_run_on(monkeypatch, tmp_path):
    """Pinned to 2 of a host's 4 CPUs (taskset, a cpuset), the other 2 busy: what runs
    there takes no CPU from this process, and a second copy thread would find its second
    CPU idle (the host-wide "cpu" line said 2 CPUs busy: never split)."""
    from kvbroker import _cpu

    def stat(busy_ticks):  # cpu0/cpu1 idle, cpu2/cpu3 busy for busy_ticks each
        lines = [
            f"cpu{i} {busy_ticks * (i >= 2)} 0 0 {busy_ticks * (i < 2)} 0 0 0 0 0 0"
            for i in range(4)
        ]
        total = f"cpu  {2 * busy_ticks} 0 0 {2 * busy_ticks} 0 0 0 0 0 0"
        fake.write_text("\n".join([total, *lines, "intr 1 2 3", ""]))

    fake = tmp_path / "stat"
    stat(1000)
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda path, *a: real_open(str(fake) if path == "/proc/stat" else path, *a)
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "times", lambda: os.times_result((1.0, 0.0, 0.0, 0.0, 0.0)))
    o = _cpu.OthersBusy()
    assert o.cpus_busy() is None
    stat(1100)  # 100 ticks later: cpu2 and cpu3 busy throughout, ours idle
    assert o.cpus_busy() == 0.0
    os.close(o._fd)


def test_others_busy_reads_no_interval_across_a_fork(monkeypatch):
    """The parent sampled its own time (5 ticks) before forking; the child's own time
    restarts from zero and may pass 5 before its first reading: the interval mixes the
    parent's time and the child's (it read 1.25 CPUs busy); no reading until the child's
    own second sample."""
    from kvbroker import _cpu

    o = _cpu.OthersBusy()
    samples = iter([(1000, 400, 5.0), (1200, 450, 30.0), (1400, 500, 40.0)])
    monkeypatch.setattr(o, "_sample", lambda: next(samples))
    o.cpus, o._last = 2, None
    assert o.cpus_busy() is None
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)  # now in the child
    assert o.cpus_busy() is None
    assert o.cpus_busy() == pytest.approx(1.4)  # (200 - 50 - 10) busy ticks of others


def test_cpu_left_idle_follows_the_other_processes(monkeypatch):
    from kvbroker import _cpu

    readings = iter([None, 0.1, 0.9, None, 0.2])

    class Fake:
        def cpus_busy(self):
            return next(readings)

    monkeypatch.setattr(_cpu._left_idle, "_source", Fake())
    monkeypatch.setattr(_cpu._left_idle, "answer", False)
    answers = []
    for _ in range(5):
        monkeypatch.setattr(_cpu._left_idle, "_at", -1.0)  # past the 0.1 s reuse
        answers.append(_cpu.cpu_left_idle())
    # no interval yet: no; then idle, busy, unknown (the last answer kept), idle
    assert answers == [False, True, False, False, True]


def test_threads_asking_the_cpu_gates_first_at_once_open_each_proc_file_once(monkeypatch):
    """Threads that call cpu_spare() and cpu_left_idle() for the first time together, while
    opening the /proc file is slow: one opening of each (every thread had made its own gate,
    and each gate but the one kept left its descriptor open for good)."""
    import importlib.util

    from kvbroker import _cpu

    # a fresh copy of the module: asked nothing yet (the loaded one has been, by other tests)
    spec = importlib.util.spec_from_file_location("kvbroker._cpu_fresh", _cpu.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    tried, fds = [], []
    real_open = os.open

    def slow_open(path, *args):
        if path in ("/proc/pressure/cpu", "/proc/stat"):
            tried.append(path)
            time.sleep(0.05)  # the other threads ask meanwhile
        fd = real_open(path, *args)
        fds.append(fd)
        return fd

    monkeypatch.setattr(os, "open", slow_open)
    threads = 8
    start = threading.Barrier(threads)
    answers = []

    def ask():
        start.wait()
        answers.append((fresh.cpu_spare(), fresh.cpu_left_idle()))

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for fd in fds:
            os.close(fd)
    assert sorted(tried) == ["/proc/pressure/cpu", "/proc/stat"]
    assert len(answers) == threads and all(type(a) is bool for pair in answers for a in pair)


def test_a_forked_child_rereads_the_cpu_gate(monkeypatch):
    """A thread re-reading a gate when the process forks is not in the child: the lock it
    held is a fresh one there, or the child would return its parent's last answer forever."""
    from kvbroker import _cpu

    class Fake:
        def spare(self):
            return False

    monkeypatch.setattr(_cpu._spare, "_source", Fake())
    monkeypatch.setattr(_cpu._spare, "answer", True)
    monkeypatch.setattr(_cpu._spare, "_at", -1.0)
    with _cpu._spare._lock:  # as a re-reading thread holds it
        pid = os.fork()
        if pid == 0:  # (never back into pytest from the child)
            try:
                os._exit(0 if _cpu.cpu_spare() is False else 1)
            finally:
                os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child never re-read"


def test_a_gated_engine_splits_only_while_its_gate_allows():
    spare = [True]
    e = E.CopyEngine(2, split_min=cs.CHUNK, split_while=lambda: spare[0])
    try:
        src = np.random.default_rng(4).integers(0, 256, 4 * cs.CHUNK + 5, dtype=np.uint8)
        for allowed, parts in ((True, 2), (False, 1)):
            spare[0] = allowed
            assert len(e.ranges(src.nbytes)) == parts
            dst = np.zeros_like(src)
            assert e.copy_hashed(dst, src) == cs.digest(src) and np.array_equal(dst, src)
            assert e.hash(src) == cs.digest(src)
    finally:
        e.close()


def test_jobs_run_in_order_over_the_threads_a_split_allows():
    spare = [True]
    e = E.CopyEngine(3, split_min=cs.CHUNK, split_while=lambda: spare[0])
    try:
        together, meet = threading.Barrier(3), [True]

        def job(i):
            if meet[0] and i in (0, 2, 4):
                together.wait(timeout=60)  # the 3 shares' first jobs: passes if all run at once
            return i, threading.get_ident()

        jobs = [lambda i=i: job(i) for i in range(7)]
        # 7 jobs of 7 MiB in all: 3 shares (jobs 0-1, 2-3, 4-6), the caller's the first
        done = e.run_jobs(jobs, 7 * cs.CHUNK)
        assert [i for i, _ in done] == list(range(7))
        assert done[0][1] == threading.get_ident()
        assert len({t for _, t in done}) == 3
        meet[0] = False
        for allowed, nbytes in ((True, cs.CHUNK), (False, 7 * cs.CHUNK)):
            spare[0] = allowed  # too few bytes to split, or the gate says no: all here
            assert {t for _, t in e.run_jobs(jobs, nbytes)} == {threading.get_ident()}
        spare[0] = True
        pair = threading.Barrier(2)
        two = [lambda: pair.wait(timeout=60) is not None and threading.get_ident()] * 2
        assert len(set(e.run_jobs(two, 7 * cs.CHUNK))) == 2  # as many shares as jobs, no more
        assert e.run_jobs([], 7 * cs.CHUNK) == []
    finally:
        e.close()


def test_a_failed_job_is_raised_once_every_job_ended():
    e = E.CopyEngine(4, split_min=cs.CHUNK)
    ended = []

    def slow(i):
        time.sleep(0.05)
        ended.append(i)

    def fail():
        raise ValueError("this job failed")

    try:
        # 4 shares of 2 jobs: the failing one ends the last share, after job 6
        jobs = [lambda i=i: slow(i) for i in range(7)] + [fail]
        with pytest.raises(ValueError, match="this job failed"):
            e.run_jobs(jobs, 8 * cs.CHUNK)
        assert sorted(ended) == list(range(7))
    finally:
        e.close()


def test_the_first_failed_job_in_order_is_raised():
    e = E.CopyEngine(4, split_min=cs.CHUNK)

    def fail(i):
        time.sleep(0.05 if i == 2 else 0)  # the later one fails first
        raise ValueError(f"job {i} failed")

    try:
        jobs = [
            lambda: None,
            lambda: None,
            lambda: fail(2),
            lambda: None,
            lambda: None,
            lambda: None,
            lambda: fail(6),
            lambda: None,
        ]
        with pytest.raises(ValueError, match="job 2 failed"):
            e.run_jobs(jobs, 8 * cs.CHUNK)
    finally:
        e.close()


def test_a_caller_never_waits_behind_another_callers_jobs():
    """Two threads share the engine's workers (a background load beside a step's seal):
    once its own share is done, a caller runs the shares no worker started itself. The
    other caller's jobs hold every worker until this caller has returned: had it waited for
    a worker, it would never return while they do."""
    e = E.CopyEngine(3, split_min=cs.CHUNK)
    running, release = threading.Semaphore(0), threading.Event()

    def background():
        running.release()
        assert release.wait(60)

    try:
        other = threading.Thread(target=e.run_jobs, args=([background] * 3, 3 * cs.CHUNK))
        other.start()
        for _ in range(3):  # its own share on its thread, one on each of the 2 workers
            assert running.acquire(timeout=60)
        got = []
        caller = threading.Thread(
            target=lambda: got.append(e.run_jobs([lambda i=i: i for i in range(3)], 3 * cs.CHUNK))
        )
        caller.start()
        caller.join(60)  # a bound against a hang only: it returns at once, or never
        done = not caller.is_alive()
        release.set()
        caller.join()
        other.join()
        assert done and got == [[0, 1, 2]]
    finally:
        release.set()
        e.close()


def test_hash_here_is_the_engines_hash_on_this_thread():
    src = np.random.default_rng(5).integers(0, 256, 3 * cs.CHUNK + 77, dtype=np.uint8)
    for native in (True, False):
        if native:
            require_c_loops()
        e = E.CopyEngine(4, split_min=cs.CHUNK, native=native)
        try:
            assert e.hash_here(src) == e.hash(src) == cs.digest(src)
        finally:
            e.close()
    assert integrity.digest_here(src) == integrity.digest(src) == cs.encode(cs.digest(src))
    assert integrity.digest_here(src, cs.KIND_XXH3) == integrity.digest(src, cs.KIND_XXH3)


def _progress_during(call) -> int:
    """How many times another Python thread ran while ``call`` ran in a worker thread.

    Not counted: the first and last 2 ms of the worker's window, where the worker may be
    between its clock reading and the call, waiting for the GIL (at most a switch interval,
    0.5 ms here): a call that holds the GIL throughout still has those."""
    import sys

    window = []
    ticks = []
    stop = threading.Event()
    margin = 0.002

    def work():
        start = time.perf_counter()
        call()
        window.extend((start, time.perf_counter()))
        stop.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        t = threading.Thread(target=work)
        t.start()
        while not stop.is_set():
            ticks.append(time.perf_counter())
        t.join()
    finally:
        sys.setswitchinterval(old)
    start, end = window
    assert end - start > 4 * margin, "the call is too short to probe"
    return sum(start + margin < x < end - margin for x in ticks)


@pytest.mark.parametrize(
    "what",
    [
        "xxh3_64 of a chunk",
        "numpy copyto",
        pytest.param("C copy_hashed", marks=needs_native),
        pytest.param("C copy_hashed, streaming stores", marks=needs_native),
        pytest.param("C hash_chunks", marks=needs_native),
        pytest.param("C copy", marks=needs_native),
        pytest.param("C copy, streaming stores", marks=needs_native),
    ],
)
def test_the_hash_and_the_copy_release_the_gil(what):
    """The engine's threads only run in parallel if the calls it makes per range (C loops)
    or per chunk (Python loops) let go of the GIL; a call that held it would let the
    spinning main thread run zero times."""
    big = np.ones(256 << 20, dtype=np.uint8)
    other = np.empty_like(big)
    call = {
        "xxh3_64 of a chunk": lambda: xxhash.xxh3_64_intdigest(big),
        "numpy copyto": lambda: np.copyto(other, big),
        "C copy_hashed": lambda: E._c_copy_hashed(other, big, cs.CHUNK),
        "C copy_hashed, streaming stores": lambda: E._c_copy_hashed(other, big, cs.CHUNK, 0, True),
        "C hash_chunks": lambda: E._c_hash_chunks(big, cs.CHUNK),
        "C copy": lambda: E._c_copy(other, big),
        "C copy, streaming stores": lambda: E._c_copy(other, big, True),
    }[what]
    # a loaded machine may not schedule the main thread in one window: a few tries
    assert any(_progress_during(call) > 0 for _ in range(5))


def test_the_gil_probe_sees_a_call_that_holds_it():
    """The probe above can fail: bytes repetition holds the GIL for its whole run."""
    assert any(_progress_during(lambda: b"x" * (256 << 20)) == 0 for _ in range(5))


def test_integrity_paths_over_threads(client):
    """put/get/claim(verify)/seal through a 3-thread default engine record and check the
    single-threaded definition."""
    saved = E._default
    E._default = E.CopyEngine(3, split_min=cs.CHUNK)
    try:
        a = np.random.default_rng(2).integers(0, 256, 6 * cs.CHUNK + 3, dtype=np.uint8)
        assert len(E._default.ranges(a.nbytes)) == 3
        client.put("k", {"a": a, "b": b"tail"})
        assert client.lookup("k").checksums["a"] == [1, reference(a, cs.CHUNK)]
        client.claim("k", verify=True).release()
        out = {"a": np.zeros_like(a)}
        client.get("k", out, verify=True)
        assert np.array_equal(out["a"], a)
        with client.reserve("w", {"x": a.nbytes}) as lease:
            lease["x"][:] = a
        assert client.lookup("w").checksums == {"x": [1, reference(a, cs.CHUNK)]}
        assert integrity.matches(a, [1, reference(a, cs.CHUNK)])
    finally:
        E._default.close()
        E._default = saved


def test_get_copies_large_buffers_out_over_the_engines_threads(client):
    """get without verify copies as put does: a buffer of several ranges over the engine's
    threads (one numpy copyto on the calling thread left a 16-core host at one core's speed),
    a small one on the calling thread."""
    splits = []

    class Recording(E.CopyEngine):
        def copy(self, dst, src):
            splits.append(len(self.ranges(src.nbytes)))
            super().copy(dst, src)

    saved = E._default
    E._default = Recording(3, split_min=cs.CHUNK)
    try:
        a = np.random.default_rng(3).integers(0, 256, 6 * cs.CHUNK + 3, dtype=np.uint8)
        client.put("k", {"a": a, "small": b"tail"})
        out = {"a": np.zeros_like(a), "small": bytearray(4)}
        client.get("k", out)
        assert np.array_equal(out["a"], a) and out["small"] == b"tail"
        assert splits == [3]  # the large buffer only, cut in three
    finally:
        E._default.close()
        E._default = saved


def test_get_refuses_destinations_the_bytes_would_not_land_in(client):
    """A strided array, a non-contiguous tensor, a read-only buffer or one of another size:
    a clear BadRequest before any byte is copied (a flat view of a strided array is a copy:
    the bytes went into it and were lost), the lease released, the object intact."""
    from kvbroker.errors import BadRequest

    data = np.arange(4096, dtype=np.uint8)
    client.put("obj", {"a": data, "b": data[:64]})
    good = np.zeros(64, dtype=np.uint8)
    strided = np.zeros((4096, 2), dtype=np.uint8)[:, 0]
    assert not strided.flags.c_contiguous
    with pytest.raises(BadRequest, match="contiguous"):
        client.get("obj", {"a": strided, "b": good})
    assert not strided.any() and not good.any()  # refused before copying anything
    with pytest.raises(BadRequest, match="read-only"):
        client.get("obj", {"a": bytes(4096)})
    with pytest.raises(BadRequest, match="4095 bytes, the buffer 4096"):
        client.get("obj", {"a": np.zeros(4095, dtype=np.uint8)})
    torch = pytest.importorskip("torch")
    t = torch.zeros((64, 128), dtype=torch.uint8).t()
    with pytest.raises(BadRequest, match="contiguous"):
        client.get("obj", {"a": t})
    assert client.stat().read_leases == 0
    into = {"a": torch.zeros(2048, dtype=torch.int16), "b": bytearray(64)}
    got = client.get("obj", into)
    assert got["a"] is into["a"] and bytes(got["a"].numpy().view(np.uint8)) == data.tobytes()
    assert bytes(got["b"]) == data[:64].tobytes()


def test_get_takes_any_mapping_of_destinations(client):
    """``out`` is any Mapping: one whose keys() is a list or a generator (a
    WeakValueDictionary's), as well as a dict. Names it has that the claim does not return are
    refused with BadRequest naming them, before anything is copied, and the object is kept."""
    import collections.abc
    import weakref

    from kvbroker.errors import BadRequest

    class ListKeys(collections.abc.Mapping):
        def __init__(self, d):
            self.d = d

        def __getitem__(self, k):
            return self.d[k]

        def __iter__(self):
            return iter(self.d)

        def __len__(self):
            return len(self.d)

        def keys(self):  # a list, as some mappings give
            return list(self.d)

    data = np.arange(256, dtype=np.uint8)
    for make in (dict, weakref.WeakValueDictionary, ListKeys):
        client.put("obj", {"a": data})
        dst = np.zeros(256, dtype=np.uint8)
        got = client.get("obj", make({"a": dst}), consume=True)
        assert got["a"] is dst and np.array_equal(dst, data)
        client.put("obj", {"a": data})
        other = np.zeros(256, dtype=np.uint8)
        with pytest.raises(BadRequest, match=r"out names buffer\(s\) \['zz'\]"):
            client.get("obj", make({"a": dst, "zz": other}), consume=True)
        assert client.exists("obj") and not other.any()  # refused: nothing consumed or copied
        client.evict("obj")


def test_get_asks_out_only_through_get_and_getitem_and_before_copying(client):
    """``get`` asks ``out`` for a buffer's destination with ``out.get(name)`` and returns
    ``out[name]``: an ``out`` with only those (no ``items``) gets its destinations filled and
    returned, and so does one that is empty by ``len`` yet serves a name (its destinations
    are still refused when two share memory). Both questions are asked before any byte is
    copied, so an ``out`` that fails one loses nothing: the consume-claim is not counted and
    the object stays."""

    class GetOnly:  # the least a destination map needs: no items(), no keys()
        def __init__(self, d, size=None):
            self.d, self.size = d, size

        def get(self, name, default=None):
            return self.d.get(name, default)

        def __getitem__(self, name):
            return self.d[name]

        def __iter__(self):
            return iter(self.d if self.size is None else ())

        def __len__(self):
            return len(self.d) if self.size is None else self.size

    data = np.arange(256, dtype=np.uint8)
    for out_of in (lambda d: GetOnly(d), lambda d: GetOnly(d, size=0)):
        client.put("obj", {"a": data, "b": data[::-1].copy()})
        dst = np.zeros(256, dtype=np.uint8)
        got = client.get("obj", out_of({"a": dst}), consume=True)
        assert got["a"] is dst and np.array_equal(dst, data)
        assert list(got) == ["a", "b"] and np.array_equal(got["b"], data[::-1])
        assert not client.exists("obj")

    from kvbroker.errors import BadRequest

    client.put("obj", {"a": data, "b": data})
    shared = np.zeros(256, dtype=np.uint8)
    with pytest.raises(BadRequest, match="share memory"):
        client.get("obj", GetOnly({"a": shared, "b": shared}, size=0), consume=True)
    assert client.exists("obj") and not shared.any()
    client.evict("obj")

    class FailsOnGetitem(GetOnly):
        def __getitem__(self, name):
            raise KeyError(name)

    client.put("obj", {"a": data})
    dst = np.zeros(256, dtype=np.uint8)
    with pytest.raises(KeyError):
        client.get("obj", FailsOnGetitem({"a": dst}), consume=True)
    assert client.exists("obj") and not dst.any()  # nothing consumed, nothing copied
    assert np.array_equal(client.get("obj", consume=True)["a"], data)


def test_get_refuses_destinations_that_share_memory(client):
    """Two destinations over the same bytes (two views of one array, one array named twice):
    the second copy would overwrite the first, and the caller would read one buffer's bytes
    as the other's. A BadRequest naming both, before any byte is copied, the lease released;
    destinations side by side are fine."""
    from kvbroker.errors import BadRequest

    data = np.arange(4096, dtype=np.uint8)
    client.put("obj", {"a": data[:2048], "b": data[2048:], "c": data[:16]})
    whole = np.zeros(4096 + 16, dtype=np.uint8)
    spare = np.zeros(16, dtype=np.uint8)
    for a, b in (
        (whole[:2048], whole[2047:4095]),  # one byte shared
        (whole[2047:4095], whole[:2048]),
    ):  # the other way round in memory
        with pytest.raises(BadRequest, match=r"out\['a'\] and out\['b'\]"):
            client.get("obj", {"a": a, "b": b, "c": spare})
    with pytest.raises(BadRequest, match=r"out\['a'\] and out\['c'\]"):
        client.get("obj", {"a": whole[:2048], "b": whole[2048:4096], "c": whole[100:116]})
    same = np.zeros(2048, dtype=np.uint8)
    with pytest.raises(BadRequest, match=r"out\['a'\] and out\['b'\]"):
        client.get("obj", {"a": same, "b": same, "c": spare})
    assert not whole.any() and not same.any() and not spare.any()  # nothing copied
    assert client.stat().read_leases == 0
    got = client.get("obj", {"a": whole[:2048], "b": whole[2048:4096], "c": whole[4096:]})
    assert bytes(whole) == data.tobytes() + data[:16].tobytes()
    assert got["a"].base is whole


def test_get_refuses_destinations_that_are_no_plain_bytes_with_a_bad_request(client):
    """A conjugate or negative view, a sparse or MKL-DNN tensor (torch refuses their raw
    bytes: a RuntimeError escaped), an object array (its elements are pointers), or something
    that holds no bytes at all: a BadRequest naming what is wrong, before any byte is copied,
    the lease released."""
    from kvbroker.errors import BadRequest

    data = np.arange(64, dtype=np.uint8)
    client.put("obj", {"a": data, "b": data})
    good = np.zeros(64, dtype=np.uint8)
    for what in (np.empty(8, dtype=object), [0] * 64, "x" * 64, 64):
        with pytest.raises(BadRequest, match="numpy array, a torch tensor or a writable"):
            client.get("obj", {"a": what, "b": good})
    torch = pytest.importorskip("torch")
    for t in (
        torch.zeros(8, dtype=torch.complex64).conj(),
        torch._neg_view(torch.zeros(16, dtype=torch.float32)),
        torch.zeros(16, dtype=torch.float32).to_sparse(),
        torch.zeros(16, dtype=torch.float32).to_mkldnn(),
    ):
        with pytest.raises(BadRequest, match="plain strided tensor"):
            client.get("obj", {"a": t, "b": good})
    assert not good.any() and client.stat().read_leases == 0


def test_a_refused_destination_does_not_count_a_consume(client):
    """get(consume=True) into a destination refused before any byte is copied: the reader
    got nothing, so its claim ends without counting (as a failed reader's does, the object
    stays for a retry); it freed the object."""
    from kvbroker.errors import BadRequest

    data = np.arange(4096, dtype=np.uint8)
    client.put("once", {"a": data})
    strided = np.zeros((4096, 2), dtype=np.uint8)[:, 0]
    with pytest.raises(BadRequest, match="contiguous"):
        client.get("once", {"a": strided}, consume=True)
    assert client.exists("once")
    got = client.get("once", {"a": np.zeros(4096, dtype=np.uint8)}, consume=True)
    assert bytes(got["a"]) == data.tobytes() and not client.exists("once")


# -- the C loops (csrc/copyhash.c) ------------------------------------------------------------


@needs_native
@settings(max_examples=80)
@given(
    n=st.integers(0, 300_000),
    chunk=st.sampled_from([1, 240, 241, 4096, 65536, 1 << 20]),
    piece=st.sampled_from([0, 1, 100, 240, 4096, 65536, 1 << 20]),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_c_loops_digest_each_chunk_as_python_xxhash_does(n, chunk, piece, src_off, dst_off, seed):
    """Every xxh3 input-length path (0, <=240 bytes, long inputs), any alignment, whole
    chunks (piece 0) or chunks copied and hashed a piece at a time."""
    from kvbroker import _copyhash

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)[src_off : src_off + n]
    dst_buf = np.zeros(n + 64, dtype=np.uint8)
    dst = dst_buf[dst_off : dst_off + n]
    want = [xxhash.xxh3_64_intdigest(src[a : a + chunk]) for a in range(0, n, chunk)]
    assert _copyhash.hash_chunks(src, chunk) == want
    assert _copyhash.copy_hashed(dst, src, chunk, piece) == want
    assert np.array_equal(dst, src)
    assert not dst_buf[:dst_off].any() and not dst_buf[dst_off + n :].any()
    assert _copyhash.hash_chunks(memoryview(src.tobytes()), chunk) == want  # any buffer


# The C loops' two forms of a copy that hashes: one pass (each stripe copied and hashed from
# the same registers, AVX2; the default wherever it runs) and two (copy, then xxHash's hash).
PASSES = [
    pytest.param(True, id="one-pass", marks=needs_native),
    pytest.param(False, id="two-passes", marks=needs_native),
]


@pytest.fixture
def passes(request):
    from kvbroker import _copyhash

    if request.param:  # skipped only where this CPU or build has no one-pass loop
        state = _copyhash.fused_state()
        if state in ("no AVX2", "not built"):
            pytest.skip(f"no one-pass loop here ({state})")
        assert state == "one pass", f"the one-pass loop is not used: {state}"
    assert _copyhash.use_fused(request.param) is request.param
    yield request.param
    _copyhash.use_fused(True)


@pytest.mark.parametrize("passes", PASSES, indirect=True)
@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.one_of(st.integers(0, 5000), st.integers(0, 2_200_000)),
    chunk=st.sampled_from([240, 241, 1024, 1025, 4096, 65536, 1 << 20]),
    stream=st.booleans(),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_one_pass_and_two_pass_copies_digest_as_python_xxhash_does(
    passes, n, chunk, stream, src_off, dst_off, seed
):
    """Every long-input case of xxh3 (a partial last stripe, whole 1 KiB blocks, a block and
    some stripes, one stripe past 240 bytes), short last chunks, streaming stores or not, any
    alignment of either side: the digests are xxHash's and the bytes land, nothing around."""
    from kvbroker import _copyhash

    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)[src_off : src_off + n]
    dst_buf = np.zeros(n + 128, dtype=np.uint8)
    dst = dst_buf[dst_off : dst_off + n]
    want = [xxhash.xxh3_64_intdigest(src[a : a + chunk]) for a in range(0, n, chunk)]
    assert _copyhash.copy_hashed(dst, src, chunk, 0, stream) == want
    assert np.array_equal(dst, src)
    assert not dst_buf[:dst_off].any() and not dst_buf[dst_off + n :].any()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")),
                set(),
            )
    except OSError:
        return set()


@needs_native
@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="no AVX2 on this CPU")
def test_the_one_pass_loop_runs_where_the_cpu_has_avx2():
    """bind_hash turns the one-pass loop off when its digests differ from xxHash's: a wrong
    loop would otherwise only make the tests above skip."""
    assert E.fused_loop()


@needs_native
def test_the_one_pass_loop_is_switched_only_where_it_was_checked():
    from kvbroker import _copyhash

    here = E.fused_loop()
    assert _copyhash.use_fused() is here  # asking changes nothing
    try:
        assert _copyhash.use_fused(False) is False and E.fused_loop() is False
        assert _copyhash.use_fused() is False
        # back on only where bind_hash found AVX2 and xxHash's digests
        assert _copyhash.use_fused(True) is here
    finally:
        _copyhash.use_fused(True)
    with pytest.raises(TypeError):
        _copyhash.use_fused(True, False)


@needs_native
def test_binding_the_hash_again_keeps_the_one_pass_loop_as_it_was_set():
    """``kvbroker doctor`` (and anyone) may call bind_hash again: use_fused(False) stands."""
    from xxhash import _xxhash

    from kvbroker import _copyhash

    here = E.fused_loop()
    try:
        _copyhash.use_fused(False)
        _copyhash.bind_hash(_xxhash.__file__)
        assert _copyhash.use_fused() is False
        assert _copyhash.fused_state() in ("off", "no AVX2", "not built")
        _copyhash.use_fused(True)
        _copyhash.bind_hash(_xxhash.__file__)
        assert _copyhash.use_fused() is here
        assert (_copyhash.fused_state() == "one pass") is here
    finally:
        _copyhash.use_fused(True)


@needs_native
def test_c_loops_refuse_bad_buffers_and_write_nothing():
    from kvbroker import _copyhash

    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    with pytest.raises(ValueError, match="dst has 999 bytes, src 1000"):
        _copyhash.copy_hashed(dst[1:], src, 256)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        _copyhash.copy_hashed(dst, src, 0)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        _copyhash.hash_chunks(src, -1)
    with pytest.raises(ValueError, match="piece must be 0"):
        _copyhash.copy_hashed(dst, src, 256, -1)
    with pytest.raises((ValueError, BufferError)):  # not C-contiguous
        _copyhash.copy_hashed(dst[::2], src[::2], 256)
    with pytest.raises(BufferError):  # bytes are read-only
        _copyhash.copy_hashed(bytes(1000), src, 256)
    with pytest.raises(TypeError):
        _copyhash.copy_hashed(dst, src)
    with pytest.raises(TypeError):
        _copyhash.hash_chunks(12, 256)
    assert not dst.any()
    # only a library this process has loaded, and only one with xxh3
    with pytest.raises(OSError, match="bind_hash"):
        _copyhash.bind_hash("/nonexistent/libxxhash.so")
    with pytest.raises(OSError, match="no XXH3_64bits"):
        _copyhash.bind_hash(_copyhash.__file__)
    assert _copyhash.hash_chunks(src, 256) == [
        xxhash.xxh3_64_intdigest(src[a : a + 256]) for a in range(0, 1000, 256)
    ]  # still bound


def test_the_c_loops_can_be_turned_off(monkeypatch):
    import subprocess
    import sys

    code = "from kvbroker._client import engine as E; print(E.NATIVE, E.CopyEngine(2).native)"
    env = {**os.environ, "KVBROKER_NATIVE_COPY": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out == ["False", "False"]
    monkeypatch.setattr(E, "_c_copy_hashed", None)
    with pytest.raises(ValueError, match="C extension is not available"):
        E.CopyEngine(2, native=True)


def test_the_c_loops_are_built_where_a_compiler_is():
    """The extension is optional so that an install without a compiler still works; where one
    is (CI, the project's machines), a failed build must not hide behind the fallback."""
    import shutil
    import sysconfig

    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] or "cc") and headers):
        pytest.skip("no C compiler or no Python headers: the Python loops are expected")
    try:
        from kvbroker import _copyhash
    except ImportError as exc:
        pytest.fail(f"kvbroker._copyhash was not built here: {exc}; reinstall (pip install -e .)")
    assert callable(_copyhash.copy_hashed)


@needs_native
def test_a_copy_split_over_threads_hashes_in_pieces(small_chunks, monkeypatch):
    """Over several threads the C loops copy and hash each chunk PIECE bytes at a time; one
    thread keeps whole chunks (engine.PIECE says why). Both give the definition's value."""
    from kvbroker import _copyhash

    calls = []
    real = E._c_copy_hashed
    monkeypatch.setattr(E, "_c_copy_hashed", lambda *a: calls.append(a[3:]) or real(*a))
    monkeypatch.setattr(E, "PIECE", 1000)  # smaller than the 4 KiB test chunk
    src = np.random.default_rng(3).integers(0, 256, 10 * small_chunks + 5, dtype=np.uint8)
    dst = np.empty_like(src)
    for threads, piece in ((3, 1000), (1, 0)):
        e = E.CopyEngine(threads, split_min=small_chunks, native=True)
        try:
            calls.clear()
            dst[:] = 0
            assert e.copy_hashed(dst, src) == reference(src, small_chunks)
            assert np.array_equal(dst, src)
            assert calls and all(c == (piece, False) for c in calls), calls
        finally:
            e.close()
    assert _copyhash.copy_hashed is real


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(0, 300_000),
    skew=st.integers(0, 63),
    chunk=st.integers(1, 1 << 17),
    piece=st.sampled_from([0, 1, 4096, 65536]),
)
def test_streaming_stores_copy_and_hash_the_same_bytes(size, skew, chunk, piece):
    """Non-temporal stores (the copies past the engine's stream_min) land every byte, at any alignment of
    the destination (they need a 16-byte aligned one: the head and tail go by memcpy), and
    the digests, taken from the source then, are the ordinary stores' ones."""
    from kvbroker import _copyhash

    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    area = np.zeros(size + 128, dtype=np.uint8)
    dst = area[skew : skew + size]
    want = _copyhash.copy_hashed(np.empty_like(src), src, chunk, piece)
    assert _copyhash.copy_hashed(dst, src, chunk, piece, True) == want
    assert np.array_equal(dst, src) and not area[:skew].any() and not area[skew + size :].any()
    area[:] = 0
    _copyhash.copy(dst, src, True)
    assert np.array_equal(dst, src) and not area[:skew].any() and not area[skew + size :].any()


@needs_native
def test_copies_past_stream_min_store_non_temporally(small_chunks, monkeypatch):
    """The engine asks the C loops for streaming stores on copies of stream_min bytes or more,
    split or not, with or without a hash; smaller ones store as usual."""
    calls = []
    real_hashed, real_copy = E._c_copy_hashed, E._c_copy
    monkeypatch.setattr(
        E, "_c_copy_hashed", lambda *a: calls.append(("hashed", a[-1])) or real_hashed(*a)
    )
    monkeypatch.setattr(E, "_c_copy", lambda *a: calls.append(("copy", a[-1])) or real_copy(*a))
    src = np.random.default_rng(5).integers(0, 256, 6 * small_chunks + 7, dtype=np.uint8)
    dst = np.empty_like(src)
    for threads in (1, 3):
        for stream_min, stream in ((src.nbytes, True), (src.nbytes + 1, False)):
            e = E.CopyEngine(threads, split_min=small_chunks, native=True, stream_min=stream_min)
            try:
                calls.clear()
                dst[:] = 0
                assert e.copy_hashed(dst, src) == reference(src, small_chunks)
                assert np.array_equal(dst, src)
                dst[:] = 0
                e.copy(dst, src)
                assert np.array_equal(dst, src)
                kinds = {k for k, _ in calls}
                assert kinds == {"hashed", "copy"}, calls
                assert all(flag is stream for _, flag in calls), calls
            finally:
                e.close()
    assert E.CopyEngine(1).stream_min == E.stream_min()


def test_streaming_starts_at_half_the_last_level_cache(tmp_path, monkeypatch):
    for index, size in (
        ("index0", "32K"),
        ("index2", "2048K"),
        ("index3", "307200K"),
        ("index4", "junk"),
    ):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "power").mkdir()  # no size: not a cache
    assert E.last_level_cache(str(tmp_path)) == 300 << 20
    assert E.last_level_cache(str(tmp_path / "absent")) is None
    monkeypatch.setattr(E, "last_level_cache", lambda: 300 << 20)
    assert E.stream_min() == 150 << 20
    monkeypatch.setattr(E, "last_level_cache", lambda: None)
    assert E.stream_min() == E.STREAM_MIN_FLOOR == 16 << 20
    monkeypatch.setattr(E, "last_level_cache", lambda: 1 << 20)  # only an L2 reported
    assert E.stream_min() == E.STREAM_MIN_FLOOR


@needs_native
@pytest.mark.parametrize("shift", [-4097, -1, 0, 1, 4096, 65537])
def test_c_loops_refuse_overlapping_buffers(shift):
    """A copy whose source and destination overlap would read bytes it had already written
    (its digests those of neither): refused, and nothing is written."""
    from kvbroker import _copyhash

    whole = np.random.default_rng(1).integers(0, 256, 400_000, dtype=np.uint8)
    before = whole.copy()
    n = 200_000
    src = whole[50_000 : 50_000 + n]
    dst = whole[50_000 + shift : 50_000 + shift + n]
    for call in (
        lambda: _copyhash.copy_hashed(dst, src, 4096),
        lambda: _copyhash.copy_hashed(dst, src, 4096, 1024, True),
        lambda: _copyhash.copy(dst, src),
        lambda: _copyhash.copy(dst, src, True),
    ):
        with pytest.raises(ValueError, match="overlap"):
            call()
    assert np.array_equal(whole, before)
    # next to each other is not overlapping
    _copyhash.copy_hashed(whole[:1000], whole[1000:2000], 4096)
    assert np.array_equal(whole[:1000], before[1000:2000])


@needs_native
def test_c_loops_take_plain_data_of_any_item_type_but_no_python_objects():
    """Items are moved and hashed as bytes (any numeric or structured type); an array of
    Python objects is refused: its copy would duplicate references nobody counts."""
    from kvbroker import _copyhash

    for dtype in (
        np.uint8,
        np.float16,
        np.float32,
        np.int64,
        np.complex128,
        np.dtype([("a", np.int32), ("b", np.float64)]),
    ):
        src = np.frombuffer(np.random.default_rng(2).bytes(48 * 1000), dtype=dtype)
        dst = np.zeros_like(src)
        want = [
            xxhash.xxh3_64_intdigest(src.tobytes()[a : a + 4096])
            for a in range(0, src.nbytes, 4096)
        ]
        assert _copyhash.copy_hashed(dst, src, 4096) == want
        assert dst.tobytes() == src.tobytes()
        assert _copyhash.hash_chunks(src, 4096) == want
    objects = np.array([object() for _ in range(8)])
    holds = np.zeros(8, dtype=[("n", np.int64), ("o", object)])
    for bad in (objects, holds):
        plain = np.zeros(bad.nbytes, dtype=np.uint8)
        for call, args in (
            (_copyhash.copy_hashed, (np.empty_like(bad), bad, 64)),
            (_copyhash.copy, (np.empty_like(bad), bad)),
            (_copyhash.copy, (bad, plain)),
            (_copyhash.hash_chunks, (bad, 64)),
        ):
            with pytest.raises(TypeError, match="Python objects"):
                call(*args)


@pytest.mark.parametrize("native", NATIVE_MODES)
def test_the_engine_refuses_overlapping_views_with_either_loops(small_chunks, native):
    """Split over threads, a copy between overlapping views would read bytes another thread
    had already written: refused by both loops, nothing written."""
    e = E.CopyEngine(4, split_min=small_chunks, native=native)
    whole = np.random.default_rng(3).integers(0, 256, 24 * small_chunks, dtype=np.uint8)
    before = whole.copy()
    n = 16 * small_chunks
    try:
        for shift in (1, small_chunks, -3 * small_chunks - 5):
            a = 4 * small_chunks
            dst, src = whole[a + shift : a + shift + n], whole[a : a + n]
            for call, args in (
                (e.copy, (dst, src)),
                (e.copy_hashed, (dst, src)),
                (e.copy_hashed, (whole[a + 1 : a + 101], whole[a : a + 100])),
            ):
                with pytest.raises(ValueError, match="overlap"):
                    call(*args)
        assert np.array_equal(whole, before)
    finally:
        e.close()
