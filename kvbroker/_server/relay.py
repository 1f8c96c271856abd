"""An I/O worker process of the daemon (setting ``io_workers``).

It accepts client connections on the daemon's listening socket (inherited), reads them,
frames their requests (:mod:`kvbroker._server.framing`, the daemon's own limits) and hands
them to the daemon over one socketpair, the *link*; it writes the daemon's replies back.
Everything a client reaches — sessions, leases, objects, pools — stays in the daemon, the
single writer; a worker holds only connections and the bytes in flight, so its death loses
no state: the daemon sees its link close, ends the sessions of its connections as if their
peers had gone, and starts another. Why: one event loop serves ~70k small requests/s on
one core, and most of that is per-connection I/O; with workers, the daemon's loop reads one
link per worker per turn, many requests at a time (Redis' I/O threads, in processes: the GIL).

The link carries msgpack arrays ``[what, connection id, ...]``, batched per loop turn on
each side (:data:`TO_DAEMON`, :data:`TO_WORKER`). This module is the worker's side and runs
as ``python -m kvbroker._server.relay``; the daemon's side is :mod:`kvbroker._server.relays`.
It imports neither the broker nor torch: a worker starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

import msgpack

from .framing import FrameError, Framer, peer_credentials

__all__ = ["TO_DAEMON", "TO_WORKER", "main"]

# Worker -> daemon: [OPENED, cid, pid, uid, gid] a client connected; [REQUESTS, cid, [msg...]]
# requests in order; [MALFORMED, cid, why] its stream cannot be read on (the worker stopped
# reading it); [UNREAD, cid, bytes, total] the worker cut it off for unread replies (total 0:
# over max_write_buffer; else all its connections left `total`, over its share of
# max_write_buffers_total); [LOST, cid] the connection is gone (always the last word on it);
# [READY] listening.
OPENED, REQUESTS, MALFORMED, UNREAD, LOST, READY = range(6)
TO_DAEMON = {"OPENED": OPENED, "REQUESTS": REQUESTS, "MALFORMED": MALFORMED, "UNREAD": UNREAD,
             "LOST": LOST, "READY": READY}  # fmt: skip
# Daemon -> worker: [WRITE, cid, reply] (a map: the worker packs it); [CLOSE, cid] after what was written; [ABORT, cid]
# now; [PAUSE, cid] / [RESUME, cid] reading it; [LIMITS, 0, per_connection, total] unread
# reply bounds; [STOP_ACCEPTING, 0] (draining).
WRITE, CLOSE, ABORT, PAUSE, RESUME, LIMITS, STOP_ACCEPTING = range(7)
TO_WORKER = {"WRITE": WRITE, "CLOSE": CLOSE, "ABORT": ABORT, "PAUSE": PAUSE, "RESUME": RESUME,
             "LIMITS": LIMITS, "STOP_ACCEPTING": STOP_ACCEPTING}  # fmt: skip

_READ_SIZE = 64 * 1024
_RBUF = memoryview(bytearray(_READ_SIZE))  # one read buffer for all (as the daemon's)
# A link frame is at most a batch of requests of a few frames of MAX_REQUEST each; the
# daemon is trusted, so this only bounds a bug.
LINK_BUFFER = 1 << 30


class Link:
    """One end of the daemon <-> worker socketpair: items out batched per loop turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.out: list[Any] = []
        self.unpacker = msgpack.Unpacker(raw=False, max_buffer_size=LINK_BUFFER)

    def send(self, item: Any) -> None:
        if not self.out:
            self.loop.call_soon(self.flush)
        self.out.append(item)

    def flush(self) -> None:
        """One frame per turn: the list of the items sent since the last (one C call packs
        them all, replies included)."""
        out, self.out = self.out, []
        if self.transport is None or self.transport.is_closing():
            return
        try:
            frame = msgpack.packb(out)
        except (ValueError, TypeError, OverflowError):
            frame = msgpack.packb([_packable(item) for item in out])
        self.transport.write(frame)

    def items(self, data: bytes) -> Iterator[Any]:
        """The items ``data`` completes, in order."""
        self.unpacker.feed(data)
        for batch in self.unpacker:
            yield from batch


def _packable(item: Any) -> Any:
    """``item``, or for a reply that cannot be packed an error reply in its place (one bad
    value must not close the connection, nor cost the others in its batch their replies)."""
    try:
        msgpack.packb(item)
    except (ValueError, TypeError, OverflowError) as exc:
        reply = item[2] if len(item) > 2 and isinstance(item[2], dict) else {}
        return (WRITE, item[1], {"id": reply.get("id"), "ok": False, "error": {
            "code": "internal", "message": f"the reply cannot be sent: {exc}"}})  # fmt: skip
    return item


class _Client(asyncio.BufferedProtocol):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.cid = 0
        self.transport: asyncio.Transport | None = None
        self.framer = Framer()
        self.reading = True

    def connection_made(self, transport) -> None:
        w = self.worker
        self.transport = transport
        w.last_id += 1
        self.cid = w.last_id
        w.clients[self.cid] = self
        transport.set_write_buffer_limits(high=w.per_connection)
        w.link.send((OPENED, self.cid, *peer_credentials(transport.get_extra_info("socket"))))

    def connection_lost(self, exc) -> None:
        w = self.worker
        if w.clients.pop(self.cid, None) is not None:
            w.backlogged.discard(self)
            w.link.send((LOST, self.cid))

    def get_buffer(self, sizehint: int) -> memoryview:
        return _RBUF

    def buffer_updated(self, nbytes: int) -> None:
        try:
            msgs = self.framer.feed(_RBUF[:nbytes])
        except FrameError as exc:
            self.pause()
            self.worker.link.send((MALFORMED, self.cid, str(exc)))
            return
        if msgs:
            self.worker.link.send((REQUESTS, self.cid, msgs))

    def pause_writing(self) -> None:
        # The peer left max_write_buffer unread: cut it off (the daemon logs it, ends it).
        self.worker.cut(self, 0)

    def resume_writing(self) -> None:
        pass

    def pause(self) -> None:
        if self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = False
            self.transport.pause_reading()

    def resume(self) -> None:
        if not self.reading and self.transport is not None and not self.transport.is_closing():
            self.reading = True
            self.transport.resume_reading()


class _LinkProtocol(asyncio.Protocol):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def connection_made(self, transport) -> None:
        self.worker.link.transport = transport

    def data_received(self, data: bytes) -> None:
        w = self.worker
        for item in w.link.items(data):
            w.command(item)

    def connection_lost(self, exc) -> None:
        self.worker.daemon_gone.set()  # the daemon stopped or died: so does its worker


class Worker:
    """The worker's state: its clients by id, the link, the unread-reply bounds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, per_connection: int, total: int):
        self.loop = loop
        self.link = Link(loop)
        self.clients: dict[int, _Client] = {}
        self.last_id = 0
        self.per_connection, self.total = per_connection, total
        self.backlogged: set[_Client] = set()
        self.server: asyncio.AbstractServer | None = None
        self.daemon_gone = asyncio.Event()

    def command(self, item: list) -> None:
        what, cid = item[0], item[1]
        if what == WRITE:
            c = self.clients.get(cid)
            if c is not None and not c.transport.is_closing():
                c.transport.write(msgpack.packb(item[2]))
                if c.transport.get_write_buffer_size():
                    self._mind_backlog(c)
        elif what == CLOSE or what == ABORT:
            c = self.clients.get(cid)
            if c is not None:
                (c.transport.close if what == CLOSE else c.transport.abort)()
        elif what == PAUSE or what == RESUME:
            c = self.clients.get(cid)
            if c is not None:
                (c.pause if what == PAUSE else c.resume)()
        elif what == LIMITS:
            self.per_connection, self.total = item[2], item[3]
            for c in self.clients.values():
                c.transport.set_write_buffer_limits(high=self.per_connection)
        elif what == STOP_ACCEPTING:
            if self.server is not None:
                self.server.close()

    def cut(self, c: _Client, total: int) -> None:
        if self.clients.get(c.cid) is c and not c.transport.is_closing():
            self.link.send((UNREAD, c.cid, c.transport.get_write_buffer_size(), total))
            c.transport.abort()

    def _mind_backlog(self, c: _Client) -> None:
        """Hold every connection's unread replies under this worker's share of
        max_write_buffers_total, cutting off the one holding the most (as the daemon does)."""
        self.backlogged.add(c)
        sizes = []
        total = 0
        for b in list(self.backlogged):
            n = b.transport.get_write_buffer_size() if not b.transport.is_closing() else 0
            if n == 0:
                self.backlogged.discard(b)
            else:
                total += n
                sizes.append((n, b.cid, b))
        sizes.sort(key=lambda x: (x[0], x[1]))
        while total > self.total and sizes:
            n, _, worst = sizes.pop()
            self.cut(worst, total)
            self.backlogged.discard(worst)
            total -= n

    def sweep(self) -> None:
        """A connection it stopped reading (paused by the daemon) is not seen to close by
        reading: one poll(2) each, once a second, finds the peers that hung up."""
        for c in list(self.clients.values()):
            if c.reading or c.transport.is_closing():
                continue
            sock = c.transport.get_extra_info("socket")
            if sock is None:
                continue
            p = select.poll()
            p.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            if p.poll(0):
                c.transport.abort()


async def _serve(listen_fd: int, link_fd: int, per_connection: int, total: int) -> None:
    loop = asyncio.get_running_loop()
    w = Worker(loop, per_connection, total)
    link_sock = socket.socket(fileno=link_fd)
    await loop.create_unix_connection(lambda: _LinkProtocol(w), sock=link_sock)
    listen = socket.socket(fileno=listen_fd)
    w.server = await loop.create_unix_server(lambda: _Client(w), sock=listen)
    w.link.send((READY, 0))

    async def sweeping() -> None:
        while True:
            await asyncio.sleep(1.0)
            w.sweep()

    sweeper = loop.create_task(sweeping())
    await w.daemon_gone.wait()
    sweeper.cancel()
    w.server.close()
    for c in list(w.clients.values()):
        c.transport.abort()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvbroker._server.relay")
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--link-fd", type=int, required=True)
    ap.add_argument("--max-write-buffer", type=int, required=True)
    ap.add_argument("--max-write-buffers", type=int, required=True)
    a = ap.parse_args(argv)
    # The daemon decides when its workers stop (it drains first): a SIGTERM or ^C meant for
    # the service reaches the whole process group, and must not cut its clients off.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    serving = _serve(a.listen_fd, a.link_fd, a.max_write_buffer, a.max_write_buffers)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serving)
    else:
        uvloop.run(serving)
    return 0


if __name__ == "__main__":
    os.environ.pop("NOTIFY_SOCKET", None)  # the daemon speaks to systemd, not its workers
    sys.exit(main())
