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
        "benchmark": "sglang_storage", "commit": "abc1234", "command": "bench_sglang_storage.py",
        "machine": machine, "tokens": 16384, "page_size": 64, "layout": "page_first",
        "pages": 256, "bytes": 2 << 30, "rounds": 3, "bit_exact": True, "seconds": seconds,
        "median_GBps": {"memcpy_out": 1.07, "kvbroker_set": 0.86},
        "ratios": {"kvbroker_set / memcpy_out": [2.0, 1.25, 1.1]},
    }  # fmt: skip
    (tmp_path / "sglang-storage-cpu.json").write_text(json.dumps(result))
    text = doc.markdown()
    assert "Commit `abc1234`" in text and "kvbroker's get bit-exact: yes" in text
    assert "| kvbroker_set | 2.500 s | 0.86 |" in text
    # the median of the per-round ratios (1.25), not 2.500 / 2.000 from the medians
    assert "| kvbroker_set / memcpy_out | 1.25 (1.10–2.00) |" in text
