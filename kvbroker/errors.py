"""The exceptions kvbroker raises, one flat hierarchy.

Every error the daemon reports travels as a ``code`` string plus a message; the client turns
the code back into the class below with the same ``code``. Catch :class:`KVBrokerError` for
all of them.
"""

from __future__ import annotations

__all__ = [
    "KVBrokerError",
    "BadRequest",
    "ProtocolError",
    "NotFound",
    "Exists",
    "Incomplete",
    "PoolFull",
    "LeaseExpired",
    "Timeout",
    "Forbidden",
    "QuotaExceeded",
    "LimitExceeded",
    "ChecksumMismatch",
    "LayoutMismatch",
    "BrokerUnavailable",
    "PeerUnavailable",
    "TransferFailed",
    "InternalError",
    "error_for_code",
]


class KVBrokerError(Exception):
    """Base class of every kvbroker error."""

    code = "error"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(KVBrokerError):
    """The request was understood but its arguments are invalid (wrong type, bad name...)."""

    code = "bad_request"


class ProtocolError(KVBrokerError):
    """The peer broke the wire protocol: malformed or oversized frame, version mismatch."""

    code = "protocol"


class NotFound(KVBrokerError):
    """No sealed object under that namespace and key."""

    code = "not_found"


class Exists(KVBrokerError):
    """The key is already published (or being published) and replace was not asked for."""

    code = "exists"


class Incomplete(KVBrokerError):
    """A sharded request is not complete yet: not every prefill shard has been sealed."""

    code = "incomplete"


class PoolFull(KVBrokerError):
    """The reservation does not fit, even after evicting every unleased object."""

    code = "pool_full"


class LeaseExpired(KVBrokerError):
    """The lease ended (TTL, eviction of its object, fencing): the holder must stop using it.

    Data read through an expired read lease may have been overwritten by the next owner.
    """

    code = "lease_expired"


class Timeout(KVBrokerError):
    """A bounded wait ended without the awaited event (e.g. a claim with ``wait=``)."""

    code = "timeout"


class Forbidden(KVBrokerError):
    """The peer's credentials do not allow this operation on this namespace."""

    code = "forbidden"


class QuotaExceeded(KVBrokerError):
    """A reservation would take a namespace past its byte quota (the message says how far),
    even after evicting that namespace's own unleased objects."""

    code = "quota_exceeded"


class LimitExceeded(KVBrokerError):
    """A per-daemon or per-connection limit was hit: connections, leases per client.

    The message names the limit and its configuration key."""

    code = "limit_exceeded"


class ChecksumMismatch(KVBrokerError):
    """The bytes of a buffer no longer match the checksum recorded when it was sealed.

    Raised by the client (``claim(..., verify=True)``, ``get(..., verify=True)``); the data is
    never served. ``buffers`` names the buffers that failed.
    """

    code = "checksum_mismatch"

    def __init__(
        self, message: str = "", *, code: str | None = None, buffers: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message, code=code)
        self.buffers = tuple(buffers)


class LayoutMismatch(KVBrokerError):
    """The claimer's KV layout is incompatible with the published one (dtype, heads, ...)."""

    code = "layout_mismatch"


class BrokerUnavailable(KVBrokerError):
    """No daemon answers on the socket (it names the path that was tried)."""

    code = "unavailable"


class PeerUnavailable(KVBrokerError):
    """A peer broker (``peer="A:PORT"``) is down, unreachable, refused us (token, address),
    or died mid-transfer. The message names the peer. Nothing of the object was sealed."""

    code = "peer_unavailable"


class TransferFailed(KVBrokerError):
    """A pull from a peer broker failed after it started: the NIXL READ ended in error or
    did not finish in time, or the peer's lease had ended before the copy was released (its
    pages may have been reused). The message names the peer. Nothing was sealed."""

    code = "transfer_failed"


class InternalError(KVBrokerError):
    """A bug in the daemon; the request failed but the daemon and other clients carry on."""

    code = "internal"


# Every error that travels by code, once: the wire's ``ERROR_CODES`` derive from this, and
# ``error_for_code`` turns a received code back into its class.
ERROR_CLASSES: tuple[type[KVBrokerError], ...] = (
    BadRequest,
    ProtocolError,
    NotFound,
    Exists,
    Incomplete,
    PoolFull,
    LeaseExpired,
    Timeout,
    Forbidden,
    QuotaExceeded,
    LimitExceeded,
    ChecksumMismatch,
    LayoutMismatch,
    BrokerUnavailable,
    PeerUnavailable,
    TransferFailed,
    InternalError,
)
_BY_CODE: dict[str, type[KVBrokerError]] = {cls.code: cls for cls in ERROR_CLASSES}


def error_for_code(code: str, message: str) -> KVBrokerError:
    """The exception instance for an error code received from the daemon."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return KVBrokerError(message, code=code)
    return cls(message)
