"""The block API: what every engine adapter publishes and loads prefix blocks through.

A *block* is one broker object holding one layer group's share of ``block_size`` tokens of a
prompt (or one request's state page), keyed by the prompt's chained hash
(:func:`kvbroker.prefix.block_hashes`) and its format's suffix, its parent the previous block
of the same chain. :class:`~kvbroker.prefix.PrefixCache`, :mod:`kvbroker.kv`, the transformers
adapter and the vLLM connector all stand on this module; an adapter needs nothing below it.

Formats (what a block holds; frozen, msgpack-able through ``meta()``)
----------------------------------------------------------------------
- :class:`AttentionFormat`: one TP rank's heads of every attention layer of a group, K and V
  (an MLA latent), each ``[head][token][head_dim]``, laid back to back in one buffer
  (``packed``, the vLLM connector's form) or one named buffer per (layer, K/V) (``packed=None``,
  :meth:`PrefixCache.publish_kv`'s form). Any TP layout of the model reshards it on load. A
  sliding-window group is the same bytes with ``window`` set: :meth:`~AttentionFormat.reachable`
  says which blocks a request still reads.
- :class:`StateFormat`: an opaque per-request state page (a Mamba layer group's conv and SSM
  state...): named buffers (:class:`StateBuffer`) saved and loaded whole, one shard per TP rank.

Writers (who owns and frees what)
---------------------------------
- :func:`reserve` takes one write lease per block the node lacks, in one round trip, all or
  nothing (a refused batch holds no pages); :func:`reserve_later` sends it without waiting.
- A :class:`Reservation` lends the reserved extents: :meth:`~Reservation.view` (writable numpy
  views, for host copies) and :meth:`~Reservation.runs` over :func:`pool_address` (for DMA).
  The writer owns those bytes until it seals or aborts; the views die with the lease.
- :func:`seal` makes the blocks the broker's (visible, evictable leaf first), with one
  checksum per buffer (:func:`copy`, :meth:`Reservation.checksums`, :func:`start_device_checksums`);
  a refusal aborts what it did not seal. :func:`seal_later` sends it without waiting.
- :func:`abort` frees the pages of leases not sealed. It never waits on a broken connection
  (whose leases went with it) nor for the client to reconnect.
- A connection that dies takes its write leases with it: a crashed writer leaves no
  half-written block.

Sessions
--------
- :func:`retention` ``(session, retain, priority)`` is the ``retain=`` of :func:`reserve` and
  the matches: the blocks a request of that session publishes or matches are *retained*
  while it lasts (evicted only after every unretained object, lowest priority first), and
  each request renews it. Operators list and steer sessions with ``kvbroker sessions``,
  ``retain`` and ``release``.

Same-node handoffs (GPU staging rings, ``kvbroker serve --gpu-ring``)
----------------------------------------------------------------------
- :func:`ring_lookup` says which keys name sealed ring objects (no lease, no torch). The
  bytes move with :class:`kvbroker.gpu.GpuClient`'s ``ring_reserve`` (a write lease on a
  ring region: fill ``region.tensor``, then ``seal``) and ``ring_read`` (a read lease:
  read ``region.tensor``, then ``release``; a consume-read frees the object with it).

Readers
-------
- :func:`match` (a format's chain, resharded across TP layouts for attention),
  :func:`match_shards` and :func:`match_keys` take ONE read lease over the longest run of
  leading blocks the node holds (``hold=False``: only count them).
- The match hands out :meth:`~kvbroker.prefix.PrefixMatch.extents` (no view per buffer) or
  read-only views (``match.blocks[i][name]``); both are valid until ``release()`` (the end of
  its ``with`` block), during which the blocks are never evicted. Copy out, then release.
"""

from __future__ import annotations

from ._client.block_formats import (
    PACKED_KV,
    PACKED_STATE,
    STATE_META_TAG,
    AttentionFormat,
    StateBuffer,
    StateFormat,
    shard_block_key,
)
from ._client.block_ops import (
    PendingReservation,
    Reservation,
    abort,
    checksum,
    copy,
    device_checksums_available,
    empty_checksum,
    pool_address,
    retention,
    pool_runs,
    reserve,
    reserve_later,
    seal,
    seal_later,
    start_device_checksums,
    view,
)
from ._client.block_match import match, match_keys, match_shards, ring_lookup
from ._client.copy import copy_into
from ._client.prefix_match import SHARD_META_TAG, KVPrefixMatch, MatchedBlock, PrefixMatch
from ._client.tp import Piece, claim_plan, shard_heads

__all__ = [
    # formats
    "AttentionFormat",
    "StateBuffer",
    "StateFormat",
    "PACKED_KV",
    "PACKED_STATE",
    "SHARD_META_TAG",
    "STATE_META_TAG",
    "shard_block_key",
    "shard_heads",
    "claim_plan",
    "Piece",
    # writers
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
    "copy_into",
    "checksum",
    "empty_checksum",
    "device_checksums_available",
    "start_device_checksums",
    # readers
    "match",
    "match_shards",
    "match_keys",
    "ring_lookup",
    "PrefixMatch",
    "KVPrefixMatch",
    "MatchedBlock",
    # sessions: what a request names to keep its blocks past plain LRU
    "retention",
]
