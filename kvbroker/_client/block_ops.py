"""Block writers: reserve, copy, seal or abort a batch of blocks (readers: block_match.py)
(public through :mod:`kvbroker.blocks`, whose module doc says who owns and frees what).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from . import integrity as _integrity
from .copy import copy_into
from .engine import default_engine
from .._wire import checksum as _cs
from .._wire.protocol import name_bytes, request_chunks, retain_problem
from ..errors import BadRequest, KVBrokerError, LayoutMismatch

__all__ = [
    "Reservation",
    "PendingReservation",
    "reserve",
    "reserve_later",
    "seal",
    "seal_later",
    "abort",
    "view",
    "pool_address",
    "pool_runs",
    "copy",
    "checksum",
    "empty_checksum",
    "device_checksums_available",
    "start_device_checksums",
    "retention",
]


def retention(
    session: str | None, retain: float | str | None = None, priority: int | None = None
) -> dict | None:
    """What a request names of a session (the ``retain`` argument of :func:`reserve` and the
    matches): blocks it publishes or matches are kept past plain LRU while the session lasts,
    renewed by each request (``retain``: seconds or "10m"; None: the daemon's default), and
    evicted lowest ``priority`` first (0 to 100). None without a session."""
    if session is None:
        if retain is not None or priority is not None:
            raise BadRequest("retain and priority need a session name")
        return None
    out: dict[str, Any] = {"session": session}
    if retain is not None:
        from .._wire.paths import parse_duration

        try:
            out["for"] = parse_duration(retain)
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"retain: {exc}") from None
    if priority is not None:
        out["priority"] = priority
    if (problem := retain_problem(out)) is not None:  # the op table's rule, before sending
        raise BadRequest(problem)
    return out


# -- writers -------------------------------------------------------------------------------
class Reservation:
    """One :func:`reserve` batch. ``leases[i]``: block i's write lease, or None (the node
    already holds it: nothing to write). The reserved blocks (those with a lease, in order)
    are numbered ``j``; ``rows`` holds their extents as an int64 array ``[reserved, 1 +
    2·len(names)]`` of ``pool, offset, nbytes, offset, nbytes, ...`` in ``names`` order, or
    is None when their buffers differ (then :meth:`extents` only)."""

    __slots__ = ("client", "leases", "names", "rows", "_maps")

    def __init__(
        self, client, leases: list, names: list[str], rows, maps: list[dict] | None = None
    ) -> None:
        self.client, self.leases, self.names, self.rows = client, leases, names, rows
        self._maps = maps

    @classmethod
    def empty(cls, client, names: Sequence[str]) -> Reservation:
        import numpy as np

        return cls(client, [], list(names), np.zeros((0, 1 + 2 * len(names)), np.int64))

    @property
    def taken(self) -> list[int]:
        """The write leases, in block order."""
        return [lease for lease in self.leases if lease is not None]

    def __len__(self) -> int:
        return len(self._maps) if self.rows is None else len(self.rows)

    def extents(self, j: int) -> dict[str, tuple[int, int, int]]:
        """``{name: (pool, offset, nbytes)}`` of the j-th reserved block."""
        if self.rows is None:
            return dict(self._maps[j])
        row = self.rows[j]
        pool = int(row[0])
        return {
            n: (pool, int(row[1 + 2 * i]), int(row[2 + 2 * i])) for i, n in enumerate(self.names)
        }

    def view(self, j: int, name: str, offset: int = 0, nbytes: int | None = None):
        """A writable numpy uint8 view of buffer ``name`` of the j-th reserved block (from
        ``offset``, ``nbytes`` long: default to its end), valid until seal or abort."""
        pool, at, size = self.extents(j)[name]
        if nbytes is None:
            nbytes = size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > size:
            raise ValueError(f"({offset}, {nbytes}) runs past buffer {name} ({size} bytes)")
        return self.client.pool_view(pool, at + offset, nbytes, writable=True)

    def runs(
        self, order: list[str], nbytes: int, bases: dict[int, int], stage: int, stride: int
    ) -> list[tuple[int, int, int]]:
        """:func:`pool_runs` of the reserved blocks."""
        if self.rows is None:
            raise LayoutMismatch("reserved blocks of one batch differ in their buffers")
        return pool_runs(self.rows, self.names, order, nbytes, bases, stage, stride)

    def checksums(self, names: Sequence[str] | None = None) -> list[dict]:
        """Each reserved block's ``{name: checksum}`` (the client's kind) of what it holds
        now, one block per job over the copy engine's threads; for :func:`seal`."""
        kind = self.client.checksum_kind
        names = list(self.names if names is None else names)
        jobs, total = [], 0
        for j in range(len(self)):
            views = [self.view(j, n) for n in names]
            total += sum(v.nbytes for v in views)
            jobs.append(functools.partial(_digests, names, views, kind))
        return default_engine().run_jobs(jobs, total) if jobs else []

    def seal(self, checksums: list[dict] | None = None) -> None:
        """:func:`seal` of every reserved block."""
        seal(self.client, self.taken, checksums)

    def abort(self) -> None:
        """:func:`abort` of every reserved block."""
        abort(self.client, self.taken)

    def __add__(self, other: Reservation) -> Reservation:
        import numpy as np

        if not other.leases:
            return self
        if not self.leases:
            return other
        if (
            self.rows is None
            or other.rows is None
            or (other.names != self.names and len(other.rows) and len(self.rows))
        ):
            maps = [self.extents(j) for j in range(len(self))]
            maps += [other.extents(j) for j in range(len(other))]
            return Reservation(self.client, self.leases + other.leases, self.names, None, maps)
        names = self.names if len(self.rows) else other.names
        return Reservation(
            self.client, self.leases + other.leases, names, np.concatenate([self.rows, other.rows])
        )


def _digests(names: list[str], views: list, kind: int) -> dict:
    return {n: _integrity.digest_here(v, kind) for n, v in zip(names, views, strict=True)}


def reserve(
    client,
    namespace: str,
    blocks: list[dict],
    buffers: dict[str, int] | None = None,
    meta: dict | None = None,
    *,
    ttl: float | None = None,
    retain: dict | None = None,
) -> Reservation:
    """Reserve the blocks ``[{"key", "parent", "tokens"?}]`` that the node lacks, each with
    ``buffers`` (``{name: nbytes}``) and ``meta`` (None: each block's own ``"buffers"`` and
    ``"meta"``), in one round trip with a compact reply. All or nothing: a refused batch
    (PoolFull, QuotaExceeded...) holds no pages. At most 8192 blocks and a 1 MiB request.
    ``retain``: the session the blocks are published for (:func:`retention`): once sealed,
    it retains them; those already here too."""
    reply = client.ops.reserve_blocks(
        blocks,
        namespace=namespace,
        ttl=ttl,
        buffers=buffers,
        meta=meta,
        compact=True,
        retain=retain,
    )
    return _reservation(client, reply, list(buffers or ()))


class PendingReservation:
    """:func:`reserve` sent without waiting: :meth:`result` reads the reply, a
    :class:`Reservation`, or raises its error. The daemon answers a connection's requests in
    order, so a writer keeps a few batches in its queue while it copies."""

    __slots__ = ("_client", "_pending", "_names")

    def __init__(self, client, pending, names: list[str]) -> None:
        self._client, self._pending, self._names = client, pending, names

    def result(self) -> Reservation:
        return _reservation(self._client, self._pending.result(), self._names)


def reserve_later(
    client,
    namespace: str,
    blocks: list[dict],
    buffers: dict[str, int] | None = None,
    meta: dict | None = None,
    *,
    ttl: float | None = None,
    retain: dict | None = None,
) -> PendingReservation:
    """:func:`reserve`, sent without waiting for the reply."""
    pending = client.ops.pipelined.reserve_blocks(
        blocks,
        namespace=namespace,
        ttl=ttl,
        buffers=buffers,
        meta=meta,
        compact=True,
        retain=retain,
    )
    return PendingReservation(client, pending, list(buffers or ()))


def _reservation(client, reply: dict, names: list[str]) -> Reservation:
    import numpy as np

    if "packed" in reply:
        names = list(reply["names"])
        rows = np.frombuffer(reply["packed"], dtype="<i8").reshape(-1, 1 + 2 * len(names))
        return Reservation(client, list(reply["leases"]), names, rows)
    leases, maps = [], []
    for res in reply["results"]:  # nothing reserved (every block exists), or buffers that
        if res.get("exists"):  # differ between blocks: one map per block
            leases.append(None)
            continue
        leases.append(res["lease"])
        maps.append({n: tuple(e) for n, e in res["buffers"].items()})
    if maps and all(list(m) == list(maps[0]) for m in maps):
        names = list(maps[0])
    elif maps:
        return Reservation(client, leases, names, None, maps)
    flat = [[m[names[0]][0]] + [v for n in names for v in m[n][1:]] for m in maps]
    rows = np.asarray(flat, dtype=np.int64).reshape(-1, 1 + 2 * len(names))
    return Reservation(client, leases, names, rows)


def seal(client, leases: list[int], checksums: list[dict | None] | None = None) -> None:
    """Make the leased blocks the broker's, parents before children, with ``checksums`` (one
    ``{buffer: checksum}`` per lease, in order; None: sealed without). One round trip per
    request's worth; a refusal (a daemon requiring checksums, an expired lease) aborts every
    lease not sealed yet, then raises."""
    if not leases:
        return
    sums = list(checksums) if checksums is not None else [None] * len(leases)
    if len(sums) != len(leases):
        raise BadRequest(f"seal: {len(leases)} leases but {len(sums)} checksum maps")
    costs = [12 + (sum(name_bytes(n) + 16 for n in s) if s else 1) for s in sums]
    for lo, hi in request_chunks(costs):
        chunk = sums[lo:hi]
        try:
            client.ops.seal_many(
                list(leases[lo:hi]), None if all(s is None for s in chunk) else chunk
            )
        except KVBrokerError:  # refused whole (a batch is all or nothing): none of these
            abort(client, leases[lo:])
            raise


def seal_later(client, leases: list[int], checksums: list[dict | None] | None = None):
    """:func:`seal` of one request's worth (a reservation batch), sent without waiting:
    ``.result()`` raises if it failed (nothing is aborted then: the caller aborts)."""
    return client.ops.pipelined.seal_many(list(leases), checksums)


def abort(client, leases: Sequence[int]) -> None:
    """Free the pages of write leases not sealed, pipelined; a lease that already ended is
    ignored. On a broken connection nothing is sent: its leases went with it, and no
    reconnect (the client's ``reconnect`` seconds while the daemon is down) is waited for."""
    if not client.connected:
        return
    for lease in leases:
        try:
            client.ops.abort_later(lease)
        except KVBrokerError:
            return  # the connection broke meanwhile: the rest went with it


def view(client, extent: tuple[int, int, int], *, writable: bool = True):
    """A numpy uint8 view of ``(pool, offset, nbytes)`` in this process's mapping, valid
    while the lease that lent it lasts."""
    pool, offset, nbytes = extent
    return client.pool_view(pool, offset, nbytes, writable=writable)


def pool_address(client, pool: int) -> int:
    """The address of pool ``pool``'s mapping in this process (for DMA)."""
    return client.pool_address(pool)


def pool_runs(
    rows,
    names: list[str],
    order: list[str],
    nbytes: int,
    bases: dict[int, int],
    stage: int,
    stride: int,
) -> list[tuple[int, int, int]]:
    """The byte runs between pool extents and a staging buffer, vectorized: block ``j`` of
    ``rows`` (see :class:`Reservation`) holds the buffers ``order`` (each ``nbytes`` long, a
    permutation of ``names``) at staging address ``stage + j·stride``, back to back. Returns
    ``[(pool address, staging address, nbytes)]`` with neighbours on both sides merged (the
    broker lays a block's buffers out back to back, and consecutive blocks often follow
    each other: a few runs, not one per buffer). ``bases``: ``{pool: pool_address(pool)}``.
    Raises LayoutMismatch on a size mismatch."""
    import numpy as np

    rows = np.asarray(rows, dtype=np.int64)
    m, k = len(rows), len(order)
    if m == 0:
        return []
    cols = [names.index(n) for n in order] if order != names else list(range(k))
    sizes = rows[:, [2 + 2 * c for c in cols]]
    if (sizes != nbytes).any():
        raise LayoutMismatch(f"a block buffer is not {nbytes} bytes")
    base_of = np.zeros(int(rows[:, 0].max()) + 1, dtype=np.int64)
    for pool in set(rows[:, 0].tolist()):
        base_of[pool] = bases[pool]
    pool_addr = (base_of[rows[:, 0]][:, None] + rows[:, [1 + 2 * c for c in cols]]).ravel()
    stage_addr = (
        stage
        + np.arange(m, dtype=np.int64)[:, None] * stride
        + np.arange(k, dtype=np.int64)[None, :] * nbytes
    ).ravel()
    # a run starts where either side does not continue the previous buffer
    breaks = (
        np.flatnonzero(
            (pool_addr[1:] != pool_addr[:-1] + nbytes)
            | (stage_addr[1:] != stage_addr[:-1] + nbytes)
        )
        + 1
    )
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(pool_addr)]))) * nbytes
    return list(
        zip(pool_addr[starts].tolist(), stage_addr[starts].tolist(), lengths.tolist(), strict=True)
    )


def copy(dst, src: Any, checksum_kind: int | None = None) -> Any:
    """Copy ``src`` (an array, a CPU or CUDA tensor, strided or not, bytes) into the uint8
    view ``dst`` in one pass; with ``checksum_kind`` (``client.checksum_kind``), return the
    checksum of the copied bytes for :func:`seal`, hashed as they are copied."""
    if checksum_kind is None:
        copy_into(dst, src)
        return None
    if not dst.nbytes:
        return _integrity.empty_digest(checksum_kind)
    return _integrity.copy_hashed(dst, src, copy_into, checksum_kind)


def checksum(view: Any, kind: int) -> Any:
    """The checksum of ``kind`` of a contiguous buffer, for :func:`seal`."""
    return _integrity.digest(view, kind)


def empty_checksum(kind: int) -> Any:
    """The checksum of ``kind`` of a buffer of 0 bytes."""
    return _integrity.empty_digest(kind)


def device_checksums_available(client) -> bool:
    """Whether :func:`start_device_checksums` can hash for this client's daemon here (it
    takes the kind the GPU computes, and Triton runs)."""
    from .kernels import triton_available

    return client.checksum_kind == _cs.KIND_XXH3C and triton_available()


class _DeviceChecksums:
    __slots__ = ("_pending",)

    def __init__(self, pending) -> None:
        self._pending = pending

    def result(self) -> list:
        return [_cs.encode(v) for v in self._pending.result()]


def start_device_checksums(rows):
    """The checksum of each row of a contiguous CUDA tensor (a batch of staged blocks),
    queued on the current stream: ``.result()`` waits and returns them in wire form, one
    per row (streams that wait on the current one see them computed)."""
    from . import gpu_checksum

    return _DeviceChecksums(gpu_checksum.start_rows(rows))
