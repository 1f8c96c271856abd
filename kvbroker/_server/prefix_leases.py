"""Prefix matches: the run of leading blocks a request names, and the read lease over it.

A match of N blocks is one read lease over all of them (see the ownership contract in
:mod:`kvbroker._server.state`). It runs once per request for hundreds of blocks, so the
per-block work is done by C loops (``map`` over the namespace's dict, ``list.index``) rather
than Python statements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .broker import Broker
    from .state import StoredObject

__all__ = ["matched_run"]


def matched_run(b: Broker, namespace: str, keys: list[Any]) -> list[StoredObject]:
    """The sealed objects of the leading ``keys`` of ``namespace`` up to the first one that
    is not published (a key that is not a string never is)."""
    space = b.by_namespace.get(namespace)
    if not space or not keys:
        return []
    try:
        found = list(map(space.get, keys))  # a hashable non-string key gets None: a miss
    except TypeError:  # an unhashable key (a list, a map): the run ends before it
        found = [space.get(k) if k.__class__ is str else None for k in keys]
    try:
        del found[found.index(None):]
    except ValueError:
        pass  # every key matched
    return found
