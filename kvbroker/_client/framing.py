"""Framing: messages over a transport, through the wire's one codec
(:mod:`kvbroker._wire.frames`)."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from .._wire.frames import FrameDecoder, FrameEncoder
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

    def __init__(self, transport: _Transport, *, sender: str = "the daemon") -> None:
        self.transport = transport
        self._encoder = FrameEncoder()
        self._decoder = FrameDecoder(sender=sender)
        self._read: deque[Any] = deque()  # messages one read brought beyond the first

    def send(self, message: dict[str, Any]) -> None:
        # (a forked transport refuses to send it; one too large for a daemon: BadRequest)
        self.transport.send(self._encoder.request_map(message))

    def receive(self) -> Any:
        if getattr(self.transport, "forked", False):
            raise forked_error()
        if self._read:
            return self._read.popleft()
        while True:
            messages = self._decoder.receive(self.transport.recv())
            if messages:
                if len(messages) > 1:
                    self._read.extend(messages[1:])
                return messages[0]

    def close(self) -> None:
        self.transport.close()
