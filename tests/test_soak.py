"""Soak (benchmarks/soak.py): 16 clients publishing, claiming, matching prefixes and evicting
under memory pressure. A short run always; the full 10 minutes with KVBROKER_SOAK_LONG=1."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import soak  # noqa: E402


def check(res: dict) -> None:
    assert res["errors"] == 0, res["error_samples"]
    assert res["mismatches"] == 0, res["mismatch_samples"]
    assert res["daemon_alive_at_end"] and res["daemon_exit_status"] == 0
    acc = res["accounting"]
    assert acc["exact"], acc
    # It really ran under pressure, on every path.
    assert acc["daemon_counters"]["evictions"] > 0
    assert acc["daemon_counters"]["prefix_hit_blocks"] > 0
    assert all(res["ops_by_kind"].get(k, 0) > 0 for k in ("put", "get", "prefix", "evict"))
    assert res["bytes_claimed"] > 0
    # operations that did their work: a get that found nothing is reported, not counted
    kinds = res["ops_by_kind"]
    assert res["ops"] == sum(kinds[k] for k in ("put", "get", "prefix", "evict"))
    assert res["gets_found"] == kinds["get"] > 0
    assert res["gets_missed"] == res["expected_outcomes"].get("get_not_found", 0)
    assert res["gets_found"] + res["gets_missed"] == res["tried_by_kind"]["get"]  # (no errors)
    # every miss is the daemon's too (prefix matches that found nothing add to its count)
    assert res["gets_missed"] <= acc["daemon_counters"]["misses"]
    assert res["bytes_got"] >= res["gets_found"] * 2048  # each found get read >= 2 KiB
    # what else the machine did is in the file (load and CPU pressure before and after)
    for when in ("conditions_before", "conditions_after"):
        assert set(res[when]) == {"loadavg_1min", "cpu_pressure", "when"}, res.get(when)
        assert res[when]["loadavg_1min"] is not None


def test_soak_short():
    check(soak.run(clients=16, duration=float(os.environ.get("KVBROKER_SOAK_SECONDS", "15"))))


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("KVBROKER_SOAK_LONG"),
    reason="10-minute soak: set KVBROKER_SOAK_LONG=1 (or run benchmarks/soak.py)",
)
@pytest.mark.timeout(900)
def test_soak_ten_minutes():
    check(soak.run(clients=16, duration=600.0))
