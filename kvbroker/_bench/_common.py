"""What every benchmark scenario shares: the machine description, a private daemon, the
result record (rows + targets), the text table and the JSON file.

Every scenario measures its own baseline in the same run (memcpy for transfers, a small
put+claim for prefix matches, the smallest directory for scale), so the figures that matter
are ratios: these machines are shared and noisy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def checkout_commit(root: str | None = None) -> str:
    """The commit of the checkout at ``root`` (default: this source tree) that a results file
    records: short hash, "+dirty" when tracked code differs from it (results and docs do not
    count: a run rewrites them), "unknown" without git (a copied tree)."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    git = ["git", "-C", root]
    try:
        sha = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                *git,
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)benchmarks/results",
                ":(exclude)docs",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def invocation() -> str:
    """The command line of this process, as a results file records it."""
    import shlex

    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "kvbroker"
    if prog == "__main__.py":
        prog = "python -m kvbroker"
    return " ".join([prog, *(shlex.quote(a) for a in sys.argv[1:])])


def measured_commit() -> str:
    """What a results file records as its commit: ``$KVBROKER_COMMIT`` where the tree was
    copied without git (a device machine), else :func:`checkout_commit`."""
    return os.environ.get("KVBROKER_COMMIT") or checkout_commit()


def run_conditions() -> dict[str, Any]:
    """What else the machine was doing: the 1-minute load average and the CPU pressure line
    (``/proc/pressure/cpu``, PSI); read before and after a run, since both move every absolute
    figure and switch the clients' and daemon's busy-polling (:mod:`kvbroker._cpu`)."""
    load = psi = None
    with contextlib.suppress(OSError):
        load = os.getloadavg()[0]
    with contextlib.suppress(OSError):
        with open("/proc/pressure/cpu") as f:
            psi = f.readline().strip()
    return {
        "loadavg_1min": load,
        "cpu_pressure": psi,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def machine_info() -> dict[str, Any]:
    """CPU model, core count and the versions that shape the figures."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    import msgpack
    import numpy
    import xxhash

    from .._version import __version__
    from .._wire.checksum import simd_dispatch

    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    load = None
    with contextlib.suppress(OSError):
        load = os.getloadavg()[0]  # other work on the same cores moves every absolute figure
    return {
        "host": platform.node(),
        "loadavg_1min": load,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        # the host checksum's speed: a build without run-time AVX2 / AVX-512 hashes 2.7x slower
        # on an H100 host's Xeon (benchmarks/results/xxhash-ab/)
        "xxhash": xxhash.VERSION,
        "xxhash_simd_dispatch": simd_dispatch(),
        "kvbroker": __version__,
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


@contextlib.contextmanager
def spawned_daemon(
    pool_size: str = "1G", *extra: str, env: dict | None = None, launcher: list[str] | None = None
) -> Iterator[str]:
    """A private daemon for the benchmark, stopped on exit; yields its socket path.
    ``env``: extra environment (``KVBROKER_*`` settings). ``launcher``: what runs
    ``serve ...`` (default ``python -m kvbroker``)."""
    from .. import BrokerUnavailable, Client

    d = tempfile.mkdtemp(prefix="kvb-bench-")
    path = os.path.join(d, "kvb.sock")
    proc = subprocess.Popen(
        [
            *(launcher or [sys.executable, "-m", "kvbroker"]),
            "serve",
            "--socket",
            path,
            "--pool-size",
            pool_size,
            "--log-level",
            "warning",
            *extra,
        ],
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 120  # a big pool is pre-faulted before the socket opens
        while True:
            try:
                Client(path, map_pools=False).close()
                break
            except BrokerUnavailable:
                if proc.poll() is not None:
                    raise RuntimeError("the benchmark daemon failed to start") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("the benchmark daemon did not open its socket") from None
                time.sleep(0.02)
        yield path
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(OSError):
            os.rmdir(d)


def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def timed(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn``."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


@dataclass
class Target:
    """One figure the project promises: ``measured`` compared with ``goal`` (``op``: >= or <=)."""

    name: str
    measured: float
    goal: float
    op: str = ">="
    unit: str = "x"
    # How ``measured`` is printed: a format spec, or "ratio" (format_value: two decimals, cut),
    # which a ratio (unit "x") gets unless told otherwise.
    fmt: str | None = None

    @property
    def met(self) -> bool:
        return self.measured >= self.goal if self.op == ">=" else self.measured <= self.goal

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "goal": self.goal,
            "op": self.op,
            "unit": self.unit,
            "met": self.met,
        }

    def line(self) -> str:
        mark = "met" if self.met else "MISSED"
        fmt = self.fmt or ("ratio" if self.unit == "x" else ".3g")
        return (
            f"{self.name}: {format_value(self.measured, fmt)}{self.unit} "
            f"(target {self.op} {self.goal:.3g}{self.unit}) {mark}"
        )


@dataclass
class Result:
    """What one scenario measured: rows for the table and the JSON, targets, parameters.

    ``columns``: (row key, header, format) triples; format "size" prints bytes as KiB/MiB,
    "ratio" two decimals never rounded up (:func:`format_value`).
    ``tables``: further named row sets (e.g. the hit-rate workload of ``prefix``).
    """

    scenario: str
    rows: list[dict[str, Any]]
    columns: list[tuple[str, str, str]]
    params: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    tables: dict[str, tuple[list[dict[str, Any]], list[tuple[str, str, str]]]] = field(
        default_factory=dict
    )
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        parts = [format_table(self.rows, self.columns)]
        for name, (rows, cols) in self.tables.items():
            parts += ["", f"{name}:", format_table(rows, cols)]
        if self.targets:
            parts += ["", *(t.line() for t in self.targets)]
        parts += self.notes
        return "\n".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "commit": measured_commit(),
            "command": invocation(),
            "machine": machine_info(),
            "params": self.params,
            "rows": self.rows,
            **{name: rows for name, (rows, _) in self.tables.items()},
            "targets": [t.as_dict() for t in self.targets],
            "notes": self.notes,
            # how the table is printed, so a report can be rebuilt from the JSON alone
            "columns": {"rows": self.columns, **{n: c for n, (_, c) in self.tables.items()}},
            **self.extra,
        }

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=2)
            f.write("\n")


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table; ``columns``: (key, header, format) triples."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    lines = ["  ".join(f"{h:>{w}}" for (_, h, _), w in zip(columns, widths, strict=True))]
    for row in rows:
        cells = []
        for (key, _, fmt), w in zip(columns, widths, strict=True):
            v = row.get(key)
            if v is None:
                s = "-"
            else:
                s = format_value(v, fmt)
            cells.append(f"{s:>{w}}")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def format_value(v, fmt: str) -> str:
    """``v`` as a table cell: "size" prints bytes as KiB/MiB, "ratio" two decimals cut (never
    rounded up: 0.899 prints 0.89, so a figure shown as meeting a target does), else
    ``format(v, fmt)``."""
    if fmt == "size":
        return human_size(v)
    if fmt == "ratio":
        # round(.., 6) first: 0.29 * 100 is 28.999999999999996 in binary floating point
        return f"{math.floor(round(v * 100, 6)) / 100:.2f}"
    return format(v, fmt)


def ratio(v: float) -> str:
    """A ratio as results print it: two decimals, cut (:func:`format_value`'s "ratio")."""
    return format_value(v, "ratio")


def ratio_span(values: Sequence[float]) -> str:
    """Per-round ratios as results print them: "median (least–most)", each cut (:func:`ratio`)."""
    return f"{ratio(median(values))} ({ratio(min(values))}–{ratio(max(values))})"


def write_results(prefix: str | None, result: dict, markdown: str) -> None:
    """Print ``markdown``; with ``prefix``, write ``PREFIX.json`` (``result``) and ``PREFIX.md``
    beside it (a driver's ``--out PREFIX``)."""
    print(markdown)
    if prefix:
        with open(prefix + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(prefix + ".md", "w") as f:
            f.write(markdown)


def human_size(n: int) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n} B"


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of ``pid`` in bytes (from /proc/<pid>/status)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out


def save_figure(fig, plt, out_dir: str, name: str) -> str:
    """Write ``fig`` as ``out_dir/name`` (PNG) and close it; returns the path."""
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
