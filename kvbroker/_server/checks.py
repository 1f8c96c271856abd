"""The checks of a request's arguments that the op table cannot declare: names, buffer
layouts, consumer counts, a prefix block's parent and token ids, checksums.

Each raises :class:`~kvbroker.errors.BadRequest` (or says what is wrong, ``*_problem``) and
changes nothing: the handlers (:mod:`kvbroker._server.handlers`), the pulls from peers
(:mod:`kvbroker._server.pin_reply`) and the fleet call them before any transition.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._wire import checksum as _checksum
from .._wire.names import check_buffer_name
from .._wire.objects import buffer_offsets
from .._wire.protocol import MAX_BUFFERS, MAX_NAME, meta_problem
from ..errors import BadRequest
from .state import Lease, Session, StoredObject, names_footprint, value_footprint

if TYPE_CHECKING:
    from .leases import LeaseTable

__all__ = [
    "MAX_TOKENS",
    "block_plans",
    "buffer_layout",
    "check_name",
    "checked_checksums",
    "consumers_problem",
    "extents",
    "leases_named",
    "parent_problem",
    "tokens_problem",
]

MAX_TOKENS = 1 << 16  # token ids of one prefix block


def check_name(what: str, value: str) -> str:
    if not value:
        raise BadRequest(f"{what} must not be empty")
    if len(value) > MAX_NAME:
        raise BadRequest(f"{what} longer than {MAX_NAME} characters")
    return value


def buffer_layout(buffers: dict, meta: dict | None) -> tuple[dict[str, tuple[int, int]], int]:
    """Offsets of the named buffers inside one extent (aligned), and the extent's span."""
    if not buffers:
        raise BadRequest("reserve: an object needs at least one buffer")
    if len(buffers) > MAX_BUFFERS:
        raise BadRequest(f"reserve: at most {MAX_BUFFERS} buffers per object")
    problem = meta_problem(meta)
    if problem is not None:
        raise BadRequest(f"reserve: {problem}")
    for name, nbytes in buffers.items():
        if not isinstance(name, str):
            raise BadRequest("reserve: buffer names must be strings")
        check_name("buffer name", name)
        check_buffer_name(name)  # malformed KV names would never match a claim
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise BadRequest(f"reserve: size of buffer {name!r} must be a non-negative int")
    offsets, span = buffer_offsets(buffers)
    return {name: (offsets[name], nbytes) for name, nbytes in buffers.items()}, span


def consumers_problem(consumers: Any) -> str | None:
    """Why ``consumers`` cannot be an object's consumer count (a seal here or a pull)."""
    if consumers.__class__ is not int or not 1 <= consumers <= 1 << 16:
        return "consumers must be between 1 and 65536"
    return None


def tokens_problem(tokens: Any) -> str | None:
    """Why ``tokens`` cannot be a prefix block's token ids (the events announce them)."""
    if tokens is None:
        return None
    if (
        isinstance(tokens, list)
        and len(tokens) <= MAX_TOKENS
        and all(t.__class__ is int for t in tokens)
    ):
        return None
    return f"tokens must be a list of at most {MAX_TOKENS} token ids"


def parent_problem(parent: Any) -> str | None:
    """Why ``parent`` cannot name a prefix block's parent (a key, or null)."""
    if parent is None:
        return None
    if not isinstance(parent, str) or not 0 < len(parent) <= MAX_NAME:
        return f"parent must be a key (1 to {MAX_NAME} characters) or null"
    return None


def checked_checksums(obj: StoredObject, checksums: dict | None, required: bool) -> dict | None:
    """``checksums`` as ``obj`` keeps them; BadRequest when they do not fit its buffers, or
    are missing where the daemon requires them (``required``: require_checksums)."""
    if checksums is not None:
        try:
            return _checksum.validate(checksums, obj.buffers)
        except ValueError as exc:
            raise BadRequest(f"seal of {obj.namespace}/{obj.key}: {exc}") from None
    if required:
        raise BadRequest(
            f"seal of {obj.namespace}/{obj.key}: this daemon requires a checksum per "
            "buffer (require_checksums); seal with checksums"
        )
    return None


def block_plans(namespace: str, blocks: list, buffers: dict | None, meta: dict | None) -> list:
    """``reserve_blocks``' blocks checked, each as ``(ident, parent, layout, span, meta,
    tokens, footprint)`` (``state.index_footprint``, the parts given once for the batch
    counted once): every block validated before anything is reserved."""
    if len(blocks) > MAX_BUFFERS:
        raise BadRequest(f"reserve_blocks: at most {MAX_BUFFERS} blocks per request")
    # Buffers and meta given once for the batch: laid out (and checked) once, not per block.
    shared = buffer_layout(buffers, meta) if buffers is not None else None
    names_cost = names_footprint(shared[0]) if shared is not None else 0
    meta_cost = value_footprint(meta)
    plans = []
    for i, blk in enumerate(blocks):
        if not isinstance(blk, dict) or not isinstance(blk.get("key"), str):
            raise BadRequest(f"reserve_blocks: block {i} must be a map with a string key")
        parent = blk.get("parent")
        if (problem := parent_problem(parent)) is not None:
            raise BadRequest(f"reserve_blocks: block {i}: {problem}")
        bufs, own_meta = blk.get("buffers"), blk.get("meta", meta)
        if (
            (bufs is None and shared is None)
            or (bufs is not None and not isinstance(bufs, dict))
            or (own_meta is not None and not isinstance(own_meta, dict))
        ):
            raise BadRequest(
                f"reserve_blocks: block {i}: buffers (and meta) must be maps, "
                "given per block or once for the batch"
            )
        if bufs is not None:
            layout, span = buffer_layout(bufs, own_meta)
            cost = names_footprint(layout)
        else:
            layout, span = shared  # type: ignore[misc]
            if own_meta is not meta and (problem := meta_problem(own_meta)) is not None:
                raise BadRequest(f"reserve_blocks: block {i}: {problem}")
            cost = names_cost
        cost += meta_cost if own_meta is meta else value_footprint(own_meta)
        ident = (namespace, check_name("key", blk["key"]))
        tokens = blk.get("tokens")
        if (problem := tokens_problem(tokens)) is not None:
            raise BadRequest(f"reserve_blocks: block {i}: {problem}")
        cost += 36 * len(tokens or ())
        plans.append((ident, parent, layout, span, own_meta, tokens, cost))
    return plans


def extents(obj: StoredObject, chosen: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """The reply's form of buffers: name -> [pool, offset, nbytes]."""
    idx = obj.pool.index
    return {name: [idx, off, n] for name, (off, n) in chosen.items()}


def leases_named(
    table: LeaseTable,
    session: Session,
    op: str,
    lids: list,
    kind: str | None,
    repeats: bool = False,
) -> list[Lease]:
    """The live leases ``lids`` of this session (of ``kind``), every one checked before a
    batch op acts on any: a bad id fails the request and changes nothing."""
    held = []
    for lid in lids:
        if not isinstance(lid, int) or isinstance(lid, bool):
            raise BadRequest(f"{op}: leases must be a list of lease ids")
        held.append(table.of(session, lid, kind))
    if not repeats and len({ls.id for ls in held}) != len(held):
        raise BadRequest(f"{op}: a lease is named twice")
    return held
