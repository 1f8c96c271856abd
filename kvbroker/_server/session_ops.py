"""The handlers of the sessions' ops (``sessions``, ``retain``, ``unretain``) and the
``retain`` argument of ``reserve_blocks`` and ``match_prefix``.

:class:`SessionOps` holds them: each checks what the request asks and makes one call on the
:class:`~kvbroker._server.retention.Retention`. A session is scoped by its namespace: one the
caller may not read is invisible (``sessions`` leaves it out, ``retain`` and ``unretain``
answer not_found, as for a name that does not exist); changing one needs write access, and
to be its uid or an admin. A request's ``retain`` may name only a session of the caller's uid
(or a new one).
"""

from __future__ import annotations

import math
from typing import Any

from .._wire import replies as R
from ..errors import BadRequest, Forbidden, NotFound
from .retention import Retained, Retention
from .state import Session

__all__ = ["SessionOps"]

_MAX_LISTED = 1000


class SessionOps:
    """The sessions' op handlers, over the broker's retention."""

    def __init__(self, retention: Retention) -> None:
        self.retention = retention

    def session_of_request(
        self, session: Session, namespace: str, retain: dict | None, op: str
    ) -> Retained | None:
        """The session a request's ``retain`` names, renewed (created for the caller's uid
        when new); None without one. Retaining changes eviction: it needs write access."""
        if retain is None:
            return None
        name, for_, priority = self.retention.request(retain)
        session.access.check(namespace, True, f"{op} with retain")
        entry = self.retention.sessions.get((namespace, name))
        if entry is not None and entry.uid != session.uid:
            # What a session retains counts against its owner's tenant_quota: another uid
            # naming it would spend that quota (shedding the owner's own retention) and
            # escape its own. A shared namespace shares names, not quotas.
            raise Forbidden(
                f"{op}: session {name!r} in namespace {namespace!r} belongs to uid "
                f"{entry.uid}; name a session of your own"
            )
        return self.retention.renew(namespace, name, session.uid, for_, priority)

    def op_sessions(self, session: Session, namespace: str | None, limit: int | None) -> R.Sessions:
        if limit is not None and limit < 1:
            raise BadRequest("sessions: limit must be at least 1")
        most = min(limit or _MAX_LISTED, _MAX_LISTED)
        rows, truncated = self.retention.listing(session.access.can, namespace, most)
        stats = self.retention.statistics(top=0)
        return {
            "sessions": [r.to_dict() for r in rows],
            "truncated": truncated,
            "retained_bytes": list(stats.retained_bytes),
            "retained_cap": list(stats.retained_cap),
        }

    def op_retain(
        self,
        session: Session,
        name: str,
        seconds: float,
        namespace: str | None,
        priority: int | None,
    ) -> dict[str, Any]:
        if isinstance(seconds, bool) or not 0 < seconds < math.inf:
            raise BadRequest("retain: seconds must be more than 0")
        entry = self._find(session, namespace, name, "retain")
        entry = self.retention.renew(
            entry.namespace, entry.name, entry.uid, seconds, priority, exactly=True
        )
        return entry.info(self.retention.clock()).to_dict()

    def op_unretain(self, session: Session, name: str, namespace: str | None) -> dict[str, Any]:
        entry = self._find(session, namespace, name, "unretain")
        info = entry.info(self.retention.clock()).to_dict()
        self.retention.release(entry)
        return info

    def _find(self, session: Session, namespace: str | None, name: str, op: str) -> Retained:
        entry = self.retention.find(namespace, name, session.access.can)
        if entry is None:
            where = f" in namespace {namespace!r}" if namespace is not None else ""
            raise NotFound(f"{op}: no session {name!r}{where} (kvbroker sessions lists them)")
        session.access.check(entry.namespace, True, op)
        if entry.uid != session.uid and not session.access.admin:
            # Write access to a namespace several uids write shares its names, not their
            # sessions: another tenant would end one's conversation (its blocks to the
            # oldest end of the LRU) or reorder it against everyone's. Operators may.
            raise Forbidden(
                f"{op}: session {entry.name!r} in namespace {entry.namespace!r} belongs to "
                f"uid {entry.uid}; only it or an admin ([isolation] admins) may change it"
            )
        return entry
