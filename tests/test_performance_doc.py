"""docs/performance.md is generated from benchmarks/results/ (benchmarks/performance_doc.py),
and a benchmark run (benchmarks/bench_all.py) regenerates it."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_all imports performance_doc
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


def test_committed_page_is_what_the_committed_results_give():
    doc = _load("performance_doc")
    assert (ROOT / "docs" / "performance.md").read_text() == doc.markdown(), (
        "docs/performance.md is out of date: python benchmarks/performance_doc.py"
    )
    assert doc.main(["--check"]) == 0


def test_page_follows_the_results_files(tmp_path, monkeypatch):
    """A changed figure, a results file removed: the page says what the files say."""
    doc = _load("performance_doc")
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    monkeypatch.setattr(doc, "RESULTS", results)
    data = json.loads((results / "bench-transfer-cpu.json").read_text())
    row = next(r for r in data["rows"] if r["size"] == 32 << 20)
    row["ratio_vs_memcpy"] = 0.4567
    data["commit"] = "feedbee"
    (results / "bench-transfer-cpu.json").write_text(json.dumps(data))
    (results / "soak-cpu.json").unlink()
    text = doc.markdown()
    transfer = text.split("### `kvbroker bench transfer`")[1].split("###")[0]
    assert "Commit `feedbee`" in transfer
    assert "| 32 MiB |" in transfer and "| 0.45 |" in transfer  # cut, never rounded up
    assert "### Soak" not in text
    out = tmp_path / "performance.md"
    assert doc.main(["--check", "--out", str(out)]) == 1  # missing
    out.write_text(text)
    assert doc.main(["--check", "--out", str(out)]) == 0
    out.write_text(text.replace("0.45", "0.46"))
    assert doc.main(["--check", "--out", str(out)]) == 1  # edited by hand


def test_bench_all_regenerates_the_page(tmp_path, monkeypatch):
    """`bench_all.py --report-only` (the tail of every bench run) rewrites the page."""
    bench_all = _load("bench_all")
    doc = bench_all.performance_doc
    results, docs = tmp_path / "results", tmp_path / "docs"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    docs.mkdir()
    for mod in (bench_all, doc):
        monkeypatch.setattr(mod, "RESULTS", results)
    monkeypatch.setattr(bench_all, "DOCS", docs)
    monkeypatch.setattr(bench_all, "plot_gpu", lambda: None)  # charts need matplotlib
    monkeypatch.setattr(sys, "argv", ["bench_all.py", "--report-only", "--no-profile"])
    bench_all.main()
    assert (docs / "performance.md").read_text() == doc.markdown()
    assert "### `kvbroker bench peer`" in doc.markdown()


def test_readme_headline_is_the_measured_one():
    """The README's one figure is the committed TTFT result's, and links to the page."""
    doc = _load("performance_doc")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert doc.headline() in readme
    assert "[docs/performance.md](docs/performance.md)" in readme


def test_sglang_table_ratios_come_from_the_rounds(tmp_path, monkeypatch):
    """bench_sglang_storage.py's results (the fields it writes): times are medians over the
    rounds, ratios the per-round ones, never a quotient of two medians."""
    doc = _load("performance_doc")
    monkeypatch.setattr(doc, "RESULTS", tmp_path)
    machine = json.loads((ROOT / "benchmarks/results/bench-rpc-cpu.json").read_text())["machine"]
    seconds = {"memcpy_out": [1.0, 2.0, 4.0], "kvbroker_set": [2.0, 2.5, 4.4]}
    result = {
        "benchmark": "sglang_storage",
        "commit": "abc1234",
        "command": "bench_sglang_storage.py",
        "machine": machine,
        "tokens": 16384,
        "page_size": 64,
        "layout": "page_first",
        "pages": 256,
        "bytes": 2 << 30,
        "rounds": 3,
        "bit_exact": True,
        "seconds": seconds,
        "median_GBps": {"memcpy_out": 1.07, "kvbroker_set": 0.86},
        "ratios": {"kvbroker_set / memcpy_out": [2.0, 1.25, 1.1]},
    }
    (tmp_path / "sglang-storage-cpu.json").write_text(json.dumps(result))
    text = doc.markdown()
    assert "Commit `abc1234`" in text and "kvbroker's get bit-exact: yes" in text
    assert "| kvbroker_set | 2.500 s | 0.86 |" in text
    # the median of the per-round ratios (1.25), not 2.500 / 2.000 from the medians
    assert "| kvbroker_set / memcpy_out | 1.25 (1.10–2.00) |" in text


def _cells(text: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first markdown table under ``heading``, as header -> cell."""
    body = text.split(heading, 1)[1].split("\n### ", 1)[0]
    lines = [ln for ln in body.split("\n\n| ", 1)[1].split("\n\n", 1)[0].splitlines()]
    header = [h.strip() for h in lines[0].strip("| ").split("|")]
    return [
        dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True))
        for ln in lines[2:]
    ]


def _agrees(shown: str, num: str, den: str, factor: float = 1.0) -> bool:
    """A ratio printed two decimals cut is the quotient of the two times printed beside it (to
    within what printing the times to three decimals can move it)."""
    a, b, r = float(num), float(den), float(shown.rstrip("×"))
    q = factor * a / b
    slack = q * (0.0005 / a + 0.0005 / b)
    return q - slack - 1e-9 <= r + 0.01 and r <= q + slack + 1e-9


def test_peer_ratios_are_quotients_of_the_times_beside_them(tmp_path, monkeypatch):
    """A peer run of several rounds that stored, as ratios, medians of per-round ratios (3.55
    beside times whose quotient is 3.02, as bench-peer-cpu.json did): the page prints the
    quotient of the times beside each ratio, and the targets measured from them."""
    doc = _load("performance_doc")
    monkeypatch.setattr(doc, "RESULTS", tmp_path)
    machine = json.loads((ROOT / "benchmarks/results/bench-rpc-cpu.json").read_text())["machine"]
    row = {
        "size": 256 << 10,
        "rounds": 3,
        "kvb_put_ms": 0.242,
        "kvb_get_ms": 0.128,
        "kvb_roundtrip_ms": 0.370,
        "memcpy_gbps": 23.0,
        "kvb_vs_memcpy": 0.06,
        "copy_threads": 1,
        "split_memcpy2_ms": 0.038,
        "kvb_vs_split_memcpy": 0.09,
        "dummy_put_ms": 0.500,
        "dummy_get_ms": 0.618,
        "dummy_roundtrip_ms": 1.114,
        "speedup_vs_dummy": 3.55,
        "time_vs_dummy": 0.28,
        "speedup_vs_dummy_range": [2.15, 3.70],
    }
    result = {
        "scenario": "peer",
        "commit": "abc1234",
        "command": "kvbroker bench peer",
        "machine": machine,
        "params": {"modes": ["dummy"], "rounds": 3},
        "rows": [row],
        "columns": {"rows": [["size", "size", "size"], ["speedup_vs_dummy", "x dummy", "ratio"]]},
        "targets": [
            {
                "name": "256 KiB put+get time vs Mooncake dummy",
                "measured": 0.28,
                "goal": 1 / 3,
                "op": "<=",
                "unit": "x",
                "met": True,
            }
        ],
        "notes": [],
    }
    (tmp_path / "bench-peer-cpu.json").write_text(json.dumps(result))
    text = doc.markdown()
    (r,) = _cells(text, "### `kvbroker bench peer`")
    assert r["kvb put+get ms"] == "0.370" and r["Mooncake dummy put+get ms"] == "1.118"
    assert r["x Mooncake dummy"] == "3.02"  # 1.118 / 0.370, never the stored 3.55
    assert _agrees(r["x Mooncake dummy"], r["Mooncake dummy put+get ms"], r["kvb put+get ms"])
    assert _agrees(r["kvb x memcpy"], r["memcpy ms"], r["kvb put+get ms"], factor=2)
    assert "256 KiB put+get time vs Mooncake dummy ≤ 0.333×: 0.33×" in text  # not 0.28
    assert "256 KiB x Mooncake dummy: 2.15–3.70" in text  # the per-round range, labelled
    assert "CPU pressure (PSI) not recorded" in text


def test_every_committed_peer_ratio_is_the_quotient_beside_it():
    """Every peer table of the committed page: each "x PEER" and "kvb x memcpy" cell is the
    quotient of the times printed in its row."""
    text = (ROOT / "docs" / "performance.md").read_text()
    headings = [h for h in text.split("\n") if h.startswith("### `kvbroker bench peer`")]
    assert headings
    for heading in headings:
        for r in _cells(text, heading):
            kvb = r["kvb put+get ms"]
            assert _agrees(r["kvb x memcpy"], r["memcpy ms"], kvb, factor=2), (heading, r)
            assert _agrees(r["kvb x memcpy same threads"], r["2 memcpys, same threads ms"], kvb)
            for col, cell in r.items():
                if col.startswith("x "):
                    assert _agrees(cell, r[col[2:] + " put+get ms"], kvb), (heading, col, r)


def test_serving_ratios_come_from_the_figures_beside_them(tmp_path, monkeypatch):
    """bench_serving.py's results: the page divides the figures it prints, whatever ratio the
    file stored, and says the load and CPU pressure the run recorded."""
    doc = _load("performance_doc")
    monkeypatch.setattr(doc, "RESULTS", tmp_path)
    data = json.loads((ROOT / "benchmarks/results/serving-cpu.json").read_text())
    plain, kvb = data["rows"][0], data["rows"][1]
    plain["ttft_p50_s"], kvb["ttft_p50_s"] = 2.0, 1.5
    kvb["ttft_p50_vs_plain"] = 0.5  # a stored ratio no figure of the table gives
    (tmp_path / "serving-cpu.json").write_text(json.dumps(data))
    text = doc.markdown()
    rows = {r["mode"]: r for r in _cells(text, "### Serving")}
    assert rows["kvbroker"]["TTFT p50"] == "1,500 ms" and rows["plain"]["TTFT p50"] == "2,000 ms"
    assert rows["kvbroker"]["TTFT p50 / plain's"] == "0.75×"
    assert "CPU pressure (PSI: share of the last minute some task waited for a CPU)" in text


def test_peer_table_shows_the_memcpy_of_each_peers_turn(tmp_path, monkeypatch):
    """The drivers run one after another while the machine's load moves: beside each peer, the
    memcpy its driver timed in its own loop (the median over its rounds)."""
    doc = _load("performance_doc")
    monkeypatch.setattr(doc, "RESULTS", tmp_path)
    data = json.loads((ROOT / "benchmarks/results/bench-peer-cpu.json").read_text())
    for row in data["rows"]:
        for key in [k for k in row if k.endswith("_memcpy_ms") and k != "split_memcpy2_ms"]:
            del row[key]  # as files written before the column: from the raw rounds
    for i, rnd in enumerate(data["raw_rounds"]):
        for p in rnd["peer"]:
            if p["mode"] == "dummy":
                for z in p["sizes"]:
                    z["memcpy"]["median_ms"] = [1.0, 3.0, 2.0][i]
    (tmp_path / "bench-peer-cpu.json").write_text(json.dumps(data))
    rows = _cells(doc.markdown(), "### `kvbroker bench peer`")
    assert {r["Mooncake dummy's turn: memcpy ms"] for r in rows} == {"2.000"}
