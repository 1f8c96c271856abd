"""The reply of every op, as types: the ``reply`` column of the op table (``protocol.OPS``).

The daemon's handlers build these shapes and the client's stubs read them; :func:`mismatch`
checks a received value against its type (the fuzz test runs it on every reply), so a reply
that drifts from its declaration fails a test instead of a reader.

No ``from __future__ import annotations`` here: ``NotRequired`` inside a string annotation
is not seen by ``TypedDict`` on Python 3.11, and the checker reads the real types.
"""

import dataclasses
import types
import typing
from typing import Any, Literal, NotRequired, TypedDict

from .stats import ObjectInfo, SessionInfo

__all__ = [
    "Extent",
    "Empty",
    "PoolInfo",
    "HiddenPool",
    "Hello",
    "Reserved",
    "Sealed",
    "ArenaLent",
    "Published",
    "Claimed",
    "Renewed",
    "Listed",
    "Evicted",
    "BlockReserved",
    "BlockExists",
    "BlocksReserved",
    "SealedMany",
    "PrefixMatch",
    "RingInfo",
    "Rings",
    "RingRegion",
    "RingClaimed",
    "RingFound",
    "Watching",
    "Pong",
    "Reported",
    "Fetched",
    "Sessions",
    "mismatch",
]

# [pool, offset, nbytes]: a byte range of pool `pool` (an index into hello's `pools`).
Extent = list[int]


class Empty(TypedDict):
    pass


class PoolInfo(TypedDict):
    index: int
    name: str  # the shared-memory segment to map
    size: int
    page_size: int


class HiddenPool(TypedDict):
    """Another tenant's pool (``[tenant_pools]``): its index, not its segment."""

    index: int
    hidden: bool  # always true


class Hello(TypedDict):
    version: int
    server_version: str
    server_pid: int
    session: int
    lease_ttl: float
    # every pool, in index order (an Extent's pool); a pool of another tenant, which this
    # client may not map, only as a HiddenPool
    pools: list[PoolInfo | HiddenPool]
    epoch: int  # starts of this socket's daemon that adopted the previous one's pools
    # the checksum kinds a seal may carry (kvbroker._wire.checksum.KINDS); a daemon that
    # does not send this field accepts kind 0 (bare integers) only
    checksum_kinds: list[int]
    # the sockets of the daemon's read replicas (kvbroker._server.replica), which answer
    # exists and match_prefix(hold=False); absent when it runs none
    replicas: NotRequired[list[str]]


class Reserved(TypedDict):
    lease: int
    ttl: float
    buffers: dict[str, Extent]


class Sealed(TypedDict):
    namespace: str
    key: str
    nbytes: int


class ArenaLent(TypedDict):
    lease: int
    arena: Extent


class Published(Sealed):
    lease: int | None  # the arena now held (the rest, or a fresh one), if any
    arena: Extent | None


class Claimed(TypedDict):
    lease: int
    ttl: float
    meta: dict | None
    buffers: dict[str, Extent]
    checksums: dict[str, int] | None  # {buffer: xxh3_64} of the selected buffers


class Renewed(TypedDict):
    expires_in: list[tuple[int, float]]  # [lease, seconds] in the order asked


class Listed(TypedDict):
    objects: list[ObjectInfo]
    truncated: bool  # more objects match than this reply lists
    next: int | None  # when truncated: the cursor to pass as `after` for the next page


class Evicted(TypedDict):
    evicted: list[ObjectInfo]  # at most 10,000 of them
    count: int
    bytes: int
    skipped_leased: int
    skipped_parents: int  # kept for having children outside the batch
    dry_run: bool
    on_disk: int  # disk copies dropped (in count and bytes when nothing else held them)


class BlockReserved(TypedDict):
    lease: int
    buffers: dict[str, Extent]


class BlockExists(TypedDict):
    exists: bool


class BlocksReserved(TypedDict):
    ttl: float
    results: list[BlockReserved | BlockExists]  # in the order of `blocks`; empty if compact
    # `compact` asked and every reserved block has the buffers `names`: per block its lease
    # (None: it exists), and little-endian int64 rows [pool, offset, nbytes, offset, nbytes,
    # ...], one per reserved block, in order (see PrefixMatch).
    leases: NotRequired[list[int | None]]
    names: NotRequired[list[str]]
    packed: NotRequired[bytes]


class SealedMany(TypedDict):
    sealed: int


class PrefixMatch(TypedDict):
    ttl: float
    matched: int
    lease: int | None  # None when nothing matched
    names: list[str]
    # the run's meta when its blocks share one, else each block's
    metas: NotRequired[list[dict | None]]
    # When every block has the buffers `names`: little-endian int64 rows [pool, offset,
    # nbytes, offset, nbytes, ...], one per block, and `blocks` is empty; else `blocks`.
    packed: NotRequired[bytes]
    blocks: list[dict[str, Extent]]


class RingInfo(TypedDict):
    index: int
    device: str  # PCI bus id
    name: str
    capacity: int
    align: int
    handle: bytes  # 64-byte CUDA IPC handle


class Rings(TypedDict):
    rings: list[RingInfo]


class RingRegion(TypedDict):
    lease: int
    device: int
    offset: int
    nbytes: int
    kind: Literal["scratch", "write"]


class RingClaimed(TypedDict):
    lease: int
    device: int
    offset: int
    nbytes: int
    meta: dict | None


class RingFound(TypedDict):
    # per key asked: {"device": ring index, "nbytes": int, "meta": dict | None}, or None
    objects: list[dict | None]


class Watching(TypedDict):
    interval: float


class Reported(TypedDict):
    counters: int  # how many the daemon now holds for this client


class Pong(TypedDict):
    server_version: str
    server_pid: int
    started_at: float  # Unix time the daemon started
    epoch: int  # as Hello's


class Fetched(TypedDict):
    namespace: str
    key: str
    nbytes: int
    fetched: bool  # false: the object was here already (nothing moved)
    peer: str


class Sessions(TypedDict):
    sessions: list[SessionInfo]  # those the caller may see, largest first
    truncated: bool  # more than `limit`
    retained_bytes: list[int]  # per pool index: bytes sessions retain there
    retained_cap: list[int]  # per pool index: the most they may ([sessions] pool_share)


def mismatch(value: Any, tp: Any, where: str = "reply") -> str | None:
    """Why ``value`` (as msgpack decoded it: tuples arrive as lists) is not a ``tp``, or
    None when it is one. Dicts must carry every required key and no other."""
    if tp is Any:
        return None
    if tp is None or tp is type(None):
        return None if value is None else f"{where}: {value!r} is not null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        reasons = [mismatch(value, arg, where) for arg in typing.get_args(tp)]
        return None if None in reasons else " / ".join(r for r in reasons if r)
    if origin in (NotRequired, typing.Required):
        return mismatch(value, typing.get_args(tp)[0], where)
    if origin is Literal:
        return None if value in typing.get_args(tp) else f"{where}: {value!r} not in {tp}"
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp, include_extras=True)
        return _mapping(value, hints, tp.__required_keys__, where)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        required = {
            f.name
            for f in dataclasses.fields(tp)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        return _mapping(
            value, {f.name: hints[f.name] for f in dataclasses.fields(tp)}, required, where
        )
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"{where}: {type(value).__name__} is not a list"
        args = typing.get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                return f"{where}: {len(value)} items, not {len(args)}"
            pairs = zip(value, args, strict=True)
        else:
            pairs = ((v, args[0] if args else Any) for v in value)
        for i, (v, t) in enumerate(pairs):
            reason = mismatch(v, t, f"{where}[{i}]")
            if reason:
                return reason
        return None
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            return f"{where}: {type(value).__name__} is not a map"
        kt, vt = typing.get_args(tp) or (Any, Any)
        for k, v in value.items():
            reason = mismatch(k, kt, f"{where} key") or mismatch(v, vt, f"{where}[{k!r}]")
            if reason:
                return reason
        return None
    if tp is float:  # msgpack keeps 30 an int where Python wrote 30 for seconds
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    return None if ok else f"{where}: {type(value).__name__} {value!r:.60} is not {tp.__name__}"


def _mapping(value: Any, hints: dict[str, Any], required, where: str) -> str | None:
    if not isinstance(value, dict):
        return f"{where}: {type(value).__name__} is not a map"
    missing = set(required) - value.keys()
    if missing:
        return f"{where}: missing {sorted(missing)}"
    extra = value.keys() - hints.keys()
    if extra:
        return f"{where}: undeclared {sorted(map(str, extra))}"
    for key, v in value.items():
        reason = mismatch(v, hints[key], f"{where}.{key}")
        if reason:
            return reason
    return None
