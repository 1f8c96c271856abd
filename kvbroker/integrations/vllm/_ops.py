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
``abort`` (the same ones ``PrefixCache`` sends), a writable view of a reserved extent, and the
address of a pool mapping (for DMA).
"""

from __future__ import annotations

from kvbroker._client.tp import shard_heads
from kvbroker.errors import KVBrokerError

__all__ = [
    "abort_leases",
    "extent_view",
    "pool_address",
    "reserve_blocks",
    "seal_many",
    "shard_heads",
]  # fmt: skip


def reserve_blocks(client, namespace: str, blocks: list[dict], ttl: float | None = None) -> list:
    """Reserve block objects ``[{"key", "parent", "buffers": {name: nbytes}, "meta"}]``.

    Returns one entry per block: None when the node already holds it (nothing to write),
    else ``(lease id, {name: (pool, offset, nbytes)})``. All or nothing: a failed batch
    holds no pages."""
    reply = client._call("reserve_blocks", namespace=namespace, blocks=blocks, ttl=ttl)
    out = []
    for res in reply["results"]:
        if res.get("exists"):
            out.append(None)
        else:
            out.append((res["lease"], {n: tuple(e) for n, e in res["buffers"].items()}))
    return out


def seal_many(client, leases: list[int]) -> None:
    """Seal write leases in one round trip (no checksums)."""
    if leases:
        client._call("seal_many", leases=leases, checksums=None)


def abort_leases(client, leases: list[int]) -> None:
    """Abort write leases, pipelined; a lease that already ended is ignored. If the
    connection is gone its leases went with it."""
    for lease in leases:
        try:
            client._send_only("abort", lease=lease)
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
    import ctypes

    mm = client._mapping(pool).mm
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


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
