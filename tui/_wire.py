"""An asyncio connection to the daemon: the same msgpack framing as the blocking client.

The monitor lives on Textual's event loop, so it talks to the daemon without threads: one
reader task sorts what arrives into replies (matched to requests by id) and pushes (the
``watch`` snapshots). Closing the connection wakes every waiter with ``BrokerUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack

from kvbroker._wire.protocol import PROTOCOL_VERSION, unpacker_limits
from kvbroker.errors import BrokerUnavailable, ProtocolError, error_for_code

__all__ = ["AsyncConnection"]

_READ_SIZE = 64 * 1024


class AsyncConnection:
    """One greeted session with the daemon; requests may overlap pushes freely."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._unpacker = msgpack.Unpacker(raw=False, **unpacker_limits())
        self._next_id = 1
        self._waiting: dict[int, asyncio.Future] = {}
        self._pushes: asyncio.Queue[dict | BaseException] = asyncio.Queue(maxsize=8)
        self._lost: BaseException | None = None
        self._read_task = asyncio.create_task(self._read_loop())
        self.hello: dict = {}

    @classmethod
    async def open(cls, path: str, *, name: str, role: str = "monitor") -> AsyncConnection:
        try:
            reader, writer = await asyncio.open_unix_connection(path)
        # No path in these: the status line that shows them names the socket first.
        except FileNotFoundError:
            raise BrokerUnavailable("no daemon: no such socket") from None
        except OSError as exc:
            raise BrokerUnavailable(f"no daemon answers ({exc.strerror or exc})") from None
        conn = cls(reader, writer)
        try:
            conn.hello = await conn.call("hello", version=PROTOCOL_VERSION, name=name, role=role)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def call(self, op: str, **args: Any) -> Any:
        if self._lost is not None:
            raise BrokerUnavailable(str(self._lost))
        rid = self._next_id
        self._next_id += 1
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            self._writer.write(msgpack.packb({"id": rid, "op": op, "args": args}))
            await self._writer.drain()
        except OSError as exc:
            self._waiting.pop(rid, None)
            raise BrokerUnavailable(f"lost the daemon: {exc}") from None
        return await future

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
                try:
                    self._unpacker.feed(data)
                except msgpack.BufferFull:
                    raise ProtocolError("the daemon sent a frame over the size limit") from None
                for msg in self._unpacker:
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
        if "push" in msg:
            if self._pushes.full():
                # A slow screen should see the newest snapshot, not a backlog of old ones.
                self._pushes.get_nowait()
            self._pushes.put_nowait(msg)
            return
        future = self._waiting.pop(msg.get("id"), None)
        if future is None or future.done():
            return
        if msg.get("ok"):
            future.set_result(msg.get("result"))
        else:
            err = msg.get("error") or {}
            future.set_exception(
                error_for_code(str(err.get("code", "error")), str(err.get("message", "")))
            )

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
