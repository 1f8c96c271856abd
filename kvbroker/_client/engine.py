"""The host copy engine: big copies and checksums split over a few threads, one pass.

A copy of ``n`` bytes is cut into ranges of whole checksum chunks
(:data:`kvbroker._wire.checksum.CHUNK`), one per thread; the calling thread takes the first
range itself, a small pool of workers the others. Each thread copies its range a chunk at a
time and, when a checksum is asked for, hashes each chunk right after copying it, while it is
still in cache: the bytes cross memory once, as without checksums. The chunk digests come
back in order and are combined as :mod:`kvbroker._wire.checksum` defines, so the result is
bit for bit the single-threaded :func:`~kvbroker._wire.checksum.digest`.

Each thread's range is one call into ``kvbroker._copyhash`` (``csrc/copyhash.c``):
the GIL is released once per range, and each chunk is copied and hashed in one pass where
the CPU has AVX2 (each 64-byte stripe loaded once, stored, and fed to xxh3_64's
accumulators from the same registers: :func:`fused_loop`), else copied with memcpy and then
hashed with python-xxhash's own xxh3_64 (its compiled function, with its run-time AVX2 /
AVX-512 choice). Both are bound at import and checked against ``xxh3_64_intdigest``. On an
H100 host's Xeon a 32 MiB copy+hash on one thread ran at 0.86x of a memcpy in one pass against
0.76x in two (0.78x against 0.71x and 0.76x against 0.72x in two other runs), and on 8 threads
as fast either way (1.89 against 1.76 ms, 1.47 against 1.46, 1.45 against 1.50; 0.81-0.86x of a
memcpy on as many threads: ``benchmarks/results/host-copy-h100-host.md`` and its history):
there the memory is the limit, and the one pass saves the hash's reads from cache, not from
memory. In Python the same loop hands the GIL back and forth twice per chunk
(numpy's ``copyto``, then python-xxhash's one-shot hash, both releasing it), and those
hand-offs are what limited the scaling (measured on an H100 host's 16 cores, 32 MiB, 1 MiB
chunks: fused copy+hash on 8 threads at 0.57x of a plain 8-thread memcpy;
``benchmarks/results/host-copy-h100-host.md`` has the two side by side). Where the
extension was not built (it is optional: no C compiler at install), or with
``KVBROKER_NATIVE_COPY=0``, the engine runs those Python loops (:data:`NATIVE`). Copies of
half the last-level cache or more (16 MiB at least) store non-temporally there
(:func:`stream_min`): they
cannot stay in the cache, and would only evict what the next requests need; the hash then
reads the source, which the copy just loaded (the same bytes).

Users: ``put`` (copy + hash), ``get`` (copy, or copy + hash with ``verify``), ``claim``'s
verify and ``seal`` of a caller-filled lease (hash). Copies the engine cannot cut into byte
ranges itself, a paged cache's blocks gathered or scattered by numpy, run as independent jobs
over the same threads (:meth:`CopyEngine.run_jobs`): ``kvbroker.kv.publish_shard`` (one
(layer, K/V) buffer per job, hashed by the job that filled it) and ``claim_shards``, prefix
loads (one layer per job), the vLLM connector's host seal (one block's hash per job).

Threads: ``KVBROKER_COPY_THREADS`` when set, else the CPUs this process may run on
(``os.sched_getaffinity``) up to :data:`MAX_THREADS`. On a machine of :data:`SHARED_CPUS` CPUs
or fewer the second is the daemon's and the other processes' too: without
``KVBROKER_COPY_THREADS`` the engine splits a copy there only while the other processes
leave a CPU idle (:func:`kvbroker._cpu.cpu_left_idle`), else keeps it on the calling thread:
one core does not saturate the memory of the 2-CPU EPYC VM (32 MiB copy_hashed into
/dev/shm at 1.16x of a one-thread memcpy on 2 threads, 0.86x on 1, with the second core
free), but a second thread that shares its core with another process costs more than it
brings (0.84x against 0.85x; ``benchmarks/results/host-copy-cpu*.md``). Copies under
:data:`SPLIT_MIN` bytes per thread stay on the calling thread.

The engine owns its worker threads and nothing else; every function borrows the views it is
given, and returns only after every worker is done with them.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from .._wire import checksum as _cs

__all__ = [
    "CopyEngine",
    "default_engine",
    "default_threads",
    "default_gate",
    "fused_loop",
    "MAX_THREADS",
    "NATIVE",
    "SHARED_CPUS",
    "SPLIT_MIN",
    "last_level_cache",
    "stream_min",
]


# Past 8 threads, GIL hand-offs cost more than the extra bandwidth (16 threads lost to 8 on
# the H100 host above).
MAX_THREADS = 8
# Each thread gets at least this many bytes (two chunks): handing a range to a worker and
# collecting its result costs ~20-50 us, a 2 MiB copy ~100-200 us.
SPLIT_MIN = 2 * 1024 * 1024
# At most this many usable CPUs: the engine's threads past the first only while a CPU is spare.
SHARED_CPUS = 2
# When a copy+hash runs on several threads and the C loops hash in a second pass (no AVX2:
# see fused_loop; the one-pass loop needs no pieces), they copy and hash each chunk this many
# bytes at a time (xxh3's streaming form: the same digest), so the hash reads what it just
# copied from L1/L2. 32 MiB into /dev/shm against a memcpy on as many threads
# (benchmarks/results/copy-piece/): H100 host's Xeon, 8 threads 1.03x against 0.90x for
# whole 1 MiB chunks, 4 threads 0.84x against 0.75x; the 2-core EPYC VM, 2 threads 0.94x
# against 0.82x. On one thread the machines disagree (Xeon 0.77x against 0.68x, EPYC 0.78x
# against 0.85x): a copy on one thread keeps whole chunks, as the EPYC VM, where one thread
# is the usual case, prefers.
PIECE = 256 * 1024
# Copies of at least half the last-level cache store non-temporally through the C loops
# (copyhash.c says what that is), as glibc's memcpy does past a threshold of its own per call
# (which a copy cut into chunks and threads never reaches): a copy that size cannot stay in
# the cache, and ordinary stores would only evict the working sets of this process and of
# the daemon, whose next requests then run from memory; one that fits in half of it may still
# be read back from it by the claim that follows. Put+get against a memcpy on as many threads
# (benchmarks/results/stream-stores/ab-*.md): on the 2-core EPYC VM (32 MiB L3), 32 MiB
# 0.95x against 0.74x with ordinary stores, 16 MiB 0.77x against 0.61x (8 MiB: 0.59x against
# 0.51x); on the H100 host (300 MiB L3), where the get reads
# back from the cache what ordinary stores left, 32 MiB 0.74x against 0.70x and 16 MiB lost
# (0.66x against 0.68x, the get 1025 us against 865).
# Where the cache's size cannot be read, and the least: a machine that reports no L3 (some
# VMs show only L1/L2) would otherwise stream copies the claim that follows reads back.
STREAM_MIN_FLOOR = 16 * 1024 * 1024


def last_level_cache(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size in bytes of the largest CPU cache Linux reports for CPU 0 (sysfs), or None."""
    best = None
    try:
        entries = os.listdir(root)
    except OSError:
        return None
    for entry in entries:
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best or 0, int(digits) * scale)
    return best


def stream_min() -> int:
    """The smallest copy that stores non-temporally here: half the last-level cache, at
    least :data:`STREAM_MIN_FLOOR`."""
    llc = last_level_cache()
    return max(llc // 2, STREAM_MIN_FLOOR) if llc else STREAM_MIN_FLOOR


_hash = xxhash.xxh3_64_intdigest


def _bind_c_loops():
    """The C loops' (copy_hashed, hash_chunks, copy), hashing with python-xxhash's xxh3_64,
    and ``None``; else three Nones and why not: the extension was not built (it is optional),
    or does not import, or its digests are not xxhash's (a bug: :data:`C_LOOPS_REFUSED`)."""
    try:
        from .._copyhash import bind_hash, copy, copy_hashed, hash_chunks
    except ModuleNotFoundError as exc:
        if exc.name == f"{__package__.rpartition('.')[0]}._copyhash":
            return None, None, None, "not built"
        return None, None, None, f"kvbroker._copyhash does not import: {exc}"
    except ImportError as exc:
        return None, None, None, f"kvbroker._copyhash does not import: {exc}"
    from xxhash import _xxhash

    try:
        bind_hash(_xxhash.__file__)
    except OSError as exc:
        return None, None, None, f"python-xxhash's xxh3_64 cannot be bound: {exc}"
    # every xxh3 input-length path (0-16, 17-128, 129-240 bytes, long inputs), hashed in
    # place and copied (the one-pass loop where it runs), in ~2 ms
    for probe, chunk in (
        (bytes(range(256)) * 5, 7),
        (bytes(range(256)) * 5, 240),
        (bytes(range(256)) * 5, 1000),
        (bytes(range(251)) * 4200, 1 << 20),
    ):
        want = [_hash(probe[at : at + chunk]) for at in range(0, len(probe), chunk)]
        landed = bytearray(len(probe))
        if (
            hash_chunks(probe, chunk) != want
            or copy_hashed(landed, probe, chunk) != want
            or landed != probe
        ):
            return (
                None,
                None,
                None,
                (
                    f"csrc/copyhash.c's digests of {len(probe)} bytes in "
                    f"chunks of {chunk} are not xxhash's xxh3_64"
                ),
            )
    return copy_hashed, hash_chunks, copy, None


_c_copy_hashed, _c_hash_chunks, _c_copy, C_LOOPS_REFUSED = _bind_c_loops()
if C_LOOPS_REFUSED not in (None, "not built"):  # built, yet not used: say so once
    logging.getLogger("kvbroker").warning(
        "the copy engine runs its Python loops: %s", C_LOOPS_REFUSED
    )
_stream_min = functools.cache(stream_min)  # engines' default: sysfs read once per process

# Whether engines copy and hash through csrc/copyhash.c by default (else the Python loops;
# KVBROKER_NATIVE_COPY=0 is an operator's way back to them).
NATIVE = _c_copy_hashed is not None and os.environ.get("KVBROKER_NATIVE_COPY", "1") != "0"


def fused_loop() -> bool:
    """Whether the C loops copy and hash in one pass here (``csrc/copyhash.c``: AVX2, checked
    against xxHash's digests when bound); else each chunk is copied, then hashed."""
    if _c_copy_hashed is None:
        return False
    from .._copyhash import use_fused

    return use_fused()


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """Threads for the default engine: ``KVBROKER_COPY_THREADS``, else the usable CPUs capped
    at MAX_THREADS (see :func:`default_gate` for when the second of 2 is used)."""
    env = os.environ.get("KVBROKER_COPY_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(
                f"KVBROKER_COPY_THREADS must be a positive integer, not {env!r}"
            ) from None
        if n < 1:
            raise ValueError(f"KVBROKER_COPY_THREADS must be a positive integer, not {env!r}")
        return n
    return min(_usable_cpus(), MAX_THREADS)


def default_gate() -> Callable[[], bool] | None:
    """When the default engine may split a copy: :func:`kvbroker._cpu.cpu_left_idle` on a
    machine of SHARED_CPUS CPUs or fewer unless ``KVBROKER_COPY_THREADS`` is set; None
    (always) otherwise."""
    if os.environ.get("KVBROKER_COPY_THREADS") or _usable_cpus() > SHARED_CPUS:
        return None
    from .._cpu import cpu_left_idle

    return cpu_left_idle


def _copy_range(dst, src, a: int, b: int) -> None:
    import numpy as np

    np.copyto(dst[a:b], src[a:b])


def _copy_hash_range(dst, src, a: int, b: int) -> list[int]:
    """Copy ``src[a:b]`` into ``dst[a:b]`` a chunk at a time, hashing each copied chunk."""
    import numpy as np

    out = []
    chunk = _cs.CHUNK
    for at in range(a, b, chunk):
        piece = dst[at : at + chunk] if at + chunk <= b else dst[at:b]
        np.copyto(piece, src[at : at + piece.nbytes])
        out.append(_hash(piece))
    return out


def _hash_range(view, a: int, b: int) -> list[int]:
    chunk = _cs.CHUNK
    return [_hash(view[at : min(at + chunk, b)]) for at in range(a, b, chunk)]


def _copy_range_native(dst, src, stream: bool, a: int, b: int) -> None:
    _c_copy(dst[a:b], src[a:b], stream)


def _copy_hash_range_native(dst, src, piece: int, stream: bool, a: int, b: int) -> list[int]:
    return _c_copy_hashed(dst[a:b], src[a:b], _cs.CHUNK, piece, stream)


def _hash_range_native(view, a: int, b: int) -> list[int]:
    return _c_hash_chunks(view[a:b], _cs.CHUNK)


def _wait_all(futures) -> BaseException | None:
    """Wait until every future is done, whatever interrupts the wait (a KeyboardInterrupt
    from a signal handler); returns the first interruption, for the caller to raise."""
    interrupted = None
    while True:
        try:
            wait(futures)
            return interrupted
        except BaseException as exc:
            interrupted = interrupted or exc


def _run_share(jobs: Sequence[Callable[[], Any]]) -> list:
    return [job() for job in jobs]


class CopyEngine:
    """Copies and chunk checksums over ``threads`` threads (the caller's included).

    Arguments are flat, C-contiguous uint8 numpy arrays of equal size (``dst`` writable).
    ``split_while``: a copy is split only while it returns True (None: always).
    ``native``: copy and hash each range in one call to the C extension (default
    :data:`NATIVE`); False runs the Python loops. ``stream_min``: copies of at least this
    many bytes store non-temporally (the C loops only; default: :func:`stream_min`).
    """

    def __init__(
        self,
        threads: int | None = None,
        split_min: int = SPLIT_MIN,
        split_while: Callable[[], bool] | None = None,
        native: bool | None = None,
        stream_min: int | None = None,
    ) -> None:
        self.threads = default_threads() if threads is None else int(threads)
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        self.split_min = max(_cs.CHUNK, int(split_min))
        self.split_while = split_while
        if native and _c_copy_hashed is None:
            raise ValueError(
                "the copy engine's C extension is not available here "
                "(not built, or KVBROKER_NATIVE_COPY=0)"
            )
        self.native = NATIVE if native is None else bool(native)
        self.stream_min = _stream_min() if stream_min is None else int(stream_min)
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        _engines.add(self)

    # -- plumbing ----------------------------------------------------------------------------
    def _workers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # after a fork the parent's workers do not exist here: start fresh ones
                self._pool = ThreadPoolExecutor(
                    self.threads - 1, thread_name_prefix="kvbroker-copy"
                )
                self._pid = os.getpid()
            return self._pool

    def ranges(self, nbytes: int) -> list[tuple[int, int]]:
        """How a copy of ``nbytes`` is split: chunk-aligned ``(start, stop)`` byte ranges, one
        per thread that takes part (a single range when splitting would not pay)."""
        parts = min(self.threads, nbytes // self.split_min) if nbytes else 1
        if parts <= 1 or (self.split_while is not None and not self.split_while()):
            return [(0, nbytes)]
        chunk = _cs.CHUNK
        chunks = -(-nbytes // chunk)
        bounds = [min(nbytes, (chunks * i // parts) * chunk) for i in range(parts + 1)]
        return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i] < bounds[i + 1]]

    def _run(self, fn, args: tuple, ranges: list[tuple[int, int]]) -> list:
        return self._spread([(fn, *args, a, b) for a, b in ranges])

    def _spread(self, calls: list[tuple]) -> list:
        """``fn(*args)`` for each ``(fn, *args)`` of ``calls``, the first on this thread and
        the others on the workers; their results in order, or the error of the first call
        that failed (the calls after a failure that no worker had started are not run).

        Once its own call is done, this thread runs the calls no worker has started yet
        itself: the pool is shared (a background load beside a step's seal), and a call
        queued behind another caller's would make this one wait for that caller's copies.
        It returns or raises only once no worker still runs one of its calls, even if a
        signal interrupts the wait: they touch the caller's views."""
        if len(calls) == 1:
            fn, *args = calls[0]
            return [fn(*args)]
        pool = self._workers()
        futures = [pool.submit(*call) for call in calls[1:]]
        done: dict[int, Any] = {}
        failed: dict[int, BaseException] = {}
        try:
            for i, call in enumerate(calls):
                if i and not futures[i - 1].cancel():
                    continue  # a worker runs it
                if failed:
                    continue  # cancelled: an earlier call failed
                fn, *args = call
                try:
                    done[i] = fn(*args)
                except Exception as exc:
                    failed[i] = exc
        except BaseException:  # interrupted here: start nothing more
            for f in futures:
                f.cancel()
            raise
        finally:
            # (a cancelled future counts as done for wait() only once a worker dequeued it)
            interrupted = _wait_all([f for f in futures if not f.cancelled()])
        for i, f in enumerate(futures, 1):
            if not f.cancelled():
                exc = f.exception()
                if exc is None:
                    done[i] = f.result()
                else:
                    failed[i] = exc
        if failed:
            raise failed[min(failed)]
        if interrupted is not None:
            raise interrupted
        return [done[i] for i in range(len(calls))]

    # -- operations --------------------------------------------------------------------------
    def copy(self, dst, src) -> None:
        """``dst[:] = src``, bit for bit."""
        _check(dst, src)
        n = src.nbytes
        if self.native:
            self._run(_copy_range_native, (dst, src, n >= self.stream_min), self.ranges(n))
        else:
            _refuse_overlap(dst, src)
            self._run(_copy_range, (dst, src), self.ranges(n))

    def copy_here(self, dst, src) -> None:
        """``dst[:] = src`` on the calling thread, for a copy too small to split (through the
        C loop where built: a memcpy without numpy's dispatch, 0.5 us less at 256 KiB)."""
        if self.native:
            _c_copy(dst, src, False)
        else:
            import numpy as np

            np.copyto(dst, src)

    def copy_hashed(self, dst, src) -> int:
        """``dst[:] = src`` and the kind-1 checksum value of the copied bytes (hashed right
        after each chunk is copied, in ``dst``, or in ``src`` for a streaming copy)."""
        _check(dst, src)
        n = src.nbytes
        if 0 < n <= _cs.CHUNK:  # one chunk: the small objects' path, kept short
            if self.native:
                return _cs.combine(n, _c_copy_hashed(dst, src, _cs.CHUNK))
            import numpy as np

            _refuse_overlap(dst, src)
            np.copyto(dst, src)
            return _cs.combine(n, [_hash(dst)])
        ranges = self.ranges(n)
        if self.native:  # pieces only when split over threads: see PIECE
            piece = PIECE if len(ranges) > 1 else 0
            parts = self._run(
                _copy_hash_range_native, (dst, src, piece, n >= self.stream_min), ranges
            )
        else:
            _refuse_overlap(dst, src)
            parts = self._run(_copy_hash_range, (dst, src), ranges)
        return _cs.combine(src.nbytes, [d for part in parts for d in part])

    def hash(self, view) -> int:
        """The kind-1 checksum value of ``view``."""
        fn = _hash_range_native if self.native else _hash_range
        parts = self._run(fn, (view,), self.ranges(view.nbytes))
        return _cs.combine(view.nbytes, [d for part in parts for d in part])

    def hash_here(self, view) -> int:
        """:meth:`hash` on the calling thread (a job of :meth:`run_jobs` hashing its own
        output: a job never waits for the engine's other threads)."""
        fn = _hash_range_native if self.native else _hash_range
        return _cs.combine(view.nbytes, fn(view, 0, view.nbytes))

    def run_jobs(self, jobs: Sequence[Callable[[], Any]], nbytes: int) -> list:
        """Run independent ``jobs`` (callables moving ``nbytes`` in all, about alike) over
        the engine's threads, the calling thread taking the first share; their results, in
        order. Split as a copy of ``nbytes`` is (:meth:`ranges`: at least ``split_min``
        bytes per thread, and only while ``split_while`` says so), never into more shares
        than jobs. For copies numpy or the C loops make (each releases the GIL while it
        moves bytes) that the engine cannot cut itself: a paged cache's blocks, one
        (layer, K/V) buffer per job. Returns, or raises the first job's error, only once
        every job has ended: none still touches the caller's views. A job must not call
        the engine's splitting methods (:meth:`copy`, :meth:`copy_hashed`, :meth:`hash`):
        the workers they would wait for may all be running this call's jobs; it hashes
        with :meth:`hash_here`."""
        parts = min(len(jobs), len(self.ranges(nbytes)))
        if parts <= 1:
            return [job() for job in jobs]
        bounds = [len(jobs) * i // parts for i in range(parts + 1)]
        shares = [(_run_share, jobs[bounds[i] : bounds[i + 1]]) for i in range(parts)]
        return [r for part in self._spread(shares) for r in part]

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.shutdown(wait=True)
            self._pool = None


def _check(dst, src) -> None:
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into a view of {dst.nbytes}")


def _refuse_overlap(dst, src) -> None:
    """The Python loops refuse what the C loops refuse (csrc/copyhash.c): a copy whose
    ranges, split over threads, would read bytes another thread had already written."""
    import numpy as np

    if src.nbytes and np.may_share_memory(dst, src):
        raise ValueError("copy: dst and src overlap: copy through a separate buffer")


_default: CopyEngine | None = None
_default_lock = threading.Lock()


def default_engine() -> CopyEngine:
    """The process-wide engine (threads from :func:`default_threads`, gated by
    :func:`default_gate`, both read once)."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = CopyEngine(split_while=default_gate())
    return _default


_engines: weakref.WeakSet[CopyEngine] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """Locks a parent's thread may have held when it forked (the workers are started again
    by the pid check in ``_workers``)."""
    global _default_lock
    _default_lock = threading.Lock()
    for engine in list(_engines):
        engine._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
