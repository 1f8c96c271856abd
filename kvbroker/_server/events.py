"""KV events for cache-aware routers, in vLLM's wire format (ZMQ PUB + ROUTER replay).

A router (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's own subscriber example) learns
which prefix blocks a node holds from the stream vLLM publishes with ``--kv-events-config``.
The daemon publishes the same stream for the prefix blocks in its pools, so such a router
consumes it without changes.

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
nothing of kvbroker's hashing. ``medium`` is ``"CPU"`` (host pools) unless told otherwise.

Replay: a ROUTER socket answers ``[identity, b"", start_seq (8 bytes big endian)]`` with every
buffered batch (the last ``buffer_steps``) whose sequence number is ``>= start_seq``, then an
end marker whose sequence is -1 (8 bytes, signed), each reply after an empty delimiter frame.
Ask from a DEALER socket (send ``[b"", start_seq]``): a plain REQ socket keeps only the first
reply of a stream, as vLLM's example subscriber does.

Threads
-------
:class:`EventPublisher` owns both sockets and one thread. The daemon's event loop only calls
:meth:`EventPublisher.publish`, which appends to a bounded in-memory queue under a lock and
never blocks on ZMQ or on a slow subscriber (PUB drops at its high-water mark, as in vLLM).
When the queue is full the new events and those still queued are dropped and counted, and
the next batch sent starts with ``AllBlocksCleared``: a router then forgets this node's blocks
and learns only what happens afterwards, so it can under-estimate what the node holds (which
costs cache hits) but never over-state it; and
``on_overflow`` (if given) is called from the publisher thread so the owner can announce its
blocks again.

pyzmq is an optional extra (``pip install 'kvbroker[events]'``): this module imports it only
when a publisher is created.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventPublisher",
    "END_SEQ",
    "FORMATS",
    "MEDIUM_CPU",
    "encode_batch",
    "encode_event",
    "external_hash",
    "topic_for",
]

log = logging.getLogger("kvbroker.events")

MEDIUM_CPU = "CPU"
FORMATS = ("positional", "tagged")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
EXTRA = "events"  # pip install 'kvbroker[events]'


def _import_zmq():
    try:
        import zmq
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"KV events need pyzmq: pip install 'kvbroker[{EXTRA}]' ({e})"
        ) from e
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
            return ["BlockStored", _ints(ev.block_hashes), None if p is None else int(p),
                    _ints(ev.token_ids), int(ev.block_size), ev.lora_id, ev.medium,
                    ev.lora_name]
        if type(ev) is BlockRemoved:
            return ["BlockRemoved", _ints(ev.block_hashes), ev.medium]
        if type(ev) is AllBlocksCleared:
            return ["AllBlocksCleared"]
        raise TypeError(f"not a KV event: {ev!r}")
    if fmt == "tagged":
        out = _wire_event(ev, "positional")
        return {"type": out[0], **dict(zip(_FIELDS[out[0]], out[1:]))}
    raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")


# vLLM's declaration order, which the positional layout follows
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_event(ev: Event, fmt: str = "positional") -> bytes:
    """One event alone, as it appears inside a batch (for tests and tools)."""
    return msgpack.packb(_wire_event(ev, fmt), use_bin_type=True)


def encode_batch(ts: float, events: Iterable[Event], dp_rank: int = 0,
                 fmt: str = "positional") -> bytes:
    """The payload frame: ``[ts, [events], dp_rank]``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")
    return msgpack.packb([float(ts), [_wire_event(e, fmt) for e in events], int(dp_rank)],
                         use_bin_type=True)


class EventPublisher:
    """Publishes KV events on a ZMQ PUB socket from its own thread; see the module docstring.

    ``endpoint``: ``tcp://*:5557`` (or any address with ``*``, ``ipc://``, ``inproc://``) binds;
    ``tcp://host:port`` connects (vLLM's rule). ``replay_endpoint`` (optional) is bound.
    ``publish`` may be called from any thread and never blocks on the network.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str,
        replay_endpoint: str | None = None,
        dp_rank: int = 0,
        fmt: str = "positional",
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        max_batch: int = 1024,
        hwm: int = 100_000,
        on_overflow: Callable[[], None] | None = None,
        context=None,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")
        if max_queue < 1 or max_batch < 1 or buffer_steps < 0:
            raise ValueError("max_queue and max_batch must be positive, buffer_steps >= 0")
        zmq = _import_zmq()
        self._zmq = zmq
        self.fmt = fmt
        self.topic = topic
        self._topic = topic.encode()
        self.dp_rank = dp_rank
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._on_overflow = on_overflow
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            self.endpoint = self._attach(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._attach(self._replay, replay_endpoint, bind=True)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._cond = threading.Condition()
        self._queue: deque[Event] = deque()
        self._overflowed = False
        self._running = True
        self._seq = 0
        # counters (read by stat/Prometheus; written by one thread each, read racily)
        self.events_published = 0
        self.batches_published = 0
        self.events_dropped = 0
        self.overflows = 0
        self.replay_requests = 0
        self.send_errors = 0
        self._thread = threading.Thread(target=self._run, name="kvbroker-events", daemon=True)
        self._thread.start()

    def _attach(self, sock, endpoint: str, bind: bool | None = None) -> str:
        if bind is None:
            bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    # -- producer side (any thread; the daemon's event loop) ---------------------------------

    def publish(self, events: Sequence[Event]) -> bool:
        """Queue ``events`` (in order) for the next batch. False if they were dropped because
        the queue is full (see the module docstring); never blocks on the network."""
        if not events:
            return True
        with self._cond:
            if not self._running:
                raise RuntimeError("event publisher is closed")
            if len(self._queue) + len(events) > self.max_queue:
                # Drop what is queued too: the AllBlocksCleared sent next supersedes it, and
                # replaying queued stores whose removal was dropped would over-state the node.
                self.events_dropped += len(self._queue) + len(events)
                self._queue.clear()
                if not self._overflowed:
                    self._overflowed = True
                    self.overflows += 1
                return False
            self._queue.extend(events)
            self._cond.notify()
        return True

    def stored(self, block_hashes: Sequence[int], parent_block_hash: int | None,
               token_ids: Sequence[int], block_size: int, *, medium: str | None = MEDIUM_CPU,
               lora_name: str | None = None) -> bool:
        return self.publish([BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
                                         None, medium, lora_name)])

    def removed(self, block_hashes: Sequence[int], *, medium: str | None = MEDIUM_CPU) -> bool:
        return self.publish([BlockRemoved(block_hashes, medium)])

    def cleared(self) -> bool:
        return self.publish([AllBlocksCleared()])

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def next_seq(self) -> int:
        return self._seq

    def stats(self) -> dict:
        return {
            "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
            "topic": self.topic, "format": self.fmt, "next_seq": self._seq,
            "events_published": self.events_published,
            "batches_published": self.batches_published,
            "events_dropped": self.events_dropped, "overflows": self.overflows,
            "replay_requests": self.replay_requests, "send_errors": self.send_errors,
            "queued": len(self._queue),
        }

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued event has been sent (tests, clean stops)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._overflowed or self._sending:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout``), then close the sockets."""
        self.flush(timeout)
        with self._cond:
            self._running = False
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - a send stuck past the timeout
            log.warning("event publisher thread did not stop in %.1fs", timeout)
            return
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- publisher thread --------------------------------------------------------------------

    _sending = False

    def _take(self) -> tuple[list[Event], bool] | None:
        with self._cond:
            while self._running and not self._queue and not self._overflowed:
                self._cond.wait(0.05)
                if self._replay is not None and self._replay.poll(0):
                    return [], False
            if not self._queue and not self._overflowed:
                return None  # closed and drained
            overflowed, self._overflowed = self._overflowed, False
            n = min(len(self._queue), self.max_batch)
            batch = [self._queue.popleft() for _ in range(n)]
            self._sending = True
            return batch, overflowed

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # a malformed request must not stop publishing
                    log.exception("event replay failed")
            taken = self._take()
            if taken is None:
                return
            events, overflowed = taken
            if overflowed:
                # The router forgets this node's blocks rather than keep a wrong view.
                events = [AllBlocksCleared(), *events]
                if self._on_overflow is not None:
                    try:
                        self._on_overflow()
                    except Exception:
                        log.exception("on_overflow callback failed")
            if not events:
                continue
            try:
                payload = encode_batch(time.time(), events, self.dp_rank, self.fmt)
                seq = self._seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                         copy=False)
                self._seq = seq + 1
                self._buffer.append((seq, payload))
                self.batches_published += 1
                self.events_published += len(events)
            except zmq.ZMQError:
                self.send_errors += 1
                log.exception("publishing a KV event batch failed")
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid replay request (%d frames)", len(frames))
            return
        client, _empty, start = frames
        self.replay_requests += 1
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                head = (client, b"", self._topic) if self.fmt == "tagged" else (client, b"")
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        tail = (client, b"", b"") if self.fmt == "tagged" else (client, b"")
        self._replay.send_multipart((*tail, END_SEQ, b""))
