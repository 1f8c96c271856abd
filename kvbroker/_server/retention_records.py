"""The sessions' journal records: what :mod:`kvbroker._server.retention` writes into the
journal (:mod:`kvbroker._server.journal` says how each is replayed) and the check a restart
makes of one before believing it.

- ``named_record``: ``{"t": "r", ns, n, u, p, x, c, a}``, a session named or renewed (owner uid,
  priority, wall-clock expiry, creation) and the serials it retains from now on;
- ``shed_record``: ``{"t": "d", ns, n, a}``, serials a bound (tenant quota, pool share) took from
  it;
- ``ended_record``: ``{"t": "R", ns, n}``, released or expired.
"""

from __future__ import annotations

import math
from typing import Any

from .._wire.protocol import MAX_NAME, MAX_PRIORITY

__all__ = ["named_record", "shed_record", "ended_record", "restorable"]


def named_record(entry: Any, serials: list[int]) -> dict[str, Any]:
    """``entry``: a :class:`~kvbroker._server.retention.Retained` (as for the others)."""
    return {
        "t": "r",
        "ns": entry.namespace,
        "n": entry.name,
        "u": entry.uid,
        "p": entry.priority,
        "x": entry.expires_at,
        "c": entry.created_at,
        "a": serials,
    }


def shed_record(entry: Any, serials: list[int]) -> dict[str, Any]:
    return {"t": "d", "ns": entry.namespace, "n": entry.name, "a": serials}


def ended_record(entry: Any) -> dict[str, Any]:
    return {"t": "R", "ns": entry.namespace, "n": entry.name}


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def restorable(rec: Any) -> tuple[str, str, int, float, int, float | None, set[int]] | None:
    """A journal's session record as (namespace, name, uid, expiry, priority, created,
    serials), or None when it is malformed. Checked whole before anything is restored: a
    NaN expiry would never end and would disorder every other session's in the expiry heap;
    one bad record must neither stop the warm restart of every tenant's objects nor leave a
    session half made."""
    if not isinstance(rec, dict):
        return None
    ns, name, uid = rec.get("ns"), rec.get("n"), rec.get("u")
    expires, prio, created = rec.get("x"), rec.get("p", 0), rec.get("c")
    serials = rec.get("a", ())
    if not (isinstance(ns, str) and isinstance(name, str) and 0 < len(name) <= MAX_NAME):
        return None
    if isinstance(uid, bool) or not isinstance(uid, int) or not 0 <= uid < 2**32:
        return None
    if not _finite(expires) or not (created is None or _finite(created)):
        return None
    if isinstance(prio, bool) or not isinstance(prio, int) or not 0 <= prio <= MAX_PRIORITY:
        return None
    if not isinstance(serials, (list, tuple)):
        return None
    return (
        ns,
        name,
        uid,
        float(expires),
        prio,
        None if created is None else float(created),
        {s for s in serials if isinstance(s, int) and not isinstance(s, bool)},
    )
