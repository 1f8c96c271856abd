"""The handlers of the sessions' ops (``sessions``, ``retain``, ``unretain``) and the
``retain`` argument of ``reserve_blocks`` and ``match_prefix``.

Each checks what the request asks and makes one call on the broker's
:class:`~kvbroker._server.retention.Retention`. A session is scoped by its namespace: one the
caller may not read is invisible (``sessions`` leaves it out, ``retain`` and ``unretain``
answer not_found, as for a name that does not exist); changing one needs write access.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .._wire import replies as R
from ..errors import BadRequest, NotFound
from .retention import MAX_PRIORITY, Retained

if TYPE_CHECKING:
    from .broker import Broker
    from .state import Session

__all__ = ["op_retain", "op_sessions", "op_unretain", "session_of_request"]

_MAX_LISTED = 1000


def session_of_request(b: Broker, session: Session, namespace: str, retain: dict | None,
                       op: str) -> Retained | None:  # fmt: skip
    """The session a request's ``retain`` names, renewed (created for the caller's uid
    when new); None without one. Retaining changes eviction: it needs write access."""
    if retain is None:
        return None
    name, for_, priority = b.retention.check_request(retain)
    session.access.check(namespace, True, f"{op} with retain")
    return b.retention.renew(namespace, name, session.uid, for_, priority)


def op_sessions(b: Broker, session: Session, namespace: str | None,
                limit: int | None) -> R.Sessions:  # fmt: skip
    if limit is not None and limit < 1:
        raise BadRequest("sessions: limit must be at least 1")
    rows, truncated = b.retention.listing(session.access.can, namespace,
                                          min(limit or _MAX_LISTED, _MAX_LISTED))  # fmt: skip
    stats = b.retention.statistics(top=0)
    return {"sessions": [r.to_dict() for r in rows], "truncated": truncated,
            "retained_bytes": list(stats.retained_bytes),
            "retained_cap": list(stats.retained_cap)}  # fmt: skip


def op_retain(b: Broker, session: Session, name: str, seconds: float,
              namespace: str | None, priority: int | None) -> dict[str, Any]:  # fmt: skip
    if isinstance(seconds, bool) or not 0 < seconds < math.inf:
        raise BadRequest("retain: seconds must be more than 0")
    if priority is not None and not 0 <= priority <= MAX_PRIORITY:
        raise BadRequest(f"retain: priority must be from 0 to {MAX_PRIORITY}")
    entry = _find(b, session, namespace, name, "retain")
    entry = b.retention.renew(entry.namespace, entry.name, entry.uid, seconds, priority,
                              exactly=True)  # fmt: skip
    return entry.info(b.retention.clock()).to_dict()


def op_unretain(b: Broker, session: Session, name: str, namespace: str | None) -> dict[str, Any]:
    entry = _find(b, session, namespace, name, "unretain")
    info = entry.info(b.retention.clock()).to_dict()
    b.retention.release(entry)
    return info


def _find(b: Broker, session: Session, namespace: str | None, name: str, op: str) -> Retained:
    entry = b.retention.find(namespace, name, session.access.can)
    if entry is None:
        where = f" in namespace {namespace!r}" if namespace is not None else ""
        raise NotFound(f"{op}: no session {name!r}{where} (kvbroker sessions lists them)")
    session.access.check(entry.namespace, True, op)
    return entry
