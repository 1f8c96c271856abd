"""Framing: msgpack maps over a transport, decoded by a streaming Unpacker under limits."""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol

import msgpack

from .._wire.protocol import MAX_REQUEST, unpacker_limits
from ..errors import BadRequest, BrokerUnavailable, ProtocolError

__all__ = ["MessageStream"]


class _Transport(Protocol):
    def send(self, data: bytes) -> None: ...
    def recv(self) -> bytes: ...
    def close(self) -> None: ...


class MessageStream:
    """Whole msgpack messages to and from a byte transport.

    A process forked from the one that opened the stream shares its socket: a message
    either sends goes to the same daemon session, and either may read the other's reply.
    So a stream refuses to be used from a child (BrokerUnavailable, which a Client answers
    by connecting again, from the child; closing it there closes only the child's copy)."""

    def __init__(self, transport: _Transport) -> None:
        self.forked = False  # set in a child process (os.register_at_fork below)
        _streams.add(self)
        self.transport = transport
        self._packer = msgpack.Packer()
        self._unpacker = msgpack.Unpacker(raw=False, **unpacker_limits())
        # Bytes fed to the unpacker: while its position (tell) is short of them, a message
        # may be there to take without reading; otherwise read first, rather than pay for a
        # StopIteration on every receive.
        self._fed = 0

    def send(self, message: dict[str, Any]) -> None:
        if self.forked:
            raise _forked()
        data = self._packer.pack(message)
        if len(data) > MAX_REQUEST:  # the daemon would cut the connection off mid-frame
            raise BadRequest(f"{message.get('op')}: the request packs to {len(data)} bytes, "
                             f"more than the {MAX_REQUEST} a daemon reads; send less at once")
        self.transport.send(data)

    def receive(self) -> Any:
        if self.forked:
            raise _forked()
        unpacker = self._unpacker
        while True:
            if unpacker.tell() < self._fed:
                try:
                    return next(unpacker)
                except StopIteration:
                    pass
                except Exception as exc:
                    raise ProtocolError(f"malformed frame from the daemon: {exc}") from None
            data = self.transport.recv()
            try:
                unpacker.feed(data)
            except msgpack.BufferFull:
                raise ProtocolError("the daemon sent a frame over the size limit") from None
            self._fed += len(data)

    def close(self) -> None:
        self.transport.close()


def _forked() -> BrokerUnavailable:
    return BrokerUnavailable("this connection was opened by the process this one forked from; "
                             "a forked process uses a connection of its own")


_streams: weakref.WeakSet[MessageStream] = weakref.WeakSet()


def _mark_forked() -> None:
    for stream in list(_streams):
        stream.forked = True


os.register_at_fork(after_in_child=_mark_forked)
