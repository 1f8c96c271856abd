"""One client connection of the daemon: transport, framing, requests in order.

An ``asyncio`` protocol per connection hands what it reads to the wire's frame codec
(:mod:`kvbroker._wire.frames`, under the request limit of :mod:`kvbroker._wire.protocol`);
requests go to the broker one at a time, in order.
A connection waiting in a blocking ``claim`` keeps reading (so a peer that dies while it
waits is seen at once; what it pipelines meanwhile is queued, up to ``_MAX_QUEUED``
requests, answered after the claim), and never holds up another connection. The wait is no
longer than the daemon's ``max_wait``; its state (one entry in the daemon's waiters, one
timer) belongs to the connection and goes with it. A draining daemon treats each op as its row of the op table
says (``draining``). Who owns and frees what: :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import struct
from collections import deque
from time import perf_counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .state import Deferred, Session, WouldWait
from .._wire import replies as R
from .._wire.frames import (
    FrameDecoder,
    FrameEncoder,
    FrameError,
    SharedUnpacker,
    answer_id,
    as_request,
)
from .._wire.protocol import MAX_REQUEST, OPS
from ..errors import BadRequest, BrokerUnavailable, InternalError, KVBrokerError, LimitExceeded
from ..errors import NotFound, ProtocolError, Timeout

if TYPE_CHECKING:
    from .hosting import DaemonView

__all__ = ["Connection"]

log = logging.getLogger("kvbroker.daemon")


def _passes_a_wait(msg: Any) -> bool:
    """Whether queued request ``msg`` is served while its connection waits (``passes_a_wait``
    in its op table row); anything malformed waits its turn, and is refused then."""
    op = msg.get("op") if msg.__class__ is dict else None
    row = OPS.get(op) if op.__class__ is str else None
    return row is not None and row.passes_a_wait


_SO_PEERCRED_FMT = "3i"
_READ_SIZE = 64 * 1024
# One read buffer for every connection: the loop fills it and calls buffer_updated at once,
# which hands it to the connection's decoder, so nothing stays in it between reads (a
# buffer per connection was 64 KiB of memory per idle or waiting client).
_RBUF = memoryview(bytearray(_READ_SIZE))
# Connections share one msgpack Unpacker (~40 KiB of parse stack each) between frames: only
# one whose last read ended mid-frame keeps its own until that frame is complete.
_SHARED = SharedUnpacker(MAX_REQUEST)


# A bounded slice of the loop per connection per turn: after this many requests, or this
# long, a connection's further requests wait for the next turn of the loop, after every
# other connection that is ready (one pipelining client must not starve the others).
_SLICE_REQUESTS = 8
_SLICE_SECONDS = 0.0005
# Requests parsed but not yet answered, per connection; past this it stops reading (a
# waiting claim's connection keeps reading until then, to see its peer close at once).
_MAX_QUEUED = 256


class Connection(asyncio.BufferedProtocol):
    """One client connection: framing, the session's requests in order, a blocking claim's
    wait, the ``watch`` stream; the service of the op table's ``Service.DAEMON`` rows."""

    # A BufferedProtocol reads into one reused buffer: plain Protocol allocates a fresh
    # 256 KiB bytes object per read, which costs more than the request itself.
    def __init__(self, daemon: DaemonView) -> None:
        self.daemon = daemon
        self.broker = daemon.broker
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.decoder = FrameDecoder(MAX_REQUEST, shared=_SHARED)
        self.encoder = FrameEncoder(on_unpackable=self._unpackable)
        self.queue: deque[Any] = deque()
        self.busy = False
        self.closed = False
        self.write_paused = False
        # The daemon, not the peer, ended the connection: the peer may still be writing into
        # its write-leased pages, which then go into the broker's timed quarantine.
        self.cut_off = False
        # A blocking claim in progress: (rid, op, args, key, deadline), its timer.
        self.wait: tuple[int, str, Any, tuple[str, str], float] | None = None
        self.wait_timer: asyncio.TimerHandle | None = None
        # A request answered after a pull from a peer broker (kvbroker._server.fleet): the
        # task doing it, cancelled when the connection goes.
        self.deferred: asyncio.Task | None = None
        self.reading = True
        self._pump_pending = False  # the rest of its queue is served next turn
        self.watch_handle: asyncio.TimerHandle | None = None
        self.watch_interval = 0.0
        self._after_reply: Callable[[], None] | None = None  # a daemon op's follow-up
        self._out: list[bytes] | None = None  # replies of the slice being answered (_pump)
        self.uid = -1
        self.counted = False  # in the daemon's connections per uid
        self.last_active = self.connected_at = 0.0  # loop times: its last read, its start

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        pid = uid = gid = -1
        try:
            raw = sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_SO_PEERCRED_FMT)
            )
            pid, uid, gid = struct.unpack(_SO_PEERCRED_FMT, raw)
        except OSError:
            pass
        cfg = self.daemon.config
        limit, per_uid = cfg.max_connections, cfg.max_connections_per_uid
        refusal = None
        if len(self.daemon.connections) >= limit:
            refusal = (
                f"kvbroker serves at most {limit} connections (max_connections); "
                "try again when one closes"
            )
        elif self.daemon.per_uid.get(uid, 0) >= per_uid:
            refusal = (
                f"uid {uid} already holds {per_uid} connections, the most one uid may "
                "hold (max_connections_per_uid); close some first"
            )
        if refusal is not None:
            log.warning("refused a connection of pid %d uid %d: %s", pid, uid, refusal)
            self._send(self.encoder.error(None, LimitExceeded.code, refusal))
            transport.close()
            self.closed = True
            return
        self.uid, self.counted = uid, True
        self.daemon.per_uid[uid] = self.daemon.per_uid.get(uid, 0) + 1
        self.last_active = self.connected_at = self.daemon.loop_time()
        # Replies and pushes a peer leaves unread pile up here; past this, pause_writing
        # cuts the peer off instead of letting its buffer grow without bound.
        transport.set_write_buffer_limits(high=self.daemon.config.max_write_buffer)
        self.session = self.broker.open_session(pid, uid, gid)
        self.daemon.connections.add(self)
        log.debug("session %d: connected pid=%d uid=%d", self.session.id, pid, uid)

    def connection_lost(self, exc) -> None:
        self.daemon.forget(self)
        if self.session is None or self.session.id not in self.broker.sessions:
            self.closed = True
            return
        self.closed = True
        self._end_wait()
        if self.deferred is not None:
            self.deferred.cancel()
        if self.watch_handle is not None:
            self.watch_handle.cancel()
        self.daemon.connections.discard(self)
        self.broker.close_session(self.session, cut_off=self.cut_off)
        log.debug("session %d: closed", self.session.id)

    def pause_writing(self) -> None:
        # The peer stopped reading (a stuck watcher, a client pipelining requests without
        # reading replies): max_write_buffer bytes wait for it. Writes never block the loop,
        # so the only bound left is to drop the peer; its leases end with the connection.
        self.write_paused = True
        s = self.session
        log.warning(
            "session %d (pid %d, uid %d, %s): disconnected: %d bytes of replies left unread "
            "(max_write_buffer %d)",
            s.id,
            s.pid,
            s.uid,
            s.name or "unnamed",
            self.transport.get_write_buffer_size(),
            self.daemon.config.max_write_buffer,
        )
        self.closed = self.cut_off = True
        self.transport.abort()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._update_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return _RBUF

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.daemon.note_activity()
        self.last_active = self.daemon.loop_time()
        try:
            messages = self.decoder.receive(_RBUF[:nbytes])
        except FrameError as exc:
            self._fatal(exc.message)
            return
        self.queue.extend(messages)
        if self._pump_pending:  # its slice of this turn is used: the rest comes next turn
            self._update_reading()
        else:
            self._pump()

    def _pump(self) -> None:
        """Answer queued requests in order, until the connection waits (a blocking claim) or
        its slice of this turn of the loop is used up (the rest: next turn). While it waits,
        the requests queued behind the claim that only end leases (the op table's
        ``passes_a_wait``: releases, which another thread of the client sent) are answered
        from the head of the queue, so they are not held back for the whole wait.

        The slice's journal records go out in one write, then its replies in one more (a
        pipelined release and the publish behind it: two system calls, not four), so no
        reply leaves before the records of the changes it acknowledges."""
        self._pump_pending = False
        queue = self.queue
        if queue and not self.closed and (not self.busy or self._may_pass(queue[0])):
            journal = self.broker.journal
            batched = journal is not None and journal.begin()
            self._out = out = []
            try:
                deadline = perf_counter() + _SLICE_SECONDS
                n = 0
                while True:
                    self._handle(queue.popleft())
                    n += 1
                    if not queue or self.closed or (self.busy and not self._may_pass(queue[0])):
                        break
                    if n >= _SLICE_REQUESTS or perf_counter() > deadline:
                        self._pump_pending = True
                        asyncio.get_running_loop().call_soon(self._pump)
                        break
            finally:
                if batched:
                    journal.flush()
                self._out = None
                if out:
                    self._write(out[0] if len(out) == 1 else b"".join(out))
        self._update_reading()

    def _may_pass(self, msg: Any) -> bool:
        """Whether queued ``msg`` is served while the connection is busy: a release, past a
        claim that waits, and nothing past a deferred request (a peer fetch, an evict in
        slices), whose answer must not see what was sent after it."""
        return self.wait is not None and _passes_a_wait(msg)

    def _update_reading(self) -> None:
        """Read while the connection can take more: not cut off, not over its backlog."""
        if self.closed or self.transport is None:
            return
        want = not (self.write_paused or self._pump_pending or len(self.queue) >= _MAX_QUEUED)
        if want != self.reading:
            self.reading = want
            (self.transport.resume_reading if want else self.transport.pause_reading)()

    # -- requests ------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        try:
            rid, op, args = as_request(msg)
        except BadRequest as exc:
            self._error(answer_id(msg), exc.code, exc.message)
            return
        row = OPS.get(op)
        if self.daemon.draining and row is not None:  # it hands out no new leases
            if row.draining.refuse:
                self._error(
                    rid,
                    BrokerUnavailable.code,
                    "kvbroker is shutting down: finish what you hold, take new leases "
                    "from the next daemon",
                )
                return
            if row.draining.publishes and not self.daemon.keeps_pools:
                self.broker.end_unpublished(self.session, args, "kvbroker is stopping")
                self._error(
                    rid,
                    BrokerUnavailable.code,
                    "kvbroker is stopping and frees its pools: nothing published now "
                    "would be kept (the write lease or arena named ended)",
                )
                return
            if row.draining.args and isinstance(args, dict):
                args = {**args, **dict(row.draining.args)}  # e.g. publish: no fresh arena
        try:
            result = self.broker.handle(self.session, op, args, self)
        except WouldWait as ww:
            self._start_wait(rid, op, args, ww)
            return
        except Deferred as d:  # a pull from a peer broker first (kvbroker._server.fleet)
            self._start_deferred(rid, op, d)
            return
        except KVBrokerError as exc:
            self._error(rid, exc.code, exc.message or str(exc))
            return
        except Exception as exc:
            log.exception("session %d: %s failed", self.session.id, op)
            self._error(rid, InternalError.code, f"{type(exc).__name__}: {exc}")
            return
        self._reply(rid, result)
        if self._after_reply is not None:
            after, self._after_reply = self._after_reply, None
            after()

    # -- the daemon's ops (Service.DAEMON rows of the op table) ----------------------------
    def handle(self, session: Session, op: str, args: dict) -> Any:
        return getattr(self, "op_" + op)(session, **args)

    def op_watch(self, session: Session, interval: float) -> R.Watching:
        if interval < 0 or (0 < interval < 0.05):
            raise BadRequest("watch: interval must be 0 (stop) or at least 0.05 s")
        self._after_reply = lambda: self._set_watch(interval)  # the first push after the reply
        return {"interval": interval}

    def _start_wait(self, rid: int, op: str, args: Any, ww: WouldWait) -> None:
        """Answer ``rid`` once ``ww.key`` is sealed, or with Timeout after its wait (at most
        the daemon's max_wait). The connection keeps reading meanwhile: a peer that closes
        ends the wait at once (connection_lost)."""
        loop = asyncio.get_running_loop()
        limit = self.daemon.config.max_wait
        timeout = min(ww.timeout, limit)
        self.busy = True
        self.wait = (rid, op, args, ww.key, timeout)
        self.wait_timer = loop.call_later(timeout, self._wait_expired)
        self.daemon.add_waiter(ww.key, self)

    def cancel_wait(self, code: str, message: str) -> None:
        """Answer a waiting claim with an error now (the daemon is draining)."""
        if self.wait is None or self.closed:
            return
        rid = self.wait[0]
        self._end_wait()
        self._error(rid, code, message)
        self._wait_done()

    def _end_wait(self) -> None:
        """Forget the wait in progress (its timer, its entry among the daemon's waiters)."""
        if self.wait is None:
            return
        self.daemon.remove_waiter(self.wait[3], self)
        if self.wait_timer is not None:
            self.wait_timer.cancel()
            self.wait_timer = None
        self.wait = None

    def _wait_expired(self) -> None:
        self.wait_timer = None
        if self.wait is None or self.closed:
            return
        rid, _, args, key, timeout = self.wait
        self._end_wait()
        asked = args.get("wait") if isinstance(args, dict) else None
        limit = self.daemon.config.max_wait
        cap = (
            f" (this daemon waits at most {limit:g} s: max_wait)"
            if isinstance(asked, (int, float)) and asked > limit
            else ""
        )
        self._error(
            rid, Timeout.code, f"{key[0]}/{key[1]} was not published within {timeout:g} s{cap}"
        )
        self._wait_done()

    def sealed(self) -> None:
        """The awaited key was sealed (called soon after, from the loop): try the claim."""
        if self.wait is None or self.closed:
            return
        rid, op, args, key, _ = self.wait
        try:
            result = self.broker.handle(self.session, op, {**args, "wait": None})
        except NotFound:  # sealed then gone again before we ran: keep waiting
            self.daemon.add_waiter(key, self)
            return
        except KVBrokerError as exc:
            self._end_wait()
            self._error(rid, exc.code, exc.message or str(exc))
        except Exception as exc:
            self._end_wait()
            log.exception("session %d: %s failed", self.session.id, op)
            self._error(rid, InternalError.code, f"{type(exc).__name__}: {exc}")
        else:
            self._end_wait()
            self._reply(rid, result)
        self._wait_done()

    def _start_deferred(self, rid: int, op: str, d: Deferred) -> None:
        """Answer ``rid`` once ``d`` is done. Like a wait, the connection keeps reading (its
        next requests queue behind this one; a peer that closes is seen at once)."""
        self.busy = True
        self.deferred = asyncio.get_running_loop().create_task(self._deferred(rid, op, d))

    async def _deferred(self, rid: int, op: str, d: Deferred) -> None:
        try:
            while True:
                try:
                    done = await asyncio.wait_for(d.work(), d.timeout)
                except asyncio.TimeoutError:
                    raise Timeout(f"{op}: no answer from the peer within {d.timeout:g} s") from None
                try:
                    result = d.then(done)
                except Deferred as more:  # its answer needs more work first (the pools' part
                    d = more  # of an evict read in slices, then the disk's)
                    continue
                break
            self._reply(rid, result)
        except KVBrokerError as exc:
            self._error(rid, exc.code, exc.message or str(exc))
        except asyncio.CancelledError:
            return
        except Exception as exc:
            log.exception("session %d: %s failed", self.session.id, op)
            self._error(rid, InternalError.code, f"{type(exc).__name__}: {exc}")
        finally:
            self.deferred = None
        self._wait_done()

    def _wait_done(self) -> None:
        self.busy = False
        if not self._pump_pending:
            self._pump()

    # -- watch ---------------------------------------------------------------------------
    def _set_watch(self, interval: float) -> None:
        if self.watch_handle is not None:
            self.watch_handle.cancel()
            self.watch_handle = None
        self.watch_interval = interval
        if interval > 0:
            self._push_stats()

    def _push_stats(self) -> None:
        if self.closed or self.watch_interval <= 0:
            return
        # A watcher that stops reading is cut off once max_write_buffer is unread.
        stats = self.broker.statistics_for(self.session)
        self._send(self.encoder.push("stats", stats.to_dict()))
        self.watch_handle = asyncio.get_running_loop().call_later(
            self.watch_interval, self._push_stats
        )

    # -- output --------------------------------------------------------------------------
    def _error(self, rid: int | None, code: str, message: str) -> None:
        self.broker.counters["errors"] += 1
        if not self.closed:
            self._send(self.encoder.error(rid, code, message))

    def _reply(self, rid: int, result: Any) -> None:
        if not self.closed:
            self._send(self.encoder.reply(rid, result))

    def _unpackable(self, exc: Exception) -> None:
        # Never let one unpackable value close the connection: the encoder answers an error.
        log.error(
            "session %d: cannot pack a reply (%s); answering an error instead",
            self.session.id if self.session else -1,
            exc,
        )

    def _send(self, data: bytes) -> None:
        if self.closed:
            return
        if self._out is not None:  # answering a slice of requests: written at its end
            self._out.append(data)
        else:
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.closed:
            return
        self.transport.write(data)
        # The busy-poll window runs from each reply too: a client answered after a long
        # request (a 512-block match) asks again at once, and would otherwise find the loop
        # asleep and pay a wake-up.
        self.daemon.note_activity()
        if self.transport.get_write_buffer_size():  # the peer is behind: mind the total
            self.daemon.backlogged(self)

    def peer_gone(self) -> bool:
        """Whether the peer hung up, seen without reading (for a connection that stopped
        reading: a backlog behind a blocking claim). One poll(2) of its socket."""
        sock = self.transport.get_extra_info("socket") if self.transport else None
        if sock is None:
            return False
        p = select.poll()
        p.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        return bool(p.poll(0))

    def holds_nothing(self) -> bool:
        """No lease, arena, wait, watch or request in progress: closing it loses nothing."""
        s = self.session
        return (
            s is not None
            and not s.leases
            and not s.arenas
            and self.wait is None
            and not self.busy
            and not self.queue
            and self.watch_interval <= 0
            and not self.decoder.buffered
        )

    def close_quietly(self, why: str) -> None:
        """The daemon closes a connection that holds nothing (idle, or never said hello)."""
        s = self.session
        log.info(
            "session %d (pid %d, uid %d, %s): closed: %s",
            s.id,
            s.pid,
            s.uid,
            s.name or "unnamed",
            why,
        )
        self._error(None, LimitExceeded.code, f"kvbroker closed this connection: {why}")
        self.closed = True
        self.transport.close()

    def cut_for_budget(self, total: int) -> None:
        """Cut off: all connections together leave max_write_buffers_total unread."""
        s = self.session
        log.warning(
            "session %d (pid %d, uid %d, %s): disconnected: it leaves %d bytes of replies "
            "unread, the most of any connection, and all together leave %d "
            "(max_write_buffers_total %d)",
            s.id,
            s.pid,
            s.uid,
            s.name or "unnamed",
            self.transport.get_write_buffer_size(),
            total,
            self.daemon.config.max_write_buffers_total,
        )
        self.closed = self.cut_off = True
        self.transport.abort()

    def _fatal(self, message: str) -> None:
        sid = self.session.id if self.session else -1
        log.warning("session %d: protocol error, closing: %s", sid, message)
        self._error(None, ProtocolError.code, message)
        self.closed = self.cut_off = True
        self.transport.close()
