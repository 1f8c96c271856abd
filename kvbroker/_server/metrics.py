"""Prometheus endpoint: the statistics snapshot in the text exposition format.

A custom collector turns one :class:`~kvbroker._wire.stats.Statistics` (the objects ``stat``
sends, built by :mod:`kvbroker._server.snapshot`) into metric families at scrape time, so
nothing is counted twice and the hot path pays nothing between scrapes. prometheus-client's
HTTP server runs in its own thread; the snapshot itself is taken on the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .._wire.stats import Statistics

__all__ = ["BrokerCollector", "MetricsServer"]

log = logging.getLogger("kvbroker.metrics")

# Counters field -> (metric name without _total, help)
_COUNTERS = {
    "publishes": ("kvbroker_publishes", "Objects sealed."),
    "claims": ("kvbroker_claims", "Read leases granted."),
    "bytes_in": ("kvbroker_published_bytes", "Bytes of objects sealed."),
    "bytes_out": ("kvbroker_claimed_bytes", "Bytes of objects claimed."),
    "hits": ("kvbroker_hits", "Claims and lookups that found their key."),
    "misses": ("kvbroker_misses", "Claims and lookups that did not find their key."),
    "evictions": ("kvbroker_evictions", "Objects evicted."),
    "evicted_bytes": ("kvbroker_evicted_bytes", "Bytes of objects evicted."),
    "aborts": ("kvbroker_aborts", "Write leases aborted or discarded."),
    "expired_leases": ("kvbroker_expired_leases", "Leases ended by their TTL."),
    "requests": ("kvbroker_requests", "Requests handled."),
    "errors": ("kvbroker_errors", "Requests answered with an error."),
    "replica_requests": (
        "kvbroker_replica_requests",
        "Requests answered by read replicas (in kvbroker_requests_total too).",
    ),
    "replica_exits": (
        "kvbroker_replica_exits",
        "Read replicas that exited (each is started again, with backoff).",
    ),
}

# PoolStatistics field -> (metric name, help)
_POOL_GAUGES = {
    "capacity": ("kvbroker_pool_capacity_bytes", "Size of the pool."),
    "used": ("kvbroker_pool_used_bytes", "Bytes allocated to objects and leases."),
    "free": ("kvbroker_pool_free_bytes", "Bytes free."),
    "quarantined": (
        "kvbroker_pool_quarantined_bytes",
        "Bytes held back from expired write leases of live writers.",
    ),
    "largest_free": ("kvbroker_pool_largest_free_bytes", "Largest free extent."),
    "fragmentation": ("kvbroker_pool_fragmentation_ratio", "1 - largest free extent / free."),
    "objects": ("kvbroker_pool_objects", "Sealed objects in the pool."),
    "high_watermark": ("kvbroker_pool_high_watermark_ratio", "Eviction starts above this use."),
    "low_watermark": ("kvbroker_pool_low_watermark_ratio", "Eviction stops at this use."),
}


class BrokerCollector(Collector):
    """Yields kvbroker_* metric families from a fresh snapshot at every scrape."""

    def __init__(self, statistics: Callable[[], Statistics]) -> None:
        self._statistics = statistics

    def collect(self) -> Iterator[Metric]:
        s = self._statistics()
        info = InfoMetricFamily("kvbroker", "Daemon version and socket.")
        info.add_metric([], {"version": s.version, "socket": s.socket})
        yield info
        yield GaugeMetricFamily(
            "kvbroker_start_time_seconds",
            "When the daemon started (Unix time).",
            value=s.started_at,
        )
        yield GaugeMetricFamily("kvbroker_objects", "Sealed objects.", value=s.objects)
        yield GaugeMetricFamily(
            "kvbroker_pending_objects", "Objects reserved, not sealed yet.", value=s.pending
        )
        yield GaugeMetricFamily("kvbroker_clients", "Connected clients.", value=len(s.clients))
        yield GaugeMetricFamily(
            "kvbroker_read_replicas", "Read replicas serving.", value=s.read_replicas
        )
        leases = GaugeMetricFamily("kvbroker_leases", "Leases held.", labels=["kind"])
        leases.add_metric(["read"], s.read_leases)
        leases.add_metric(["write"], s.write_leases)
        yield leases
        for field, (name, doc) in _POOL_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["pool"])
            for p in s.pools:
                g.add_metric([str(p.index)], getattr(p, field))
            yield g
        leased = GaugeMetricFamily(
            "kvbroker_pool_leased_bytes", "Bytes under leases.", labels=["pool", "kind"]
        )
        for p in s.pools:
            leased.add_metric([str(p.index), "read"], p.leased_read)
            leased.add_metric([str(p.index), "write"], p.leased_write)
        yield leased
        for field, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(s.counters, field))
        yield from _transfer(s)
        yield from _retention(s)
        yield from _disk(s)


def _retention(s: Statistics) -> Iterator[Metric]:
    """Sessions (kvbroker._server.retention): what they retain, against what they may."""
    r = s.retention
    if r is None:
        return
    yield GaugeMetricFamily("kvbroker_sessions", "Sessions retaining blocks.", value=r.sessions)
    yield GaugeMetricFamily(
        "kvbroker_retained_objects", "Objects sessions retain.", value=r.retained_objects
    )
    for name, doc, values in (
        ("kvbroker_retained_bytes", "Bytes sessions retain in the pool.", r.retained_bytes),
        (
            "kvbroker_retained_cap_bytes",
            "The most sessions may retain in the pool ([sessions] pool_share).",
            r.retained_cap,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["pool"])
        for i, v in enumerate(values):
            g.add_metric([str(i)], v)
        yield g
    evicted = CounterMetricFamily(
        "kvbroker_retained_evictions",
        "Retained objects evicted, by why (pool_full, watermark, quota, operator).",
        labels=["reason"],
    )
    for why, n in sorted(r.evicted.items()):
        evicted.add_metric([why], n)
    yield evicted
    dropped = CounterMetricFamily(
        "kvbroker_retention_dropped",
        "Objects that lost a session's "
        "retention, by why (expired, released, tenant_quota, "
        "pool_share).",
        labels=["reason"],
    )
    for why, n in sorted(r.dropped.items()):
        dropped.add_metric([why], n)
    yield dropped


# TransferStatistics field -> (metric name, help); counters end in _total once exposed
_TRANSFER_GAUGES = {
    "serving": ("kvbroker_peer_connections_served", "Peer brokers connected to this one."),
    "leases_served": ("kvbroker_peer_leases", "Leases held here for peer brokers."),
    "in_flight": ("kvbroker_pulls_in_flight", "Pulls from peer brokers under way."),
}
_TRANSFER_COUNTERS = {
    "pulls": ("kvbroker_pulls", "Pulls from peer brokers that sealed their objects."),
    "bytes_pulled": ("kvbroker_pulled_bytes", "Bytes pulled from peer brokers (NIXL READ)."),
    "pins_served": ("kvbroker_peer_pins", "Pins of this broker's objects for peers."),
    "bytes_served": ("kvbroker_served_bytes", "Bytes of objects peers read and released."),
    "refused": (
        "kvbroker_peer_refused",
        "Peer connections refused (too many handshakes, a failed TLS handshake or certificate, not a peer).",
    ),
}
_EVENT_COUNTERS = {
    "events_published": ("kvbroker_kv_events", "KV events sent to subscribers."),
    "events_dropped": ("kvbroker_kv_events_dropped", "KV events dropped (queue full)."),
    "replay_requests": ("kvbroker_kv_event_replays", "Replay requests answered."),
    "replay_refused": (
        "kvbroker_kv_event_replays_refused",
        "Replay requests refused (malformed, or too many at once).",
    ),
}


# DiskTierStatistics field -> (metric name, help)
_DISK_GAUGES = {
    "capacity": ("kvbroker_disk_capacity_bytes", "Bytes the disk tier's slot files hold."),
    "used": ("kvbroker_disk_used_bytes", "Bytes of disk slots in use (being written too)."),
    "objects": ("kvbroker_disk_objects", "Objects with a copy on disk."),
    "only_on_disk": ("kvbroker_disk_only_objects", "Objects on disk and in no pool."),
    "writing_bytes": ("kvbroker_disk_writing_bytes", "Bytes being written to disk."),
    "promoting": ("kvbroker_disk_promoting", "Objects being read back into a pool."),
    "o_direct": ("kvbroker_disk_o_direct", "1: the disk tier uses O_DIRECT; 0: buffered I/O."),
}
_DISK_COUNTERS = {
    "written_bytes": ("kvbroker_disk_written_bytes", "Bytes written to disk slots."),
    "demoted": ("kvbroker_disk_demotions", "Evictions from a pool that kept the object on disk."),
    "promoted": ("kvbroker_disk_promotions", "Objects read back from disk into a pool."),
    "promoted_bytes": ("kvbroker_disk_promoted_bytes", "Bytes read back from disk."),
    "promote_seconds": ("kvbroker_disk_promote_seconds", "Seconds of promotions' reads."),
    "evicted": ("kvbroker_disk_evictions", "Objects dropped from disk (room, quota, evict)."),
    "dropped_damaged": (
        "kvbroker_disk_damaged",
        "Disk slots dropped for not hashing to their digest (never served).",
    ),
    "skipped": ("kvbroker_disk_skipped", "Evictions from a pool not kept on disk."),
    "errors": ("kvbroker_disk_errors", "Failed disk reads, writes and index syncs."),
}


def _disk(s: Statistics) -> Iterator[Metric]:
    d = s.disk
    if d is None:
        return
    for field, (name, doc) in _DISK_GAUGES.items():
        yield GaugeMetricFamily(name, doc, value=float(getattr(d, field)))
    for field, (name, doc) in _DISK_COUNTERS.items():
        yield CounterMetricFamily(name, doc, value=getattr(d, field))


def _transfer(s: Statistics) -> Iterator[Metric]:
    t = s.transfer
    if t is not None:
        for field, (name, doc) in _TRANSFER_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=getattr(t, field))
        for field, (name, doc) in _TRANSFER_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(t, field))
        fails = CounterMetricFamily(
            "kvbroker_pull_failures",
            "Pulls that failed (nothing sealed), by error code.",
            labels=["code"],
        )
        for code, n in sorted((t.failures_by_code or {}).items()):
            fails.add_metric([code], n)
        yield fails
        peers = GaugeMetricFamily(
            "kvbroker_peer_up",
            "Peer brokers this one pulls from (1: connected).",
            labels=["peer", "node"],
        )
        for p in t.peers:
            peers.add_metric([p.address, p.node], 1 if p.connected else 0)
        yield peers
    e = s.events
    if e is not None:
        for field, (name, doc) in _EVENT_COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=getattr(e, field))
        yield GaugeMetricFamily(
            "kvbroker_kv_events_queued", "KV events waiting to be sent.", value=e.queued
        )
        yield GaugeMetricFamily(
            "kvbroker_kv_event_replay_buffer_bytes",
            "Payload bytes of past batches kept for replay.",
            value=e.buffered_bytes,
        )


class MetricsServer:
    """``GET /metrics`` on (host, port) in a daemon thread; :meth:`close` stops it."""

    def __init__(self, address: tuple[str, int], statistics: Callable[[], Statistics]):
        host, port = address
        # A private registry: no process/platform collectors of this interpreter mixed in.
        registry = CollectorRegistry(auto_describe=False)
        registry.register(BrokerCollector(statistics))
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host, self.port = host, self._server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
