"""vLLM's KV event wire format: the events, their msgpack encodings, block hashes, topics.

Wire format (``vllm/distributed/kv_events.py``)
-----------------------------------------------
Each message is three ZMQ frames: ``topic`` (``kv@<node>@<model>``: llm-d splits it on ``@``
into pod and model, so neither may contain ``@``), the batch's sequence number as 8 bytes big
endian (0, 1, 2... from the publisher's start), and the payload: a msgpack array
``[ts, [event, ...], data_parallel_rank]``. Events, by ``fmt``:

- ``"positional"`` (default): each event a msgpack array, tag first, fields in vLLM's
  declaration order — ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``. This is vLLM's encoding while its ``KVCacheEvent`` was
  ``array_like`` and what llm-d's vLLM adapter decodes (it requires exactly these 8 and 3
  fields). Replay replies are ``[seq, payload]``.
- ``"tagged"``: each event a msgpack map ``{"type": "BlockStored", "block_hashes": ...}`` in
  the same field order — what vLLM 0.32's own ``KVEventBatch`` decodes (its events are no
  longer ``array_like``). Replay replies carry the topic: ``[topic, seq, payload]``.

Block hashes are unsigned 64-bit integers: the last 8 bytes, big endian, of kvbroker's block
hash (:func:`external_hash`) — the same reduction llm-d applies to vLLM's byte hashes, and what
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` makes vLLM send. Every ``BlockStored`` carries the
block's token ids, so a router that computes its own hashes from tokens (llm-d does) needs
nothing of kvbroker's hashing. ``medium`` is ``"CPU"`` (host pools) unless told otherwise;
``"STORAGE"`` is the disk tier (vLLM's ``MEDIUM_STORAGE``, what its file-system offloading
tier announces).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "Event",
    "FORMATS",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "encode_batch",
    "encode_event",
    "external_hash",
    "import_zmq",
    "topic_for",
]

MEDIUM_CPU = "CPU"  # the pools (host memory), as vLLM's CPU offloading tier says it
MEDIUM_STORAGE = "STORAGE"  # the disk tier, as vLLM's fs / storage offloading tiers say it
FORMATS = ("positional", "tagged")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's end marker
EXTRA = "events"  # the stream travels on pyzmq: pip install 'kvbroker[events]'


def import_zmq():
    """pyzmq, or ImportError naming the extra that brings it."""
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"KV events need pyzmq: pip install 'kvbroker[{EXTRA}]' ({e})") from e
    return zmq


def external_hash(block_hash: str | bytes | int) -> int:
    """A kvbroker block hash as the unsigned 64-bit integer the events carry.

    ``block_hash`` is a prefix block's key (hex digest, optionally followed by a shard suffix
    ``/h..tp..``), its digest bytes, or already an integer. The last 8 bytes, big endian: the
    reduction llm-d applies to byte hashes, so both sides agree on the number.
    """
    if isinstance(block_hash, int):
        if not 0 <= block_hash < 1 << 64:
            raise ValueError("an integer block hash must fit in 64 unsigned bits")
        return block_hash
    if isinstance(block_hash, str):
        digest = bytes.fromhex(block_hash.partition("/")[0])
    else:
        digest = bytes(block_hash)
    if not digest:
        raise ValueError("empty block hash")
    return int.from_bytes(digest[-8:], "big")


def topic_for(node: str, model: str) -> str:
    """``kv@<node>@<model>``, the topic vLLM deployments use and llm-d parses."""
    for what, value in (("node", node), ("model", model)):
        if not value or "@" in value:
            raise ValueError(f"{what} name {value!r} must be non-empty and contain no '@'")
    return f"kv@{node}@{model}"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now held; ``block_hashes`` in chain order, each block ``block_size`` tokens of
    ``token_ids`` (``len(token_ids) == len(block_hashes) * block_size``)."""

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_CPU
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[int]
    medium: str | None = MEDIUM_CPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _ints(xs: Sequence[int]) -> list[int]:
    # msgpack packs only Python ints: numpy integers (token ids often are) become ints here.
    return xs if type(xs) is list and all(type(x) is int for x in xs) else list(map(int, xs))


def _wire_event(ev: Event, fmt: str) -> list | dict:
    if fmt == "positional":
        if type(ev) is BlockStored:
            p = ev.parent_block_hash
            return [
                "BlockStored",
                _ints(ev.block_hashes),
                None if p is None else int(p),
                _ints(ev.token_ids),
                int(ev.block_size),
                ev.lora_id,
                ev.medium,
                ev.lora_name,
            ]
        if type(ev) is BlockRemoved:
            return ["BlockRemoved", _ints(ev.block_hashes), ev.medium]
        if type(ev) is AllBlocksCleared:
            return ["AllBlocksCleared"]
        raise TypeError(f"not a KV event: {ev!r}")
    if fmt == "tagged":
        out = _wire_event(ev, "positional")
        return {"type": out[0], **dict(zip(_FIELDS[out[0]], out[1:], strict=True))}
    raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")


# vLLM's declaration order, which the positional layout follows
_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_event(ev: Event, fmt: str = "positional") -> bytes:
    """One event alone, as it appears inside a batch (for tests and tools)."""
    return msgpack.packb(_wire_event(ev, fmt), use_bin_type=True)


def encode_batch(
    ts: float, events: Iterable[Event], dp_rank: int = 0, fmt: str = "positional"
) -> bytes:
    """The payload frame: ``[ts, [events], dp_rank]``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")
    return msgpack.packb(
        [float(ts), [_wire_event(e, fmt) for e in events], int(dp_rank)], use_bin_type=True
    )
