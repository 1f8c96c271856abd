"""One object on disk, as the disk tier keeps it (:mod:`kvbroker._server.disk_tier`): its
slot, the digest of what was written there, and what a pool needs to seal it again."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from .._wire import checksum as _checksum
from .._wire.protocol import meta_problem
from .checks import tokens_problem
from .state import index_footprint

__all__ = ["DiskEntry", "entry_of_record", "object_record", "slot_units", "written_length"]


class DiskEntry:
    """One object on disk: its slot, the digest of what was written, and what a pool needs
    to seal it again (its record)."""

    __slots__ = (
        "ident",
        "file",
        "start",
        "units",
        "length",
        "digest",
        "record",
        "serial",
        "written",
        "writing",
        "reading",
        "gone",
        "charged",
        "tenants",
        "obj",
        "last_access",
        "seq",
        "announced",
    )

    def __init__(
        self,
        ident: tuple[str, str],
        slot: tuple[int, int, int],
        length: int,
        record: dict[str, Any],
        serial: int,
        charged: int,
        tenants: tuple[tuple[str, int], ...],
    ) -> None:
        self.ident = ident
        self.file, self.start, self.units = slot
        self.length = length  # bytes written from the extent's first byte (page-aligned)
        self.digest: int | None = None  # xxh3_64 of those bytes, once written
        self.record = record  # buffers (relative), meta, checksums, parent, tokens, ...
        self.serial = serial  # of the pool object it copies (a warm restart matches them)
        self.written = False  # its bytes are in the slot, synced: it may be promoted
        self.writing: asyncio.Future | None = None  # the write in flight
        self.reading = 0  # promotions reading it: its slot is not freed under them
        self.gone = False  # forgotten while a write or read was in flight
        self.charged = charged
        self.tenants = tenants
        # The pool object it is a copy of, while that is linked; None: on disk only. One
        # unlinked other than by eviction (consumed, replaced, evicted on purpose) takes the
        # disk copy with it (DiskTier.live).
        self.obj: Any = None
        self.last_access = time.time()
        # Its place in ``list``'s order (kvbroker._server.listing): the seq of the pool
        # object it was demoted from; negative for one found on disk at start.
        self.seq = 0
        # The KV event feed (kvbroker._server.fleet_events) announced it as on disk
        # (medium STORAGE): its removal from disk is announced too.
        self.announced = False

    @property
    def nbytes(self) -> int:
        return int(self.record["nbytes"])

    def info(self) -> dict[str, Any]:
        """As ``list`` and ``evict`` describe objects; pool -1: on disk only."""
        rec = self.record
        return {
            "namespace": self.ident[0],
            "key": self.ident[1],
            "nbytes": self.nbytes,
            "buffers": len(rec["buffers"]),
            "pool": -1,
            "readers": 0,
            "created_at": rec.get("created_at") or 0.0,
            "last_access": self.last_access,
            "meta": rec.get("meta"),
        }

    def lookup(self) -> dict[str, Any]:
        """``lookup``'s answer: the info, its checksums, buffer sizes and consumers left."""
        rec = self.record
        return {
            **self.info(),
            "checksums": rec.get("checksums"),
            "buffer_sizes": {name: n for name, (_, n) in rec["buffers"].items()},
            "consumers": rec.get("consumers") or 1,
        }

    def to_record(self) -> dict[str, Any]:
        """Its ``p`` record in the index."""
        return {
            "t": "p",
            "f": self.file,
            "s": self.start,
            "n": self.units,
            "l": self.length,
            "d": self.digest,
            "ns": self.ident[0],
            "k": self.ident[1],
            "sr": self.serial,
            "tn": [list(t) for t in self.tenants],
            "o": self.record,
        }


def object_record(obj: Any) -> dict[str, Any]:
    """What promotion needs of a pool object to seal it again (buffers relative to its
    extent)."""
    base = obj.start * obj.pool.page_size
    return {
        "nbytes": obj.nbytes,
        "meta": obj.meta,
        "checksums": obj.checksums,
        "parent_key": obj.parent_key,
        "tokens": obj.tokens,
        "consumers": obj.consumers,
        "created_at": obj.created_at,
        "buffers": {name: [off - base, n] for name, (off, n) in obj.buffers.items()},
    }


def written_length(obj: Any, unit: int) -> int:
    """The bytes of ``obj``'s extent that hold its buffers, rounded up to ``unit`` (never
    past the extent: pages are a multiple of the unit)."""
    base = obj.start * obj.pool.page_size
    end = max((off - base + n for off, n in obj.buffers.values()), default=0)
    return max(unit, -(-end // unit) * unit)


def _count(value: Any, least: int = 0) -> bool:
    return value.__class__ is int and value >= least


def slot_units(length: int, footprint: int, scale: float, unit: int) -> int:
    """The units of the slot of an object of ``length`` bytes written whose index entry
    takes ``footprint`` bytes of daemon memory (``state.index_footprint``): at least the
    footprint times ``scale`` (disk size / pool size). A pool object occupies at least its
    footprint, so the daemon's memory is bounded by the pools; a slot sized by the bytes
    alone let 4096 names of empty buffers (~500 KiB of entry) sit in one 4 KiB slot."""
    return -(-max(length, math.ceil(footprint * scale)) // unit)


def entry_of_record(
    slot: tuple[int, int], rec: dict[str, Any], unit: int, scale: float
) -> DiskEntry | None:
    """The written entry an index ``p`` record on ``slot`` (file, start) describes, or None
    when a field is not what :meth:`DiskEntry.to_record` writes. The index is read at start
    for every tenant: a record anyone crafted or damaged (its frame's crc is no secret) is
    dropped on its own, never a crash of the start; and nothing it says may reach past the
    bytes its digest vouches for (a buffer past them would lease pool bytes never read from
    its slot, another object's), nor take more memory than its slot pays for
    (:func:`slot_units`, ``scale``: disk size / pool size)."""
    ns, key, units, length, o = (
        rec.get("ns"),
        rec.get("k"),
        rec.get("n"),
        rec.get("l"),
        rec.get("o"),
    )
    serial, tenants = rec.get("sr") or 0, rec.get("tn") or ()
    if not (
        ns.__class__ is str
        and key.__class__ is str
        and _count(units, 1)
        and _count(length, 1)
        and length <= units * unit
        and _count(rec.get("d"))
        and _count(serial)
        and isinstance(tenants, list | tuple)
        and all(
            isinstance(t, list | tuple) and len(t) == 2 and t[0].__class__ is str and _count(t[1])
            for t in tenants
        )
        and isinstance(o, dict)
        and _count(o.get("nbytes"))
        and isinstance(o.get("buffers"), dict)
    ):
        return None
    for name, extent in o["buffers"].items():
        if not (
            name.__class__ is str
            and isinstance(extent, list | tuple)
            and len(extent) == 2
            and _count(extent[0])
            and _count(extent[1])
            and extent[0] + extent[1] <= length
        ):
            return None
    meta, sums, created = o.get("meta"), o.get("checksums"), o.get("created_at")
    consumers, parent = o.get("consumers"), o.get("parent_key")
    if (
        not (meta is None or isinstance(meta, dict))
        or meta_problem(meta) is not None
        or tokens_problem(o.get("tokens")) is not None
        or not (consumers is None or _count(consumers, 1))
        or not (parent is None or parent.__class__ is str)
        or not (created is None or (created.__class__ in (int, float) and math.isfinite(created)))
    ):
        return None
    if sums is not None:
        try:
            _checksum.validate(sums, o["buffers"])
        except ValueError:
            return None
    if units < slot_units(
        length, index_footprint(o["buffers"], meta, o.get("tokens")), scale, unit
    ):
        return None  # an entry bigger than its slot pays for
    e = DiskEntry(
        (ns, key),
        (*slot, units),
        length,
        o,
        serial,
        units * unit,
        tuple((k, i) for k, i in tenants),
    )
    e.digest, e.written = rec["d"], True
    return e
