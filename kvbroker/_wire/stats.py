"""Frozen snapshot types: one :class:`Statistics` feeds ``stat --json``, ``watch``, the TUI
and Prometheus.

The daemon builds these objects itself (``kvbroker._server.snapshot``) and sends their
:meth:`Statistics.to_dict`; clients get them back with :meth:`Statistics.from_dict`. Every
counter and field is named once, here. Sizes are bytes, times are seconds (wall-clock Unix
time where a point in time is meant).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = [
    "ClientStatistics",
    "Counters",
    "DiskTierStatistics",
    "EventStatistics",
    "LeaseInfo",
    "NamespaceUsage",
    "ObjectInfo",
    "PeerInfo",
    "PoolStatistics",
    "RetentionStatistics",
    "RingStatistics",
    "SessionInfo",
    "Statistics",
    "TransferRecord",
    "TransferStatistics",
]


def _build(cls, data: dict[str, Any]):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class PoolStatistics:
    index: int
    name: str
    capacity: int
    page_size: int
    used: int
    free: int
    leased_read: int
    leased_write: int
    quarantined: int
    objects: int
    largest_free: int
    fragmentation: float
    high_watermark: float
    low_watermark: float
    # Coarse occupancy map: one character per cell, '.' free, 's' sealed, 'r' read-leased,
    # 'w' write-leased, 'q' quarantined (the busiest state in the cell wins).
    occupancy: str = ""


@dataclass(frozen=True)
class RingStatistics:
    """One GPU staging ring (``serve --gpu-ring``), in the shape of a pool: ``quarantined``
    is freed space the ring's FIFO frontier has not passed yet (not reusable until it does)."""

    index: int
    device: str  # PCI bus id
    name: str
    capacity: int
    used: int
    free: int
    leased_read: int
    leased_write: int
    quarantined: int
    objects: int
    largest_free: int
    fragmentation: float
    high_watermark: float
    low_watermark: float
    occupancy: str = ""  # as PoolStatistics.occupancy

    # Rings reached clients as plain dicts before they were typed: reading one by key
    # (``stat().rings[0]["used"]``) keeps working.
    def __getitem__(self, name: str) -> Any:
        try:
            return getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default)


@dataclass(frozen=True)
class ClientStatistics:
    session: int
    pid: int
    uid: int
    gid: int
    name: str
    role: str
    connected_at: float
    read_leases: int
    write_leases: int
    bytes_published: int
    bytes_claimed: int
    reported: dict = field(default_factory=dict)  # its own counters ({name: int}, `report`)


@dataclass(frozen=True)
class LeaseInfo:
    lease: int
    kind: str  # "read" | "write"
    session: int
    namespace: str
    key: str
    nbytes: int
    expires_in: float


@dataclass(frozen=True)
class TransferRecord:
    at: float
    op: str  # "publish" | "claim"
    session: int
    namespace: str
    key: str
    nbytes: int


@dataclass(frozen=True)
class NamespaceUsage:
    """One namespace: sealed objects and their bytes; ``used``: bytes of pool pages charged
    to it (reserved, sealed, or freed only once the last reader leaves), ``quota``: its
    byte limit, None when it has none."""

    namespace: str
    objects: int
    bytes: int
    used: int
    quota: int | None = None


@dataclass(frozen=True)
class Counters:
    publishes: int = 0
    claims: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    aborts: int = 0
    expired_leases: int = 0
    requests: int = 0
    errors: int = 0
    prefix_queries: int = 0
    prefix_hit_blocks: int = 0
    prefix_miss_blocks: int = 0
    prefix_hit_tokens: int = 0
    replica_requests: int = 0  # answered by read replicas (in ``requests`` too)
    replica_exits: int = 0  # read replicas that exited (each started again, with backoff)


@dataclass(frozen=True)
class PeerInfo:
    """A peer broker this daemon pulls from (a control connection it opened)."""

    address: str
    node: str
    connected: bool


@dataclass(frozen=True)
class TransferStatistics:
    """Broker-to-broker transfer (``[transfer]``, kvbroker._server.fleet): ``listen`` is ""
    when this daemon serves no peer. Pulled: what this daemon read from peers; served: what
    peers read from it (bytes of pins released by the peer; the READ itself is one-sided)."""

    node: str
    listen: str
    peers: tuple[PeerInfo, ...] = ()
    serving: int = 0  # peer connections to this daemon
    leases_served: int = 0  # live leases held here for peers
    in_flight: int = 0  # pulls under way
    pulls: int = 0
    bytes_pulled: int = 0
    pins_served: int = 0
    bytes_served: int = 0
    failures: int = 0  # pulls that ended in an error (nothing sealed)
    failures_by_code: dict[str, int] | None = None  # error code -> count
    refused: int = 0  # peer connections refused (handshake limits, TLS or certificate, not a peer)
    last_failure: str = ""
    # The latest pull: its bytes, the seconds of its one NIXL READ, of the whole pull
    last_pull_bytes: int = 0
    last_read_seconds: float = 0.0
    last_pull_seconds: float = 0.0
    # ... and its phases, name -> seconds (connect, pin, reserve, read, verify, handoff,
    # release, seal): where a remote claim's time goes beyond the READ
    last_pull_phases: dict[str, float] | None = None


@dataclass(frozen=True)
class EventStatistics:
    """The KV event publisher (``[events]``, kvbroker._server.events)."""

    endpoint: str
    replay_endpoint: str
    topic: str
    format: str
    next_seq: int = 0
    events_published: int = 0
    events_dropped: int = 0
    overflows: int = 0
    replay_requests: int = 0
    queued: int = 0
    replay_refused: int = 0  # malformed replay requests, or too many replays at once
    buffered_bytes: int = 0  # payload bytes kept for replay ([events] replay_buffer)
    authenticated: bool = False  # CURVE: only subscribers with a listed key


@dataclass(frozen=True)
class DiskTierStatistics:
    """The disk tier (``[tier.disk]``, kvbroker._server.disk_tier). ``objects`` counts every
    object with a copy written on disk, ``only_on_disk`` those not in a pool too; ``used`` is
    slot bytes (whole units, those being written included), ``bytes`` the objects' own."""

    directories: tuple[str, ...]
    capacity: int
    used: int
    objects: int
    only_on_disk: int = 0
    bytes: int = 0
    policy: str = "evicted"
    o_direct: bool = False  # False: buffered I/O (o_direct_problem says why)
    o_direct_problem: str | None = None
    writing_bytes: int = 0  # being written now
    index_pending: int = 0  # written, their index record not synced yet (lost to a crash)
    promoting: int = 0  # objects being read back now
    writes: int = 0
    written_bytes: int = 0
    written_back: int = 0  # copies written while the object stayed in its pool
    demoted: int = 0  # evictions from a pool that kept the object here
    promoted: int = 0  # objects read back into a pool
    promoted_bytes: int = 0
    promote_seconds: float = 0.0  # reads and verification of those, summed
    evicted: int = 0  # dropped from disk (room, quotas, evict --tier disk)
    dropped_damaged: int = 0  # slots that did not hash to their digest: never served
    skipped: int = 0  # evictions from a pool not kept here (no room, quota, busy)
    errors: int = 0  # failed reads, writes and index syncs
    recovered: int = 0  # objects the index vouched for at start
    recovered_dropped: int = 0  # index records dropped at start (damaged, unvouched)


@dataclass(frozen=True)
class SessionInfo:
    """A session (``retain`` on a request): the blocks it retains (``kvbroker._server.retention``)."""

    namespace: str
    name: str
    uid: int  # the tenant whose quota it counts against (who first named it)
    priority: int
    blocks: int
    bytes: int  # pages of the blocks it retains
    last_use: float
    expires_in: float  # seconds
    created_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RetentionStatistics:
    """Sessions together: bytes retained per pool against its cap ([sessions] pool_share),
    and why retention was dropped (tenant_quota, pool_share, expired, released) and why
    retained blocks were evicted (pool_full, watermark, quota, operator)."""

    sessions: int = 0
    retained_objects: int = 0
    retained_bytes: tuple[int, ...] = ()  # per pool index
    retained_cap: tuple[int, ...] = ()  # per pool index
    tenant_quota: int | None = None
    largest: tuple[SessionInfo, ...] = ()  # the largest sessions (at most 64)
    evicted: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Statistics:
    taken_at: float
    version: str
    pid: int
    started_at: float
    socket: str
    objects: int
    pending: int
    read_leases: int
    write_leases: int
    pools: tuple[PoolStatistics, ...]
    clients: tuple[ClientStatistics, ...]
    counters: Counters
    leases: tuple[LeaseInfo, ...] = ()
    transfers: tuple[TransferRecord, ...] = ()
    rings: tuple[RingStatistics, ...] = ()
    namespaces: tuple[NamespaceUsage, ...] = ()  # largest use first (at most 1000)
    arenas: int = 0  # write arenas lent to clients (their pages are in pools' leased_write)
    read_replicas: int = 0  # processes answering exists and unheld matches (named in hello)
    transfer: TransferStatistics | None = None  # [transfer] configured
    events: EventStatistics | None = None  # [events] publish configured
    disk: DiskTierStatistics | None = None  # [tier.disk] configured
    retention: RetentionStatistics | None = None  # sessions (kvbroker._server.retention)

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.pools)

    @property
    def used(self) -> int:
        return sum(p.used for p in self.pools)

    @property
    def uptime(self) -> float:
        return self.taken_at - self.started_at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Statistics:
        d = dict(data)
        d["pools"] = tuple(_build(PoolStatistics, p) for p in d.get("pools", ()))
        d["clients"] = tuple(_build(ClientStatistics, c) for c in d.get("clients", ()))
        d["leases"] = tuple(_build(LeaseInfo, x) for x in d.get("leases", ()))
        d["transfers"] = tuple(_build(TransferRecord, x) for x in d.get("transfers", ()))
        d["rings"] = tuple(_build(RingStatistics, x) for x in d.get("rings", ()))
        d["namespaces"] = tuple(_build(NamespaceUsage, x) for x in d.get("namespaces", ()))
        d["counters"] = _build(Counters, d.get("counters", {}))
        t = d.get("transfer")
        if t is not None:
            t = dict(t)
            t["peers"] = tuple(_build(PeerInfo, x) for x in t.get("peers", ()))
            d["transfer"] = _build(TransferStatistics, t)
        if d.get("events") is not None:
            d["events"] = _build(EventStatistics, d["events"])
        if d.get("disk") is not None:
            disk = dict(d["disk"])
            disk["directories"] = tuple(disk.get("directories", ()))
            d["disk"] = _build(DiskTierStatistics, disk)
        if d.get("retention") is not None:
            r = dict(d["retention"])
            r["largest"] = tuple(_build(SessionInfo, x) for x in r.get("largest", ()))
            for name in ("retained_bytes", "retained_cap"):
                r[name] = tuple(r.get(name, ()))
            d["retention"] = _build(RetentionStatistics, r)
        return _build(cls, d)


@dataclass(frozen=True)
class ObjectInfo:
    namespace: str
    key: str
    nbytes: int
    buffers: int
    pool: int
    readers: int
    created_at: float
    last_access: float
    meta: dict | None = None
    # {buffer: xxh3_64} recorded at seal; only ``lookup`` fills it (None: sealed without).
    checksums: dict | None = None
    # Only ``lookup`` fills these: {buffer: nbytes} in layout order, and the consume-claims
    # still to be released before the object is freed.
    buffer_sizes: dict | None = None
    consumers: int | None = None
    # Only ``list`` fills it: "dram" (in a pool), "disk" (on the disk tier only: a claim
    # brings it back first) or "dram+disk" (in a pool, with a copy on disk).
    tier: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObjectInfo:
        return _build(cls, data)
