"""The peer channel's operations: what one broker may ask another (issue 18; hardened in
issue 38), declared once, as :data:`~kvbroker._wire.protocol.OPS` declares the local ones.

The channel is mutual TLS (:mod:`kvbroker._server.transfer`); over it a request is
``{"op": str, "args": {...}}`` and a reply ``{"ok": true, ...}`` or ``{"error": code,
"message": str}``, one length-prefixed msgpack frame each. :func:`validate_peer_args` checks
a request's arguments against :data:`PEER_OPS` with the same function the local ops use
(:func:`~kvbroker._wire.protocol.check_args`); the serving broker then applies the local
ops' value checks (names of 1 to ``MAX_NAME`` characters, at most ``MAX_BUFFERS`` keys)
through the same helpers its handlers call; a TTL's range is the rule declared on it
(:data:`~kvbroker._wire.rules.LEASE_TTL`, as on the local ops).
"""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from .rules import LEASE_TTL, Arg, check_args

__all__ = ["PEER_OPS", "PEER_PROTOCOL", "validate_peer_args"]

PEER_PROTOCOL = "kvbroker-peer/2"  # /1 was the shared-token (HMAC) channel


def _a(*types: type, required: bool = False, default: Any = None) -> Arg:
    return Arg(tuple(types), required, default)


_NAMESPACE = _a(str, default="default")
_TTL = Arg((int, float), required=True, rule=LEASE_TTL)

PEER_OPS: dict[str, dict[str, Arg]] = {
    # The first frame each side sends after the TLS handshake: who it says it is (the
    # certificate says who it is; this names it in logs and stat).
    "hello": {"proto": _a(str, required=True), "node": _a(str, default="")},
    # A read lease held for the asking broker, and the object's description in the reply.
    "pin": {
        "namespace": _NAMESPACE,
        "key": _a(str, required=True),
        "ttl": _TTL,
        "consume": _a(bool, default=False),
    },
    # The leading run of ``keys`` held here, one lease for all of them.
    "pin_prefix": {"namespace": _NAMESPACE, "keys": _a(list, required=True), "ttl": _TTL},
    "lookup": {"namespace": _NAMESPACE, "key": _a(str, required=True)},
    "release": {"lease": _a(int, required=True), "consumed": _a(bool, default=False)},
    "renew": {"lease": _a(int, required=True), "ttl": _TTL},
}


def validate_peer_args(op: Any, raw: Any, limits: Any) -> dict[str, Any]:
    """A peer request's arguments checked against :data:`PEER_OPS` (types, and rules with
    the serving side's ``limits``: its ``max_lease_ttl``; defaults filled in);
    :class:`~kvbroker.errors.BadRequest` for an unknown op or a bad argument."""
    declared = PEER_OPS.get(op) if isinstance(op, str) else None
    if declared is None or op == "hello":
        raise BadRequest(f"unknown peer op {op!r}")
    return check_args(f"peer {op}", declared, raw, limits)
