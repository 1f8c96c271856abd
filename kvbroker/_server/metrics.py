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
}

# PoolStatistics field -> (metric name, help)
_POOL_GAUGES = {
    "capacity": ("kvbroker_pool_capacity_bytes", "Size of the pool."),
    "used": ("kvbroker_pool_used_bytes", "Bytes allocated to objects and leases."),
    "free": ("kvbroker_pool_free_bytes", "Bytes free."),
    "quarantined": ("kvbroker_pool_quarantined_bytes",
                    "Bytes held back from expired write leases of live writers."),
    "largest_free": ("kvbroker_pool_largest_free_bytes", "Largest free extent."),
    "fragmentation": ("kvbroker_pool_fragmentation_ratio", "1 - largest free extent / free."),
    "objects": ("kvbroker_pool_objects", "Sealed objects in the pool."),
    "high_watermark": ("kvbroker_pool_high_watermark_ratio", "Eviction starts above this use."),
    "low_watermark": ("kvbroker_pool_low_watermark_ratio", "Eviction stops at this use."),
}  # fmt: skip


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
            "kvbroker_start_time_seconds", "When the daemon started (Unix time).",
            value=s.started_at,
        )  # fmt: skip
        yield GaugeMetricFamily("kvbroker_objects", "Sealed objects.", value=s.objects)
        yield GaugeMetricFamily(
            "kvbroker_pending_objects", "Objects reserved, not sealed yet.", value=s.pending
        )
        yield GaugeMetricFamily("kvbroker_clients", "Connected clients.", value=len(s.clients))
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
