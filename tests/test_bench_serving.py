"""benchmarks/bench_serving.py's trace and arithmetic, without engines (the benchmark itself
runs vLLM for minutes: its figures are in benchmarks/results/serving-cpu.json)."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_serving", ROOT / "benchmarks" / "bench_serving.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_shares_the_system_prompt_and_grows_each_conversation():
    b = _bench()
    trace = b.make_trace(conversations=3, turns=3, system=64, user=16, output=4, seed=5)
    assert len(trace) == 3 and all(len(c) == 3 for c in trace)
    system = trace[0][0]["prompt"][:64]
    for conv in trace:
        assert conv[0]["prompt"][:64] == system  # one system prompt for every user
        assert len(conv[0]["prompt"]) == 64 + 16
        for prev, nxt in itertools.pairwise(conv):
            # a turn's prompt is the conversation so far: the previous prompt, its recorded
            # reply, then the user's new tokens
            assert nxt["prompt"][: len(prev["prompt"]) + 4] == prev["prompt"] + prev["reply"]
            assert len(nxt["prompt"]) == len(prev["prompt"]) + 4 + 16
    assert trace[0][0]["prompt"][64:] != trace[1][0]["prompt"][64:]  # users differ
    assert b.make_trace(3, 3, 64, 16, 4, seed=5) == trace  # a recording: the same every mode
    assert b.make_trace(3, 3, 64, 16, 4, seed=6)[0][0]["prompt"][:64] != system  # new round


def test_summaries_pool_the_rounds_and_ratios_divide_the_rows():
    b = _bench()

    def rec(ttft, prompt, recomputed, out):
        return {"ttft": ttft, "prompt_tokens": prompt, "recomputed": recomputed, "output": out}

    plain = [rec(2.0, 100, 100, [1, 2]), rec(4.0, 100, 60, [3, 4])]
    kvb = [rec(1.0, 100, 100, [1, 2]), rec(1.0, 100, 20, [3, 5])]
    rows = b.with_ratios(
        [b.summarize("plain", plain, [10.0], None), b.summarize("kvbroker", kvb, [4.0, 4.0], plain)]
    )
    p, k = rows
    assert p["ttft_p50_s"] == 3.0 and k["ttft_p50_s"] == 1.0
    assert p["recomputed_tokens"] == 160 and k["recomputed_tokens"] == 120
    assert k["output_tokens_per_s"] == pytest.approx(4 / 8.0)  # over the summed wall times
    assert k["outputs_equal_plain"] == 1  # the second request's tokens differ
    assert k["ttft_p50_vs_plain"] == pytest.approx(k["ttft_p50_s"] / p["ttft_p50_s"])
    assert k["throughput_vs_plain"] == pytest.approx(
        k["output_tokens_per_s"] / p["output_tokens_per_s"]
    )
    assert b.pct([1.0, 2.0, 3.0, 4.0], 0.99) == 4.0
