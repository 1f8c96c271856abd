"""The disk tier's storage: preallocated slot files, their index on disk, and the I/O.

Space is one slot file per ``[tier.disk] directories`` entry (``kvbroker-tier.slots``, mode
0600), ``posix_fallocate``d whole at start so a full device fails the start, not a demotion
later, and carved into slots of whole units (the pools' page size, at least 4 KiB) by an
:class:`~kvbroker._server.allocator.ExtentAllocator` per file. The files are opened with
``O_DIRECT`` where the file system takes it (:func:`probe_direct`, run at start: tmpfs and
some FUSE file systems refuse it; then buffered I/O and ``fdatasync``, said in ``doctor``
and ``stat``). Every transfer is page-aligned (slots are whole units), to or from a buffer
of the daemon's own: pool pages are read and written with ``pread``/``pwrite`` on the
pool's segment (:class:`PoolPages`), never through a mapping a client could truncate under
the daemon (a SIGBUS would end every tenant's service); one copy more per object, in the
kernel, beside the device's transfer.

The I/O is ``os.pwritev``/``os.preadv`` from a small thread pool (both release the GIL), not
NIXL's POSIX backend: ``benchmarks/bench_disk_io.py`` (one request per 2 MiB object, 4 in
flight, O_DIRECT, bit-exact) found no gain from NIXL on this VM's disk — the recorded run
(``benchmarks/results/disk-io-cpu.json``) read 1.19 GB/s with the threads against 1.04 with
NIXL's libaio mode, 0.88 io_uring and 0.78 POSIX AIO; an earlier run had io_uring 1.20 against
0.95, within the disk's noise — and the thread pool needs no optional dependency (NIXL comes
with the ``transfer`` extra only), no registration of every pool and slot file with an
agent, and no transfer handle to build and release per promotion.

The index (:class:`DiskIndex`, ``kvbroker-tier.index`` in the first directory) is a log of
framed records, as the warm-restart journal's are (``KVD1`` | u32 length | u32 crc32 with the
file's random seed | msgpack body): a header naming the slot files' geometry, ``p`` (an
object's bytes are in a slot: written and ``fdatasync``ed before the record is appended),
``x`` (a slot's object is gone) and ``c`` (its consume-claims left, as they are released),
appended by the loop and written with one ``fsync`` per batch by an I/O thread (:meth:`DiskIndex.write_out`). A freed slot is reused at once: a crash
can leave a ``p`` record naming a slot another object wrote since, and its digest catches
that (below). Loading
drops what it cannot vouch for: a damaged record (its checksum), a slot outside its file, two
live records on overlapping slots (both), a header whose geometry is not this configuration's
(everything). The bytes themselves are vouched for at promotion: each ``p`` record carries the
xxh3_64 of what was written, and a slot whose bytes no longer hash to it is dropped, never
served (:mod:`kvbroker._server.disk_tier`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from .._wire import checksum
from ..errors import KVBrokerError
from .allocator import ExtentAllocator

__all__ = [
    "INDEX_NAME",
    "MIN_UNIT",
    "SLOTS_NAME",
    "DiskIndex",
    "DiskStore",
    "Loaded",
    "PoolPages",
    "PoolUnusable",
    "probe_direct",
]

log = logging.getLogger("kvbroker.disk")

SLOTS_NAME = "kvbroker-tier.slots"
INDEX_NAME = "kvbroker-tier.index"
MIN_UNIT = 4096  # O_DIRECT's alignment on every common device (logical blocks of 512 or 4K)
MAGIC = b"KVD1"
FORMAT = 1
_FRAME = struct.Struct("<4sII")
_MAX_RECORD = 1 << 24
# The buffer each I/O thread keeps for the objects it moves between a pool and a slot (a
# larger object gets one of its own): no mapping, page faults and zeroing per object.
SCRATCH_KEPT = 16 << 20


def probe_direct(directory: str) -> str | None:
    """None when ``directory``'s file system takes ``O_DIRECT`` reads and writes of aligned
    4 KiB; else why not (its words, for ``doctor`` and the log)."""
    path = os.path.join(directory, f".kvbroker-direct-probe-{os.getpid()}")
    buf = mmap.mmap(-1, MIN_UNIT)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return f"open with O_DIRECT: {exc.strerror}"
    try:
        if not hasattr(os, "O_DIRECT"):
            return "this platform has no O_DIRECT"
        buf[:8] = b"kvbroker"
        os.pwritev(fd, [buf], 0)
        buf[:8] = b"\0" * 8
        if os.preadv(fd, [buf], 0) != MIN_UNIT or buf[:8] != b"kvbroker":
            return "an O_DIRECT read did not return what was written"
        return None
    except OSError as exc:
        return f"O_DIRECT I/O: {exc.strerror}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        buf.close()


_hash_buffers = threading.local()  # PoolPages.matches' chunk buffer, per thread


class PoolUnusable(OSError):
    """A pool's segment is not what the daemon made (truncated): its pages cannot be moved;
    the disk copies are not at fault."""


class PoolPages:
    """One pool's pages as the disk tier moves them: ``pread``/``pwrite`` on the pool's
    segment (``fd``, the daemon's to close), never loads and stores into a mapping of it.
    Whoever may map a pool may ``ftruncate`` it (a tenant its tenant pool, a group member a
    shared one); a load past its new end is a SIGBUS, which would kill the daemon and every
    tenant's service with it, where a read past it is just short and a write is refused.
    (The daemon still maps no KV bytes: one copy more per object moved, in the kernel.)"""

    def __init__(self, index: int, fd: int, size: int) -> None:
        self.index, self.fd, self.size = index, fd, size

    def _lost(self, what: str) -> PoolUnusable:
        size = os.fstat(self.fd).st_size
        return PoolUnusable(f"pool {self.index} {what}: it holds {size} of its {self.size} bytes")

    def check(self) -> None:
        """PoolUnusable when the segment is not its size (truncated). Only a check at this
        moment: what goes through a mapping afterwards can still meet a truncation."""
        if os.fstat(self.fd).st_size != self.size:
            raise self._lost("is truncated")

    def read(self, offset: int, view: memoryview) -> None:
        """Fill ``view`` from the pool's bytes at ``offset``; PoolUnusable when they are not
        all there (the segment was truncated)."""
        if _transfer(os.preadv, self.fd, view, offset) != len(view):
            raise self._lost(f"cannot be read at {offset}")

    def write(self, offset: int, view: memoryview) -> None:
        """Write ``view`` into the pool at ``offset``; PoolUnusable when the segment is not
        its size (a write past the end of a truncated one would grow it again)."""
        self.check()
        if _transfer(os.pwritev, self.fd, view, offset) != len(view):
            raise self._lost(f"cannot be written at {offset}")

    def matches(self, offset: int, nbytes: int, recorded: Any) -> bool:
        """Whether the pool's ``nbytes`` at ``offset`` hash to ``recorded`` (a checksum's
        wire form, either kind): read a chunk at a time into a buffer of the caller's
        thread's own, hashed while it is in cache. PoolUnusable when the bytes are not all
        there; ValueError for a malformed ``recorded``."""
        kind, value = checksum.parse(recorded)
        legacy = xxhash.xxh3_64() if kind == checksum.KIND_XXH3 else None
        digests = []
        buf = getattr(_hash_buffers, "buf", None)
        if buf is None:  # one per thread, kept: a fresh one is a page fault per 4 KiB
            buf = _hash_buffers.buf = bytearray(checksum.CHUNK)
        with memoryview(buf) as whole:
            for at in range(0, nbytes, checksum.CHUNK):
                with whole[: min(checksum.CHUNK, nbytes - at)] as chunk:
                    self.read(offset + at, chunk)
                    if legacy is not None:
                        legacy.update(chunk)
                    else:
                        digests.append(checksum.chunk_digest(chunk))
        got = legacy.intdigest() if legacy is not None else checksum.combine(nbytes, digests)
        return got == value

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotFile:
    """One preallocated file of slots, its own allocator over its units."""

    def __init__(self, index: int, path: str, units: int, unit: int, direct: bool) -> None:
        self.index, self.path, self.units, self.unit = index, path, units, unit
        self.size = units * unit
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(self.fd, 0o600)
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
            os.posix_fallocate(self.fd, 0, self.size)
        except OSError as exc:
            os.close(self.fd)
            raise KVBrokerError(
                f"[tier.disk] cannot reserve {self.size} bytes in {path}: {exc.strerror}"
            ) from None
        self.allocator = ExtentAllocator(units)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class Loaded:
    """What :meth:`DiskIndex.load` read back: the live ``p`` records by slot, and what it
    dropped (damaged records; records it could not vouch for)."""

    entries: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    damaged: int = 0
    dropped: int = 0
    reset: str | None = None  # why everything was dropped (geometry changed, no header)


class DiskIndex:
    """The tier's index log: appended by the event loop, synced by the I/O threads."""

    def __init__(self, path: str, geometry: list[list[int]]) -> None:
        self.path = path
        self.geometry = geometry  # [[units, unit], ...] per slot file
        self.seed = 0
        self.fd = -1
        self.pending: list[dict[str, Any]] = []  # records appended, not yet written
        self.records = 0  # records in the file (compaction when > 2x live + 1024)

    # -- reading -------------------------------------------------------------------------
    def load(self) -> Loaded:
        out = Loaded()
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return out
        records = list(self._frames(data, out))
        head = records[0] if records else None
        if head is None or head.get("t") != "h" or head.get("v") != FORMAT:
            out.reset = "the index has no readable header"
            return out
        if head.get("g") != self.geometry:
            out.reset = f"the slot files' geometry changed ({head.get('g')} -> {self.geometry})"
            return out
        live = out.entries
        for rec in records[1:]:
            kind, slot = rec.get("t"), (rec.get("f"), rec.get("s"))
            if kind not in ("p", "x", "c") or not all(v.__class__ is int for v in slot):
                out.damaged += 1  # (a float, a bool, a huge or negative number: not ours)
                continue
            if kind == "p":
                if slot in live:  # a second object on a live slot: which is whose?
                    del live[slot]
                    out.dropped += 2
                    continue
                live[slot] = rec
            elif kind == "x":
                live.pop(slot, None)
            elif slot in live:  # "c": consume-claims released since the p record
                o, consumers = live[slot].get("o"), rec.get("c")
                if isinstance(o, dict) and consumers.__class__ is int and consumers >= 1:
                    o["consumers"] = consumers
        # Slots outside their file, or overlapping another live slot: both dropped.
        by_file: dict[int, list[tuple[int, int, tuple[int, int]]]] = {}
        for slot, rec in list(live.items()):
            f, s = slot
            n = rec.get("n")
            if (
                not 0 <= f < len(self.geometry)
                or n.__class__ is not int
                or n <= 0
                or s < 0
                or s + n > self.geometry[f][0]
            ):
                del live[slot]
                out.dropped += 1
                continue
            by_file.setdefault(f, []).append((s, n, slot))
        for runs in by_file.values():
            runs.sort()
            bad: set[tuple[int, int]] = set()
            end, last = -1, None
            for s, n, slot in runs:
                if s < end:
                    bad |= {slot, last}
                if s + n > end:
                    end, last = s + n, slot
            for slot in bad:
                if live.pop(slot, None) is not None:
                    out.dropped += 1
        return out

    def _frames(self, data: bytes, out: Loaded) -> Iterator[dict]:
        pos, seed, first = 0, 0, True
        while pos + _FRAME.size <= len(data):
            magic, length, crc = _FRAME.unpack_from(data, pos)
            body = data[pos + _FRAME.size : pos + _FRAME.size + length]
            if (
                magic != MAGIC
                or length > _MAX_RECORD
                or len(body) != length
                or zlib.crc32(body, seed if not first else 0) != crc
            ):
                if len(body) != length and magic == MAGIC:
                    break  # a torn last record
                out.damaged += 1
                nxt = data.find(MAGIC, pos + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            pos += _FRAME.size + length
            try:
                rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001 - any body msgpack refuses (a list as a map key: TypeError)
                out.damaged += 1
                continue
            if not isinstance(rec, dict):
                out.damaged += 1
                continue
            if first:
                first = False
                seed = rec.get("seed", 0) if rec.get("t") == "h" else 0
                self.seed = seed if seed.__class__ is int else 0
                seed = self.seed
            yield rec

    # -- writing -------------------------------------------------------------------------
    # The loop appends records and takes them for a write; the I/O thread frames them (under
    # the seed of the file they go to) and writes them, one write or rewrite at a time. So a
    # compaction's new seed never frames a record the old file gets, nor the other way round,
    # and what the loop appends while a rewrite runs stays pending for the next write.
    def rewrite(self, live: list[dict[str, Any]]) -> None:
        """Start a fresh file holding ``live`` only (at open, and to compact): written to a
        temporary file, synced, then renamed over the old one. A failure leaves the old
        file, and its seed, as they were."""
        seed = secrets.randbits(32)
        tmp = self.path + ".tmp"
        buf = bytearray(self._frame({"t": "h", "v": FORMAT, "g": self.geometry, "seed": seed}, 0))
        for rec in live:
            buf += self._frame(rec, seed)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path)
        self.seed = seed
        dirfd = os.open(os.path.dirname(self.path) or ".", os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def append(self, rec: dict[str, Any]) -> None:
        self.pending.append(rec)
        self.records += 1

    def take(self) -> list[dict[str, Any]]:
        """The records appended since the last take, for one :meth:`write_out`."""
        recs, self.pending = self.pending, []
        return recs

    def put_back(self, recs: list[dict[str, Any]]) -> None:
        """Records a write could not make durable: first again, in their order (an ``x``
        lost would let a restart serve what its ``p`` names)."""
        self.pending[:0] = recs

    def write_out(self, recs: list[dict[str, Any]]) -> None:
        """In an I/O thread: append ``recs`` (what :meth:`take` handed over) and fsync. On
        an error (ENOSPC) the file is cut back to where it ended, so the records can be
        written again whole, then it raises."""
        data = b"".join(self._frame(rec, self.seed) for rec in recs)
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            _write_all(self.fd, data)
            os.fsync(self.fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, end)
            raise

    @staticmethod
    def _frame(rec: dict[str, Any], seed: int) -> bytes:
        body = msgpack.packb(rec, use_bin_type=True)
        return _FRAME.pack(MAGIC, len(body), zlib.crc32(body, seed)) + body

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _transfer(call: Any, fd: int, view: memoryview, offset: int) -> int:
    """The bytes ``call`` (``os.preadv`` or ``os.pwritev``) moved between ``view`` and
    ``fd`` from ``offset``, continued after short transfers until it moves none. No slice
    of ``view`` outlives it, an error's traceback included: the caller closes the buffer
    under ``view`` after an error too."""
    done, total = 0, len(view)
    while done < total:
        with view[done:] as rest:
            n = call(fd, [rest], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class DiskStore:
    """The slot files, the index and the I/O threads of one disk tier."""

    def __init__(
        self, directories: list[str], size: int, unit: int, *, direct: bool = True, threads: int = 4
    ) -> None:
        if not directories:
            raise KVBrokerError("[tier.disk] directories: name at least one directory")
        self.unit = max(unit, MIN_UNIT)
        per_file = size // len(directories) // self.unit
        if per_file < 1:
            raise KVBrokerError(
                f"[tier.disk] size {size} is less than one slot ({self.unit} bytes) per directory"
            )
        self.directories = [os.path.abspath(d) for d in directories]
        self.direct_problem: str | None = None
        for d in self.directories:
            try:
                os.makedirs(d, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise KVBrokerError(f"[tier.disk] cannot create {d}: {exc.strerror}") from None
            if not os.access(d, os.W_OK | os.X_OK):
                raise KVBrokerError(f"[tier.disk] {d} is not writable by this daemon")
            if direct and self.direct_problem is None:
                self.direct_problem = probe_direct(d)
        self.direct = direct and self.direct_problem is None
        if direct and not self.direct:
            log.warning(
                "[tier.disk] O_DIRECT is not available (%s): buffered I/O, synced with fdatasync",
                self.direct_problem,
            )
        self.files: list[SlotFile] = []
        try:
            for i, d in enumerate(self.directories):
                self.files.append(
                    SlotFile(i, os.path.join(d, SLOTS_NAME), per_file, self.unit, self.direct)
                )
        except BaseException:
            self.close()
            raise
        self.index = DiskIndex(
            os.path.join(self.directories[0], INDEX_NAME), [[f.units, f.unit] for f in self.files]
        )
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="kvbroker-disk")
        self._local = threading.local()

    @contextlib.contextmanager
    def scratch(self, nbytes: int) -> Iterator[memoryview]:
        """In an I/O thread: a page-aligned buffer of ``nbytes`` of the daemon's own (as
        ``O_DIRECT`` wants), the thread's kept one when it fits."""
        buf = getattr(self._local, "buf", None)
        own = None
        if nbytes > SCRATCH_KEPT:
            buf = own = mmap.mmap(-1, nbytes)
        elif buf is None or len(buf) < nbytes:
            if buf is not None:
                buf.close()
            buf = self._local.buf = mmap.mmap(-1, min(SCRATCH_KEPT, max(nbytes, 1 << 20)))
        try:
            with memoryview(buf) as whole, whole[:nbytes] as view:
                yield view
        finally:
            if own is not None:
                own.close()

    @property
    def capacity(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def used(self) -> int:
        return sum(f.allocator.used * f.unit for f in self.files)

    def allocate(self, nbytes: int) -> tuple[int, int, int] | None:
        """(file, start unit, units) of a free slot for ``nbytes``, emptiest file first;
        None when none is free."""
        units = -(-nbytes // self.unit)
        for f in sorted(self.files, key=lambda f: -f.allocator.free):
            start = f.allocator.alloc(units)
            if start is not None:
                return f.index, start, units
        return None

    def adopt(self, slots: list[tuple[int, int, int]]) -> None:
        """Make exactly ``slots`` (file, start, units) live (a restart's index)."""
        by_file: dict[int, list[tuple[int, int]]] = {}
        for f, s, n in slots:
            by_file.setdefault(f, []).append((s, n))
        for f in self.files:
            f.allocator = ExtentAllocator.with_live(f.units, by_file.get(f.index, []))

    def free(self, file: int, start: int, units: int) -> None:
        self.files[file].allocator.free_extent(start, units)

    # -- in an I/O thread ----------------------------------------------------------------
    def write(self, file: int, start: int, views: list[memoryview]) -> None:
        """Write ``views`` one after the other from the slot's first byte, then make them
        durable (fdatasync). Short writes are continued; an error raises OSError."""
        f = self.files[file]
        offset = start * f.unit
        for view in views:
            if _transfer(os.pwritev, f.fd, view, offset) != len(view):
                raise OSError(f"short write to {f.path}")
            offset += len(view)
        os.fdatasync(f.fd)

    def read(self, file: int, start: int, view: memoryview) -> None:
        f = self.files[file]
        offset = start * f.unit
        if _transfer(os.preadv, f.fd, view, offset) != len(view):
            raise OSError(f"short read from {f.path} at {offset}")

    def close(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for f in self.files:
            f.close()
        index = getattr(self, "index", None)
        if index is not None:
            index.close()
