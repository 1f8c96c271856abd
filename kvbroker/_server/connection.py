"""One client connection of the daemon: transport, framing, requests in order.

An ``asyncio`` protocol per connection feeds msgpack's streaming ``Unpacker`` under hard
limits (:mod:`kvbroker._wire.protocol`); requests go to the broker one at a time, in order.
A connection waiting in a blocking ``claim`` stops reading until it is answered, and never
holds up another connection. A draining daemon treats each op as its row of the op table
says (``draining``). Who owns and frees what: :mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from .snapshot import statistics_for
from .state import Deferred, Session, WouldWait
from .._wire import replies as R
from .._wire.protocol import MAX_REQUEST, OPS, unpacker_limits
from ..errors import BadRequest, BrokerUnavailable, InternalError, KVBrokerError, LimitExceeded
from ..errors import NotFound, ProtocolError, Timeout

if TYPE_CHECKING:
    from .daemon import Daemon

__all__ = ["Connection"]

log = logging.getLogger("kvbroker.daemon")

_SO_PEERCRED_FMT = "3i"
_READ_SIZE = 64 * 1024


class Connection(asyncio.BufferedProtocol):
    """One client connection: framing, the session's requests in order, a blocking claim's
    wait, the ``watch`` stream; the service of the op table's ``Service.DAEMON`` rows."""

    # A BufferedProtocol reads into one reused buffer: plain Protocol allocates a fresh
    # 256 KiB bytes object per read, which costs more than the request itself.
    def __init__(self, daemon: Daemon) -> None:
        self._rbuf = memoryview(bytearray(_READ_SIZE))
        self.daemon = daemon
        self.broker = daemon.broker
        self.transport: asyncio.Transport | None = None
        self.session: Session | None = None
        self.unpacker = msgpack.Unpacker(raw=False, **unpacker_limits(MAX_REQUEST))
        self.queue: deque[Any] = deque()
        self.busy = False
        self.closed = False
        self.write_paused = False
        # The daemon, not the peer, ended the connection: the peer may still be writing into
        # its write-leased pages, which then go into the broker's timed quarantine.
        self.cut_off = False
        self.waiter: asyncio.Task | None = None
        self.wait_rid: int | None = None
        self.watch_handle: asyncio.TimerHandle | None = None
        self.watch_interval = 0.0
        self._after_reply: Callable[[], None] | None = None  # a daemon op's follow-up

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
        limit = self.daemon.config.max_connections
        if len(self.daemon.connections) >= limit:
            log.warning("refused a connection of pid %d uid %d: %d connections already "
                        "(max_connections)", pid, uid, limit)  # fmt: skip
            self._send({"id": None, "ok": False, "error": {
                "code": LimitExceeded.code,
                "message": f"kvbroker serves at most {limit} connections (max_connections); "
                           "try again when one closes"}})  # fmt: skip
            transport.close()
            self.closed = True
            return
        # Replies and pushes a peer leaves unread pile up here; past this, pause_writing
        # cuts the peer off instead of letting its buffer grow without bound.
        transport.set_write_buffer_limits(high=self.daemon.config.max_write_buffer)
        self.session = self.broker.open_session(pid, uid, gid)
        self.daemon.connections.add(self)
        log.debug("session %d: connected pid=%d uid=%d", self.session.id, pid, uid)

    def connection_lost(self, exc) -> None:
        if self.session is None or self.session.id not in self.broker.sessions:
            self.closed = True
            return
        self.closed = True
        if self.waiter is not None:
            self.waiter.cancel()
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
            "(max_write_buffer %d)", s.id, s.pid, s.uid, s.name or "unnamed",
            self.transport.get_write_buffer_size(), self.daemon.config.max_write_buffer,
        )  # fmt: skip
        self.closed = self.cut_off = True
        self.transport.abort()

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.busy and not self.closed:
            self.transport.resume_reading()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._rbuf

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        self.daemon.note_activity()
        try:
            self.unpacker.feed(self._rbuf[:nbytes])
        except msgpack.BufferFull:
            self._fatal("frame exceeds the size limit")
            return
        while not self.closed:
            try:
                msg = next(self.unpacker)
            except StopIteration:
                return
            except Exception as exc:  # any decoding failure: the stream cannot resync
                self._fatal(f"malformed frame: {type(exc).__name__}: {exc}")
                return
            if self.busy:
                self.queue.append(msg)
            else:
                self._handle(msg)

    # -- requests ------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            self._error(None, BadRequest.code, "a request must be a map with id, op and args")
            return
        rid, op, args = msg.get("id"), msg.get("op"), msg.get("args")
        if not isinstance(rid, int) or isinstance(rid, bool) or not isinstance(op, str):
            self._error(rid if isinstance(rid, int) else None, BadRequest.code,
                        "a request needs an integer id and a string op")
            return
        row = OPS.get(op)
        if self.daemon.draining and row is not None:  # it hands out no new leases
            if row.draining.refuse:
                self._error(rid, BrokerUnavailable.code,
                            "kvbroker is shutting down: finish what you hold, take new leases "
                            "from the next daemon")
                return
            if row.draining.publishes and not self.daemon.keeps_pools:
                self.broker.end_unpublished(self.session, args, "kvbroker is stopping")
                self._error(rid, BrokerUnavailable.code,
                            "kvbroker is stopping and frees its pools: nothing published now "
                            "would be kept (the write lease or arena named ended)")
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
        self._send({"id": rid, "ok": True, "result": result})
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
        self.busy = True
        self.wait_rid = rid
        self.transport.pause_reading()
        self.waiter = asyncio.get_running_loop().create_task(self._wait(rid, op, args, ww))

    def cancel_wait(self, code: str, message: str) -> None:
        """Answer a waiting claim with an error now (the daemon is draining)."""
        if self.waiter is None or self.closed:
            return
        self.waiter.cancel()
        self.waiter = None
        self._error(self.wait_rid, code, message)
        self._wait_done()

    async def _wait(self, rid: int, op: str, args: dict, ww: WouldWait) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ww.timeout
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise Timeout(
                        f"{ww.key[0]}/{ww.key[1]} was not published within {ww.timeout:g} s"
                    )
                try:
                    await asyncio.wait_for(self.daemon.sealed_future(ww.key), remaining)
                except asyncio.TimeoutError:
                    continue
                try:
                    result = self.broker.handle(self.session, op, {**args, "wait": None})
                except KVBrokerError as exc:
                    if isinstance(exc, NotFound):
                        continue  # sealed then gone again before we ran: keep waiting
                    raise
                self._send({"id": rid, "ok": True, "result": result})
                break
        except KVBrokerError as exc:
            self.broker.counters["errors"] += 1
            self._error(rid, exc.code, exc.message)
        except asyncio.CancelledError:
            return
        finally:
            self.waiter = None
        self._wait_done()

    def _start_deferred(self, rid: int, op: str, d: Deferred) -> None:
        self.busy = True
        self.wait_rid = rid
        self.transport.pause_reading()
        self.waiter = asyncio.get_running_loop().create_task(self._deferred(rid, op, d))

    async def _deferred(self, rid: int, op: str, d: Deferred) -> None:
        try:
            try:
                done = await asyncio.wait_for(d.work(), d.timeout)
            except asyncio.TimeoutError:
                raise Timeout(f"{op}: no answer from the peer within {d.timeout:g} s") from None
            self._send({"id": rid, "ok": True, "result": d.then(done)})
        except KVBrokerError as exc:
            self._error(rid, exc.code, exc.message or str(exc))
        except asyncio.CancelledError:
            return
        except Exception as exc:
            log.exception("session %d: %s failed", self.session.id, op)
            self._error(rid, InternalError.code, f"{type(exc).__name__}: {exc}")
        finally:
            self.waiter = None
        self._wait_done()

    def _wait_done(self) -> None:
        self.busy = False
        while self.queue and not self.busy and not self.closed:
            self._handle(self.queue.popleft())
        if not self.busy and not self.closed and not self.write_paused:
            self.transport.resume_reading()

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
        stats = statistics_for(self.broker, self.session)
        self._send({"push": "stats", "result": stats.to_dict()})
        self.watch_handle = asyncio.get_running_loop().call_later(
            self.watch_interval, self._push_stats
        )

    # -- output --------------------------------------------------------------------------
    def _error(self, rid: int | None, code: str, message: str) -> None:
        self.broker.counters["errors"] += 1
        self._send({"id": rid, "ok": False, "error": {"code": code, "message": message}})

    def _send(self, obj: dict) -> None:
        if not self.closed:
            self.transport.write(msgpack.packb(obj))

    def _fatal(self, message: str) -> None:
        sid = self.session.id if self.session else -1
        log.warning("session %d: protocol error, closing: %s", sid, message)
        self._error(None, ProtocolError.code, message)
        self.closed = self.cut_off = True
        self.transport.close()
