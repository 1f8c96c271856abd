"""The daemon's side of its I/O workers (setting ``io_workers``; the worker process and the
link's messages: :mod:`kvbroker._server.relay`).

Each client connection a worker accepted is an ordinary :class:`~.connection.Connection`
here, with a :class:`RelayedTransport` instead of a socket: its requests arrive in batches
on the worker's link, its replies leave on it. So sessions, waits, pushes, limits and the
draining rules are the ones of a direct connection, served by the one writer. What the
worker owns instead: the client's socket, its framing, and its unread replies (it cuts off
a client over ``max_write_buffer``, or the worst one when its connections together leave
more than its share of ``max_write_buffers_total``, and says so; the daemon logs it and ends
the session). A worker that dies takes its connections with it (their sessions end as if
their peers had gone, write-leased pages go to the timed quarantine) and is started again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from . import relay as R
from .connection import Connection

if TYPE_CHECKING:
    from .daemon import Daemon

__all__ = ["RelayedTransport", "Relays"]

log = logging.getLogger("kvbroker.daemon")

_START_TIMEOUT = 30.0  # a worker is a bare Python with msgpack: well under a second
_STOP_TIMEOUT = 5.0
_RESPAWN_DELAY = 1.0  # between a worker's death and its successor (no crash loop at full speed)


class RelayedTransport:
    """What a :class:`Connection` sees of a client served by an I/O worker: the few
    transport calls it makes, turned into messages on the worker's link."""

    __slots__ = ("_closing", "cid", "creds", "link")

    def __init__(self, link: R.Link, cid: int, creds: tuple[int, int, int]) -> None:
        self.link, self.cid, self.creds = link, cid, creds
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.creds if name == "peercred" else default

    def send_reply(self, reply: dict) -> None:
        """A reply or push, packed by the worker (the link packs a turn's items in one call)."""
        if not self._closing:
            self.link.send((R.WRITE, self.cid, reply))

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self.link.send((R.CLOSE, self.cid))

    def abort(self) -> None:
        self._closing = True
        self.link.send((R.ABORT, self.cid))

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        self.link.send((R.PAUSE, self.cid))

    def resume_reading(self) -> None:
        self.link.send((R.RESUME, self.cid))

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass  # the worker holds the unread bytes, under the limits Relays.limits sends it

    def get_write_buffer_size(self) -> int:
        return 0  # (same)


class _WorkerLink(asyncio.Protocol):
    """The daemon's end of one worker's link: its connections by id."""

    def __init__(self, relays: Relays, index: int) -> None:
        self.relays = relays
        self.index = index
        self.link = R.Link(asyncio.get_running_loop())
        self.conns: dict[int, Connection] = {}
        self.ready = asyncio.get_running_loop().create_future()
        self.proc: subprocess.Popen | None = None

    def connection_made(self, transport) -> None:
        self.link.transport = transport

    def data_received(self, data: bytes) -> None:
        conns = self.conns
        for item in self.link.items(data):
            what, cid = item[0], item[1]
            if what == R.REQUESTS:
                conn = conns.get(cid)
                if conn is not None:
                    conn.deliver(item[2])
            elif what == R.OPENED:
                conn = conns[cid] = Connection(self.relays.daemon)
                conn.connection_made(RelayedTransport(self.link, cid, tuple(item[2:5])))
            elif what == R.LOST:
                conn = conns.pop(cid, None)
                if conn is not None:
                    conn.connection_lost(None)
            elif what == R.MALFORMED:
                conn = conns.get(cid)
                if conn is not None and not conn.closed:
                    conn._fatal(item[2])
            elif what == R.UNREAD:
                conn = conns.get(cid)
                if conn is not None and not conn.closed and conn.session is not None:
                    conn.cut_unread(item[2], item[3])
            elif what == R.READY and not self.ready.done():
                self.ready.set_result(None)

    def connection_lost(self, exc) -> None:
        self.link.transport = None
        conns, self.conns = self.conns, {}
        for conn in conns.values():
            conn.cut_off = True  # its client may still be writing into write-leased pages
            conn.closed = True
            conn.connection_lost(None)
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("the I/O worker exited before serving"))
        self.relays.gone(self, len(conns))


class Relays:
    """The daemon's I/O workers: started, kept, and stopped with it."""

    def __init__(self, daemon: Daemon, listen: socket.socket, count: int) -> None:
        self.daemon = daemon
        self.listen = listen
        self.workers: list[_WorkerLink | None] = [None] * count
        self.closing = False
        self.started = 0  # workers started in all (successors of dead ones included)

    async def start(self) -> None:
        """Start every worker; returns once all listen (raises if one cannot start)."""
        links = [await self._spawn(i) for i in range(len(self.workers))]
        try:
            await asyncio.wait_for(asyncio.gather(*(w.ready for w in links)), _START_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError) as exc:
            await self.close()
            from .startup import DaemonError

            raise DaemonError(f"the I/O workers (io_workers) did not start: {exc or 'timeout'}"
                              ) from None  # fmt: skip

    async def _spawn(self, index: int) -> _WorkerLink:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cfg = self.daemon.config
        env = dict(os.environ)
        # The worker imports this very package, wherever the daemon found it.
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        env.pop("NOTIFY_SOCKET", None)  # the daemon speaks to systemd, its workers do not
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvbroker._server.relay",
                 "--listen-fd", str(self.listen.fileno()), "--link-fd", str(theirs.fileno()),
                 "--max-write-buffer", str(cfg.max_write_buffer),
                 "--max-write-buffers", str(self._share())],
                pass_fds=(self.listen.fileno(), theirs.fileno()), env=env,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        _, w = await loop.create_unix_connection(lambda: _WorkerLink(self, index), sock=ours)
        w.proc = proc
        self.workers[index] = w
        self.started += 1
        return w

    def _share(self) -> int:
        return max(1, self.daemon.config.max_write_buffers_total // len(self.workers))

    @property
    def connections(self) -> int:
        return sum(len(w.conns) for w in self.workers if w is not None)

    def limits(self) -> None:
        """Send the (reloaded) unread-reply bounds to every worker."""
        for w in self.workers:
            if w is not None:
                w.link.send((R.LIMITS, 0, self.daemon.config.max_write_buffer, self._share()))

    def stop_accepting(self) -> None:
        for w in self.workers:
            if w is not None:
                w.link.send((R.STOP_ACCEPTING, 0))

    def gone(self, w: _WorkerLink, conns: int) -> None:
        if self.workers[w.index] is w:
            self.workers[w.index] = None
        if self.closing:
            return
        status = w.proc.poll() if w.proc is not None else None
        log.error("I/O worker %d (pid %s) exited (status %s): its %d connection(s) ended; "
                  "starting another", w.index, w.proc.pid if w.proc else "?", status, conns)
        asyncio.get_running_loop().create_task(self._respawn(w.index))

    async def _respawn(self, index: int) -> None:
        await asyncio.sleep(_RESPAWN_DELAY)
        if self.closing or self.workers[index] is not None:
            return
        try:
            w = await self._spawn(index)
            await asyncio.wait_for(asyncio.shield(w.ready), _START_TIMEOUT)
        except Exception:
            log.exception("could not start I/O worker %d again", index)

    async def close(self) -> None:
        """Stop the workers: each aborts what connections it still has, then exits."""
        self.closing = True
        procs = []
        for w in self.workers:
            if w is None:
                continue
            w.link.flush()
            if w.link.transport is not None:
                w.link.transport.close()  # its end reads EOF after the last message
            if w.proc is not None:
                procs.append(w.proc)
        loop = asyncio.get_running_loop()
        for proc in procs:
            try:
                await asyncio.wait_for(loop.run_in_executor(None, proc.wait), _STOP_TIMEOUT)
            except asyncio.TimeoutError:
                log.warning("I/O worker pid %d did not stop within %g s: killed",
                            proc.pid, _STOP_TIMEOUT)  # fmt: skip
                proc.kill()
                await loop.run_in_executor(None, proc.wait)

