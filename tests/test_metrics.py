"""``serve --metrics``: the statistics snapshot in Prometheus' text format, over loopback."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


def _metrics_url(d) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        m = re.search(r"metrics on (http://\S+)", d.log())
        if m:
            return m.group(1)
        time.sleep(0.05)
    raise AssertionError(d.log())


def _scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def _value(samples, name, **labels) -> float:
    for s in samples[name]:
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, labels))


def test_metrics_scraped_over_loopback(make_daemon):
    d = make_daemon(
        "--pool-size", "16M", "--page-size", "4K", "--pools", "2", "--metrics", ":0"
    )  # a bare port: loopback, any free port for the test
    url = _metrics_url(d)
    assert url.startswith("http://127.0.0.1:")
    with d.client(arena_size=0) as c:  # no write arena: the pool holds the object alone
        c.put("a", {"x": b"x" * 10000})
        lease = c.claim("a")
        s = _scrape(url)
        lease.release()
    assert _value(s, "kvbroker_publishes_total") == 1
    assert _value(s, "kvbroker_claims_total") == 1
    assert _value(s, "kvbroker_objects") == 1
    assert _value(s, "kvbroker_clients") == 1
    assert _value(s, "kvbroker_leases", kind="read") == 1
    assert _value(s, "kvbroker_pool_capacity_bytes", pool="1") == 16 << 20
    used = _value(s, "kvbroker_pool_used_bytes", pool="0") + _value(
        s, "kvbroker_pool_used_bytes", pool="1"
    )
    assert used == 12288  # 10000 bytes in 4 KiB pages
    assert _value(s, "kvbroker_pool_high_watermark_ratio", pool="0") == 0.95
    assert _value(s, "kvbroker_read_replicas") == 0  # (tests/conftest.py: none by default)
    assert _value(s, "kvbroker_replica_requests_total") == 0
    assert _value(s, "kvbroker_replica_exits_total") == 0
    assert s["kvbroker_info"][0].labels["socket"] == d.socket_path
    assert "python_info" not in s  # only the daemon's own families
    assert d.stop() == 0


def test_metrics_are_off_by_default(daemon):
    assert "metrics on" not in daemon.log()


# Every counter family and the `stat` counter it must show, written out here (not read from
# the exporter's own table, so a family wired to the wrong or a missing counter is caught).
_COUNTER_FAMILIES = {
    "kvbroker_publishes_total": "publishes",
    "kvbroker_claims_total": "claims",
    "kvbroker_published_bytes_total": "bytes_in",
    "kvbroker_claimed_bytes_total": "bytes_out",
    "kvbroker_hits_total": "hits",
    "kvbroker_misses_total": "misses",
    "kvbroker_evictions_total": "evictions",
    "kvbroker_evicted_bytes_total": "evicted_bytes",
    "kvbroker_aborts_total": "aborts",
    "kvbroker_errors_total": "errors",
}


def test_counter_families_equal_the_stat_counters(make_daemon):
    from kvbroker.errors import BadRequest, NotFound

    d = make_daemon("--pool-size", "1M", "--page-size", "4K", "--metrics", ":0")
    url = _metrics_url(d)
    with d.client(arena_size=0) as c:
        for i in range(40):  # 40 x 64 KiB through a 1 MiB pool: evictions
            c.put(f"k{i}", {"x": b"x" * (64 << 10)})
        with c.claim("k39"):
            pass
        with pytest.raises(NotFound):
            c.claim("nope")
        c.reserve("aborted", {"x": 4096}).abort()
        with pytest.raises(BadRequest):
            c.claim("k39", select="(")  # a bad regex: an error reply
        stat = c.stat().counters
        s = _scrape(url)
    for family, counter in _COUNTER_FAMILIES.items():
        want = getattr(stat, counter)
        assert want > 0, f"the test did not exercise {counter}"
        assert _value(s, family) == want, (family, counter)


def test_every_metric_the_docs_name_is_exposed():
    """A metric the documents name (README.md, docs/) is one a scrape exposes, as exposed:
    a counter with its _total. Every optional part configured, so each family is there."""
    import dataclasses
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest

    from kvbroker._server.metrics import BrokerCollector
    from kvbroker._wire.stats import (
        DiskTierStatistics,
        EventStatistics,
        PeerInfo,
        TransferStatistics,
    )
    from kvbroker.tui.testing import make_retention, make_snapshot

    snap = dataclasses.replace(
        make_snapshot(1, retention=make_retention()),
        transfer=TransferStatistics(
            "node-a",
            "127.0.0.1:7070",
            (PeerInfo("10.0.0.2:7070", "node-b", True),),
            failures_by_code={"peer_unavailable": 1},
        ),
        events=EventStatistics("tcp://*:5557", "tcp://*:5558", "kv@node-a@m", "positional"),
        disk=DiskTierStatistics(("/var/lib/kvbroker/nvme0",), 1 << 30, 0, 0),
    )
    registry = CollectorRegistry()
    registry.register(BrokerCollector(lambda: snap))
    exposed = {
        family.name + ("_total" if family.type == "counter" else "")
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    } | {"kvbroker_info"}
    root = Path(__file__).resolve().parent.parent
    # kvbroker_* words of the documents that are not metrics: pytest fixtures, vLLM's flat
    # request arguments
    not_metrics = {f"kvbroker_{w}" for w in ("daemon", "client", "session", "retain", "priority")}
    named = {
        name
        for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        if page.name != "performance.md"  # its table rows name benchmark paths
        for name in re.findall(r"`(kvbroker_[a-z_]*[a-z])[`{ ]", page.read_text())
    } - not_metrics
    assert len(named) > 15 and not named - exposed, sorted(named - exposed)
