"""Framing: msgpack maps over a transport, decoded by a streaming Unpacker under limits."""

from __future__ import annotations

from typing import Any, Protocol

import msgpack

from .._wire.protocol import MAX_REQUEST, unpacker_limits
from ..errors import BadRequest, ProtocolError
from .transport import forked_error

__all__ = ["MessageStream"]


class _Transport(Protocol):
    def send(self, data: bytes) -> None: ...
    def recv(self) -> bytes: ...
    def close(self) -> None: ...


class MessageStream:
    """Whole msgpack messages to and from a byte transport.

    A process forked from the one that opened the stream shares its socket: a message
    either sends goes to the same daemon session, and either may read the other's reply
    (one already read into this stream's buffer, too). So a stream whose transport was
    forked (``transport.forked``, :mod:`kvbroker._client.transport`) refuses to be used
    (BrokerUnavailable, which a Client answers by connecting again, from the child; closing
    it there closes only the child's copy)."""

    def __init__(self, transport: _Transport) -> None:
        self.transport = transport
        self._packer = msgpack.Packer()
        self._unpacker = msgpack.Unpacker(raw=False, **unpacker_limits())
        # Bytes fed to the unpacker: while its position (tell) is short of them, a message
        # may be there to take without reading; otherwise read first, rather than pay for a
        # StopIteration on every receive.
        self._fed = 0

    def send(self, message: dict[str, Any]) -> None:
        data = self._packer.pack(message)  # (a forked transport refuses to send it)
        if len(data) > MAX_REQUEST:  # the daemon would cut the connection off mid-frame
            raise BadRequest(f"{message.get('op')}: the request packs to {len(data)} bytes, "
                             f"more than the {MAX_REQUEST} a daemon reads; send less at once")
        self.transport.send(data)

    def receive(self) -> Any:
        if getattr(self.transport, "forked", False):
            raise forked_error()
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
