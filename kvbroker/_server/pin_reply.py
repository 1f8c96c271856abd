"""What a peer broker's pin reply may describe (issue 38): :class:`Described`, one object of
the reply, checked by the pulling daemon (:mod:`kvbroker._server.fleet`) before it reserves
anything, as a local seal of the object would be checked; and :func:`looked_up`, a lookup's
answer, checked before the client is given it. The reply is authenticated (mutual
TLS), but its owner is another machine: a compromised peer must not make this daemon seal
what it did not ask for, read elsewhere than the object, or keep what no local op accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._wire import checksum
from .checks import buffer_layout, check_name, consumers_problem, parent_problem, tokens_problem

__all__ = ["Described", "looked_up"]


@dataclass(frozen=True)
class Described:
    """One object of a peer's pin reply, checked as a local seal of it would be: its key
    and buffer names and sizes (``checks.buffer_layout``, as ``reserve``), meta, checksums (well
    formed, one per buffer, as ``seal``), consumers, prefix parent and token ids (as
    ``reserve_blocks``), and extents that lie in the owner's pool exactly as its buffers
    do in one object (so a reply cannot send us reading elsewhere)."""

    namespace: str
    key: str
    layout: dict[str, tuple[int, int]]
    span: int
    meta: dict | None
    extents: list[tuple[int, int]]
    checksums: dict | None
    consumers: int
    parent: str | None
    tokens: list[int] | None

    @classmethod
    def check(cls, desc: Any, namespace: str, require_checksums: bool) -> Described:
        if not isinstance(desc, dict):
            raise ValueError("an object must be a map")
        if desc.get("namespace") != namespace:
            raise ValueError("an object of another namespace")
        key = desc.get("key")
        if not isinstance(key, str):
            raise ValueError("its key must be a string")
        check_name("key", key)
        bufs, meta = desc.get("buffers"), desc.get("meta")
        if not isinstance(bufs, dict) or (meta is not None and not isinstance(meta, dict)):
            raise ValueError("buffers and meta must be maps")
        placed = {}
        for name, v in bufs.items():
            if not (
                isinstance(v, list)
                and len(v) == 2
                and all(x.__class__ is int and 0 <= x < 1 << 62 for x in v)
            ):
                raise ValueError(f"buffer {str(name)[:80]!r} must be [offset, size]")
            placed[name] = (v[0], v[1])
        layout, span = buffer_layout({n: size for n, (_, size) in placed.items()}, meta)
        end = 0
        for off, size in sorted(placed.values()):
            if off < end:
                raise ValueError("its buffers overlap")
            end = off + size
        total = sum(n for _, n in placed.values())
        if desc.get("nbytes", total) != total:
            raise ValueError("nbytes is not the sum of its buffers")
        # One extent per non-empty buffer, in the buffers' order, each at the buffer's own
        # offset from one base: nothing else of the owner's pool is read.
        want = [(off, size) for off, size in placed.values() if size]
        extents = desc.get("extents")
        if not isinstance(extents, list) or len(extents) != len(want):
            raise ValueError("its extents do not match its buffers")
        bases, remote = set(), []
        for e, (off, size) in zip(extents, want, strict=True):
            if not (
                isinstance(e, list)
                and len(e) == 2
                and e[0].__class__ is int
                and e[1].__class__ is int
                and e[1] == size
                and off <= e[0] < 1 << 64
            ):
                raise ValueError("its extents do not match its buffers")
            bases.add(e[0] - off)
            remote.append((e[0], size))
        if len(bases) > 1:
            raise ValueError("its extents do not lie as its buffers do")
        sums = desc.get("checksums")
        if sums is not None:
            sums = checksum.validate(sums, layout)  # as a seal here: every buffer, well formed
        elif require_checksums:
            raise ValueError(
                "it has no checksums, and this daemon requires a checksum per "
                "buffer (require_checksums)"
            )
        consumers, parent, tokens = (
            desc.get("consumers", 1),
            desc.get("parent"),
            desc.get("tokens"),
        )
        problem = consumers_problem(consumers) or parent_problem(parent) or tokens_problem(tokens)
        if problem is not None:
            raise ValueError(problem)
        return cls(namespace, key, layout, span, meta, remote, sums, consumers, parent, tokens)


# The fields of a peer's lookup answer (ObjectInfo's) and the types each must have.
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "namespace": (str,),
    "key": (str,),
    "nbytes": (int,),
    "buffers": (int,),
    "pool": (int,),
    "readers": (int,),
    "created_at": (int, float),
    "last_access": (int, float),
    "meta": (dict, type(None)),
    "checksums": (dict, type(None)),
    "buffer_sizes": (dict, type(None)),
    "consumers": (int, type(None)),
}


def looked_up(info: Any, namespace: str, key: str) -> dict | None:
    """A peer's answer to ``lookup`` of ``namespace/key``, as the client may be given it:
    None, or the :class:`~kvbroker._wire.stats.ObjectInfo` fields of that very object with
    their types, every required one present (ValueError otherwise; nothing else of the
    reply is passed on)."""
    if info is None:
        return None
    if not isinstance(info, dict):
        raise ValueError("not a map")
    if info.get("namespace") != namespace or info.get("key") != key:
        raise ValueError("it describes another object than the one asked")
    out = {}
    for name, types in _INFO_TYPES.items():
        value = info.get(name)
        if value.__class__ is bool or not isinstance(value, types):
            if name in ("meta", "checksums", "buffer_sizes", "consumers") and name not in info:
                continue
            raise ValueError(f"its {name} is not a {' or '.join(t.__name__ for t in types)}")
        out[name] = value
    return out
