"""A client's stream: who is at the other end (``SO_PEERCRED``), and its requests out of
the bytes, through msgpack's streaming ``Unpacker`` under the protocol's hard limits
(:mod:`kvbroker._wire.protocol`).

One :class:`Framer` per client connection, in the daemon (:mod:`kvbroker._server.connection`)
or in an I/O worker (:mod:`kvbroker._server.relay`). An ``Unpacker`` costs ~40 KiB (its parse
stack), so the framers of one process share one, and only a framer whose last read ended
mid-frame keeps its own until that frame is complete: an idle or waiting client costs no
parser.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack

from .._wire.protocol import MAX_REQUEST, unpacker_limits

__all__ = ["FrameError", "Framer", "peer_credentials"]

_SO_PEERCRED_FMT = "3i"


class FrameError(Exception):
    """The stream cannot be read on (a frame over the limits, or malformed): the message
    says why; the connection must close."""


def _fresh() -> msgpack.Unpacker:
    return msgpack.Unpacker(raw=False, **unpacker_limits(MAX_REQUEST))


class Framer:
    """Whole requests from the bytes of each read, in order."""

    __slots__ = ("_done", "_fed", "_own")

    # The process's shared parser, empty between reads, and the bytes fed into it so far.
    _shared: msgpack.Unpacker | None = None
    _shared_fed = 0

    def __init__(self) -> None:
        self._own: msgpack.Unpacker | None = None  # only while a frame is partly read
        self._fed = self._done = 0

    @property
    def mid_frame(self) -> bool:
        """Whether a frame is partly read (closing now would cut it)."""
        return self._own is not None

    def feed(self, data: memoryview) -> list[Any]:
        """The requests ``data`` completes; raises :class:`FrameError`."""
        nbytes = len(data)
        u = self._own
        cls = Framer
        if u is None:
            u = cls._shared
            if u is None:
                u = cls._shared = _fresh()
                cls._shared_fed = 0
            done = cls._shared_fed  # where its last complete frame ended
            cls._shared_fed += nbytes
            fed = cls._shared_fed
        else:
            done = self._done
            self._fed += nbytes
            fed = self._fed
        try:
            u.feed(data)
        except msgpack.BufferFull:
            raise FrameError("frame exceeds the size limit") from None
        msgs = []
        while True:
            try:
                msg = next(u)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001 -- any decoding failure: no resync
                if u is cls._shared:
                    cls._shared = None
                raise FrameError(f"malformed frame: {type(exc).__name__}: {exc}") from None
            done = u.tell()  # (after a partial frame, tell() counts its bytes too)
            msgs.append(msg)
        left = fed - done
        if u is cls._shared:
            if left:  # a frame continues in the next read: this connection's own parser
                cls._shared = None
                self._own = own = _fresh()
                own.feed(data[nbytes - left:])
                self._fed, self._done = left, 0
        elif not left:
            self._own = None
        else:
            self._done = done
        return msgs


def peer_credentials(sock: socket.socket | None) -> tuple[int, int, int]:
    """(pid, uid, gid) of a Unix socket's peer, from SO_PEERCRED; -1s when unknown."""
    try:
        raw = sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_SO_PEERCRED_FMT)
        )
    except (OSError, AttributeError):
        return -1, -1, -1
    pid, uid, gid = struct.unpack(_SO_PEERCRED_FMT, raw)
    return pid, uid, gid
