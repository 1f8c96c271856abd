"""KV events for cache-aware routers, in vLLM's wire format (ZMQ PUB + ROUTER replay).

A router (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's own subscriber example) learns
which prefix blocks a node holds from the stream vLLM publishes with ``--kv-events-config``.
The daemon publishes the same stream for the prefix blocks in its pools, so such a router
consumes it without changes.

The wire format (vLLM's ``KVEventBatch``, ``BlockStored``..., in its two msgpack encodings,
block hashes and topics) is :mod:`kvbroker._server.event_wire`'s, re-exported here.

Who may subscribe
-----------------
A ``BlockStored`` carries a prompt's token ids, and anyone can subscribe to a bind-form
endpoint or bind a connect-form port first. ``curve`` (:class:`CurveKeys`) makes the
daemon a CURVE server on both sockets, so that only subscribers holding a listed key get
anything; why CURVE, and the tenant rule for a stream without it, are in
:mod:`kvbroker._server.event_auth`.

Replay, fairly
--------------
A ROUTER socket answers ``[identity, b"", start_seq (8 bytes big endian)]`` with every
buffered batch whose sequence number is ``>= start_seq``, then an end marker whose sequence
is -1 (8 bytes, signed), each reply after an empty delimiter frame. Ask from a DEALER socket
(send ``[b"", start_seq]``): a plain REQ socket keeps only the first reply of a stream, as
vLLM's example subscriber does. The buffer keeps the last ``buffer_steps`` batches and at
most ``buffer_bytes`` of payload (a batch of long prompts can be megabytes); a change of
what the stream may carry (a reload) empties it (:meth:`EventPublisher.forget_history`). Replays are
streamed, not sent whole: each turn of the publisher thread publishes the live batch due and
sends each replay in progress a slice (``REPLAY_SLICE`` bytes), so a requester asking again
and again from 0 never holds the live stream up. One replay per requester (a new request
replaces its replay in progress), at most ``MAX_REPLAYS`` at once (others get the end
marker at once), each waiting for a requester that does not read (ROUTER_MANDATORY, a small
send high-water mark) and dropped after ``REPLAY_STALL`` seconds without progress. Frames
larger than a request (``MAX_REQUEST_FRAME``, ``zmq.MAXMSGSIZE``) disconnect their sender
before they are buffered; malformed requests are counted and warned about at most once per
``WARN_INTERVAL``.

Threads
-------
:class:`EventPublisher` owns both sockets and one thread. The daemon's event loop only calls
:meth:`EventPublisher.publish`, which appends to a bounded in-memory queue under a lock and
never blocks on ZMQ or on a slow subscriber (PUB drops at its high-water mark, as in vLLM;
``PUB_HWM`` batches).
When the queue is full the new events and those still queued are dropped and counted, and
the next batch sent starts with ``AllBlocksCleared``: a router then forgets this node's blocks
and learns only what happens afterwards, so it can under-estimate what the node holds (which
costs cache hits) but never over-state it; and
``on_overflow`` (if given) is called from the publisher thread so the owner can announce its
blocks again. An event that cannot be encoded (token ids that are not integers) is dropped
and counted, never the thread: a dropped removal clears the stream the same way.

pyzmq is an optional extra (``pip install 'kvbroker[events]'``): this module imports it only
when a publisher is created.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .event_auth import CurveKeys
from .event_wire import (
    END_SEQ,
    FORMATS,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    encode_batch,
    encode_event,
    external_hash,
    import_zmq,
    topic_for,
)
from .log_limits import RateLimitedWarnings

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CurveKeys",
    "EventPublisher",
    "END_SEQ",
    "FORMATS",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "encode_batch",
    "encode_event",
    "external_hash",
    "topic_for",
]

log = logging.getLogger("kvbroker.events")

# Replay buffer: 16 MiB keeps ~100,000 batches of one 16-token block, or a few hundred of
# 16,384-token blocks; a router that missed more rebuilds from AllBlocksCleared on.
DEFAULT_BUFFER_BYTES = 16 << 20
# A live batch holds about this many payload bytes at most (one event more if it is larger):
# what PUB and a replay hold per message stays small.
MAX_BATCH_BYTES = 256 << 10
# Batches PUB keeps for a subscriber that does not take them (anyone can subscribe to a
# bind-form endpoint): about PUB_HWM * MAX_BATCH_BYTES at worst (shared by all such
# subscribers), not vLLM's 100,000 batches (gigabytes of long prompts). A router that falls
# this far behind loses batches and fills the gap from the replay socket, as with vLLM.
PUB_HWM = 1000
# A replay request is [b"", 8 bytes]: a frame larger than 1 KiB disconnects its sender
# (zmq.MAXMSGSIZE, checked per frame as it arrives, before it is buffered). Not smaller:
# the limit applies to the CURVE handshake's commands (HELLO is 200 bytes, INITIATE more)
# and to encrypted frames, which carry a nonce and a MAC.
MAX_REQUEST_FRAME = 1024
REPLAY_HWM = 64  # messages queued per requester (requests in, replies out)
MAX_REPLAYS = 64  # replays in progress at once (one per requester)
REPLAY_SLICE = 256 << 10  # bytes a replay may send a turn, one batch at least
REPLAY_STALL = 30.0  # seconds a replay may wait for a requester that does not read
WARN_INTERVAL = 10.0  # seconds between two warnings of one kind (bad requests...)


@dataclass(slots=True)
class _Replay:
    next_seq: int
    blocked_since: float | None = None


def _cost(ev: Event) -> int:
    """About how many payload bytes ``ev`` takes (msgpack: <= 9 a hash, <= 5 a token id)."""
    if type(ev) is BlockStored:
        return 48 + 9 * len(ev.block_hashes) + 5 * len(ev.token_ids)
    if type(ev) is BlockRemoved:
        return 24 + 9 * len(ev.block_hashes)
    return 24


class EventPublisher:
    """Publishes KV events on a ZMQ PUB socket from its own thread; see the module docstring.

    ``endpoint``: ``tcp://*:5557`` (or any address with ``*``, ``ipc://``, ``inproc://``) binds;
    ``tcp://host:port`` connects (vLLM's rule). ``replay_endpoint`` (optional) is bound.
    ``curve`` (optional :class:`CurveKeys`): both sockets accept only those subscribers.
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
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        max_queue: int = 100_000,
        max_batch: int = 1024,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        hwm: int = PUB_HWM,
        on_overflow: Callable[[], None] | None = None,
        context=None,
        curve: CurveKeys | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown event format {fmt!r} (one of {', '.join(FORMATS)})")
        if max_queue < 1 or max_batch < 1 or max_batch_bytes < 1:
            raise ValueError("max_queue, max_batch and max_batch_bytes must be positive")
        if buffer_steps < 0 or buffer_bytes < 0:
            raise ValueError("buffer_steps and buffer_bytes must be >= 0")
        zmq = import_zmq()
        self._zmq = zmq
        self.fmt = fmt
        self.topic = topic
        self._topic = topic.encode()
        self.dp_rank = dp_rank
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self.buffer_steps = buffer_steps
        self.buffer_bytes = buffer_bytes
        self._on_overflow = on_overflow
        self._auth = self._own_ctx = self._pub = self._replay = None
        self.authenticated = curve is not None
        try:
            if curve is not None:
                # A ZAP handler serves a whole context: ours alone, so that no other socket
                # of the process (or another publisher) shares or replaces it.
                from zmq.auth.thread import ThreadAuthenticator

                self._own_ctx = self._ctx = zmq.Context()
                self._auth = ThreadAuthenticator(self._ctx, log=log.getChild("zap"))
                self._auth.start()
                self._auth.configure_curve(domain="*", location=curve.clients_dir)
            else:
                self._ctx = context or zmq.Context.instance()
            self._pub = self._socket(zmq.PUB, curve)
            self._pub.set_hwm(hwm)
            self.endpoint = self._attach(self._pub, endpoint)
            self.replay_endpoint = None
            if replay_endpoint:
                r = self._replay = self._socket(zmq.ROUTER, curve)
                r.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME)
                r.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone requester: an error
                r.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                r.setsockopt(zmq.RCVHWM, REPLAY_HWM)
                self.replay_endpoint = self._attach(r, replay_endpoint, bind=True)
        except Exception:
            self._close_sockets(0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0  # payload bytes in _buffer
        self._replays: dict[bytes, _Replay] = {}  # requester identity -> its replay, in turn
        self._warnings = RateLimitedWarnings(log, WARN_INTERVAL)
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
        self.replay_refused = 0  # malformed, or too many replays at once
        self.encode_errors = 0
        self.send_errors = 0
        self._thread = threading.Thread(target=self._run, name="kvbroker-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, curve: CurveKeys | None):
        sock = self._ctx.socket(kind)
        if curve is not None:
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
            sock.curve_server = True  # also when it connects: the subscriber must prove a key
        return sock

    def _attach(self, sock, endpoint: str, bind: bool | None = None) -> str:
        if bind is None:
            bind = (
                "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
            )
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    def _close_sockets(self, linger_ms: int) -> None:
        if self._pub is not None:
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx is not None:
            self._own_ctx.term()

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

    def stored(
        self,
        block_hashes: Sequence[int],
        parent_block_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str | None = MEDIUM_CPU,
        lora_name: str | None = None,
    ) -> bool:
        return self.publish(
            [
                BlockStored(
                    block_hashes, parent_block_hash, token_ids, block_size, None, medium, lora_name
                )
            ]
        )

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

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def stats(self) -> dict:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "format": self.fmt,
            "next_seq": self._seq,
            "authenticated": self.authenticated,
            "events_published": self.events_published,
            "batches_published": self.batches_published,
            "events_dropped": self.events_dropped,
            "overflows": self.overflows,
            "replay_requests": self.replay_requests,
            "replay_refused": self.replay_refused,
            "replays_in_progress": len(self._replays),
            "encode_errors": self.encode_errors,
            "send_errors": self.send_errors,
            "queued": len(self._queue),
            "buffered_batches": len(self._buffer),
            "buffered_bytes": self._buffered,
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
        self._close_sockets(int(timeout * 1000))

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- publisher thread --------------------------------------------------------------------

    def forget_history(self) -> None:
        """Drop what is queued and, before the next batch goes out, every buffered batch:
        what the stream may carry changed (a reload), and a replay must not hand out what
        was published under the old rule. The caller publishes the new state next
        (``AllBlocksCleared`` first), as after an overflow."""
        with self._cond:
            self._queue.clear()
            self._forget = True
            self._cond.notify()

    _forget = False
    _sending = False

    def _take(self, wait: float) -> tuple[list[Event], bool] | None:
        """The next live batch (up to ``max_batch`` events and about ``max_batch_bytes``),
        waiting up to ``wait`` seconds for one (less when a replay request comes)."""
        with self._cond:
            if wait > 0 and self._running and not self._queue and not self._overflowed:
                deadline = time.monotonic() + wait
                while self._running and not self._queue and not self._overflowed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 0.05))
                    if self._replay is not None and self._replay.poll(0):
                        break
            if not self._running and not self._queue and not self._overflowed:
                return None  # closed and drained
            if self._forget:  # the publisher thread owns the buffer: emptied here
                self._forget = False
                self._buffer.clear()
                self._buffered = 0
            overflowed, self._overflowed = self._overflowed, False
            batch: list[Event] = []
            cost = 0
            while self._queue and len(batch) < self.max_batch and cost < self.max_batch_bytes:
                ev = self._queue.popleft()
                batch.append(ev)
                cost += _cost(ev)
            self._sending = bool(batch) or overflowed
            return batch, overflowed

    def _run(self) -> None:
        while True:
            progressed = False
            if self._replay is not None:
                try:
                    self._accept_replays()
                    progressed = self._advance_replays()
                except Exception:  # a requester must not stop publishing
                    self._warnings.warn("replay", "event replay failed", exc_info=True)
            # With replays in progress, wait only when none could move (a requester that
            # does not read): the live batch and every replay get a turn each round.
            wait = 0.05 if not self._replays else (0.0 if progressed else 0.005)
            taken = self._take(wait)
            if taken is None:
                return
            events, overflowed = taken
            if not events and not overflowed:
                continue
            try:
                self._send(events, overflowed)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _send(self, events: list[Event], overflowed: bool) -> None:
        zmq = self._zmq
        if overflowed:
            # The router forgets this node's blocks rather than keep a wrong view.
            events = [AllBlocksCleared(), *events]
            if self._on_overflow is not None:
                try:
                    self._on_overflow()
                except Exception:
                    log.exception("on_overflow callback failed")
        try:
            payload = encode_batch(time.time(), events, self.dp_rank, self.fmt)
        except (TypeError, ValueError, OverflowError):
            payload = self._encode_valid(events)
            if payload is None:
                return
        try:
            seq = self._seq
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._seq = seq + 1
            self._keep(seq, payload)
            self.batches_published += 1
            self.events_published += len(events)
        except zmq.ZMQError:
            self.send_errors += 1
            log.exception("publishing a KV event batch failed")

    def _encode_valid(self, events: list[Event]) -> bytes | None:
        """The batch without the events that cannot be encoded (token ids that are not
        integers, hashes out of range). A dropped removal would leave a router believing
        this node holds the block: the stream is cleared (see ``publish``'s overflow)."""
        good = []
        for ev in events:
            try:
                encode_event(ev, self.fmt)
            except (TypeError, ValueError, OverflowError) as exc:
                self.encode_errors += 1
                self.events_dropped += 1
                self._warnings.warn(
                    "encode",
                    "dropped a KV event that cannot be encoded (%s: %s)",
                    type(exc).__name__,
                    exc,
                )
                if type(ev) is not BlockStored:
                    with self._cond:
                        if not self._overflowed:
                            self._overflowed = True
                            self.overflows += 1
                continue
            good.append(ev)
        if not good:
            return None
        return encode_batch(time.time(), good, self.dp_rank, self.fmt)

    def _keep(self, seq: int, payload: bytes) -> None:
        """Buffer a sent batch for replay: the last ``buffer_steps``, ``buffer_bytes`` at most."""
        buf = self._buffer
        buf.append((seq, payload))
        self._buffered += len(payload)
        while buf and (len(buf) > self.buffer_steps or self._buffered > self.buffer_bytes):
            self._buffered -= len(buf.popleft()[1])

    # -- replay (publisher thread) -----------------------------------------------------------

    def _accept_replays(self) -> None:
        zmq = self._zmq
        for _ in range(MAX_REPLAYS):  # a bounded number a turn: the live stream comes next
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                self.replay_refused += 1
                self._warnings.warn(
                    "request",
                    "invalid KV event replay request (%d frames, sizes %s)",
                    len(frames),
                    [len(f) for f in frames[1:4]],
                )
                continue
            client, _empty, start = frames
            self.replay_requests += 1
            if client in self._replays:
                del self._replays[client]  # the new request replaces it, at the back
            elif len(self._replays) >= MAX_REPLAYS:
                self.replay_refused += 1
                self._warnings.warn(
                    "busy",
                    "%d KV event replays in progress: a request answered with the end marker",
                    MAX_REPLAYS,
                )
                self._send_end(client)
                continue
            self._replays[client] = _Replay(int.from_bytes(start, "big"))

    def _advance_replays(self) -> bool:
        """Send each replay in progress its next slice; True if anything was sent."""
        zmq = self._zmq
        progressed = False
        now = time.monotonic()
        for client in list(self._replays):
            rep = self._replays.pop(client)
            oldest = self._buffer[0][0] if self._buffer else self._seq
            rep.next_seq = max(rep.next_seq, oldest)  # trimmed meanwhile: a gap, as asked early
            head = (client, b"", self._topic) if self.fmt == "tagged" else (client, b"")
            sent = 0
            try:
                while rep.next_seq < self._seq and sent < REPLAY_SLICE:
                    seq, payload = self._buffer[rep.next_seq - oldest]
                    self._replay.send_multipart(
                        (*head, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=False
                    )
                    rep.next_seq += 1
                    sent += len(payload) + 1
                if rep.next_seq >= self._seq and self._send_end(client, raise_full=True):
                    progressed = True
                    continue  # done
            except zmq.Again:  # its pipe is full: it is not reading (yet)
                pass
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # it went away
                    continue
                raise
            if sent:
                progressed, rep.blocked_since = True, None
            elif rep.blocked_since is None:
                rep.blocked_since = now
            elif now - rep.blocked_since > REPLAY_STALL:
                self._warnings.warn(
                    "stall",
                    "dropped a KV event replay whose requester read nothing for %.0f s",
                    REPLAY_STALL,
                )
                continue
            self._replays[client] = rep  # its next turn comes after the others'
        return progressed

    def _send_end(self, client: bytes, raise_full: bool = False) -> bool:
        zmq = self._zmq
        tail = (client, b"", b"") if self.fmt == "tagged" else (client, b"")
        try:
            self._replay.send_multipart((*tail, END_SEQ, b""), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if raise_full:
                raise
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return True  # gone: nothing left to send it
            raise
