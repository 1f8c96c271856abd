"""The wire protocol: limits, message shapes, and the one table of operations.

Transport: a Unix stream socket. Framing: consecutive msgpack maps, decoded with msgpack's
streaming ``Unpacker`` under the hard limits below, so a bad peer cannot make either side
allocate without bound.

Request  ``{"id": int, "op": str, "args": {...}}``
Reply    ``{"id": int, "ok": true, "result": ...}``
         ``{"id": int, "ok": false, "error": {"code": str, "message": str}}``
Push     ``{"push": "stats", "result": <Statistics dict>}`` (only after ``watch``)

Every op is one row of :data:`OPS`: its arguments, its reply type (``replies``), which
service answers it, what it does with leases and what a draining daemon does with it; the
rest of the code derives what it needs from that row. The first request on a connection
must be ``hello`` (the ops whose row says ``needs_hello``). Requests on one connection are answered
in order. Only control messages travel here: KV bytes move through the shared-memory pools.

Extent triples ``[pool, offset, nbytes]`` name a byte range of pool ``pool`` (an index into
the ``pools`` list of the hello reply); the client maps each pool once and views the range.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from . import replies as R
from ..errors import ERROR_CLASSES, BadRequest
from .replies import mismatch
from .rules import LEASE_TTL, Arg, Replica, Rule, check_args, check_rules, replica_answers, ruled
from .stats import ObjectInfo, SessionInfo, Statistics

PROTOCOL_VERSION = 1

# Hard limits on what one frame may hold. Control messages are small: the biggest are
# `list`/`stat` replies and reservations naming many buffers. msgpack checks the string and
# array limits only once a whole object has arrived, so the buffer limit is what bounds the
# memory a peer can make us hold: 1 MiB per connection in the daemon.
MAX_REQUEST = 1024 * 1024
MAX_FRAME = 16 * 1024 * 1024
MAX_STR = 64 * 1024
# A binary field may fill its frame: a match_prefix reply packs one int64 row of extents per
# block, 1,032 bytes for a 64-buffer (32-layer) block, so a 16k-token prompt in 16-token
# blocks is just over 1 MiB. The frame limit still bounds what a peer can make us hold.
MAX_BIN = MAX_FRAME
MAX_ARRAY = 1 << 20
MAX_MAP = 1 << 16
MAX_BUFFERS = 8192
MAX_NAME = 512
MAX_PRIORITY = 100  # a session's priority: 0 (the default) to this
MAX_REPORTED = 32  # counters a client may report (the report op)
MAX_META = 64 * 1024
MAX_META_DEPTH = 32  # maps and lists inside an object's meta: replies nest it a few deeper


def meta_problem(meta: Any) -> str | None:
    """Why ``meta`` may not be kept with an object (too deep, too big, not packable), or
    None. Checked before an object is reserved: a meta that cannot be packed inside a
    ``list`` or ``evict`` reply would break those ops for every client."""
    if meta is None:
        return None
    stack = [(meta, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if depth > MAX_META_DEPTH:
                return f"meta nests deeper than {MAX_META_DEPTH} levels"
            items = value.values() if isinstance(value, dict) else value
            stack.extend((v, depth + 1) for v in items)
    import msgpack

    try:
        size = len(msgpack.packb(meta))
    except (ValueError, TypeError, OverflowError) as exc:
        return f"meta cannot be packed: {exc}"
    if size > MAX_META:
        return f"meta packs to {size} bytes, more than {MAX_META}"
    return None


def unpacker_limits(max_frame: int = MAX_FRAME) -> dict[str, int]:
    """Keyword arguments for ``msgpack.Unpacker`` enforcing the limits above."""
    return {
        "max_buffer_size": max_frame,
        "max_str_len": MAX_STR,
        "max_bin_len": min(MAX_BIN, max_frame),
        "max_array_len": MAX_ARRAY,
        "max_map_len": MAX_MAP,
        "max_ext_len": 0,
    }


def name_bytes(name: str) -> int:
    """The bytes ``name`` packs to, without its header (UTF-8: a character is 1 to 4)."""
    return len(name) if name.isascii() else len(name.encode())


def seal_size(names: Iterable[str]) -> int:
    """An upper bound on the packed size of a ``seal`` with checksums of buffers ``names``
    (each name with its checksum)."""
    return 256 + sum(name_bytes(n) + 3 + 24 for n in names)


def publish_size(names: Iterable[str], checksums: bool) -> int:
    """An upper bound on the packed size of a ``publish`` of buffers ``names`` (each name
    with its size, and with its checksum), its meta apart."""
    per_name = 9 + (24 if checksums else 0)
    return 512 + sum((1 + int(checksums)) * (name_bytes(n) + 3) + per_name for n in names)


def request_chunks(
    costs: list[int], budget: int = MAX_REQUEST // 2, most: int = 1 << 30
) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges of a batch whose items cost ``costs[i]`` packed bytes each, so
    that every range's request stays within ``budget`` (half a request: room for the rest
    of it) and ``most`` items: how a client splits a batch the daemon would refuse whole."""
    out, lo, used = [], 0, 0
    for i, cost in enumerate(costs):
        if i > lo and (used + cost > budget or i - lo >= most):
            out.append((lo, i))
            lo, used = i, 0
        used += cost
    if lo < len(costs):
        out.append((lo, len(costs)))
    return out


_NUMBER = (int, float)
_OPT_STR = (str, type(None))
_OPT_NUM = (int, float, type(None))


class Service(enum.Enum):
    """Which part of the daemon answers an op: where its one handler lives."""

    BROKER = "broker"  # kvbroker._server.handlers: op_<name>(broker, session, **args)
    RINGS = "rings"  # kvbroker._server.rings.RingService.op_<name>(session, **args)
    DAEMON = "daemon"  # kvbroker._server.connection.Connection.op_<name>(session, **args)


class LeaseRole(enum.Flag):
    """What an op does with leases (write arenas and ring leases included)."""

    NONE = 0
    TAKES = enum.auto()  # hands one out: a draining daemon must not (see Drain)
    NAMES = enum.auto()  # acts on one the caller holds: gone with its connection


@dataclass(frozen=True)
class Drain:
    """What a draining daemon (stopping, waiting for held leases to end) does with an op:
    serve it, refuse it (``unavailable``), or serve it with ``args`` overriding the
    request's (so that it takes no new lease). ``publishes``: the op makes an object
    visible, so it is served only by a daemon that keeps its pools for the next one (a
    restart); one that frees them (a stop) refuses it and ends the write lease or arena it
    names: a publish is refused or kept, never acknowledged and then lost with the pools."""

    refuse: bool = False
    args: tuple[tuple[str, Any], ...] = ()
    publishes: bool = False


SERVE = Drain()
REFUSE = Drain(refuse=True)


@dataclass(frozen=True)
class Op:
    args: dict[str, Arg]
    reply: Any  # a type of kvbroker._wire.replies (or stats); checked by check_reply
    doc: str
    service: Service = Service.BROKER
    lease: LeaseRole = LeaseRole.NONE
    draining: Drain = SERVE
    needs_hello: bool = True
    # Served while an earlier claim of the same connection waits (``wait``; not past a
    # deferred request such as a peer fetch, whose answer must not see it): an op
    # that only ends leases the caller holds, so another thread's release (a GPU landing's
    # finisher) is not held back for the whole wait. The daemon still answers everything
    # else on a connection in the order it came.
    passes_a_wait: bool = False
    # Whether (and when) a read replica answers it (kvbroker._wire.rules.Replica).
    replica: Replica | None = None


def _a(*types: type, required: bool = False, default: Any = None, rule: Any = None) -> Arg:
    return Arg(tuple(types), required, default, rule)


_TTL = _a(int, float, type(None), rule=LEASE_TTL)  # a lease TTL; None: the daemon's default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def priority_problem(priority: Any, limits: Any = None) -> str | None:
    """Why ``priority`` is no session priority (an integer, 0 to MAX_PRIORITY), or None."""
    if priority is None or (_is_int(priority) and 0 <= priority <= MAX_PRIORITY):
        return None
    return f"priority must be an integer from 0 to {MAX_PRIORITY}, not {priority!r}"


def retain_problem(retain: Any, limits: Any = None) -> str | None:
    """Why ``retain`` is not a request's session (``{session, for?, priority?}``: a name of 1
    to MAX_NAME characters, seconds more than 0, a priority), or None. The client checks
    what it builds with it too (``kvbroker.blocks.retention``)."""
    if retain is None:
        return None
    if extra := sorted(set(retain) - {"session", "for", "priority"}):
        return f"retain: unknown fields {extra}; it takes session, for and priority"
    name, for_ = retain.get("session"), retain.get("for")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        return f"retain: session must be a name of 1 to {MAX_NAME} characters"
    if for_ is not None and (
        isinstance(for_, bool) or not isinstance(for_, (int, float)) or not 0 < for_ < math.inf
    ):
        return "retain: for must be a number of seconds, more than 0"
    problem = priority_problem(retain.get("priority"))
    return None if problem is None else f"retain: {problem}"


# The session a publish or a match names (kvbroker._server.retention): one rule for every op.
_RETAIN = _a(dict, type(None), rule=Rule("{session, for?, priority?}", retain_problem))
_PRIORITY = _a(int, type(None), rule=Rule("0 to MAX_PRIORITY", priority_problem))


_TAKES, _NAMES = LeaseRole.TAKES, LeaseRole.NAMES

# The one table: every operation, its arguments (name -> accepted types, default), its reply
# type, which service handles it, what it does with leases, what a draining daemon does with
# it. Adding an op: a row here, its handler (see Service), a client stub.
OPS: dict[str, Op] = {
    "hello": Op(
        {
            "version": _a(int, required=True),
            "name": _a(str, default=""),
            "role": _a(str, default=""),
        },
        R.Hello,
        "Open the session: protocol version check, client name and role.",
        needs_hello=False,
        replica=Replica(routed=False),  # each replica connection opens its own
    ),
    "reserve": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "buffers": _a(dict, required=True),
            "meta": _a(dict, type(None)),
            "replace": _a(bool, default=False),
            "ttl": _TTL,
            "consumers": _a(int, default=1),
            "retain": _RETAIN,
        },
        R.Reserved,
        "Write lease on fresh extents for a new object; nothing is visible until seal. "
        "`consumers`: how many releases of consume-claims free the object (default 1). "
        "`retain`: {session, for?, priority?}: that session, renewed, retains the object once "
        "sealed (or the one already published, when this answers exists).",
        lease=_TAKES, draining=REFUSE,
    ),
    "seal": Op(
        {"lease": _a(int, required=True), "checksums": _a(dict, type(None))},
        R.Sealed,
        "Make the written object visible atomically; ends the write lease. `checksums`: "
        "{buffer: xxh3_64 of its bytes} for every buffer, kept with the object and returned "
        "by claim and lookup (required when the daemon sets require_checksums).",
        lease=_NAMES, draining=Drain(publishes=True),
    ),
    "abort": Op(
        {"lease": _a(int, required=True)},
        R.Empty,
        "Discard an unsealed object (or a write arena) and free its extents.",
        lease=_NAMES,
        passes_a_wait=True,  # an idle arena given back while a claim of its client waits
    ),
    "arena": Op(
        {"nbytes": _a(int, required=True)},
        R.ArenaLent,
        "A write arena: fresh pages this connection may fill before naming them with "
        "`publish` (a put in one round trip). Capped at 1/16 of a pool; no TTL; freed by "
        "`abort`, by being published whole, or when the connection closes.",
        lease=_TAKES, draining=REFUSE,
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
            "retain": _RETAIN,
        },
        R.Published,
        "Seal the arena's first pages as a new object, buffers laid out as `reserve` lays "
        "them out; the rest stays the arena. `next_arena` bytes: the arena to hold next "
        "(the rest, while it is at least half that size, else a fresh one of that size; 0 "
        "frees the rest). Exists leaves the arena untouched. `retain`: as in reserve.",
        lease=_NAMES | _TAKES, draining=Drain(args=(("next_arena", 0),), publishes=True),
    ),
    "claim": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "select": _a(*_OPT_STR),
            "consume": _a(bool, default=False),
            "wait": _a(*_OPT_NUM),
            "ttl": _TTL,
            "peer": _a(*_OPT_STR),
        },
        R.Claimed,
        "Read lease on a sealed object; `select` is a regex over buffer names; `wait` seconds "
        "to wait for the key to be sealed; `consume` frees the object once released. `peer` "
        "(HOST:PORT of a broker of [transfer] peers): when the object is not here, pull it "
        "from that broker first (one NIXL READ; a consume counts there), then claim it here.",
        lease=_TAKES, draining=REFUSE,
    ),
    "release": Op(
        {"lease": _a(int, required=True), "consume": _a(bool, default=True)},
        R.Empty,
        "End a read lease (frees the object if it was claimed with consume). `consume` "
        "false ends a consume claim without counting it: the reader gave up unused.",
        lease=_NAMES,
        passes_a_wait=True,
    ),
    "renew": Op(
        {"leases": _a(list, required=True), "ttl": _TTL},
        R.Renewed,
        "Extend leases by their TTL; an ended lease answers lease_expired.",
        lease=_NAMES,
    ),
    "lookup": Op(
        {"namespace": _a(str, default="default"), "key": _a(str, required=True),
         "peer": _a(*_OPT_STR)},
        ObjectInfo | None,
        "Describe one sealed object without leasing it: with its checksums, each buffer's "
        "size (`buffer_sizes`, in layout order) and the consume-claims still to be released "
        "before it is freed (`consumers`); with `peer`, the peer broker's object when this "
        "daemon has none (nothing is pulled).",
    ),
    "exists": Op(
        {"namespace": _a(str, default="default"), "key": _a(str, required=True)},
        bool,
        "Whether the object is sealed here: `lookup` without its description. Read replicas "
        "answer it too (the sockets `hello` names in `replicas`).",
        replica=Replica(),
    ),
    "list": Op(
        {
            "namespace": _a(*_OPT_STR),
            "match": _a(*_OPT_STR),
            "limit": _a(int, type(None)),
            "after": _a(int, type(None)),
            "tier": _a(str, default="all"),
        },
        R.Listed,
        "Sealed objects, optionally filtered by namespace and a regex over keys, at most "
        "`limit` (and 10,000, and about 4 MiB of them) a reply, in the order they were "
        "sealed. `truncated`: more "
        "match; pass the reply's `next` as `after` for the next page (every object sealed "
        "before the first page and still there is listed once). Each object's `tier`: dram "
        "(in a pool), disk (on the disk tier only) or dram+disk; `tier` filters as evict's: "
        "all, dram (in a pool) or disk (with a copy on disk).",
    ),
    "evict": Op(
        {
            "namespace": _a(*_OPT_STR), "key": _a(*_OPT_STR), "match": _a(*_OPT_STR),
            "match_buffers": _a(*_OPT_STR), "older_than": _a(*_OPT_NUM),
            "all": _a(bool, default=False), "dry_run": _a(bool, default=False),
            "tier": _a(str, default="all"),
        },
        R.Evicted,
        "Free sealed objects matching every given filter; leased ones are skipped. The reply "
        "counts them all and lists at most 10,000 (and about 4 MiB) of them. `tier`: all "
        "(pools and disk), dram (the pools; kept on disk) or disk (the disk copies only).",
    ),
    "reserve_blocks": Op(
        {
            "namespace": _a(str, default="default"),
            "blocks": _a(list, required=True),
            "ttl": _TTL,
            "buffers": _a(dict, type(None)),
            "meta": _a(dict, type(None)),
            "compact": _a(bool, default=False), "retain": _RETAIN,
        },
        R.BlocksReserved,
        "Write leases for many prefix blocks in one round trip. Each block is "
        "{key, parent: key|null, buffers: {name: nbytes}, meta?, tokens?}; `buffers` and "
        "`meta` given once for the batch apply to every block without its own. A block "
        "already published answers exists and costs no copy. A block is evicted only after "
        "its children. `tokens`: the block's token ids, announced in KV events ([events]). "
        "`compact`: reply with `leases` (null where a block exists) and one packed extent "
        "row per reserved block, as match_prefix does, when their buffer names agree. `retain`"
        ": {session, for?, priority?}: that session, renewed, retains the blocks.",
        lease=_TAKES, draining=REFUSE,
    ),
    "seal_many": Op(
        {"leases": _a(list, required=True), "checksums": _a(list, type(None))},
        R.SealedMany,
        "Seal several write leases in order (parents before children); `checksums`, when "
        "given, holds one {buffer: digest} map (or null) per lease.",
        lease=_NAMES, draining=Drain(publishes=True),
    ),
    "match_prefix": Op(
        {
            "namespace": _a(str, default="default"),
            "keys": _a(list, required=True),
            "block_tokens": _a(int, default=0),
            "ttl": _TTL, "peer": _a(*_OPT_STR),
            "hold": _a(bool, default=True), "retain": _RETAIN,
        },
        R.PrefixMatch,
        "Longest run of leading `keys` that are published, all under one read lease. When "
        "every block has the buffers `names`, `packed` holds a little-endian int64 row "
        "[pool, offset, nbytes, offset, nbytes, ...] per block; else `blocks` a map each. "
        "`peer`: pull the blocks after the local run that the peer broker holds first (one "
        "NIXL READ for all of them). `hold` false: only `matched`, no lease, no extents (a "
        "scheduler asking how much it could load; read replicas answer it). `retain`: as in "
        "reserve_blocks (the daemon answers it).",
        lease=_TAKES, draining=REFUSE,
        # no lease, no extents, no peer: a map of names answers it
        replica=Replica(when=(("hold", False), ("peer", None), ("retain", None))),
    ),
    "release_many": Op(
        {"leases": _a(list, required=True)},
        R.Empty,
        "End several read leases.",
        lease=_NAMES,
        passes_a_wait=True,
    ),
    # GPU staging rings (kvbroker._server.rings); a daemon without --gpu-ring answers bad_request.
    "rings": Op(
        {},
        R.Rings,
        "The daemon's GPU staging rings, one per GPU, and the handles to map them.",
        service=Service.RINGS,
    ),
    "ring_reserve": Op(
        {
            "device": _a(int, required=True),
            "nbytes": _a(int, required=True),
            "namespace": _a(str, default="default"),
            "key": _a(*_OPT_STR),
            "meta": _a(dict, type(None)),
            "ttl": _TTL,
        },
        R.RingRegion,
        "A region of ring `device`, bound to this connection: scratch staging (no key), or "
        "a ring-located object to publish under `key` (seal it; `ttl`: how long it waits "
        "for a claimer once sealed). A full ring answers pool_full at once.",
        service=Service.RINGS, lease=_TAKES, draining=REFUSE,
    ),
    "ring_seal": Op(
        {"lease": _a(int, required=True)},
        R.Sealed,
        "Make a written ring object visible; the object now owns its region. Refused "
        "while draining: the rings never outlive the daemon, and no one may claim from it.",
        service=Service.RINGS, lease=_NAMES, draining=REFUSE,
    ),
    "ring_claim": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "consume": _a(bool, default=True),
            "wait": _a(*_OPT_NUM),
        },
        R.RingClaimed,
        "Read lease on a sealed ring object (`consume`: one-shot, freed once released); "
        "`wait` seconds for it to be sealed.",
        service=Service.RINGS, lease=_TAKES, draining=REFUSE,
    ),
    "ring_lookup": Op(
        {"namespace": _a(str, default="default"), "keys": _a(list, required=True)}, R.RingFound,
        "Which of `keys` name sealed ring objects (ring, size, meta; None: none); no lease.",
        service=Service.RINGS,
    ),
    "ring_release": Op(
        {"lease": _a(int, required=True)},
        R.Empty,
        "End a ring lease: frees a scratch region, discards an unsealed object, ends a read.",
        service=Service.RINGS, lease=_NAMES,
    ),
    "fetch": Op(
        {
            "namespace": _a(str, default="default"),
            "key": _a(str, required=True),
            "peer": _a(str, required=True),
        },
        R.Fetched,
        "Pull a sealed object from a peer broker (HOST:PORT) into this daemon's pools, "
        "unless it is here already; no lease is lent to the caller.",
        draining=REFUSE,
    ),
    "sessions": Op({"namespace": _a(*_OPT_STR), "limit": _a(int, type(None))}, R.Sessions,
                   "Sessions the caller may see (kvbroker._server.retention), largest first."),
    "retain": Op({"name": _a(str, required=True), "seconds": _a(*_NUMBER, required=True),
                  "namespace": _a(*_OPT_STR), "priority": _PRIORITY}, SessionInfo,
                 "Keep session `name` retained `seconds` from now; set its priority."),
    "unretain": Op({"name": _a(str, required=True), "namespace": _a(*_OPT_STR)}, SessionInfo,
                   "End session `name`: its blocks fall back to the plain LRU."),
    "stat": Op({}, Statistics, "One statistics snapshot."),
    "ping": Op(
        {},
        R.Pong,
        "A round trip that does nothing: the daemon's version, pid and start time.",
        replica=Replica(routed=False),
    ),
    "report": Op(
        {"counters": _a(dict, required=True)},
        R.Reported,
        "Publish this client's own counters ({name: non-negative int}, at most "
        f"{MAX_REPORTED} names, replacing the last report), shown per client by `stat` (and "
        "`stat --json`): e.g. the vLLM connector's loaded and saved blocks, tokens, bytes.",
    ),
    "watch": Op(
        {"interval": _a(*_NUMBER, default=1.0)},
        R.Watching,
        "Stream statistics snapshots on this connection ({push: 'stats', result: "
        "Statistics} every `interval` seconds); interval 0 stops the stream.",
        service=Service.DAEMON,
    ),
}  # fmt: skip


def ops_where(test: Callable[[Op], bool]) -> frozenset[str]:
    """The names of the ops whose row passes ``test``: how the rest of the code asks the
    table (which ops name a lease, which a draining daemon refuses, ...)."""
    return frozenset(name for name, op in OPS.items() if test(op))


# Requests that act on a lease the caller holds: after a reconnect the lease is gone.
LEASE_NAMING_OPS = ops_where(lambda op: LeaseRole.NAMES in op.lease)
# Refused by a draining daemon, which hands out no new leases.
REFUSED_WHILE_DRAINING = ops_where(lambda op: op.draining.refuse)

# What a read replica answers (kvbroker._server.replica), and what a client sends one.
REPLICA_OPS = ops_where(lambda op: op.replica is not None)
REPLICA_ROUTED_OPS = ops_where(lambda op: op.replica is not None and op.replica.routed)


def answered_by_a_replica(op_name: str, args: dict[str, Any]) -> bool:
    """Whether a read replica answers this request (its row's ``replica``, the arguments'
    values included)."""
    row = OPS.get(op_name)
    return row is not None and replica_answers(row.replica, row.args, args)


# Connections are answered with these codes (kvbroker.errors holds their classes).
ERROR_CODES = tuple(cls.code for cls in ERROR_CLASSES)


def check_reply(op_name: str, result: Any) -> str | None:
    """Why ``result`` is not the reply ``op_name`` declares, or None when it is."""
    return mismatch(result, OPS[op_name].reply, f"{op_name} reply")


_MISSING = object()
# Per op, each argument with the classes it takes as they are: what validate_args checks first.
_EXACT: dict[str, tuple[tuple[str, frozenset[type]], ...]] = {
    name: tuple((arg_name, frozenset(arg.types)) for arg_name, arg in op.args.items())
    for name, op in OPS.items()
}
# Per op, its arguments that have a value rule (rules.Rule), checked on every path.
_RULED = {name: ruled(op.args) for name, op in OPS.items()}


def validate_args(op_name: str, raw: Any, limits: Any) -> dict[str, Any]:
    """Check a request's arguments against the table (types, then the arguments' rules with
    the serving side's ``limits``: an object with ``max_lease_ttl``); returns them with
    defaults filled in.

    Raises :class:`~kvbroker.errors.BadRequest` naming the offending argument.
    """
    exact = _EXACT.get(op_name)
    if exact is not None and raw.__class__ is dict and len(raw) == len(exact):
        # What clients send: every argument, each of exactly an accepted class (msgpack
        # decodes to plain builtins). The table's answer without its questions; anything
        # else (a default to fill in, a subclass, a bool for an int) takes the long way.
        for name, classes in exact:
            if raw.get(name, _MISSING).__class__ not in classes:
                break
        else:
            rules = _RULED[op_name]
            if rules:
                check_rules(op_name, rules, raw, limits)
            return raw
    op = OPS.get(op_name)
    if op is None:
        raise BadRequest(f"unknown op {op_name!r}")
    return check_args(op_name, op.args, raw, limits)
