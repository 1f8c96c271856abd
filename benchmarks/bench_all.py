"""Run every CPU scenario of ``kvbroker bench`` and write the committed results.

For each scenario: ``kvbroker bench NAME ... --json-out benchmarks/results/bench-NAME-cpu.json
--plot docs/``; then benchmarks/results/bench-cpu.md is rebuilt from the JSON files (machine,
versions, the exact command, the table, the targets), and where a transfer target is missed
the profile of that size (benchmarks/profile_transfer.py) is appended to it. Last,
docs/performance.md is regenerated from every results file (benchmarks/performance_doc.py).

    .venv/bin/python benchmarks/bench_all.py --mooncake-python /tmp/mc/bin/python
    .venv/bin/python benchmarks/bench_all.py --only scale --report-only   # rebuild the .md

The peer scenario runs benchmarks/mooncake_peer.py under --mooncake-python: Mooncake in an
environment of its own, its libraries on LD_LIBRARY_PATH (docs/operating.md, "Comparing with
Mooncake"), and LMCache's and KVCR's drivers under --lmcache-python and --kvcr-python
("Comparing with LMCache", "Comparing with KVCR").
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from kvbroker._bench import format_table
from kvbroker._bench._common import format_value

sys.path.insert(0, str(Path(__file__).resolve().parent))
import performance_doc  # benchmarks/performance_doc.py, beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
ORDER = ("transfer", "rpc", "scale", "prefix", "tp", "peer")


def commands(
    mooncake_python: str | None, lmcache_python: str | None = None, kvcr_python: str | None = None
) -> dict[str, list[str]]:
    cmds = {
        "transfer": ["transfer"],
        "rpc": ["rpc"],
        "scale": ["scale"],
        "prefix": ["prefix"],
        "tp": ["tp"],
    }
    peers = [
        ("--mooncake-python", mooncake_python),
        ("--lmcache-python", lmcache_python),
        ("--kvcr-python", kvcr_python),
    ]
    if any(python for _, python in peers):
        cmds["peer"] = [
            "peer",
            *(a for opt, python in peers if python for a in (opt, python)),
            "--rounds",
            "3",
        ]
    return cmds


def wait_for_quiet(max_load: float | None, patience: float = 600.0) -> None:
    """Wait (bounded) until the 1-minute load average drops to ``max_load``: on a shared
    machine, start each scenario in a quiet moment. The load is recorded in the JSON."""
    if max_load is None:
        return
    import time

    end = time.monotonic() + patience
    while os.getloadavg()[0] > max_load and time.monotonic() < end:
        time.sleep(5)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


def run(name: str, args: list[str]) -> None:
    out = RESULTS / f"bench-{name}-cpu.json"
    argv = [
        "kvbroker",
        "bench",
        *args,
        "--json-out",
        str(out.relative_to(ROOT)),
        "--plot",
        str(DOCS.relative_to(ROOT)),
    ]
    print("$", shlex.join(argv), flush=True)
    subprocess.run([sys.executable, "-m", "kvbroker", *argv[1:]], cwd=ROOT, check=True)
    data = json.loads(out.read_text())
    data["command"] = shlex.join(argv)
    out.write_text(json.dumps(data, indent=2) + "\n")


def plot_gpu() -> None:
    """docs/gpu.png from the committed GPU results (benchmarks/bench_gpu.py on a GPU host):
    the H100 run (this round's code; the H200 x2 one is an earlier commit's, kept as a record)."""
    from kvbroker._bench import plot_result, scenario

    path = next(
        (p for p in (RESULTS / "gpu-h100.json", RESULTS / "gpu-h200.json") if p.exists()), None
    )
    if path is not None:
        raw = json.loads(path.read_text())
        rows = scenario("gpu").rows_from(raw)
        print(
            "wrote",
            *plot_result(
                {"scenario": "gpu", "rows": rows, "params": {"device": raw["device"]}}, str(DOCS)
            ),
        )


def section(data: dict) -> list[str]:
    m = data["machine"]
    cols = {k: [tuple(c) for c in v] for k, v in data["columns"].items()}
    load = m.get("loadavg_1min")
    lines = [
        f"## {data['scenario']}",
        "",
        f"`{data.get('command', 'kvbroker bench ' + data['scenario'])}` — {m['when']}, "
        f"kvbroker {m['kvbroker']}, Python {m['python']}, numpy {m['numpy']}"
        + (f"; load average {load:.1f} on {m['cores']} cores when it ended" if load else ""),
        "",
        "```",
        format_table(data["rows"], cols["rows"]),
    ]
    for name, c in cols.items():
        if name != "rows":
            lines += ["", f"{name}:", format_table(data[name], c)]
    lines += ["```", ""]
    for t in data["targets"]:
        mark = "met" if t["met"] else "**missed**"
        lines.append(
            f"- {t['name']}: {_measured(t)}{t['unit']} "
            f"(target {t['op']} {t['goal']:.3g}{t['unit']}) — {mark}"
        )
    lines += [f"- {n}" for n in data.get("notes", [])]
    return lines + [""]


def _measured(target: dict) -> str:
    """A target's measured value as the target lines print it: ratios cut to two decimals."""
    return format_value(target["measured"], "ratio" if target["unit"] == "x" else ".3g")


def report(profiles: list[str]) -> str:
    found = [
        json.loads((RESULTS / f"bench-{n}-cpu.json").read_text())
        for n in ORDER
        if (RESULTS / f"bench-{n}-cpu.json").exists()
    ]
    if not found:
        return ""
    m = found[0]["machine"]
    lines = [
        "# kvbroker benchmarks, CPU",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, "
        f"Linux {m['kernel']} (a shared VM: other work ran on the same cores). "
        "Every figure below is a ratio measured side by side in one run; single absolute "
        "figures move by ±20% between runs. Charts: docs/*.png (made by `--plot docs`).",
        "Rebuild everything: `.venv/bin/python benchmarks/bench_all.py "
        "--mooncake-python /tmp/mc/bin/python` (Mooncake's driver: benchmarks/mooncake_peer.py; "
        'its set-up: docs/operating.md, "Comparing with Mooncake").',
        # (from the results, not this checkout: --report-only may run at a later commit)
        f"Commit measured: {', '.join(sorted({d.get('commit', 'unknown') for d in found}))}.",
        "",
    ]
    for data in found:
        lines += section(data)
    if profiles:
        lines += ["## Profiles of missed transfer targets", "", *profiles]
    return "\n".join(lines) + "\n"


def summary() -> str:
    """The table of targets, from the result files: figure, measured, target, command."""
    lines = ["| figure | measured | target | reproduce |", "|---|---|---|---|"]
    for n in ORDER:
        p = RESULTS / f"bench-{n}-cpu.json"
        if not p.exists():
            continue
        data = json.loads(p.read_text())
        cmd = data.get("command", f"kvbroker bench {n}").split(" --json-out")[0]
        for t in data["targets"]:
            mark = "" if t["met"] else " **(missed)**"
            unit = "×" if t["unit"] == "x" else t["unit"]
            op = t["op"].replace(">=", "≥").replace("<=", "≤")
            lines.append(
                f"| {t['name']} | {_measured(t)}{unit}{mark} | "
                f"{op} {t['goal']:.3g}{unit} | `{cmd}` |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake-python", help="Python with Mooncake installed (peer scenario)")
    ap.add_argument("--lmcache-python", help="Python with the lmcache wheel (peer scenario)")
    ap.add_argument("--kvcr-python", help="Python with the kvcr wheel and NIXL (peer scenario)")
    ap.add_argument("--only", action="append", choices=ORDER)
    ap.add_argument("--report-only", action="store_true", help="only rebuild bench-cpu.md")
    ap.add_argument("--summary", action="store_true", help="print the table of targets")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--max-load", type=float, help="wait (up to 10 min) for a load this low")
    a = ap.parse_args()
    if a.summary:
        print(summary())
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    DOCS.mkdir(exist_ok=True)
    if not a.report_only:
        for name, args in commands(a.mooncake_python, a.lmcache_python, a.kvcr_python).items():
            if not a.only or name in a.only:
                wait_for_quiet(a.max_load)
                run(name, args)
    plot_gpu()
    profiles = []
    missed = set()
    for n in ("transfer", "peer"):
        p = RESULTS / f"bench-{n}-cpu.json"
        if p.exists():
            for t in json.loads(p.read_text())["targets"]:
                if not t["met"]:
                    missed.add("32M" if t["name"].startswith("32 MiB") else "256K")
    if missed and not a.no_profile:
        for size in sorted(missed):
            cmd = [
                sys.executable,
                "benchmarks/profile_transfer.py",
                "--size",
                size,
                "--seconds",
                "4",
            ]
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
            profiles.append(f"`{shlex.join(['python', *cmd[1:]])}`\n\n{p.stdout}")
    text = report(profiles)
    (RESULTS / "bench-cpu.md").write_text(text)
    print(f"wrote {RESULTS / 'bench-cpu.md'}")
    print("wrote", performance_doc.write(DOCS / "performance.md"))


if __name__ == "__main__":
    main()
