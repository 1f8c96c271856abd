"""The warm-restart journal: the broker's index of sealed objects, beside the socket.

What it holds, and who writes it
--------------------------------

One file, ``<socket>.journal``, written only by the daemon holding ``<socket>.lock``: a
sequence of records, appended as the index changes. Each record is framed (format 3)::

    b"KVJ3" | u32 length | u32 crc32(body, seed) | body: one msgpack map

so a damaged record is detected (its checksum), skipped alone (the next record is found by
its magic and checksum), and never read as another one. The header is written twice, first
in the file, so one damaged copy does not make the whole file unreadable; its checksum starts
from 0 and it names the ``seed`` every other record's checksum starts from: a random secret
of this file. Record bodies hold bytes clients chose (keys, metas), so one could hold a
whole frame; after a damaged record the reader looks for the next frame inside the damage,
and a frame a client wrote there passes for a record only with the seed, which it cannot
read (the file is the daemon user's, mode 0600), or by a 1 in 2^32 chance. (Format 2 files,
from before the seed, are still read, the same way but without that protection, and
rewritten as format 3 at once.)

- ``{"t": "h", ...}`` — the header, first: format version, the daemon's epoch and the pool
  geometry (segment names, sizes, page size) the extents below refer to;
- ``{"t": "s", "o": record}`` — an object was sealed (``StoredObject.to_record``);
- ``{"t": "u", "s": serial}`` — a sealed object was unlinked (evicted, replaced, consumed);
  its extents are free once the daemon restarts, whoever was still reading them;
- ``{"t": "c", "s": serial, "n": consumers}`` — a consume-claim was released;
- ``{"t": "i", "n": id}`` — lease and session ids below ``n`` may have been handed out;
- ``{"t": "r", "ns", "n", "u", "p", "x", "c", "a": [serials]}`` — a session
  (:mod:`kvbroker._server.retention`) was named or renewed: its owner's uid, priority, expiry
  (wall-clock) and creation time, and the serials it retains from now on (``a``, added to
  those of its earlier records; an ``r`` with no serials also records a shortened expiry,
  a reload's ``max_retain``); ``{"t": "d", "ns", "n", "a": [serials]}`` — a bound (the
  tenant quota, the pool share) took those serials from it: no longer retained unless a
  later ``r`` names them again; ``{"t": "R", "ns", "n"}`` — it was released or expired.
  A restarted daemon keeps the sessions not expired, over the objects still there, and
  enforces their bounds again;
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

Loading trusts nothing it cannot check (issue 16): damaged records are dropped and counted
(``Recovered.damaged``); an object whose pages a later ``w`` record lent again (a lost ``u``
record: it was freed and its pages reused) is dropped as stale (``Recovered.dropped``). The
broker writes a key's ``u`` before the ``s`` that replaces it, and a ``w`` before any ``s`` on
its pages, so two records that break that order contradict each other and **both** are
dropped (issue 38): a second live ``s`` of one key with no ``u`` of the first between them,
and an ``s`` on a live object's pages with no ``w`` between them (what a record rewritten with
a valid checksum, or moved, looks like: which one holds whose bytes cannot be told); ids
are fenced a block further per damaged record (a lost ``i`` record). What the rest of the
restore refuses (duplicate keys, overlapping or out-of-pool extents, children of dropped
parents): :func:`kvbroker._server.restore.restore`.

Compaction rewrites the file as a header plus one ``s`` record per live object (to a
temporary file, then ``rename``) once the log holds more than twice the live records, so
the file stays O(live objects) and appends stay O(1) amortised.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgpack

__all__ = ["Journal", "Recovered", "JournalError", "journal_path"]

log = logging.getLogger("kvbroker.journal")

FORMAT = 3
MAGIC = b"KVJ3"
_LEGACY_MAGIC = b"KVJ2"  # format 2: no seed (every checksum starts from 0)
_FRAME = struct.Struct("<4sII")  # magic, body length, crc32 of the body
_MAX_RECORD = 64 << 20  # a body longer than this is a damaged length field
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
    # (first byte, end) of each damaged stretch of the file that was skipped (not the tail)
    damaged: list[tuple[int, int]] = field(default_factory=list)
    # why objects of the journal were not kept: reason -> ["namespace/key", ...]
    dropped: dict[str, list[str]] = field(default_factory=dict)

    dropped_serials: set[int] = field(default_factory=set)  # their children go too
    # (namespace, name) -> a session's last "r" record, "a" every serial it still retains
    sessions: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def drop(self, reason: str, what: str, serial: int | None = None) -> None:
        self.dropped.setdefault(reason, []).append(what)
        if serial is not None:
            self.dropped_serials.add(serial)

    @property
    def suspect(self) -> bool:
        """Some record was damaged, cut or contradicted: what is left must be checked harder.
        (A torn tail counts: one append is one write(2), which a SIGKILL does not tear; a file
        cut short lost records whose pages may since hold other bytes.)"""
        return bool(self.damaged or self.dropped or self.torn_bytes)


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
        self._batch: list[bytes] | None = None  # frames of the request being handled
        self.seed = 0  # the file's checksum seed, drawn at each rewrite (see the module doc)
        # The sessions' ``r`` records a rewrite carries (kvbroker._server.retention sets it)
        self.sessions: Callable[[], Iterable[dict[str, Any]]] = tuple

    # -- reading ---------------------------------------------------------------------------
    @staticmethod
    def load(path: str) -> Recovered | None:
        """The previous daemon's index, or None when there is no journal. Damaged records
        are dropped, not trusted (see the module doc); JournalError only when no header is
        readable."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        if not data:
            return None
        magic, seed, start = _header_of(data)
        entries, damaged, torn = _frames(data, magic, seed, start)
        if 0 < start < len(data):
            damaged.insert(0, (0, start))  # the first copy of the header
        rec: Recovered | None = None
        # (seq, pool, start, npages, serial) of s records, serial -1 for w records
        history: list[tuple[int, int, int, int, int]] = []
        seal_seq: dict[int, int] = {}
        live_keys: dict[tuple[str, str], int] = {}  # (namespace, key) -> serial last sealed
        for seq, (pos, entry) in enumerate(entries):
            t = entry.get("t") if isinstance(entry, dict) else None
            if rec is None:
                if t != "h":
                    continue  # records before any readable header cannot be placed
                try:
                    rec = Recovered(
                        int(entry["epoch"]), list(entry["pools"]), next_id=int(entry.get("ids", 1))
                    )
                except (KeyError, TypeError, ValueError):
                    damaged.append((pos, pos + 1))
                continue
            try:
                _apply(rec, t, entry, seq, history, seal_seq, live_keys)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.warning(
                    "%s: record at byte %d does not make sense (%s: %s): dropped",
                    path,
                    pos,
                    type(exc).__name__,
                    exc,
                )
                damaged.append((pos, pos + 1))
        if rec is None:
            raise JournalError(
                f"{path}: no readable header (not a kvbroker journal of format "
                f"{FORMAT}, or its header is damaged)"
            )
        rec.torn_bytes = torn
        rec.damaged = damaged
        if damaged:
            # A lost "i" record would let ids handed out before the crash be handed out again.
            rec.next_id += ID_BLOCK * (1 + len(damaged))
        _drop_stale(rec, history, seal_seq)
        return rec

    # -- writing ---------------------------------------------------------------------------
    def rewrite(
        self,
        records: Iterable[dict[str, Any]],
        next_id: int,
        lent: Iterable[tuple[int, int, int]] = (),
    ) -> None:
        """Replace the file with the header, ``records`` (the live objects), ``lent``
        (``(pool, start, npages)`` lent for writing or quarantined) and the sessions' ``r``
        records (``sessions()``, set by the retention that journals here), atomically."""
        if self.failed:
            return
        self.flush()  # the rewrite replaces the file: nothing may be written after it
        try:
            self._rewrite(records, next_id, lent, self.sessions())
        except OSError as exc:
            self._fail(exc)

    def _rewrite(
        self,
        records: Iterable[dict[str, Any]],
        next_id: int,
        lent: Iterable[tuple[int, int, int]],
        sessions: Iterable[dict[str, Any]] = (),
    ) -> None:
        tmp = self.path + ".tmp"
        pack = self._packer.pack
        live = 0
        self.id_limit = next_id + ID_BLOCK
        seed = int.from_bytes(os.urandom(4), "little")
        header = _frame(
            pack(
                {
                    "t": "h",
                    "v": FORMAT,
                    "epoch": self.epoch,
                    "pools": self.pools,
                    "ids": self.id_limit,
                    "seed": seed,
                }
            ),
            0,
        )
        chunks = [header, header]  # twice: one damaged copy leaves the other
        for r in records:
            chunks.append(_frame(pack({"t": "s", "o": r}), seed))
            live += 1
        for p, start, npages in lent:
            chunks.append(_frame(pack({"t": "w", "p": p, "s": start, "n": npages}), seed))
        for r in sessions:
            chunks.append(_frame(pack(r), seed))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"".join(chunks))
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self.seed = seed
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        self._appended = 0
        self._live = live
        self.compactions += 1

    def begin(self) -> bool:
        """Hold the records appended from now on for one write at :meth:`flush`: one system
        call per request, or per slice of one connection's requests, instead of one per
        record (a 64-block reserve journals 64). The caller replies only after the flush, so
        an acknowledged change is in the file as before. False, holding nothing new, when a
        batch is open already: whoever opened it flushes."""
        if self._batch is not None:
            return False
        self._batch = []
        return True

    def flush(self) -> None:
        """Write the records held since :meth:`begin` (one ``write``), and hold no more."""
        frames, self._batch = self._batch, None
        if frames:
            self._write(b"".join(frames), len(frames))

    def _append(self, entry: dict[str, Any]) -> None:
        if self.failed:
            return
        data = _frame(self._packer.pack(entry), self.seed)
        if self._batch is not None:
            self._batch.append(data)
            return
        self._write(data, 1)

    def _write(self, data: bytes, records: int) -> None:
        if self.failed:
            return
        try:
            if os.write(self._fd, data) != len(data):
                raise OSError(28, "short write (no space left?)")
        except OSError as exc:
            self._fail(exc)
            return
        self._appended += records
        self.records += records

    def _fail(self, exc: OSError) -> None:
        """A journal missing a record could bring back objects whose pages were reused:
        rather than that, no journal at all (the next start is cold)."""
        self.failed = f"{exc.strerror or exc}"
        log.error(
            "cannot write the journal %s (%s): warm restart is off until the daemon "
            "restarts; the next start will be cold",
            self.path,
            self.failed,
        )
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

    def retention(self, record: dict[str, Any]) -> None:
        """A session named, renewed, released (``r`` / ``R``, kvbroker._server.retention)."""
        self._append(record)

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


# -- framing and replay ----------------------------------------------------------------------
def _frame(body: bytes, seed: int) -> bytes:
    return _FRAME.pack(MAGIC, len(body), zlib.crc32(body, seed)) + body


def _header_of(data: bytes) -> tuple[bytes, int, int]:
    """The file's magic, its checksum seed and where its records start: at the first
    readable copy of the header, the file's first frame or the next one (found by its
    magic when the first is damaged). Nowhere else: those two positions are the daemon's
    own bytes, while a frame found further on could lie in a client's meta. A format 2
    file: its magic, seed 0, 0."""
    if data[: len(_LEGACY_MAGIC)] == _LEGACY_MAGIC:
        return _LEGACY_MAGIC, 0, 0
    for pos in (0, data.find(MAGIC, 1)):
        if pos < 0 or data[pos : pos + len(MAGIC)] != MAGIC:
            continue
        _, n, crc = _FRAME.unpack_from(data, pos) if pos + _FRAME.size <= len(data) else (0, 0, 0)
        body = data[pos + _FRAME.size : pos + _FRAME.size + n]
        if len(body) != n or zlib.crc32(body) != crc:
            continue
        try:
            entry = msgpack.unpackb(body, raw=False, strict_map_key=False)
            if entry.get("t") == "h" and entry.get("v") == FORMAT:
                return MAGIC, int(entry["seed"]), pos
        except Exception:  # noqa: BLE001 - not a header: the next copy, or none
            continue
    if MAGIC not in data and data.find(_LEGACY_MAGIC, 1) >= 0:
        return _LEGACY_MAGIC, 0, 0  # format 2, its start damaged: read as format 2 was
    return MAGIC, 0, len(data)  # no readable header: Journal.load says so


def _frames(
    data: bytes, magic_of: bytes = MAGIC, seed: int = 0, start: int = 0
) -> tuple[list[tuple[int, Any]], list[tuple[int, int]], int]:
    """The records of ``data`` from ``start`` whose checksum (from ``seed``; a header's
    from 0) holds, as (offset, entry); the damaged stretches skipped in between (and at the
    end); the bytes of a torn tail: the start of a record the file ends inside (a crash
    mid-append, a truncated file)."""
    out: list[tuple[int, Any]] = []
    damaged: list[tuple[int, int]] = []
    pos, size, hdr = start, len(data), _FRAME.size
    while pos < size:
        if pos + hdr <= size:
            magic, n, crc = _FRAME.unpack_from(data, pos)
            end = pos + hdr + n
            if magic == magic_of and n <= _MAX_RECORD:
                body = data[pos + hdr : end]
                keyed = end <= size and zlib.crc32(body, seed) == crc
                if keyed or (end <= size and zlib.crc32(body) == crc):
                    try:
                        entry = msgpack.unpackb(body, raw=False, strict_map_key=False)
                    except Exception:  # checksummed yet unreadable: written wrong
                        damaged.append((pos, end))
                    else:
                        if keyed or (isinstance(entry, dict) and entry.get("t") == "h"):
                            out.append((pos, entry))
                        else:  # a frame checksummed from 0 that is not a header
                            damaged.append((pos, end))
                    pos = end
                    continue
                if end > size and data.find(magic_of, pos + 1) < 0:
                    return out, damaged, size - pos  # torn: the file ends inside it
        elif magic_of.startswith(bytes(data[pos : pos + len(magic_of)])):
            return out, damaged, size - pos  # torn inside its frame header
        nxt = data.find(magic_of, pos + 1)
        nxt = size if nxt < 0 else nxt
        damaged.append((pos, nxt))
        pos = nxt
    return out, damaged, 0


def _apply(
    rec: Recovered,
    t: Any,
    entry: dict,
    seq: int,
    history: list[tuple[int, int, int, int, int]],
    seal_seq: dict[int, int],
    live_keys: dict[tuple[str, str], int],
) -> None:
    """Replay one checked record into ``rec``."""
    if t == "h":
        return  # the second copy of the header
    if t == "s":
        o = entry["o"]
        serial = o["serial"]
        if not isinstance(serial, int) or not isinstance(o, dict):
            raise TypeError("a sealed object needs an integer serial")
        where = (int(o["pool"]), int(o["start"]), int(o["npages"]))
        history.append((seq, *where, serial))
        ident = (o.get("namespace"), o.get("key"))
        if not all(isinstance(v, str) for v in ident):
            ident = None  # malformed: restore drops it and says why
        prior = live_keys.get(ident) if ident is not None else None
        if ident is not None:
            live_keys[ident] = serial
        if prior is not None and prior != serial and prior in rec.objects:
            # The broker writes the unlink of a key's object before the seal that replaces
            # it: two live seals of one key say different things about the same name (a
            # record rewritten or misplaced with a valid checksum). Neither is believed.
            why = "two seals of its key with no unlink between them"
            del rec.objects[prior]
            rec.drop(why, f"{ident[0]}/{ident[1]}", prior)
            rec.drop(why, f"{ident[0]}/{ident[1]}", serial)
            _end_lent(rec, o)
            return
        rec.objects[serial] = o
        seal_seq[serial] = seq
        _end_lent(rec, o)
    elif t == "u":
        rec.objects.pop(entry["s"], None)
    elif t == "c":
        o = rec.objects.get(entry["s"])
        if o is not None:
            o["consumers"] = int(entry["n"])
    elif t == "w":
        p, st, n = int(entry["p"]), int(entry["s"]), int(entry["n"])
        rec.lent[(p, st)] = n
        history.append((seq, p, st, n, -1))
    elif t == "e":
        _returned(rec.lent, int(entry["p"]), int(entry["s"]))
    elif t == "i":
        rec.next_id = max(rec.next_id, int(entry["n"]))
    elif t == "r":
        key = (str(entry["ns"]), str(entry["n"]))
        serials = [s for s in entry.get("a", ()) if isinstance(s, int)]
        prior = rec.sessions.get(key)
        entry = dict(entry, a=(prior["a"] if prior is not None else []) + serials)
        rec.sessions[key] = entry
    elif t == "d":
        prior = rec.sessions.get((str(entry["ns"]), str(entry["n"])))
        if prior is not None:
            lost = {s for s in entry["a"] if isinstance(s, int)}
            prior["a"] = [s for s in prior["a"] if s not in lost]
    elif t == "R":
        rec.sessions.pop((str(entry["ns"]), str(entry["n"])), None)
    else:
        raise ValueError(f"unknown record type {t!r}")


def _end_lent(rec: Recovered, o: dict) -> None:
    """A seal ends the lending of its pages (an arena whose first pages were published
    stays lent past them)."""
    where = (o["pool"], o["start"])
    n = rec.lent.pop(where, None)
    if n is not None and n > o["npages"]:
        rec.lent[(where[0], where[1] + o["npages"])] = n - o["npages"]


def _drop_stale(
    rec: Recovered, history: list[tuple[int, int, int, int, int]], seal_seq: dict[int, int]
) -> None:
    """Drop the objects whose pages a later record put something else on. Pages lent for
    writing after an object's seal: its unlink record was lost and its pages reused (the
    broker lends pages before any seal on them): the object is stale, the later one stands.
    A later seal on its pages with no lending between: the two records contradict each
    other (a rewritten or misplaced record with a valid checksum): both are dropped."""
    import numpy as np

    lent_at, sealed_at, sealer = [], [], []
    for p in rec.pools:
        try:
            npages = max(0, int(p["size"]) // int(p["page_size"]))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            npages = 0
        lent_at.append(np.full(npages, -1, dtype=np.int64))
        sealed_at.append(np.full(npages, -1, dtype=np.int64))
        sealer.append(np.full(npages, -1, dtype=np.int64))
    for seq, p, st, n, serial in history:  # in journal order: each page keeps its latest
        if 0 <= p < len(lent_at) and n > 0 and st >= 0:
            if serial < 0:
                lent_at[p][st : st + n] = seq
            else:
                sealed_at[p][st : st + n] = seq
                sealer[p][st : st + n] = serial
    contradicted: dict[int, None] = {}
    for serial, o in list(rec.objects.items()):
        try:
            p, st, n = int(o["pool"]), int(o["start"]), int(o["npages"])
            if not (0 <= p < len(lent_at) and n > 0 and st >= 0):
                continue  # restore checks the record itself
            q = seal_seq[serial]
            relent = int(lent_at[p][st : st + n].max(initial=-1)) > q
            later = sealed_at[p][st : st + n] > q
        except (KeyError, TypeError, ValueError):
            continue
        if relent:
            del rec.objects[serial]
            rec.drop(
                "its pages were reused by a later record (its unlink was lost)",
                f"{o.get('namespace')}/{o.get('key')}",
                serial,
            )
        elif later.any():
            contradicted[serial] = None
            contradicted.update(
                dict.fromkeys(int(x) for x in np.unique(sealer[p][st : st + n][later]))
            )
    for serial in contradicted:
        o = rec.objects.pop(serial, None)
        if o is not None:
            rec.drop(
                "its pages are another live object's, sealed with no unlink and no "
                "lending between them",
                f"{o.get('namespace')}/{o.get('key')}",
                serial,
            )
