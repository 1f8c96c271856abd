"""The one place where the vLLM connector reaches below kvbroker's public API.

The connector publishes prefix blocks in the format of
:meth:`kvbroker.prefix.PrefixCache.publish_kv` (so :meth:`KVPrefixMatch.load` reads them), but
it reserves and seals them itself, because it must:

- copy each layer into the reserved blocks as soon as vLLM's forward pass has written it
  (``save_kv_layer``), and seal only once every layer is in (``wait_for_save``); an aborted
  step aborts its reservations instead of sealing half-written blocks;
- publish a prompt's last, partial block under a key of its own (the P/D tail);
- DMA straight from a CUDA cache into the reserved extents.

``PrefixCache.publish`` does reservation, copy and seal in one call, so it allows none of
these. The operations used here are the daemon's ``reserve_blocks``, ``seal_many`` and
``abort`` (the same ones ``PrefixCache`` sends, through the client's typed op stubs
``client.ops``), a writable view of a reserved extent and the address of a pool mapping
(``client._mapping``, for the copies, and its address through the GPU copy engine's
``_address``, for DMA), the head arithmetic of ``kvbroker._client.tp``,
and the extents of a prefix match without one view per buffer (``KVPrefixMatch._names`` /
``_packed`` / ``_raw``).
"""

from __future__ import annotations

from kvbroker._client.tp import shard_heads
from kvbroker.errors import KVBrokerError, LayoutMismatch

__all__ = [
    "ReserveLater",
    "Reserved",
    "abort_leases",
    "extent_view",
    "pool_address",
    "pool_runs",
    "reserve_blocks",
    "seal_later",
    "seal_many",
    "shard_heads",
]  # fmt: skip


class Reserved:
    """One ``reserve_blocks`` batch: ``leases[i]``, block i's write lease (None: the node
    already holds it, nothing to write), and the extents of the reserved blocks (those with
    a lease, in order) as ``rows``, an int64 array ``[reserved, 1 + 2·len(names)]`` of
    ``pool, offset, nbytes, offset, nbytes, ...`` in ``names`` order."""

    __slots__ = ("leases", "names", "rows")

    def __init__(self, leases: list, names: list[str], rows) -> None:
        self.leases, self.names, self.rows = leases, names, rows

    @property
    def taken(self) -> list[int]:
        return [lease for lease in self.leases if lease is not None]

    def extents(self, j: int) -> dict[str, tuple[int, int, int]]:
        """``{name: (pool, offset, nbytes)}`` of the j-th reserved block."""
        row = self.rows[j]
        pool = int(row[0])
        return {n: (pool, int(row[1 + 2 * i]), int(row[2 + 2 * i])) for i, n in enumerate(self.names)}

    def __add__(self, other: Reserved) -> Reserved:
        import numpy as np

        if not other.leases:
            return self
        if not self.leases:
            return other
        if other.names != self.names and len(other.rows) and len(self.rows):
            raise LayoutMismatch("reserved blocks of one save differ in their buffers")
        names = self.names if len(self.rows) else other.names
        return Reserved(self.leases + other.leases, names, np.concatenate([self.rows, other.rows]))


def reserve_blocks(client, namespace: str, blocks: list[dict], buffers: dict[str, int],
                   meta: dict | None, ttl: float | None = None) -> Reserved:  # fmt: skip
    """Reserve block objects ``[{"key", "parent"}]``, each with ``buffers`` (``{name:
    nbytes}``) and ``meta``, in one round trip and a compact reply. All or nothing: a
    failed batch holds no pages."""
    reply = client.ops.reserve_blocks(blocks, namespace=namespace, ttl=ttl, buffers=buffers,
                                      meta=meta, compact=True)  # fmt: skip
    return _reserved(reply, list(buffers))


class ReserveLater:
    """:func:`reserve_blocks` sent without waiting (see ``client.ops.pipelined``):
    :meth:`result` reads the reply, a :class:`Reserved`, or raises its error."""

    __slots__ = ("_pending", "_names")

    def __init__(self, client, namespace: str, blocks: list[dict], buffers: dict[str, int],
                 meta: dict | None, ttl: float | None = None) -> None:  # fmt: skip
        self._names = list(buffers)
        self._pending = client.ops.pipelined.reserve_blocks(
            blocks, namespace=namespace, ttl=ttl, buffers=buffers, meta=meta, compact=True)

    def result(self) -> Reserved:
        return _reserved(self._pending.result(), self._names)


def seal_later(client, leases: list[int], checksums: list[dict] | None = None):
    """``seal_many`` sent without waiting: ``.result()`` raises if it failed."""
    return client.ops.pipelined.seal_many(leases, checksums)


def _reserved(reply: dict, names: list[str]) -> Reserved:
    import numpy as np

    if "packed" in reply:
        names = list(reply["names"])
        rows = np.frombuffer(reply["packed"], dtype="<i8").reshape(-1, 1 + 2 * len(names))
        return Reserved(list(reply["leases"]), names, rows)
    leases, flat = [], []
    for res in reply["results"]:  # nothing reserved (every block exists), or a daemon's
        if res.get("exists"):      # plain reply: the same facts, one map per block
            leases.append(None)
            continue
        leases.append(res["lease"])
        ext = res["buffers"]
        flat.append([ext[names[0]][0]] + [v for n in names for v in ext[n][1:]])
    rows = np.asarray(flat, dtype=np.int64).reshape(-1, 1 + 2 * len(names))
    return Reserved(leases, names, rows)


def pool_runs(rows, names: list[str], order: list[str], nbytes: int, bases: dict[int, int],
              stage: int, stride: int) -> list[tuple[int, int]]:  # fmt: skip
    """The byte runs between pool extents and a staging buffer, vectorized: block ``j`` of
    ``rows`` (see :class:`Reserved`) holds the buffers ``order`` (each ``nbytes`` long, a
    permutation of ``names``) at staging address ``stage + j·stride``, back to back. Returns
    ``[(pool address, staging address, nbytes)]`` with neighbours on both sides merged (the
    broker lays a block's buffers out back to back, and consecutive blocks often follow
    each other: a few runs, not one per buffer). Raises LayoutMismatch on a size mismatch."""
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
    stage_addr = (stage + np.arange(m, dtype=np.int64)[:, None] * stride
                  + np.arange(k, dtype=np.int64)[None, :] * nbytes).ravel()  # fmt: skip
    # a run starts where either side does not continue the previous buffer
    breaks = np.flatnonzero((pool_addr[1:] != pool_addr[:-1] + nbytes)
                            | (stage_addr[1:] != stage_addr[:-1] + nbytes)) + 1  # fmt: skip
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [len(pool_addr)]))) * nbytes
    return list(zip(pool_addr[starts].tolist(), stage_addr[starts].tolist(), lengths.tolist()))


def seal_many(client, leases: list[int], checksums: list[dict] | None = None) -> None:
    """Seal write leases in one round trip; ``checksums``: one ``{buffer: checksum}`` per
    lease, in order (None: sealed without)."""
    if leases:
        client.ops.seal_many(leases, checksums)


def abort_leases(client, leases: list[int]) -> None:
    """Abort write leases, pipelined; a lease that already ended is ignored. If the
    connection is gone its leases went with it: nothing is sent, and no reconnect (the
    client's ``reconnect`` seconds while the daemon is down) is waited for to send it."""
    if client._session.broken:
        return
    for lease in leases:
        try:
            client.ops.abort_later(lease)
        except KVBrokerError:
            return


def extent_view(client, extent: tuple[int, int, int]):
    """A writable numpy uint8 view of ``(pool, offset, nbytes)`` in this process's mapping,
    valid while the lease that lent it lasts."""
    import numpy as np

    pool, offset, nbytes = extent
    return np.frombuffer(client._mapping(pool).mm, dtype=np.uint8, count=nbytes, offset=offset)


def pool_address(client, pool: int) -> int:
    """The address of pool ``pool``'s mapping in this process (for DMA)."""
    from kvbroker._client.gpu_copy import _address

    return _address(client._mapping(pool).mm)


def match_extents(match) -> tuple[list[str], object]:
    """The extents of every key a prefix match leases, without making a view per buffer:
    ``(names, rows)`` where ``rows`` is an int64 array ``[keys, 1 + 2·len(names)]`` of
    ``pool, offset, nbytes, offset, nbytes, ...`` in ``names`` order (the daemon's compact
    reply), or a per-key list of ``{name: (pool, offset, nbytes)}`` maps when the keys'
    buffers differ."""
    import numpy as np

    names = list(match._names)
    packed = match._packed
    if packed is not None:
        return names, np.frombuffer(packed, dtype="<i8").reshape(-1, 1 + 2 * len(names))
    raw = match._raw
    if raw and isinstance(raw[0], dict):
        return names, [{n: tuple(e) for n, e in r.items()} for r in raw]
    return names, np.asarray(raw, dtype=np.int64).reshape(-1, 1 + 2 * len(names))
