"""Block readers: which keys a GPU ring holds, and matching a chain of blocks (by keys, by TP
shards, or the longest prefix over the layouts tried) into leases to copy from (public through
:mod:`kvbroker.blocks`, whose module doc says who owns and frees what)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .block_formats import AttentionFormat, StateFormat, shard_block_key
from .prefix_match import KVPrefixMatch, PrefixMatch
from .tp import claim_plan
from ..errors import BadRequest, LayoutMismatch

__all__ = ["ring_lookup", "match", "match_shards", "match_keys"]


def ring_lookup(client, namespace: str, keys: Sequence[str]) -> list[dict | None]:
    """Which of ``keys`` name sealed objects in the daemon's GPU staging rings: per key its
    ``{"device": ring index, "nbytes", "meta"}``, or None. One round trip, no lease, no torch
    (a scheduler deciding whether a same-node handoff can serve a request); [] for no keys.
    A daemon without rings answers every key None."""
    from ..errors import BadRequest

    if not keys:
        return []
    try:
        return client.ops.ring_lookup(list(keys), namespace=namespace)["objects"]
    except BadRequest as exc:
        if "gpu-ring" in str(exc) or "no GPU rings" in str(exc):
            return [None] * len(keys)
        raise


def match_keys(
    client,
    namespace: str,
    keys: list[str],
    *,
    block_tokens: int = 0,
    ttl: float | None = None,
    hold: bool = True,
    peer: str | None = None,
    block_size: int = 1,
    retain: dict | None = None,
) -> PrefixMatch:
    """One read lease over the longest run of leading ``keys`` the node holds (``peer``:
    ``"HOST:PORT"`` of another node's broker, whose blocks after this node's run are pulled
    first). ``block_tokens``: tokens a key stands for, in the daemon's hit statistics;
    ``block_size``: the match's tokens per key. ``retain``: the request's session
    (:func:`retention`), renewed; it retains the blocks matched."""
    import time

    asked_at = time.monotonic()
    if peer is None:
        reply = client.ops.match_prefix(
            keys, namespace=namespace, block_tokens=block_tokens, ttl=ttl, hold=hold, retain=retain
        )
    else:
        reply = client._peer_call(
            True,
            client.ops.match_prefix,
            keys,
            namespace=namespace,
            block_tokens=block_tokens,
            ttl=ttl,
            peer=peer,
            hold=hold,
            retain=retain,
        )
    return PrefixMatch(client, reply, block_size, asked_at)


@functools.lru_cache(maxsize=256)
def _plan(heads: int | None, source: int, tp_size: int, tp_rank: int) -> tuple:
    plan = claim_plan(heads, source, tp_size, tp_rank)
    ranks = list(dict.fromkeys(p.prefill_rank for p in plan))
    return plan, ranks, [shard_block_key("", r, source, heads) for r in ranks]


def match_shards(
    client,
    namespace: str,
    hashes: Sequence[str],
    *,
    block_size: int,
    total_kv_heads: int | None,
    tp_rank: int = 0,
    tp_size: int = 1,
    source_tp_sizes: Sequence[int] | None = None,
    ttl: float | None = None,
    hold: bool = True,
    retain: dict | None = None,
) -> KVPrefixMatch:
    """The longest run of ``hashes`` every shard TP rank ``tp_rank`` of ``tp_size`` needs
    holds, in the layout of each of ``source_tp_sizes`` in turn (default: its own), keeping
    the longest (one round trip each, stopping at the first that covers every hash), under
    one read lease. ``total_kv_heads`` None: an MLA latent cache."""
    sizes = [tp_size] if source_tp_sizes is None else list(source_tp_sizes)
    best: KVPrefixMatch | None = None
    try:
        for source in dict.fromkeys(sizes):
            found = _match_layout(
                client,
                namespace,
                list(hashes),
                block_size,
                source,
                total_kv_heads,
                tp_rank,
                tp_size,
                ttl,
                hold,
                retain,
            )
            if best is None or found.num_blocks > best.num_blocks:
                if best is not None:
                    best.release()
                best = found
            else:
                found.release()
            if best.num_blocks == len(hashes):
                break
    except BaseException:
        if best is not None:
            best.release()  # not held until its TTL because a later layout's match failed
        raise
    if best is None:
        raise BadRequest("match_shards: no source TP size to match")
    return best


def _match_layout(
    client, namespace, hashes, block_size, source, heads, tp_rank, tp_size, ttl, hold, retain=None
) -> KVPrefixMatch:
    import time

    plan, ranks, suffixes = _plan(heads, source, tp_size, tp_rank)
    # Block-major, shard-minor: the broker's longest run of present keys, divided by the
    # shard count, is the run of blocks every needed shard holds. A partial last row is
    # pinned by the same lease and ignored.
    if len(suffixes) == 1:
        keys = [h + suffixes[0] for h in hashes]
    else:
        keys = [h + suffix for h in hashes for suffix in suffixes]
    asked_at = time.monotonic()
    # The broker counts hit tokens per key found: a key is 1/len(ranks) of a block here.
    reply = client.ops.match_prefix(
        keys,
        namespace=namespace,
        block_tokens=block_size // len(ranks),
        ttl=ttl,
        hold=hold,
        retain=retain,
    )
    return KVPrefixMatch(
        client,
        reply,
        block_size,
        asked_at,
        source=source,
        heads=heads,
        ranks=ranks,
        plan=plan,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def match(
    client,
    namespace: str,
    fmt: AttentionFormat | StateFormat,
    hashes: Sequence[str],
    *,
    peer_tp_sizes: Sequence[int] = (),
    ttl: float | None = None,
    hold: bool = True,
    retain: dict | None = None,
) -> PrefixMatch:
    """One read lease on the longest run of ``hashes`` whose blocks of format ``fmt`` the
    node holds. Attention: every shard this rank's heads come from, in its own TP layout
    first, then ``peer_tp_sizes`` (a :class:`KVPrefixMatch`: ``load`` it, or read its
    ``extents()`` and ``plan``). State pages: this rank's own pages (a :class:`PrefixMatch`,
    its ``meta`` checked by ``fmt.check``)."""
    if isinstance(fmt, AttentionFormat):
        return match_shards(
            client,
            namespace,
            hashes,
            block_size=fmt.block_size,
            total_kv_heads=fmt.total_kv_heads,
            tp_rank=fmt.tp_rank,
            tp_size=fmt.tp_size,
            source_tp_sizes=[fmt.tp_size, *peer_tp_sizes],
            ttl=ttl,
            hold=hold,
            retain=retain,
        )
    if isinstance(fmt, StateFormat):
        found = match_keys(
            client, namespace, [fmt.key(h) for h in hashes], ttl=ttl, hold=hold, retain=retain
        )
        if found.num_blocks and found.meta is not None:
            try:
                fmt.check(found.meta)
            except LayoutMismatch:
                found.release()
                raise
        return found
    raise BadRequest(f"match: unknown block format {type(fmt).__name__}")
