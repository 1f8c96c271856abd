"""The frame codec: every speaker of the wire turns bytes into messages, and messages into
bytes, here. No I/O (h11's shape): the caller reads and writes its socket (the client's
blocking transport, the daemon's and the read replicas' asyncio protocols, the TUI's
streams) and hands the bytes in and out.

In: :class:`FrameDecoder` takes the bytes one read brought and returns the whole messages
they complete, decoded by msgpack's streaming ``Unpacker`` under the limits of
:mod:`kvbroker._wire.protocol`; what it holds of an unfinished frame never exceeds its
``limit``. Then :func:`as_request` (the serving side: ``(id, op, args)``), :func:`is_push`,
and :func:`result_of` / :func:`error_of` (the asking side: a reply's result, or the typed
error it names).

Out: :class:`FrameEncoder` packs requests (refusing one over the daemon's request limit
before it is sent), replies, errors and pushes.

One error shape. A stream that cannot be read (a frame over the limit, bytes that are not
msgpack, a message that is not a map) raises :class:`FrameError`, a
:class:`~kvbroker.errors.ProtocolError`: the stream cannot resync, so the connection ends.
A request the serving side refuses is answered ``{"id", "ok": false, "error": {"code",
"message"}}`` (:meth:`FrameEncoder.error`), the code one of :data:`kvbroker.errors.ERROR_CLASSES`;
the asking side raises it as that class (:func:`error_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import msgpack

from ..errors import BadRequest, InternalError, KVBrokerError, ProtocolError, error_for_code
from .protocol import MAX_FRAME, MAX_REQUEST, unpacker_limits

__all__ = [
    "FrameDecoder",
    "FrameEncoder",
    "FrameError",
    "Request",
    "SharedUnpacker",
    "as_request",
    "error_of",
    "is_push",
    "result_of",
]


class FrameError(ProtocolError):
    """Bytes that cannot be read as the wire's messages: the stream cannot resync."""


class SharedUnpacker:
    """One ``Unpacker`` for the decoders of one thread between their frames (an ``Unpacker``
    costs ~40 KiB of parse stack): a decoder borrows it for the bytes of one read and keeps
    an ``Unpacker`` of its own only while a frame is unfinished. Only for decoders used from
    one thread (the daemon's event loop)."""

    __slots__ = ("fed", "limit", "unpacker")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.unpacker: msgpack.Unpacker | None = None
        self.fed = 0  # bytes fed to it: all of them parsed into whole messages

    def take(self) -> msgpack.Unpacker:
        if self.unpacker is None:
            self.unpacker, self.fed = _unpacker(self.limit), 0
        return self.unpacker


def _unpacker(limit: int) -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, **unpacker_limits(limit))


class FrameDecoder:
    """Whole messages from a byte stream, at most ``limit`` bytes of one unfinished frame
    held (msgpack's own buffer limit bounds only the bytes it has not parsed yet: a frame's
    bytes are counted here). ``sender`` names the other end in errors ("the daemon").
    ``shared``: borrow that :class:`SharedUnpacker` between frames."""

    __slots__ = ("_done", "_fed", "_own", "_shared", "limit", "sender")

    def __init__(
        self, limit: int = MAX_FRAME, *, sender: str = "", shared: SharedUnpacker | None = None
    ) -> None:
        if shared is not None and shared.limit != limit:
            raise ValueError("a shared unpacker serves decoders of its own limit")
        self.limit = limit
        self.sender = f" from {sender}" if sender else ""
        self._shared = shared
        self._own = None if shared is not None else _unpacker(limit)
        self._fed = self._done = 0  # bytes fed to its own unpacker; those of whole messages

    @property
    def buffered(self) -> int:
        """Bytes held of an unfinished frame (0 between frames)."""
        return self._fed - self._done

    def receive(self, data: bytes | memoryview) -> list[Any]:
        """The messages ``data`` completes, in order (maybe none). :class:`FrameError` when
        the stream cannot be read: it ends there, the decoder is not to be used again."""
        u = self._own
        if u is None:  # borrowed: it holds nothing between reads
            return self._receive_shared(data)
        fed = self._fed + len(data)
        try:
            u.feed(data)
        except msgpack.BufferFull:
            raise self._too_big() from None
        done = self._done
        out = []
        try:
            while done < fed:  # (all parsed: no StopIteration to pay for)
                out.append(next(u))
                done = u.tell()  # (after a partial frame, tell() counts its bytes too)
        except StopIteration:
            pass
        except Exception as exc:  # noqa: BLE001 (any decoding failure: the stream cannot resync)
            raise self._malformed(exc) from None
        if fed - done > self.limit:
            raise self._too_big()
        if done == fed and self._shared is not None:
            self._own = None  # back to the shared one
            self._fed = self._done = 0
        else:
            self._fed, self._done = fed, done
        return out

    def _receive_shared(self, data: bytes | memoryview) -> list[Any]:
        shared = self._shared
        u = shared.take()
        done = shared.fed
        fed = done + len(data)
        try:
            u.feed(data)
        except msgpack.BufferFull:  # (an empty unpacker: only a read over the limit)
            shared.unpacker = None
            raise self._too_big() from None
        out = []
        try:
            while done < fed:
                out.append(next(u))
                done = u.tell()
        except StopIteration:
            pass
        except Exception as exc:  # noqa: BLE001 (any decoding failure: the stream cannot resync)
            shared.unpacker = None
            raise self._malformed(exc) from None
        left = fed - done
        if left > self.limit:
            shared.unpacker = None
            raise self._too_big()
        shared.fed = fed
        if left:  # a frame continues in the next read: an unpacker of its own for it
            shared.unpacker = None
            self._own = own = _unpacker(self.limit)
            own.feed(data[len(data) - left :])
            self._fed, self._done = left, 0
        return out

    def _malformed(self, exc: Exception) -> FrameError:
        return FrameError(f"malformed frame{self.sender}: {type(exc).__name__}: {exc}")

    def _too_big(self) -> FrameError:
        return FrameError(f"a frame{self.sender} exceeds the size limit ({self.limit} bytes)")


class Request(NamedTuple):
    id: int
    op: str
    args: Any  # checked against the op's row by validate_args


def as_request(msg: Any) -> Request:
    """A decoded message as a request; :class:`~kvbroker.errors.BadRequest` when it is not
    one (answer it with :func:`answer_id`'s id)."""
    if msg.__class__ is not dict:
        raise BadRequest("a request must be a map with id, op and args")
    rid, op = msg.get("id"), msg.get("op")
    if rid.__class__ is not int or op.__class__ is not str:
        raise BadRequest("a request needs an integer id and a string op")
    return Request(rid, op, msg.get("args"))


def answer_id(msg: Any) -> int | None:
    """The id to answer a message with: its own when it has an integer one."""
    rid = msg.get("id") if msg.__class__ is dict else None
    return rid if rid.__class__ is int else None


def is_push(msg: Any) -> bool:
    """Whether a message from the daemon is a push (``watch``), not a reply."""
    return msg.__class__ is dict and "push" in msg


def error_of(msg: dict) -> KVBrokerError:
    """The typed error a failed reply names."""
    err = msg.get("error")
    if err.__class__ is not dict:
        err = {}
    return error_for_code(str(err.get("code", "error")), str(err.get("message", "")))


def result_of(msg: dict) -> Any:
    """A reply's result, or the error it names raised."""
    if msg.get("ok"):
        return msg.get("result")
    raise error_of(msg)


class FrameEncoder:
    """Messages to bytes, with one reused msgpack ``Packer`` (one that fails resets itself,
    so a message that cannot be packed leaves nothing behind for the next).
    ``on_unpackable(exc)``: told when a reply could not be packed and an internal error was
    packed in its place (the serving side logs it)."""

    __slots__ = ("_pack", "on_unpackable")

    def __init__(self, on_unpackable: Callable[[Exception], None] | None = None) -> None:
        self._pack = msgpack.Packer().pack
        self.on_unpackable = on_unpackable

    def request(self, rid: int, op: str, args: Any) -> bytes:
        """A request; :class:`~kvbroker.errors.BadRequest` when it packs to more than a
        daemon reads (it would cut the connection off mid-frame)."""
        return self.request_map({"id": rid, "op": op, "args": args})

    def request_map(self, request: dict[str, Any]) -> bytes:
        """:meth:`request` of a request map built already (``{"id", "op", "args"}``)."""
        data = self._pack(request)
        if len(data) > MAX_REQUEST:
            raise BadRequest(
                f"{request.get('op')}: the request packs to {len(data)} bytes, more than the "
                f"{MAX_REQUEST} a daemon reads; send less at once"
            )
        return data

    def reply(self, rid: int | None, result: Any) -> bytes:
        """A successful reply; one whose result cannot be packed is answered with an
        internal error instead (never a connection closed for one value)."""
        try:
            return self._pack({"id": rid, "ok": True, "result": result})
        except (ValueError, TypeError, OverflowError) as exc:
            if self.on_unpackable is not None:
                self.on_unpackable(exc)
            return self.error(rid, InternalError.code, f"the reply cannot be sent: {exc}")

    def error(self, rid: int | None, code: str, message: str) -> bytes:
        """A failed reply (``rid`` None: about the connection, not one request)."""
        return self._pack({"id": rid, "ok": False, "error": {"code": code, "message": message}})

    def refusal(self, rid: int | None, exc: KVBrokerError) -> bytes:
        """A failed reply saying ``exc``."""
        return self.error(rid, exc.code, exc.message or str(exc))

    def push(self, kind: str, result: Any) -> bytes:
        """An unasked message (``{"push": kind, "result": ...}``: a ``watch`` snapshot)."""
        return self._pack({"push": kind, "result": result})
