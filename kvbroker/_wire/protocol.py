"""The wire protocol: limits, message shapes, and the one table of operations.

Transport: a Unix stream socket. Framing: consecutive msgpack maps, decoded with msgpack's
streaming ``Unpacker`` under the hard limits below, so a bad peer cannot make either side
allocate without bound.

Request  ``{"id": int, "op": str, "args": {...}}``
Reply    ``{"id": int, "ok": true, "result": ...}``
         ``{"id": int, "ok": false, "error": {"code": str, "message": str}}``
Push     ``{"push": "stats", "result": <Statistics dict>}`` (only after ``watch``)

The first request on a connection must be ``hello``. Requests on one connection are answered
in order. Only control messages travel here: KV bytes move through the shared-memory pools.

Extent triples ``[pool, offset, nbytes]`` name a byte range of pool ``pool`` (an index into
the ``pools`` list of the hello reply); the client maps each pool once and views the range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest

PROTOCOL_VERSION = 1

# Hard limits on what one frame may hold. Control messages are small: the biggest are
# `list`/`stat` replies and reservations naming many buffers. msgpack checks the string and
# array limits only once a whole object has arrived, so the buffer limit is what bounds the
# memory a peer can make us hold: 1 MiB per connection in the daemon.
MAX_REQUEST = 1024 * 1024
MAX_FRAME = 16 * 1024 * 1024
MAX_STR = 64 * 1024
MAX_BIN = 1024 * 1024
MAX_ARRAY = 1 << 20
MAX_MAP = 1 << 16
MAX_BUFFERS = 8192
MAX_NAME = 512
MAX_META = 64 * 1024


def unpacker_limits(max_frame: int = MAX_FRAME) -> dict[str, int]:
    """Keyword arguments for ``msgpack.Unpacker`` enforcing the limits above."""
    return {
        "max_buffer_size": max_frame,
        "max_str_len": MAX_STR,
        "max_bin_len": MAX_BIN,
        "max_array_len": MAX_ARRAY,
        "max_map_len": MAX_MAP,
        "max_ext_len": 0,
    }


_NUMBER = (int, float)
_OPT_STR = (str, type(None))
_OPT_NUM = (int, float, type(None))


@dataclass(frozen=True)
class Arg:
    types: tuple[type, ...]
    required: bool = False
    default: Any = None


@dataclass(frozen=True)
class Op:
    args: dict[str, Arg]
    reply: str
    doc: str
    needs_hello: bool = True


def _a(*types: type, required: bool = False, default: Any = None) -> Arg:
    return Arg(tuple(types), required, default)


# The one table: every operation, its arguments (name -> accepted types, default) and reply.
OPS: dict[str, Op] = {
    "hello": Op(
        {
            "version": _a(int, required=True),
            "name": _a(str, default=""),
            "role": _a(str, default=""),
        },
        "{version, server_pid, session, lease_ttl, pools: [{index, name, size, page_size}], "
        "epoch: starts of this socket's daemon that adopted the previous one's pools}",
        "Open the session: protocol version check, client name and role.",
        needs_hello=False,
    ),
    "reserve": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "buffers": _a(dict, required=True),
            "meta": _a(dict, type(None)),
            "replace": _a(bool, default=False),
            "ttl": _a(*_OPT_NUM),
            "consumers": _a(int, default=1),
        },
        "{lease, ttl, buffers: {name: [pool, offset, nbytes]}}",
        "Write lease on fresh extents for a new object; nothing is visible until seal. "
        "`consumers`: how many releases of consume-claims free the object (default 1).",
    ),
    "seal": Op(
        {"lease": _a(int, required=True), "checksums": _a(dict, type(None))},
        "{key, namespace, nbytes}",
        "Make the written object visible atomically; ends the write lease. `checksums`: "
        "{buffer: xxh3_64 of its bytes} for every buffer, kept with the object and returned "
        "by claim and lookup (required when the daemon sets require_checksums).",
    ),
    "abort": Op(
        {"lease": _a(int, required=True)},
        "{}",
        "Discard an unsealed object and free its extents.",
    ),
    "arena": Op(
        {"nbytes": _a(int, required=True)},
        "{lease, arena: [pool, offset, nbytes]}",
        "A write arena: fresh pages this connection may fill before naming them with "
        "`publish` (a put in one round trip). Capped at 1/16 of a pool; no TTL; freed by "
        "`abort`, by being published whole, or when the connection closes.",
    ),
    "publish": Op(
        {
            "arena": _a(int, required=True),
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "buffers": _a(dict, required=True),
            "meta": _a(dict, type(None)),
            "replace": _a(bool, default=False),
            "consumers": _a(int, default=1),
            "checksums": _a(dict, type(None)),
            "next_arena": _a(int, default=0),
        },
        "{key, namespace, nbytes, lease: arena id | null, arena: [pool, offset, nbytes] | null}",
        "Seal the arena's first pages as a new object, buffers laid out as `reserve` lays "
        "them out; the rest stays the arena. `next_arena` bytes: the arena to hold next "
        "(the rest, while it is at least half that size, else a fresh one of that size; 0 "
        "frees the rest). Exists leaves the arena untouched.",
    ),
    "claim": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "select": _a(*_OPT_STR),
            "consume": _a(bool, default=False),
            "wait": _a(*_OPT_NUM),
            "ttl": _a(*_OPT_NUM),
        },
        "{lease, ttl, meta, buffers: {name: [pool, offset, nbytes]}, checksums: {name: "
        "digest} | null}",
        "Read lease on a sealed object; `select` is a regex over buffer names; `wait` seconds "
        "to wait for the key to be sealed; `consume` frees the object once released.",
    ),
    "release": Op(
        {"lease": _a(int, required=True), "consume": _a(bool, default=True)},
        "{}",
        "End a read lease (frees the object if it was claimed with consume). `consume` "
        "false ends a consume claim without counting it: the reader gave up unused.",
    ),
    "renew": Op(
        {"leases": _a(list, required=True), "ttl": _a(*_OPT_NUM)},
        "{expires_in: {lease: seconds}}",
        "Extend leases by their TTL; an ended lease answers lease_expired.",
    ),
    "lookup": Op(
        {"namespace": _a(str, default="default"), "key": _a(str, required=True)},
        "ObjectInfo dict (with checksums) or None",
        "Describe one sealed object, without leasing it.",
    ),
    "list": Op(
        {
            "namespace": _a(*_OPT_STR),
            "match": _a(*_OPT_STR),
            "limit": _a(int, type(None)),
        },
        "{objects: [ObjectInfo dict], truncated: bool}",
        "Sealed objects, optionally filtered by namespace and a regex over keys.",
    ),
    "evict": Op(
        {
            "namespace": _a(*_OPT_STR),
            "key": _a(*_OPT_STR),
            "match": _a(*_OPT_STR),
            "match_buffers": _a(*_OPT_STR),
            "older_than": _a(*_OPT_NUM),
            "all": _a(bool, default=False),
            "dry_run": _a(bool, default=False),
        },
        "{evicted: [ObjectInfo dict], bytes: int, skipped_leased: int}",
        "Free sealed objects matching every given filter; leased ones are skipped.",
    ),
    "reserve_blocks": Op(
        {
            "namespace": _a(str, default="default"),
            "blocks": _a(list, required=True),
            "ttl": _a(*_OPT_NUM),
        },
        "{results: [{lease, buffers} | {exists: true}]} in the order of `blocks`",
        "Write leases for many prefix blocks in one round trip. Each block is "
        "{key, parent: key|null, buffers: {name: nbytes}, meta?}; a block already published "
        "answers exists and costs no copy. A block is evicted only after its children.",
    ),
    "seal_many": Op(
        {"leases": _a(list, required=True), "checksums": _a(list, type(None))},
        "{sealed: int}",
        "Seal several write leases in order (parents before children); `checksums`, when "
        "given, holds one {buffer: digest} map (or null) per lease.",
    ),
    "match_prefix": Op(
        {
            "namespace": _a(str, default="default"),
            "keys": _a(list, required=True),
            "block_tokens": _a(int, default=0),
            "ttl": _a(*_OPT_NUM),
        },
        "{matched, lease, ttl, names, metas: [meta of the first block], packed: bytes | "
        "blocks: [{name: [pool, offset, nbytes]}]}",
        "Longest run of leading `keys` that are published, all under one read lease. When "
        "every block has the buffers `names`, `packed` holds a little-endian int64 row "
        "[pool, offset, nbytes, offset, nbytes, ...] per block; else `blocks` a map each.",
    ),
    "release_many": Op(
        {"leases": _a(list, required=True)},
        "{}",
        "End several read leases.",
    ),
    # GPU staging rings (kvbroker._server.rings); a daemon without --gpu-ring answers bad_request.
    "rings": Op(
        {},
        "{rings: [{index, device: PCI bus id, name, capacity, align, handle: 64-byte CUDA IPC "
        "handle}]}",
        "The daemon's GPU staging rings, one per GPU, and the handles to map them.",
    ),
    "ring_reserve": Op(
        {
            "device": _a(int, required=True),
            "nbytes": _a(int, required=True),
            "namespace": _a(str, default="default"),
            "key": _a(*_OPT_STR),
            "meta": _a(dict, type(None)),
            "ttl": _a(*_OPT_NUM),
        },
        "{lease, device, offset, nbytes, kind: 'scratch' | 'write'}",
        "A region of ring `device`, bound to this connection: scratch staging (no key), or "
        "a ring-located object to publish under `key` (seal it; `ttl`: how long it waits "
        "for a claimer once sealed). A full ring answers pool_full at once.",
    ),
    "ring_seal": Op(
        {"lease": _a(int, required=True)},
        "{namespace, key, nbytes}",
        "Make a written ring object visible; the object now owns its region.",
    ),
    "ring_claim": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "consume": _a(bool, default=True),
            "wait": _a(*_OPT_NUM),
        },
        "{lease, device, offset, nbytes, meta}",
        "Read lease on a sealed ring object (`consume`: one-shot, freed once released); "
        "`wait` seconds for it to be sealed.",
    ),
    "ring_release": Op(
        {"lease": _a(int, required=True)},
        "{}",
        "End a ring lease: frees a scratch region, discards an unsealed object, ends a read.",
    ),
    "stat": Op({}, "Statistics dict", "One statistics snapshot."),
    "watch": Op(
        {"interval": _a(*_NUMBER, default=1.0)},
        "{interval}, then pushes {push: 'stats', result: Statistics dict}",
        "Stream statistics snapshots on this connection; interval 0 stops the stream.",
    ),
}

# Connections are answered with these codes (see kvbroker.errors for the classes).
ERROR_CODES = (
    "bad_request",
    "protocol",
    "not_found",
    "exists",
    "incomplete",
    "pool_full",
    "lease_expired",
    "timeout",
    "forbidden",
    "quota_exceeded",
    "limit_exceeded",
    "layout_mismatch",
    "internal",
)


_MISSING = object()


def validate_args(op_name: str, raw: Any) -> dict[str, Any]:
    """Check a request's arguments against the table; returns them with defaults filled in.

    Raises :class:`~kvbroker.errors.BadRequest` naming the offending argument.
    """
    op = OPS.get(op_name)
    if op is None:
        raise BadRequest(f"unknown op {op_name!r}")
    if raw is None:
        raw = {}
    elif not isinstance(raw, dict):
        raise BadRequest(f"{op_name}: args must be a map, not {type(raw).__name__}")
    out: dict[str, Any] = {}
    seen = 0
    for name, arg in op.args.items():
        value = raw.get(name, _MISSING)
        if value is _MISSING:
            if arg.required:
                raise BadRequest(f"{op_name}: missing argument {name!r}")
            out[name] = arg.default
            continue
        seen += 1
        # bool is an int subclass: never accept True where a count is meant.
        if not isinstance(value, arg.types) or (
            value.__class__ is bool and bool not in arg.types
        ):
            raise BadRequest(
                f"{op_name}: {name} must be {_type_names(arg)}, not {type(value).__name__}"
            )
        out[name] = value
    if seen != len(raw):
        extra = next(k for k in raw if k not in op.args)
        raise BadRequest(f"{op_name}: unexpected argument {extra!r}")
    return out


def _type_names(arg: Arg) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in arg.types)
