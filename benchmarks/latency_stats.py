"""Latency figures shared by the benchmark scripts beside this file.

Standard library only: the peer drivers (mooncake_peer.py, lmcache_peer.py, kvcr_peer.py) run
under another project's Python, where kvbroker is not installed. The scripts import it as a
sibling (``python benchmarks/x.py`` puts this folder first on ``sys.path``; an importer by file
path puts it there itself).
"""

from __future__ import annotations

import statistics


def percentile(values, q):
    """Nearest-rank percentile of ``values`` (q in 0..1)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def stats(seconds, size):
    """``{"n", "median_ms", "p90_ms", "p99_ms", "GBps_at_median"}`` of the times ``seconds`` of
    ``size``-byte operations (GB/s use 10^9 bytes); None where there are no times."""
    if not seconds:
        return None
    med = statistics.median(seconds)
    return {
        "n": len(seconds),
        "median_ms": med * 1e3,
        "p90_ms": percentile(seconds, 0.9) * 1e3,
        "p99_ms": percentile(seconds, 0.99) * 1e3,
        "GBps_at_median": size / med / 1e9 if med > 0 else None,
    }
