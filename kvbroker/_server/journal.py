"""The warm-restart journal: the broker's index of sealed objects, beside the socket.

What it holds, and who writes it
--------------------------------

One file, ``<socket>.journal``, written only by the daemon holding ``<socket>.lock``: a
sequence of msgpack maps, appended as the index changes.

- ``{"t": "h", ...}`` — the header, first: format version, the daemon's epoch and the pool
  geometry (segment names, sizes, page size) the extents below refer to;
- ``{"t": "s", "o": record}`` — an object was sealed (``StoredObject.to_record``);
- ``{"t": "u", "s": serial}`` — a sealed object was unlinked (evicted, replaced, consumed);
  its extents are free once the daemon restarts, whoever was still reading them;
- ``{"t": "c", "s": serial, "n": consumers}`` — a consume-claim was released;
- ``{"t": "i", "n": id}`` — lease and session ids below ``n`` may have been handed out;
- ``{"t": "w", "p": pool, "s": start, "n": npages}`` — pages were lent for writing (a
  reservation or a write arena): a client may be copying into them;
- ``{"t": "e", "p": pool, "s": start}`` — pages lent for writing came back (aborted,
  expired and released, their connection gone). A seal ends them too: the ``s`` record of an
  object whose extent starts where lent pages start ends those pages, or, for a write arena
  whose first pages were published, leaves the rest lent.

Unsealed (reserved) objects are not written as objects. Pages still lent for writing when the
daemon died are not free for the next daemon at once: the writer may still be mid-copy, so
they are quarantined for ``restart_quarantine`` seconds first (``Broker.restore``).
A record is appended (one ``write``) before the request that caused it is answered, so what a
client was told is sealed survives a SIGKILL of the daemon (the page cache outlives the
process; the pools in /dev/shm would not outlive the machine anyway). A torn last record is
cut off on load.

Compaction rewrites the file as a header plus one ``s`` record per live object (to a
temporary file, then ``rename``) once the log holds more than twice the live records, so
the file stays O(live objects) and appends stay O(1) amortised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = ["Journal", "Recovered", "JournalError", "journal_path"]

log = logging.getLogger("kvbroker.journal")

FORMAT = 1
_COMPACT_MIN = 4096  # records appended before compaction is considered
# Lease and session ids are reserved in blocks, so the counter costs one record per block.
ID_BLOCK = 1 << 16


class JournalError(Exception):
    """The journal cannot be read as a kvbroker journal (wrong format, corrupt header)."""


def journal_path(socket_path: str) -> str:
    return socket_path + ".journal"


@dataclass
class Recovered:
    """What a journal says the previous daemon had: its geometry and its sealed objects."""

    epoch: int
    pools: list[dict[str, Any]]  # [{index, name, size, page_size}]
    objects: dict[int, dict[str, Any]] = field(default_factory=dict)  # serial -> record, seal order
    next_id: int = 1
    # (pool, start page) -> npages: lent for writing and not back when the daemon stopped.
    lent: dict[tuple[int, int], int] = field(default_factory=dict)
    torn_bytes: int = 0  # an incomplete last record that was cut off


def _returned(lent: dict[tuple[int, int], int], pool: int, start: int) -> None:
    """Pages lent from ``start`` came back. Not the start of a lent extent: the rest of a
    write arena whose first pages are being published (their ``s`` record follows), so the
    extent holding ``start`` keeps only its pages before it."""
    if lent.pop((pool, start), None) is not None:
        return
    for (p, first), n in lent.items():  # rare (a journal holds few lent extents): a scan
        if p == pool and first < start < first + n:
            lent[(p, first)] = start - first
            return


class Journal:
    """Appends the index's changes to ``path``; the daemon owns it (one per socket)."""

    def __init__(self, path: str, epoch: int, pools: list[dict[str, Any]]) -> None:
        self.path = path
        self.epoch = epoch
        self.pools = pools
        self._fd: int | None = None
        self._packer = msgpack.Packer()
        self._appended = 0
        self._live = 0
        self.id_limit = 0
        self.records = 0  # appended since start, for statistics
        self.compactions = 0
        self.failed: str | None = None  # why journaling stopped (a write failed)

    # -- reading ---------------------------------------------------------------------------
    @staticmethod
    def load(path: str) -> Recovered | None:
        """The previous daemon's index, or None when there is no journal."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=0)
        unpacker.feed(data)
        good = 0
        rec: Recovered | None = None
        try:
            for entry in unpacker:
                if not isinstance(entry, dict):
                    raise JournalError(f"{path}: record at byte {good} is not a map")
                t = entry.get("t")
                if rec is None:
                    if t != "h" or entry.get("v") != FORMAT:
                        raise JournalError(f"{path}: not a kvbroker journal of format {FORMAT}")
                    rec = Recovered(int(entry["epoch"]), list(entry["pools"]),
                                    next_id=int(entry.get("ids", 1)))  # fmt: skip
                elif t == "s":
                    o = entry["o"]
                    rec.objects[o["serial"]] = o
                    # The object's pages were lent for writing until now (an arena whose
                    # first pages were published stays lent past them).
                    where = (o["pool"], o["start"])
                    n = rec.lent.pop(where, None)
                    if n is not None and n > o["npages"]:
                        rec.lent[(where[0], where[1] + o["npages"])] = n - o["npages"]
                elif t == "u":
                    rec.objects.pop(entry["s"], None)
                elif t == "c":
                    o = rec.objects.get(entry["s"])
                    if o is not None:
                        o["consumers"] = entry["n"]
                elif t == "w":
                    rec.lent[(int(entry["p"]), int(entry["s"]))] = int(entry["n"])
                elif t == "e":
                    _returned(rec.lent, int(entry["p"]), int(entry["s"]))
                elif t == "i":
                    rec.next_id = max(rec.next_id, int(entry["n"]))
                else:
                    raise JournalError(f"{path}: unknown record type {t!r} at byte {good}")
                good = unpacker.tell()
        except (msgpack.UnpackException, ValueError, KeyError, TypeError) as exc:
            if rec is None:
                raise JournalError(f"{path}: unreadable header: {exc}") from None
            log.warning("%s: stopped at a corrupt record at byte %d: %s", path, good, exc)
        if rec is None:
            if not data:
                return None
            raise JournalError(f"{path}: truncated header")
        rec.torn_bytes = len(data) - good
        return rec

    # -- writing ---------------------------------------------------------------------------
    def rewrite(self, records: Iterable[dict[str, Any]], next_id: int,
                lent: Iterable[tuple[int, int, int]] = ()) -> None:  # fmt: skip
        """Replace the file with the header, ``records`` (the live objects) and ``lent``
        (``(pool, start, npages)`` lent for writing or quarantined), atomically."""
        if self.failed:
            return
        try:
            self._rewrite(records, next_id, lent)
        except OSError as exc:
            self._fail(exc)

    def _rewrite(self, records: Iterable[dict[str, Any]], next_id: int,
                 lent: Iterable[tuple[int, int, int]]) -> None:  # fmt: skip
        tmp = self.path + ".tmp"
        pack = self._packer.pack
        live = 0
        self.id_limit = next_id + ID_BLOCK
        chunks = [pack({"t": "h", "v": FORMAT, "epoch": self.epoch, "pools": self.pools,
                        "ids": self.id_limit})]  # fmt: skip
        for r in records:
            chunks.append(pack({"t": "s", "o": r}))
            live += 1
        for p, start, npages in lent:
            chunks.append(pack({"t": "w", "p": p, "s": start, "n": npages}))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"".join(chunks))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._appended = 0
        self._live = live
        self.compactions += 1

    def _append(self, entry: dict[str, Any]) -> None:
        if self.failed:
            return
        data = self._packer.pack(entry)
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(28, "short write (no space left?)")
        except OSError as exc:
            self._fail(exc)
            return
        self._appended += 1
        self.records += 1

    def _fail(self, exc: OSError) -> None:
        """A journal missing a record could bring back objects whose pages were reused:
        rather than that, no journal at all (the next start is cold)."""
        self.failed = f"{exc.strerror or exc}"
        log.error("cannot write the journal %s (%s): warm restart is off until the daemon "
                  "restarts; the next start will be cold", self.path, self.failed)
        self.remove()

    def sealed(self, record: dict[str, Any]) -> None:
        self._append({"t": "s", "o": record})
        self._live += 1

    def unlinked(self, serial: int) -> None:
        self._append({"t": "u", "s": serial})
        self._live -= 1

    def consumers(self, serial: int, n: int) -> None:
        self._append({"t": "c", "s": serial, "n": n})

    def lent(self, pool: int, start: int, npages: int) -> None:
        """Pages were lent for writing: until ``returned`` (or a seal starting there), a
        restarted daemon quarantines them."""
        self._append({"t": "w", "p": pool, "s": start, "n": npages})

    def returned(self, pool: int, start: int) -> None:
        self._append({"t": "e", "p": pool, "s": start})

    def reserve_ids(self, upto: int) -> int:
        """Record that ids below ``upto + ID_BLOCK`` may be handed out; returns that limit."""
        self.id_limit = upto + ID_BLOCK
        self._append({"t": "i", "n": self.id_limit})
        return self.id_limit

    def wants_compaction(self) -> bool:
        return not self.failed and self._appended > _COMPACT_MIN and self._appended > 2 * self._live

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.close()
        for p in (self.path, self.path + ".tmp"):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
