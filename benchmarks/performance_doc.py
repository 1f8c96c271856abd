"""docs/performance.md, generated from the committed files in benchmarks/results/.

One table per scenario, each read from the results of one run (so one commit), with the
machine and the command that produced it as that file records them. Nothing here is typed
by hand: a new run's files make a new page. ``bench_all.py`` calls this after a run;
``tests/test_performance_doc.py`` fails when the committed page is not what this writes.

    .venv/bin/python benchmarks/performance_doc.py           # rewrite docs/performance.md
    .venv/bin/python benchmarks/performance_doc.py --check   # exit 1 if it is out of date

Ratios are printed as the results do (two decimals, cut, never rounded up). A ratio sits
beside the times it was computed from, or the table says how it was computed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from kvbroker._bench._common import format_value

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"
CPU_SCENARIOS = ("transfer", "rpc", "scale", "prefix", "tp", "peer")


def ratio(v: float) -> str:
    return format_value(v, "ratio")


def size(n: int) -> str:
    return format_value(n, "size")


def cell(v, fmt: str) -> str:
    return "–" if v is None else format_value(v, fmt)


def amount(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def load(name: str) -> dict | None:
    p = RESULTS / name
    return json.loads(p.read_text()) if p.exists() else None


def source(
    name: str, commit: str, machine: str, command: str, data: dict | None = None
) -> list[str]:
    """Where a table comes from: commit, machine, command, file; with ``data`` (the results
    file), the load and CPU pressure it ran under, or that the file does not say."""
    where = f"Commit `{commit}`; {machine}; `{command}` (`benchmarks/results/{name}`)"
    if data is not None:
        where += f"; {conditions(data)}"
    return [where + ".", ""]


def source_after_load(name: str, data: dict) -> list[str]:
    """:func:`source` of a run that recorded the host's conditions before and after it: the
    machine with the load after the run, then the CPU pressure after it."""
    before, after = data["conditions_before"], data["conditions_after"]
    machine = cpu_machine({**data["machine"], "loadavg_1min": after["loadavg_1min"]})
    return source(name, data["commit"], machine, data["command"]) + [
        f"CPU pressure after the run: `{after['cpu_pressure']}` (load "
        f"{before['loadavg_1min']:.1f} before).",
        "",
    ]


def psi_avg60(line: str | None) -> str | None:
    """The 60-second average of a ``/proc/pressure/cpu`` "some" line, in %."""
    for part in (line or "").split():
        if part.startswith("avg60="):
            return part[len("avg60=") :]
    return None


def conditions(d: dict) -> str:
    """The load average and CPU pressure (PSI) a results file recorded before and after its
    run, in the shapes the drivers write them; says so where it recorded none."""
    before = after = None
    if isinstance(d.get("conditions"), dict) and "before" in d["conditions"]:
        before, after = d["conditions"]["before"], d["conditions"].get("after")
    elif "conditions_start" in d:
        before, after = d["conditions_start"], d.get("conditions_end")
    elif "conditions_before" in d:
        before, after = d["conditions_before"], d.get("conditions_after")
    elif "psi_cpu_before" in d:
        before = {"loadavg_1min": d.get("loadavg_before"), "cpu_pressure": d["psi_cpu_before"]}
        after = {
            "loadavg_1min": (d.get("machine") or {}).get("loadavg_1min"),
            "cpu_pressure": d.get("psi_cpu_after"),
        }
    if before is None:
        m = d.get("machine")
        load = m.get("loadavg_1min") if isinstance(m, dict) else None
        if load is not None:  # cpu_machine() states it
            return "CPU pressure (PSI) not recorded"
        return "load and CPU pressure (PSI) not recorded"
    after = after or {}

    def span(b, a, unit=""):
        if b is not None and a is not None:
            return f"{b} → {a}{unit} (before → after)"
        if b is not None or a is not None:
            return f"{b if b is not None else a}{unit} ({'before' if b is not None else 'after'})"
        return "not recorded"

    def load(c):
        return None if c.get("loadavg_1min") is None else f"{c['loadavg_1min']:.1f}"

    psi = span(psi_avg60(before.get("cpu_pressure")), psi_avg60(after.get("cpu_pressure")), " %")
    return (
        f"load {span(load(before), load(after))}, CPU pressure (PSI: share of the last "
        f"minute some task waited for a CPU) {psi}"
    )


def cpu_machine(m: dict) -> str:
    text = (
        f"{m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, Linux "
        f"{m['kernel']}, Python {m['python']}, {m['when']}"
    )
    if m.get("loadavg_1min") is not None:
        text += f", load {m['loadavg_1min']:.1f} at the end"
    return text


# -- the CPU scenarios of `kvbroker bench` (bench_all.py) ------------------------------------
INTRO = {
    "transfer": "Publish + claim of one object against a memcpy of the same bytes in the same "
    "loop (both copies counted, checksums on).",
    "rpc": "Control requests (`exists`) per second with N client processes.",
    "scale": "Lookup and claim+release latency, and the daemon's memory, against the number "
    "of objects held.",
    "prefix": "`match_prefix` latency against prefix length, beside a 4 KiB put+claim on the "
    "same pool; then a hit-rate workload.",
    "tp": "Claims of a heterogeneous-TP request (P prefill shards → D decode ranks) against "
    "the homogeneous P = D = 1 claim of the same request.",
    "peer": "kvbroker beside Mooncake Store (`mooncake-transfer-engine-non-cuda`, its driver "
    "`benchmarks/mooncake_peer.py`) and, where the run had them, LMCache's multiprocess server "
    "(`lmcache` wheel, `engine_driven` mode over shared memory, its driver "
    "`benchmarks/lmcache_peer.py`) and KVCR's local DRAM tier (`kvcr` wheel, NIXL UCX, its "
    "driver `benchmarks/kvcr_peer.py`) on the same sizes, in the same loop.",
}


def cpu_scenario(name: str, file: str = "", title: str = "", intro: str = "") -> list[str]:
    """The table of one ``kvbroker bench NAME --json-out FILE`` run (bench-NAME-cpu.json)."""
    file = file or f"bench-{name}-cpu.json"
    data = load(file)
    if data is None:
        return []
    lines = [title or f"### `kvbroker bench {name}`", "", intro or INTRO[name], ""]
    lines += source(
        file,
        data.get("commit", "unknown"),
        cpu_machine(data["machine"]),
        data.get("command", f"kvbroker bench {name}"),
        data,
    )
    data = HONEST.get(name, lambda d: d)(data)
    rounds = data.get("params", {}).get("rounds", 1)
    for group, cols in data["columns"].items():
        if group != "rows":
            lines.append(f"{group.replace('_', ' ')}:")
            lines.append("")
        header = [h for _, h, _ in cols]
        rows = [[cell(r.get(k), fmt) for k, _, fmt in cols] for r in data[group]]
        lines += table(header, rows)
    if rounds > 1:
        spans = [
            f"{size(r['size'])} {h}: {ratio(r[k + '_range'][0])}–{ratio(r[k + '_range'][1])}"
            for r in data["rows"]
            for k, h, fmt in data["columns"]["rows"]
            if fmt == "ratio" and k + "_range" in r
        ]
        lines += [
            (
                f"Every time is its median over the {rounds} rounds and every ratio the "
                "quotient of the two times beside it. Each ratio's least and most value in "
                "a round: " + "; ".join(spans) + "."
            ),
            "",
        ]
    lines += [f"- {n}" for n in data.get("notes", [])]
    for t in data["targets"]:
        op = t["op"].replace(">=", "≥").replace("<=", "≤")
        measured = ratio(t["measured"]) if t["unit"] == "x" else amount(t["measured"])
        unit = "×" if t["unit"] == "x" else t["unit"]
        mark = "met" if t["met"] else "**missed**"
        lines.append(
            f"- target: {t['name']} {op} {amount(t['goal'])}{unit}: {measured}{unit}, {mark}"
        )
    return lines + [""]


# -- what older results files printed that no figure beside it gave ------------------------
def honest_peer(data: dict) -> dict:
    """A peer results file as ``kvbroker bench peer`` writes it now: every ratio the quotient
    of two times of its row (files written before stored medians of per-round ratios beside
    medians of times from other rounds), the memcpy times shown, the targets from those rows.
    Per-round ranges are kept as recorded."""
    from kvbroker._bench import peer

    modes = data["params"].get("modes") or []
    rows = []
    for r in data["rows"]:
        r = dict(r)
        if "memcpy_ms" not in r:  # older files: the median memcpy as GB/s
            r["memcpy_ms"] = r["size"] / (r["memcpy_gbps"] * 1e9) * 1e3
        for m in modes:
            if f"{m}_put_ms" not in r:  # only the round trip recorded
                r[f"{m}_put_ms"], r[f"{m}_get_ms"] = r[f"{m}_roundtrip_ms"], 0.0
            if f"{m}_memcpy_ms" not in r:  # the memcpy each driver timed, from its rounds
                got = [
                    z["memcpy"]["median_ms"]
                    for rnd in data.get("raw_rounds", [])
                    for p in rnd["peer"]
                    if p["mode"] == m
                    for z in p["sizes"]
                    if z["size"] == r["size"] and z.get("memcpy")
                ]
                r[f"{m}_memcpy_ms"] = statistics.median(got) if got else None
        rows.append(peer.derive(r, modes))
    return {
        **data,
        "rows": rows,
        "columns": {"rows": peer.columns(modes)},
        "targets": [t.as_dict() for t in peer.targets(rows, modes)],
    }


def honest_scale(data: dict) -> dict:
    """A scale results file with the targets ``kvbroker bench scale`` checks now: the p50 of
    every burst (older files checked the quietest burst's, a best-of-N figure)."""
    from kvbroker._bench import scale

    return {
        **data,
        "columns": {"rows": scale.COLUMNS},
        "targets": [t.as_dict() for t in scale.targets(data["rows"])],
    }


HONEST: dict[str, Callable[[dict], dict]] = {"peer": honest_peer, "scale": honest_scale}


# -- GPU and engine scenarios (run by benchmarks/run_gpu_round.sh) ---------------------------
def gpu() -> list[str]:
    d = load("gpu-h100.json")
    if d is None:
        return []
    p, b, k = d["pinned"], d["broker"], d["kernels"]
    machine = f"{d['device']}, torch {d['torch']}, triton {d['triton']}, CUDA {d['cuda']}"
    rows = [
        [
            "publish D2H of 1 GiB, one buffer",
            f"{b['publish_d2h_one_buffer_GBps']:.1f}",
            (
                f"{ratio(b['publish_d2h_one_buffer_GBps'] / p['pinned_d2h_GBps'])} × pinned D2H "
                f"({p['pinned_d2h_GBps']:.1f})"
            ),
        ],
        [
            "publish D2H of 1 GiB, 128 buffers",
            f"{b['publish_d2h_128_buffers_GBps']:.1f}",
            f"{ratio(b['publish_d2h_128_buffers_GBps'] / p['pinned_d2h_GBps'])} × pinned D2H",
        ],
        [
            "claim H2D of 1 GiB, one buffer",
            f"{b['claim_h2d_one_buffer_GBps']:.1f}",
            (
                f"{ratio(b['claim_h2d_one_buffer_GBps'] / p['pinned_h2d_GBps'])} × pinned H2D "
                f"({p['pinned_h2d_GBps']:.1f})"
            ),
        ],
        [
            "claim H2D of 1 GiB, 128 buffers",
            f"{b['claim_h2d_128_buffers_GBps']:.1f}",
            f"{ratio(b['claim_h2d_128_buffers_GBps'] / p['pinned_h2d_GBps'])} × pinned H2D",
        ],
        [
            "Triton gather of a head range (read + written)",
            f"{k['triton_gather_GBps']:.0f}",
            (
                f"{ratio(k['triton_gather_GBps'] / k['d2d_copy_GBps'])} × D2D copy "
                f"({k['d2d_copy_GBps']:.0f})"
            ),
        ],
        [
            "Triton scatter of a head range (read + written)",
            f"{k['triton_scatter_GBps']:.0f}",
            f"{ratio(k['triton_scatter_GBps'] / k['d2d_copy_GBps'])} × D2D copy",
        ],
    ]
    lines = [
        "### GPU: `GpuClient` DMA and the TP kernels",
        "",
        (
            "Each figure beside its limit measured in the same run (`kvbroker bench gpu` runs "
            "the same script on a CUDA host)."
        ),
        "",
    ]
    lines += source("gpu-h100.json", d["commit"], machine, d["command"], d)
    return lines + table(["path", "GB/s", "against its limit"], rows)


def ttft() -> list[str]:
    d = load("ttft-cuda-8b-h100-run1.json")
    if d is None:
        return []
    m, med, md = d["machine"], d["median"], d["model"]
    n = len(d["repeats"])
    per = d["handoff_speedup_per_repeat"]
    rows = [
        ["claim (overlapped with the first decode step) + the step", ms(med["broker_s"])],
        ["claim with `overlap=False`, then the step", ms(med["serial_s"])],
        ["the claim's copies alone", f"{ms(med['claim_s'])} ({d['claim_GBps']:.1f} GB/s)"],
        ["recompute the prefill + the step", ms(med["recompute_s"])],
        [
            "prefill side: `publish_cache` through a `GpuClient`",
            f"{ms(med['publish_s'])} ({d['publish_GBps_median']:.1f} GB/s)",
        ],
        [
            "whole handoff (publish + claim + step) against recompute",
            f"**{ratio(d['handoff_speedup'])}×** (per repeat {ratio(min(per))}–{ratio(max(per))})",
        ],
        ["the same with `overlap=False`", f"{ratio(d['serial_handoff_speedup'])}×"],
    ]
    lines = [
        "### Time to first decode token (transformers, Llama-3-8B shape)",
        "",
        (
            f"A {d['prompt_tokens']:,}-token prompt, {md['layers']} layers, {md['kv_heads']} "
            f"KV heads, {d['dtype']}, random weights, {d['kv_bytes'] / 2**30:.1f} GiB of KV; "
            f"medians of {n} repeats in which the paths take turns. A ratio is the quotient "
            "of the medians beside it; the range is its value in each repeat."
        ),
        "",
    ]
    machine = f"{m['gpu']}, {m['cores']} CPUs, torch {m['torch']}, transformers {m['transformers']}"
    lines += source("ttft-cuda-8b-h100-run1.json", d["commit"], machine, d["command"], d)
    return lines + table(["decode instance: request arrives → first decode token", "median"], rows)


def vllm_gpu() -> list[str]:
    runs = [(o, load(f"vllm-gpu-h100-{o}.json")) for o in ("nhd", "hnd")]
    runs = [(o, d) for o, d in runs if d is not None]
    if not runs:
        return []
    lines = [
        "### vLLM connector, CUDA save and load",
        "",
        (
            "The worker side of `KVBrokerConnector` on a 16k-token Llama-3-8B-shaped KV "
            "(2 GiB), against pinned copies of the same bytes in the same run."
        ),
        "",
    ]
    rows = []
    for order, d in runs:
        m, sl, p = d["machine"], d["save_load"], d["pinned"]
        lines += source(
            f"vllm-gpu-h100-{order}.json",
            d["commit"],
            f"{m['device']}, torch {m['torch']}, CUDA {m['cuda']}",
            d["command"],
            d,
        )
        rows.append(
            [
                f"{sl['order']}, bit-exact {'yes' if sl['bit_exact'] else 'NO'}",
                (
                    f"{sl['save_GBps']:.1f} / {p['pinned_d2h_GBps']:.1f} GB/s = "
                    f"**{ratio(sl['save_GBps'] / p['pinned_d2h_GBps'])}×**"
                ),
                (
                    f"{sl['load_GBps']:.1f} / {p['pinned_h2d_GBps']:.1f} GB/s = "
                    f"**{ratio(sl['load_GBps'] / p['pinned_h2d_GBps'])}×**"
                ),
            ]
        )
    return lines + table(["cache", "save vs pinned D2H", "load vs pinned H2D"], rows)


def vllm_async_load() -> list[str]:
    d = load("vllm-async-load-h100.json")
    if d is None:
        return []
    s, m, p = d["summary"], d["machine"], d["params"]
    rows = [
        [
            mode,
            ms(s[mode]["quiet_step_s"]),
            ms(s[mode]["longest_step_during_load_s"]),
            ms(s[mode]["arrival_to_first_run_s"]),
        ]
        for mode in ("sync", "load_async")
    ]
    lines = [
        "### vLLM connector, `load_async`",
        "",
        (
            f"An engine stepping (~{p['step_ms']:.0f} ms of matmuls a step) while a "
            f"{p['tokens']:,}-token 8B-shaped KV loads for a request arriving at step "
            f"{p['arrive']}; medians of {p['reps']} scenarios per mode, alternated."
        ),
        "",
    ]
    lines += source(
        "vllm-async-load-h100.json",
        d["commit"],
        f"{m['device']}, torch {m['torch']}, CUDA {m['cuda']}",
        d["command"],
        d,
    )
    return lines + table(
        [
            "mode",
            "a step, no load",
            "the longest step while the load runs",
            "arrival → end of the request's first step",
        ],
        rows,
    )


def serving() -> list[str]:
    """Real vLLM CPU engines replaying a multi-turn trace (benchmarks/bench_serving.py), one
    table per results file. Ratios are computed here, from the figures printed beside them."""
    lines = []
    for path in sorted(RESULTS.glob("serving-*.json")):
        d = json.loads(path.read_text())
        p, md = d["params"], d["model"]
        lines += [
            f"### Serving: vLLM CPU engines with and without kvbroker, `{path.stem}`",
            "",
            (
                f"Two vLLM CPU engines behind a round-robin router (request i of the trace to "
                f"engine i mod 2) replay a multi-turn trace: {p['conversations']} users at once, "
                f"closed-loop, {p['turns']} turns each, a {p['system_tokens']:,}-token system "
                f"prompt shared by all, {p['user_tokens']} new tokens a turn, every prompt the "
                f"whole conversation so far, {p['output_tokens']} output tokens a request. "
                f"Model: Llama-shaped, {md['num_hidden_layers']} layers, hidden "
                f"{md['hidden_size']}, {md['parameters'] / 1e6:.0f} M parameters, fp32, random "
                "weights. *plain*: each engine with its own vLLM prefix cache; *kvbroker*: both "
                "engines with `KVBrokerConnector` (`kv_both`) on one daemon, so a prefix one "
                "computed is loaded by the other; *pd*: a `kv_producer` engine prefills every "
                "prompt and a `kv_consumer` engine loads its KV and decodes (TTFT: the "
                f"consumer's first token). {p['rounds']} rounds, each a fresh trace replayed "
                "in every mode (the modes' order rotating). Pooled over every request of every "
                "round; a ratio is the quotient of the two figures of this table it names. "
                "Recomputed tokens: prompt tokens the engines computed (P/D: both engines'). "
                "The machine is shared with other work: the load and CPU pressure of each "
                "replay are in the second table."
            ),
            "",
            # (its machine record is taken at the start: the conditions line has the loads)
            *source(
                path.name,
                d["commit"],
                cpu_machine({**d["machine"], "loadavg_1min": None}),
                d["command"],
                d,
            ),
        ]
        base = next(r for r in d["rows"] if r["mode"] == "plain")
        rows = [
            [
                r["mode"],
                f"{r['ttft_p50_s'] * 1e3:,.0f} ms",
                f"{r['ttft_p99_s'] * 1e3:,.0f} ms",
                f"{ratio(r['ttft_p50_s'] / base['ttft_p50_s'])}×",
                f"{r['output_tokens_per_s']:.2f}",
                f"{ratio(r['output_tokens_per_s'] / base['output_tokens_per_s'])}×",
                f"{r['recomputed_tokens']:,} of {r['prompt_tokens']:,}",
                f"{r.get('outputs_equal_plain', r['requests'])} of {r['requests']}",
            ]
            for r in d["rows"]
        ]
        lines += table(
            [
                "mode",
                "TTFT p50",
                "TTFT p99",
                "TTFT p50 / plain's",
                "output tokens/s",
                "/ plain's",
                "prompt tokens recomputed",
                "outputs equal to plain's",
            ],
            rows,
        )
        moved = []
        for mode, engines in (d.get("connector") or {}).items():
            totals = [t for t in engines.values() if t]
            if totals:
                loaded = sum(t.get("loaded_tokens", 0) for t in totals)
                saved = sum(t.get("saved_tokens", 0) for t in totals)
                moved.append(f"*{mode}* loaded {loaded:,} tokens' KV and saved {saved:,}")
        if moved:
            lines += [
                "The connectors' own counts over the run (warm-up included): "
                + "; ".join(moved)
                + ".",
                "",
            ]
        rows = []
        for rnd in d["rounds"]:
            rbase = next(r for r in rnd["rows"] if r["mode"] == "plain")
            for r in rnd["rows"]:
                c = rnd["conditions"][r["mode"]]
                rows.append(
                    [
                        str(rnd["round"]),
                        r["mode"],
                        f"{r['ttft_p50_s'] * 1e3:,.0f} ms",
                        f"{ratio(r['ttft_p50_s'] / rbase['ttft_p50_s'])}×",
                        f"{r['output_tokens_per_s']:.2f}",
                        f"{ratio(r['output_tokens_per_s'] / rbase['output_tokens_per_s'])}×",
                        f"{r['recomputed_tokens']:,}",
                        f"{c['before']['loadavg_1min']:.1f} → {c['after']['loadavg_1min']:.1f}",
                        (
                            f"{psi_avg60(c['before']['cpu_pressure'])} → "
                            f"{psi_avg60(c['after']['cpu_pressure'])} %"
                        ),
                    ]
                )
        lines += table(
            [
                "round",
                "mode",
                "TTFT p50",
                "/ plain's",
                "output tokens/s",
                "/ plain's",
                "recomputed",
                "load",
                "CPU pressure, avg60",
            ],
            rows,
        )
    return lines


# -- the rest of the CPU measurements ---------------------------------------------------------
def vm(d: dict) -> str:
    m = d.get("machine")
    if isinstance(m, dict):
        return f"{m.get('cpu', m.get('node'))}, {m['cpus']} CPUs, Linux {m['kernel']}"
    return str(m)


def integrity() -> list[str]:
    d = load("integrity-cpu.json")
    if d is None:
        return []
    ms, r = d["median_s"], d["ratio_with_over_without"]
    pairs = [
        ("put with checksums", "put+checksum", "put"),
        ("reserve + fill + seal, hashed at seal", "reserve+seal hash", "reserve+seal"),
        ("get with `verify=True`", "get+verify", "get"),
    ]
    rows = [
        [what, f"{ms[a] * 1e3:.2f} ms", f"{ms[b] * 1e3:.2f} ms", f"{ratio(r[a])}×"]
        for what, a, b in pairs
    ]
    lines = [
        "### Checksums",
        "",
        (
            f"What checksums cost a {size(d['size'])} object; medians of {d['reps']} each; "
            "the ratio is the quotient of the two medians beside it."
        ),
        "",
    ]
    lines += source(
        "integrity-cpu.json", d["commit"], f"{d['machine']}, {d['cpus']} CPUs", d["command"], d
    )
    return lines + table(["operation", "with", "without", "with / without"], rows)


def journal() -> list[str]:
    d = load("journal-cpu.json")
    if d is None:
        return []
    m = d["median_us"]
    lines = [
        "### Journal (warm restarts)",
        "",
        (
            f"A {size(d['object_bytes'])} put + consuming claim + release, {d['rounds']} "
            f"rounds of {d['ops_per_round']:,}, journal on {d['journal_dir'].split()[-1]}; "
            "the ratio is the quotient of the two medians beside it."
        ),
        "",
    ]
    lines += source("journal-cpu.json", d["commit"], d["machine"], d["command"], d)
    rows = [
        [
            f"{m['journal']:.1f} µs",
            f"{m['no_journal']:.1f} µs",
            f"{ratio(m['journal'] / m['no_journal'])}×",
        ]
    ]
    return lines + table(["with the journal", "without", "with / without"], rows)


def remote() -> list[str]:
    d = load("remote-cpu.json")
    if d is None:
        return []
    runs = d["throughput"] + d.get("latency", [])
    standalone = all("standalone_read_p50_s" in r for r in runs)
    rows = []
    for r in runs:
        row = [r["size"], f"{r['claim_p50_s'] * 1e3:.2f} ms"]
        if standalone:
            row += [
                f"{r['standalone_read_p50_s'] * 1e3:.2f} ms",
                f"{ratio(r['standalone_ratio_p50'])} ({ratio(r['standalone_ratio_min'])}"
                f"–{ratio(r['standalone_ratio_max'])})",
            ]
        row += [
            f"{r['raw_read_p50_s'] * 1e3:.2f} ms",
            f"{ratio(r['ratio_p50'])} ({ratio(r['ratio_min'])}–{ratio(r['ratio_max'])})",
            str(r["reps"]),
            "yes" if r["bit_exact"] and r.get("standalone_bit_exact", True) else "NO",
        ]
        rows.append(row)
    lines = [
        "### Across nodes: a remote claim against the raw NIXL READ",
        "",
        (
            "Daemon B claims an object daemon A holds: pin, write lease, one NIXL READ, "
            "checksums, release, seal, local claim, timed in B's client. Beside it, in the "
            "same rounds (order alternating): the standalone raw READ of the same size (bench_nixl_raw.py's: one transfer request between "
            "this process and a serving process, nothing of the broker's), and the READ "
            "inside that very pull. Each ratio is the median (range) of the per-round ratios "
            "READ / claim, not the quotient of the two p50s beside it."
            if standalone
            else "Daemon B claims an object daemon A holds: pin, write lease, one NIXL READ, "
            "checksums, release, seal, local claim, timed in B's client; beside it the raw "
            "NIXL READ of the same bytes inside that very pull. READ / claim is the median "
            "(range) of the per-pull ratios, not the quotient of the two p50s beside it."
        ),
        "",
    ]
    env = " ".join(f"{k}={v}" for k, v in d.get("env", {}).items())
    lines += source(
        "remote-cpu.json", d["commit"], vm(d) + (f", {env}" if env else ""), d["command"], d
    )
    head = ["object", "remote claim p50"]
    if standalone:
        head += ["raw READ p50", "raw READ / claim"]
    head += ["READ in the pull p50", "its READ / claim", "pulls", "bit-exact"]
    lines += table(head, rows)
    phased = [r for r in runs if r.get("phases_p50_s")]
    if phased:
        names = list(phased[0]["phases_p50_s"])
        lines += [
            "Where each claim's time went (p50 of each phase over the same pulls, ms; "
            "`read` is the READ in the pull, `verify` the checksum pass after it, `handoff` "
            "the worker thread's start and the event loop's wake-up after it, "
            "`client` B's request and reply around the pull):",
            "",
        ]
        lines += table(
            ["object", *names],
            [
                [r["size"], *(f"{r['phases_p50_s'].get(k, 0.0) * 1e3:.2f}" for k in names)]
                for r in phased
            ],
        )
    return lines


def soak() -> list[str]:
    d = load("soak-cpu.json")
    if d is None:
        return []
    a = d["accounting"]
    missed = d.get("expected_outcomes", {}).get("get_not_found", 0)
    if "gets_missed" in d:  # (since issue 38: ops counts only what did its work)
        ops, found = d["ops"], d["gets_found"]
    else:  # an older run counted a get that found nothing, and a put of a taken key
        undone = missed + d.get("expected_outcomes", {}).get("put_exists", 0)
        ops, found = d["ops"] - undone, d["ops_by_kind"]["get"] - missed
    rows = [
        [
            f"{d['clients']}",
            f"{d['duration_s']:.0f} s",
            f"{ops:,}",
            f"{found:,} / {missed:,}",
            str(d["errors"]),
            str(d["mismatches"]),
            (
                f"{a['used_bytes']:,} B used = {a['objects_extent_bytes']:,} B of objects; "
                f"{a['used_after_evict_all']} after `evict --all`"
            ),
        ]
    ]
    lines = [
        "### Soak",
        "",
        (
            "Clients publishing, claiming, matching prefixes and evicting under memory "
            "pressure; the pool accounting checked to the byte at the end. Operations: those "
            "that did their work (a get that found its key and checked its bytes; one that "
            "found nothing, evicted or consumed first, is counted apart)."
        ),
        "",
    ]
    lines += source("soak-cpu.json", d["commit"], d["machine"], d["command"], d)
    return lines + table(
        [
            "clients",
            "duration",
            "operations",
            "gets that found their key / found nothing",
            "errors",
            "wrong bytes",
            "accounting",
        ],
        rows,
    )


HEAD = """\
# Performance

<!-- generated by `python benchmarks/performance_doc.py` from benchmarks/results/ (and by
benchmarks/bench_all.py after a run): do not edit by hand -->

Every table comes from one results file (one run, one commit), named under it with the
machine and the command; run the command to measure your own machine. These machines are
shared, so absolute figures move by ±20 % from run to run: what is compared is measured side
by side in the same run. Ratios have two decimals, cut (never rounded up). Finished
experiments, and what each concluded: `benchmarks/experiments/INDEX.md`.

`kvbroker bench SCENARIO` measures a daemon on your machine: `transfer`, `rpc`, `scale`,
`prefix`, `tp`, `gpu` (CUDA hosts; exits 4 without CUDA) and `peer` (beside Mooncake Store,
LMCache and KVCR).
Each prints a table and the targets it checks; `--json-out FILE` writes the rows, targets,
machine and versions, `--plot DIR` draws charts (`pip install 'kvbroker[bench]'`). Without
`--socket` a scenario starts a private daemon sized for it. `benchmarks/bench_all.py` runs
every CPU scenario and rewrites this page; `benchmarks/run_gpu_round.sh` and
`benchmarks/run_host_round.sh` run the GPU host's set. Setting up the peers for `peer`:
[operating.md](operating.md#comparing-with-mooncake) (Mooncake),
[operating.md](operating.md#comparing-with-lmcache) (LMCache) and
[operating.md](operating.md#comparing-with-kvcr) (KVCR). `benchmarks/bench_serving.py`
runs real vLLM CPU engines with and without kvbroker. Every line naming a results file says
the load and the CPU pressure (PSI) the run recorded, or that it recorded none: the clients'
and the daemon's busy-polling switches with it (`kvbroker/_cpu.py`).
"""


def sglang_storage() -> list[str]:
    """SGLang's HiCache storage through kvbroker (benchmarks/bench_sglang_storage.py), one
    table per results file."""
    lines = []
    for path in sorted(RESULTS.glob("sglang-storage*.json")):
        d = json.loads(path.read_text())
        m = d["machine"]
        lines += [
            f"### SGLang HiCache storage (`{d['layout']}`), `{path.stem}`",
            "",
            (
                f"`batch_set_v1` / `batch_get_v1` of a {d['tokens']:,}-token Llama-3-8B-shaped KV "
                f"({d['pages']} pages of {d['page_size']} tokens, {d['bytes'] / 2**30:.2f} GiB) "
                "beside a plain memcpy of the same pages and SGLang's own file backend, alternated "
                f"over {d['rounds']} rounds; kvbroker's get bit-exact: "
                f"{'yes' if d['bit_exact'] else 'NO'}. Times are medians over the rounds; a ratio "
                "is the median (least–most) of the per-round ratios, each from one round's two "
                "times."
            ),
            "",
            *source(path.name, d["commit"], cpu_machine(m), d["command"], d),
        ]
        rows = [
            [v, f"{statistics.median(ts):.3f} s", f"{d['median_GBps'][v]:.2f}"]
            for v, ts in d["seconds"].items()
        ]
        lines += table(["variant", "median", "GB/s (of the median)"], rows)
        rows = [
            [name, f"{ratio(statistics.median(rs))} ({ratio(min(rs))}–{ratio(max(rs))})"]
            for name, rs in d["ratios"].items()
        ]
        lines += table(["ratio, per round", "median (least–most)"], rows)
    return lines


def events() -> list[str]:
    """The KV event stream's memory and replay flood (benchmarks/bench_events.py --part rss
    --part flood), one table per results file."""
    lines = []
    for path in sorted(RESULTS.glob("events-*cpu*.json")):
        d = json.loads(path.read_text())
        tree = f", the daemon from `{d['daemon_src']}`" if d.get("daemon_src") else ""
        lines += [f"### KV events, `{path.stem}`", ""]
        lines += source(path.name, d["commit"], cpu_machine(d["machine"]) + tree, d["command"], d)
        if d.get("note"):
            lines += [d["note"], ""]
        rows = []
        r = d.get("rss")
        if r:
            alive = r.get("round", 100)  # the driver's default before it recorded it
            rows.append(
                [
                    (
                        f"{r['blocks']:,} blocks of {r['tokens_per_block']:,} token ids published "
                        f"and evicted, {alive} alive at once"
                    ),
                    (
                        f"daemon RSS {r['rss_before_MiB']:.0f} → {r['rss_after_MiB']:.0f} MiB "
                        f"(peak {r['peak_rss_MiB']:.0f}); replay buffer "
                        f"{r['replay_buffer_bytes'] / 2**20:.1f} MiB"
                    ),
                ]
            )
        for f in d.get("flood") or []:
            who = "reading" if f["reads_replies"] else "not reading"
            late = (
                f"; latency p50 {f['latency_ms_p50']:.1f} ms, p99 {f['latency_ms_p99']:.1f} ms"
                if f["latency_ms_p50"] is not None
                else ""
            )
            rows.append(
                [
                    (
                        f"a replay flood from 0 (its sender {who} the replies) beside a live "
                        "subscriber"
                    ),
                    (
                        f"{f['live_arrived']} of {f['live']} live events arrived in "
                        f"{f['wait_s']:.0f} s{late}; {f['replay_requests_answered']:,} of "
                        f"{f['requests_sent']:,} replay requests answered"
                    ),
                ]
            )
        lines += table(["measurement", "result"], rows)
    return lines


def peer_preauth() -> list[str]:
    """Unauthenticated connections to the peer channel (benchmarks/peer_preauth.py), one table
    per results file."""
    lines = []
    mib = 2**20
    for path in sorted(RESULTS.glob("peer-preauth-*cpu*.json")):
        d = json.loads(path.read_text())
        h, s = d["results"]["hellos"], d["results"].get("stalled")
        lines += [f"### Peer channel before authentication, `{path.stem}`: {d['channel']}", ""]
        lines += source(path.name, d["commit"], cpu_machine(d["machine"]), d["command"], d)
        sent = sum(a["bytes_sent"] for a in h["attackers"])
        outcomes = ", ".join(sorted({a["outcome"] for a in h["attackers"]}))
        rows = [
            [
                (
                    f"{h['connections']} connections announcing {h['announced_bytes'] / mib:.0f} MiB "
                    "hellos"
                ),
                (
                    f"daemon peak RSS +{h['rss_growth_peak'] / mib:.1f} MiB; "
                    f"{sent / mib:.0f} MiB of them sent (" + outcomes + ")"
                ),
            ]
        ]
        if s:
            rows.append(
                [
                    f"{s['connections']} connections that stall in the handshake",
                    (
                        f"{s['closed_at_once']} closed at once; RSS {s['rss_before'] / mib:.0f} → "
                        f"{s['rss_after'] / mib:.0f} MiB"
                    ),
                ]
            )
        lines += table(["measurement", "result"], rows)
    return lines


def gpu_host() -> list[str]:
    """The same scenarios on a GPU machine's 16-core CPU (benchmarks/run_host_round.sh)."""
    return [
        *cpu_scenario("peer", "peer-h100-host.json", "### `kvbroker bench peer`, H100 host"),
        *cpu_scenario(
            "rpc",
            "rpc-h100-host.json",
            "### `kvbroker bench rpc`, H100 host, read replicas as `auto` starts them",
        ),
        *cpu_scenario(
            "rpc",
            "rpc-h100-host-no-replicas.json",
            "### `kvbroker bench rpc`, H100 host, without read replicas",
            INTRO["rpc"] + " Run right after the one above with `KVBROKER_READ_REPLICAS=0`.",
        ),
    ]


def sessions() -> list[str]:
    d = load("sessions-cpu.json")
    if d is None:
        return []
    t = d["trace"]
    lines = [
        "### Sessions against plain LRU (`benchmarks/bench_sessions.py`)",
        "",
        (
            f"A replayed multi-turn trace through the client API: {t['sessions']} conversations "
            f"of {t['turns']} turns ({t['first_tokens']} tokens, then {t['tokens_per_turn']} "
            f"more a turn), every round {t['oneshots_per_round']} one-shot prompts of "
            f"{t['oneshot_tokens']:,} tokens between the turns; a {size(t['pool_bytes'])} pool, "
            f"blocks of {t['block_tokens']} tokens and {size(t['block_bytes'])}. Each request "
            "matches (hold=False), recomputes what was not found and publishes its blocks; "
            "the same trace against a fresh daemon without and with `session=` (default "
            "`[sessions]`). Turn hit rate: tokens of later turns found, of their prompts; "
            "of reusable: of what their earlier turns published."
        ),
        "",
    ]
    lines += source_after_load("sessions-cpu.json", d)
    rows = [
        [
            r["mode"],
            f"{r['hit_rate']:.1%}",
            f"{r['of_reusable']:.1%}",
            f"{r['hit']:,}",
            f"{r['asked']:,}",
            f"{r['recomputed']:,}",
            f"{r['evictions']:,}",
        ]
        for r in d["rows"]
    ]
    return lines + table(
        [
            "mode",
            "turn hit rate",
            "of reusable",
            "hit tokens",
            "turn tokens",
            "recomputed tokens (all requests)",
            "evictions",
        ],
        rows,
    )


def sessions_vllm() -> list[str]:
    d = load("sessions-vllm-cpu.json")
    if d is None:
        return []
    t, cfg = d["trace"], d["model"]
    lines = [
        "### Sessions against plain LRU through a vLLM CPU engine "
        "(`benchmarks/bench_sessions_vllm.py`)",
        "",
        (
            f"The small form: one vLLM engine (`kv_both`, its own prefix cache off, so every "
            f"reuse goes through the broker; a seeded random Llama-shaped model, "
            f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}), "
            f"{t['sessions']} conversations of {t['turns']} turns ({t['first_tokens']} tokens, "
            f"then {t['tokens_per_turn']} more a turn), {t['oneshots_per_round']} one-shot "
            f"prompts of {t['oneshot_tokens']} tokens a round, a {t['pool']} pool; the same "
            "trace without and with the session in `kv_transfer_params`. Loaded tokens: vLLM's "
            "`num_cached_tokens` of the later turns."
        ),
        "",
    ]
    lines += source_after_load("sessions-vllm-cpu.json", d)
    rows = [
        [
            r["mode"],
            f"{r['hit_rate']:.1%}",
            f"{r['cached']:,}",
            f"{r['asked']:,}",
            f"{r['recomputed']:,}",
        ]
        for r in d["rows"]
    ]
    return lines + table(
        [
            "mode",
            "turn hit rate",
            "loaded tokens",
            "turn tokens",
            "recomputed tokens (all requests)",
        ],
        rows,
    )


def disk_tier() -> list[str]:
    d = load("disk-tier-cpu.json")
    if d is None:
        return []
    model = d["recompute_model"]
    runs = d["runs"]
    lines = [
        "### Disk tier",
        "",
        (
            f"A working set of {d['objects']} objects of {size(d['object_size'])} "
            f"({d['working_set'] // d['pool_size']}× the {size(d['pool_size'])} pool) claimed "
            "(`get`) in order, cycling, and at random; a miss is recomputed and published "
            "again. Recompute time is modeled from a measured prefill rate "
            f"(`{model['source']}`: {model['tokens']:,} tokens of an 8B Llama prefilled in "
            f"{model['prefill_s'] * 1e3:.0f} ms on an H100, {size(model['kv_bytes'])} of KV): "
            f"{d['recompute_s_per_object'] * 1e3:.2f} ms per object, added to a miss's "
            "failed claim and put. Disk tier in a temporary directory on "
            f"`{d['disk_dir']}`."
        ),
        "",
    ]
    lines += source("disk-tier-cpu.json", d["commit"], cpu_machine(d["machine"]), d["command"], d)
    rows = []
    for order in ("cycle", "random"):
        for label, what in (
            ("disk", "disk tier"),
            ("dram", "DRAM only"),
            ("recompute", "recompute every time"),
        ):
            r = runs[label][order]
            rows.append(
                [
                    order,
                    what,
                    f"{r['hit_rate']:.2f}",
                    f"{r['p50_ms']:.2f} ms",
                    f"{r['p99_ms']:.2f} ms",
                ]
            )
    lines += table(["order", "served by", "hit rate", "p50", "p99"], rows)
    p = runs["disk"]["promotion"]
    dd = runs["disk"]["dd_gbps"]
    best = max(v for v in dd.values() if v)
    lines += [
        (
            f"Promotion: {p['objects']} objects on disk only, page cache dropped "
            f"({'yes' if p['caches_dropped'] else 'no: not root'}), claimed by "
            f"{p['threads']} clients at once: {p['gbps']:.2f} GB/s; `dd iflag=direct` "
            "of the tier's slot file "
            + ", ".join(f"({k} blocks) {v:.2f} GB/s" for k, v in dd.items() if v)
            + f": promotion / the best dd = {ratio(p['gbps'] / best)}× (target 0.8×)."
        ),
        "",
        (
            f"The modeled recompute yields {model['kv_bytes'] / model['prefill_s'] / 1e9:.1f} "
            "GB/s of KV: a promotion beats it only from a device (or several) faster than "
            "that, or for a model that costs more to prefill per byte of KV (larger, longer "
            f"contexts); this VM's disk read {best:.2f} GB/s."
        ),
        "",
    ]
    return lines


def disk_io() -> list[str]:
    d = load("disk-io-cpu.json")
    if d is None:
        return []
    lines = [
        "### Disk tier I/O engines",
        "",
        (
            f"{d['objects']} objects of {size(d['object_size'])}, {d['depth']} in flight, "
            "one request each, between a page-aligned DRAM region and one preallocated file "
            f"with `O_DIRECT` on `{d['dir']}`; best of {d['rounds']} rounds, page cache "
            "dropped before each read pass; every read checked bit-exact. The disk tier uses "
            "the thread pool (kvbroker/_server/disk_store.py says why)."
        ),
        "",
    ]
    lines += source("disk-io-cpu.json", d["commit"], cpu_machine(d["machine"]), d["command"], d)
    rows = [
        [
            name,
            f"{r['write_gbps_best']:.2f} GB/s",
            f"{r['read_gbps_best']:.2f} GB/s",
            str(r["bit_exact"]),
        ]
        for name, r in d["engines"].items()
        if "error" not in r
    ]
    if d.get("dd_read_gbps_best"):
        rows.append(
            ["`dd iflag=direct` (4 MiB blocks)", "–", f"{d['dd_read_gbps_best']:.2f} GB/s", "–"]
        )
    return lines + table(["engine", "write", "read", "bit-exact"], rows)


def small_requests() -> list[str]:
    """The small-request path (issue 43): A/B runs of ``benchmarks/ab_small_requests.py``
    (one table per results file) and the journal records a put+get appends
    (``benchmarks/count_journal_records.py``)."""
    lines = []
    for path in sorted(RESULTS.glob("ab-*-cpu.json")):
        d = json.loads(path.read_text())
        if d.get("scenario") != "ab-small-requests":
            continue
        rows, psi = [], []
        for r in d["rows"]:
            psi += [psi_avg60(c["cpu_pressure"]) for c in (r["before"], r["after"])]
        loads = [c["loadavg_1min"] for r in d["rows"] for c in (r["before"], r["after"])]
        psi_f = [float(x) for x in psi if x is not None]
        lines += [
            f"### Small requests, A/B: `{path.stem}`",
            "",
            (
                f"`put` + `get(out=..., consume=True)` p50, A = `{d['commits']['A']}` against "
                f"B = `{d['commits']['B']}`, the two builds alternated over "
                f"{max(r['round'] for r in d['rows'])} rounds of {d['rows'][0]['reps']}; times "
                "are medians over the rounds, B/A the median of the per-round ratios (same "
                "rounds). Each measurement recorded its load and PSI: load "
                f"{min(loads):.1f}–{max(loads):.1f}, CPU pressure (PSI avg60) "
                f"{min(psi_f):.1f}–{max(psi_f):.1f} % over the run, so these are figures of a "
                "saturated machine, not of a quiet one."
            ),
            "",
            f"{cpu_machine(d['machine'])}; `{d['command']}` (`benchmarks/results/{path.name}`).",
            "",
        ]
        for x in d["summary"]:
            rows.append(
                [
                    size(x["size"]),
                    f"{x['A_put_get_p50_us']:.1f} µs",
                    f"{x['B_put_get_p50_us']:.1f} µs",
                    f"{ratio(x['B_over_A_median_of_round_ratios'])}× "
                    f"({ratio(min(x['round_ratios']))}–{ratio(max(x['round_ratios']))})",
                    f"{x['A_writes_per_put_get']:.2f} → {x['B_writes_per_put_get']:.2f}",
                    f"{x['A_journal_records_per_put_get']:.2f} → "
                    f"{x['B_journal_records_per_put_get']:.2f}",
                ]
            )
        lines += table(
            [
                "size",
                "A p50",
                "B p50",
                "B/A, per round: median (least–most)",
                "socket writes per put+get",
                "journal records per put+get",
            ],
            rows,
        )
    d = load("journal-records-per-put-get-cpu.json")
    if d is not None:
        lines += [
            "### Journal records per put+get",
            "",
            "Counted from the journal file itself (a count: load does not move it).",
            "",
        ]
        lines += source(
            "journal-records-per-put-get-cpu.json",
            d["commit"],
            cpu_machine(d["machine"]),
            d["command"],
            {"conditions": {"before": d["before"], "after": d["after"]}},
        )
        rows = [
            [
                size(r["size"]),
                f"{r['records_per_put_get']:.2f}",
                ", ".join(f"`{k}` {v:.2f}" for k, v in r["by_kind_per_put_get"].items()),
            ]
            for r in d["rows"]
        ]
        lines += table(["size", "records per put+get", "by kind"], rows)
    return lines


SECTIONS: tuple[tuple[str, list[Callable[[], list[str]]]], ...] = (
    ("## Serving with real engines", [serving]),
    ("## GPU and engines", [ttft, gpu, vllm_gpu, vllm_async_load]),
    ("## Host scenarios, 2-core VM", [lambda n=n: cpu_scenario(n) for n in CPU_SCENARIOS]),
    ("## Host scenarios, a GPU machine's CPU", [gpu_host]),
    ("## The small-request path, 2-core VM", [small_requests]),
    ("## SGLang", [sglang_storage]),
    (
        "## Integrity, restarts, nodes",
        [integrity, journal, remote, peer_preauth, events, soak, disk_tier, disk_io],
    ),
    ("## Sessions (multi-turn retention)", [sessions, sessions_vllm]),
)


def markdown() -> str:
    lines = [HEAD]
    for title, parts in SECTIONS:
        body = [line for part in parts for line in part()]
        if body:
            lines += [title, "", *body]
    return "\n".join(lines).rstrip("\n") + "\n"


def headline() -> str:
    """The one figure the README carries, as it words it: the whole P/D handoff against
    recomputing the prefill, whole times faster (tests/test_performance_doc.py checks)."""
    d = load("ttft-cuda-8b-h100-run1.json")
    return f"about {math.floor(d['handoff_speedup'])}× faster than recomputing the prefill"


def write(out: Path = DOC) -> Path:
    out.write_text(markdown())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    ap.add_argument("--out", type=Path, default=DOC)
    a = ap.parse_args(argv)
    if a.check:
        if not a.out.exists() or a.out.read_text() != markdown():
            print(f"{a.out} is out of date: python benchmarks/performance_doc.py", file=sys.stderr)
            return 1
        return 0
    print("wrote", write(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
