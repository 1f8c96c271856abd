"""One request's KV shard, as both shard paths see it: the host path (:mod:`kvbroker.kv`) and
the CUDA path (:func:`kvbroker.gpu.publish_shard_cuda`, :func:`kvbroker.gpu.claim_shards_cuda`)
publish the same objects and claim each other's.

- :class:`ShardSpec`: what a prefill rank's shard object holds, written into its meta
  (:meth:`ShardSpec.to_meta`), read back (:meth:`ShardSpec.from_meta`) and checked against
  the claimer's cache (:meth:`ShardSpec.check`) before a byte moves.
- :func:`pinned_shards`: the claim's pins on every contributing shard, released counted
  only when every copy landed (see "Claim" in :mod:`kvbroker.kv`).

The ownership rules are :mod:`kvbroker.kv`'s module doc; the whole contract is
``docs/design.md``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._wire.names import kv_buffer_name
from .tp import Piece, claim_plan, readers_of, shard_heads
from ..errors import Incomplete, KVBrokerError, LayoutMismatch, NotFound, Timeout
from ..layout import Layout, check_compatible, shard_storage

if TYPE_CHECKING:
    from .client import Client
    from .leases import ReadLease

__all__ = [
    "ShardSpec",
    "PublishResult",
    "ClaimResult",
    "shard_key",
    "own_heads",
    "consumers_of",
    "needed_shards",
    "pinned_shards",
    "agreed_tokens",
    "META_TAG",
    "UNKNOWN_CONSUMERS",
    "SELECT_NOTHING",
]

META_TAG = "kvbroker.kv"  # meta key marking (and versioning) a shard published by kvbroker.kv
UNKNOWN_CONSUMERS = 1 << 16  # the broker's maximum: consume-claims never free it, eviction does
# A select that maps no buffer (a claim that only pins or counts down), for other modules: a
# class that matches no character, valid for RE2 (the daemon's engine: no lookarounds) and re.
SELECT_NOTHING = r"[^\s\S]"


def shard_key(request: str, tp_rank: int, tp_size: int) -> str:
    """The broker key of prefill rank ``tp_rank``'s shard of ``request``."""
    return f"{request}/tp{tp_rank}of{tp_size}"


@dataclass
class PublishResult:
    """What ``publish_shard`` did. ``published`` is False when no decode rank reads the shard."""

    key: str
    published: bool
    consumers: int
    copy_ops: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass
class ClaimResult:
    """What ``claim_shards`` did: the shards read, copy operations issued, bytes written.

    ``source_runs`` counts contiguous runs read from the pool: one per (shard, layer, K/V).
    """

    keys: list[str]
    copy_ops: int = 0
    source_runs: int = 0
    nbytes: int = 0
    num_tokens: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    pieces: list = field(default_factory=list)


@dataclass(frozen=True)
class ShardSpec:
    """Prefill rank ``tp_rank`` of ``tp_size``'s shard of ``request``: ``heads`` of
    ``total_kv_heads`` (None: a latent cache), ``num_tokens`` tokens, one buffer per (layer,
    component) named by :func:`kvbroker._wire.names.kv_buffer_name`, each laid out as
    ``layout`` (``[head][token][head_dim]``). ``engine_layout``: the publishing engine's
    layout of one layer (a :meth:`Layout.to_dict`), for operators."""

    request: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int | None
    heads: range
    num_tokens: int
    num_layers: int
    components: tuple[str, ...]
    infix: str | None
    layout: Layout
    engine_layout: dict[str, Any] | None = None  # Layout.to_dict(); never parsed on claim
    decode_tp_size: int | None = None

    @classmethod
    def build(
        cls,
        request: str,
        *,
        tp_rank: int,
        tp_size: int,
        total_kv_heads: int | None,
        heads: range,
        num_tokens: int,
        num_layers: int,
        components: Sequence[str],
        dtype: str,
        head_dim: int,
        infix: str | None,
        engine_layout: Layout,
        decode_tp_size: int | None,
    ) -> ShardSpec:
        """The spec of a shard about to be published, its buffer layout derived."""
        storage = shard_storage(
            dtype, num_layers, len(components), len(heads), num_tokens, head_dim
        )
        return cls(
            request,
            tp_rank,
            tp_size,
            total_kv_heads,
            heads,
            num_tokens,
            num_layers,
            tuple(components),
            infix,
            storage.select("layer", 0).select("kv", 0),
            engine_layout.to_dict(),
            decode_tp_size,
        )

    @property
    def key(self) -> str:
        return shard_key(self.request, self.tp_rank, self.tp_size)

    def buffer_names(self) -> list[list[str]]:
        """Per layer, the names of its buffers in component order."""
        return [
            [kv_buffer_name(kind, i, self.infix) for kind in self.components]
            for i in range(self.num_layers)
        ]

    def to_meta(self) -> dict[str, Any]:
        return {
            META_TAG: 1,
            "request": self.request,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads,
            "heads": [self.heads.start, self.heads.stop],
            "num_tokens": self.num_tokens,
            "num_layers": self.num_layers,
            "components": list(self.components),
            "infix": self.infix,
            "layout": self.layout.to_dict(),
            "engine_layout": self.engine_layout,
            "decode_tp_size": self.decode_tp_size,
        }

    @classmethod
    def from_meta(cls, meta: Any, key: str) -> ShardSpec:
        """The spec in a claimed shard's meta; LayoutMismatch if ``key`` was not published
        by kvbroker.kv."""
        if not isinstance(meta, dict) or meta.get(META_TAG) != 1:
            raise LayoutMismatch(
                f"{key} was not published by kvbroker.kv (no shard layout in meta)"
            )
        return cls(
            meta.get("request"),
            meta.get("tp_rank"),
            meta["tp_size"],
            meta["total_kv_heads"],
            range(*meta.get("heads", (0, 0))),
            int(meta["num_tokens"]),
            meta["num_layers"],
            tuple(meta["components"]),
            meta["infix"],
            Layout.from_dict(meta["layout"]),
            meta.get("engine_layout"),
            meta.get("decode_tp_size"),
        )

    def check(
        self,
        key: str,
        *,
        components: Sequence[str],
        num_layers: int,
        total_kv_heads: int | None,
        tp_size: int,
        infix: str | None,
        layout: Layout,
    ) -> None:
        """Raise LayoutMismatch, naming the field, unless a claimer whose cache has
        ``components``, ``num_layers`` and one layer laid out as ``layout`` can read this
        shard of a prefill TP size ``tp_size`` layout of ``total_kv_heads`` heads."""

        def mismatch(what: str, published: Any, local: Any) -> LayoutMismatch:
            return LayoutMismatch(
                f"layout mismatch on {what} ({key}): published {published!r}, local {local!r}"
            )

        if self.components != tuple(components):
            raise mismatch(
                "K/V components (latent vs per-head cache)", list(self.components), list(components)
            )
        if self.tp_size != tp_size:
            raise mismatch("prefill TP size", self.tp_size, tp_size)
        if self.total_kv_heads != total_kv_heads:
            raise mismatch("total KV heads", self.total_kv_heads, total_kv_heads)
        if self.num_layers != num_layers:
            raise mismatch("layers", self.num_layers, num_layers)
        if self.infix != infix:
            raise mismatch("buffer infix", self.infix, infix)
        check_compatible(self.layout, layout, ("head_dim",), what=key)


def own_heads(
    tp_rank: int, tp_size: int, total_kv_heads: int | None, local_heads: int, *, claiming: bool
) -> range:
    """The heads TP rank ``tp_rank`` holds (publishing) or needs (``claiming``); raises
    LayoutMismatch when its cache has another number of heads."""
    mine = shard_heads(tp_rank, tp_size, total_kv_heads)
    if local_heads != len(mine):
        if claiming:
            raise LayoutMismatch(
                f"layout mismatch on KV heads: decode TP rank {tp_rank} of {tp_size} needs "
                f"{len(mine)} of {total_kv_heads} heads, but its cache has {local_heads}"
            )
        raise LayoutMismatch(
            f"layout mismatch on KV heads: TP rank {tp_rank} of {tp_size} holds {len(mine)} of "
            f"{total_kv_heads} heads, but its cache has {local_heads}"
        )
    return mine


def consumers_of(
    tp_rank: int, total_kv_heads: int | None, tp_size: int, decode_tp_size: int | None
) -> int:
    """How many consume-claims free prefill rank ``tp_rank``'s shard: the decode ranks that
    read it, or :data:`UNKNOWN_CONSUMERS` when the decode TP size is not known (0: nobody
    reads it, so it is not published)."""
    if decode_tp_size is None:
        return UNKNOWN_CONSUMERS
    return readers_of(tp_rank, total_kv_heads, tp_size, decode_tp_size)


def needed_shards(
    request: str, total_kv_heads: int | None, prefill_tp_size: int, tp_size: int, tp_rank: int
) -> tuple[list[Piece], list[str]]:
    """Decode rank ``tp_rank``'s claim plan and the keys of the shards it reads, in order."""
    plan = claim_plan(total_kv_heads, prefill_tp_size, tp_size, tp_rank)
    keys = list(dict.fromkeys(shard_key(request, p.prefill_rank, prefill_tp_size) for p in plan))
    return plan, keys


def agreed_tokens(specs: dict[str, ShardSpec], num_tokens: int | None) -> int:
    """The ``num_tokens`` every shard holds (and the caller expects, when it says)."""
    tokens = {key: spec.num_tokens for key, spec in specs.items()}
    if len(set(tokens.values())) != 1:
        raise LayoutMismatch(f"layout mismatch on num_tokens across shards: {tokens}")
    total = next(iter(tokens.values()))
    if num_tokens is not None and num_tokens != total:
        raise LayoutMismatch(
            f"layout mismatch on num_tokens: published {total}, local {num_tokens}"
        )
    return total


@contextmanager
def pinned_shards(
    client: Client, request: str, keys: list[str], namespace: str, wait: float | None, consume: bool
) -> Iterator[dict[str, ReadLease]]:
    """Read leases (consume claims if ``consume``) on every key, for the ``with`` block.

    Waits at most ``wait`` seconds in all; NotFound/Incomplete (and every pin released
    uncounted) if some are not sealed by then. Leaving the block normally releases the pins
    counted (pipelined); leaving it by an exception releases them uncounted, so nothing is
    consumed. The pins map every buffer (no select regex): a lease holds the whole object
    anyway, and a regex costs the daemon one RE2 match per buffer name."""
    pins = _pin(client, request, keys, namespace, wait, consume)
    claimed = False
    try:
        yield pins
        claimed = True
    finally:
        _release(pins.values(), counted=claimed)


def _pin(
    client: Client, request: str, keys: list[str], namespace: str, wait: float | None, consume: bool
) -> dict[str, ReadLease]:
    deadline = None if not wait else time.monotonic() + wait
    pins: dict[str, ReadLease] = {}
    missing: list[str] = []
    try:
        for key in keys:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                pins[key] = client.claim(key, namespace=namespace, wait=left, consume=consume)
            except (NotFound, Timeout):
                missing.append(key)
    except BaseException:
        _release(pins.values(), counted=False)
        raise
    if missing:
        _release(pins.values(), counted=False)
        waited = f" after waiting {wait:g} s" if wait else ""
        if len(missing) == len(keys):
            raise NotFound(
                f"request {request!r} is unknown in namespace {namespace!r}{waited}: none of "
                f"the shards this rank needs ({', '.join(keys)}) is published"
            )
        raise Incomplete(
            f"request {request!r} is incomplete{waited}: shards {', '.join(missing)} are not "
            f"sealed (sealed: {', '.join(pins)})"
        )
    return pins


def _release(leases: Iterable[ReadLease], *, counted: bool = True) -> None:
    """End the pins. ``counted`` False: a consume claim ends without counting towards freeing
    the shard (``release(consume=False)``, one round trip; failure paths only)."""
    for lease in leases:
        try:
            lease.release(consume=counted)  # counted: pipelined, checked by the next call
        except KVBrokerError:
            pass  # the lease ended already (TTL, connection): nothing left to release
