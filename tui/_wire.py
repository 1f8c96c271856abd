"""An asyncio session with the daemon: the wire's one codec (:mod:`kvbroker._wire.frames`)
and the same typed op stubs as the blocking client (:class:`kvbroker._wire.ops.Ops`).

The monitor lives on Textual's event loop, so it talks to the daemon without threads: one
reader task sorts what arrives into replies (matched to requests by id) and pushes (the
``watch`` snapshots). ``session.ops.<op>(...)`` sends a request and returns an awaitable of
its reply. Closing the session wakes every waiter with ``BrokerUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kvbroker._wire.frames import FrameDecoder, FrameEncoder, error_of, is_push, result_of
from kvbroker._wire.ops import Ops
from kvbroker._wire.protocol import PROTOCOL_VERSION
from kvbroker.errors import BrokerUnavailable, ProtocolError

__all__ = ["AsyncSession"]

log = logging.getLogger("kvbroker.tui")

_READ_SIZE = 64 * 1024


class AsyncSession:
    """One greeted session with the daemon; requests may overlap pushes freely."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder(sender="the daemon")
        self._encoder = FrameEncoder()
        self._next_id = 1
        self._waiting: dict[int, asyncio.Future] = {}
        self._unanswered: set[int] = set()  # one-way requests: a failure is logged
        self._pushes: asyncio.Queue[dict | BaseException] = asyncio.Queue(maxsize=8)
        self._lost: BaseException | None = None
        self._read_task = asyncio.create_task(self._read_loop())
        self.ops = Ops(self._request, self._post)  # each stub returns an awaitable
        self.hello: dict = {}

    @classmethod
    async def open(cls, path: str, *, name: str, role: str = "monitor") -> AsyncSession:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        # No path in these: the status line that shows them names the socket first.
        except FileNotFoundError:
            raise BrokerUnavailable("no daemon: no such socket") from None
        except OSError as exc:
            raise BrokerUnavailable(f"no daemon answers ({exc.strerror or exc})") from None
        session = cls(reader, writer)
        try:
            session.hello = await session.ops.hello(PROTOCOL_VERSION, name, role)
        except BaseException:
            await session.close()
            raise
        return session

    async def _request(self, op: str, args: dict[str, Any]) -> Any:
        """Send a request and wait for its reply's result (or its error raised)."""
        future = asyncio.get_running_loop().create_future()
        rid = self._send(op, args)
        self._waiting[rid] = future
        try:
            await self._writer.drain()
        except OSError as exc:
            self._waiting.pop(rid, None)
            raise BrokerUnavailable(f"lost the daemon: {exc}") from None
        return await future

    def _post(self, op: str, args: dict[str, Any]) -> None:
        """Send a request whose reply is only checked (a failure logged)."""
        self._unanswered.add(self._send(op, args))

    def _send(self, op: str, args: dict[str, Any]) -> int:
        if self._lost is not None:
            raise BrokerUnavailable(str(self._lost))
        rid = self._next_id
        self._next_id += 1
        data = self._encoder.request(rid, op, args)  # (BadRequest if too large to send)
        try:
            self._writer.write(data)
        except OSError as exc:
            raise BrokerUnavailable(f"lost the daemon: {exc}") from None
        return rid

    async def next_push(self) -> dict:
        item = await self._pushes.get()
        if isinstance(item, BaseException):
            self._pushes.put_nowait(item)  # every later caller gets the same end
            raise item
        return item

    async def close(self) -> None:
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._read_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._end(BrokerUnavailable("connection closed"))

    # -- reading ---------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    raise BrokerUnavailable("the daemon closed the connection")
                for msg in self._decoder.receive(data):
                    self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except OSError as exc:
            self._end(BrokerUnavailable(f"lost the daemon: {exc}"))
        except Exception as exc:  # noqa: BLE001 - any failure ends the session for all waiters
            self._end(exc)

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, dict):
            raise ProtocolError(f"unexpected message from the daemon: {msg!r:.80}")
        if is_push(msg):
            if self._pushes.full():
                # A slow screen should see the newest snapshot, not a backlog of old ones.
                self._pushes.get_nowait()
            self._pushes.put_nowait(msg)
            return
        rid = msg.get("id")
        if rid in self._unanswered:
            self._unanswered.discard(rid)
            if not msg.get("ok"):
                log.warning("request %s failed after the fact: %s", rid, error_of(msg))
            return
        future = self._waiting.pop(rid, None)
        if future is None or future.done():
            return
        try:
            future.set_result(result_of(msg))
        except Exception as exc:  # noqa: BLE001 - the reply's error, for its waiter
            future.set_exception(exc)

    def _end(self, exc: BaseException) -> None:
        if self._lost is not None:
            return
        self._lost = exc
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(BrokerUnavailable(str(exc)))
        self._waiting.clear()
        if self._pushes.full():
            self._pushes.get_nowait()
        self._pushes.put_nowait(BrokerUnavailable(str(exc)))
