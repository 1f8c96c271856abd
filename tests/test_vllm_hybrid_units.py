"""The hybrid connector's two halves driven directly against a real daemon (no vLLM engine):
a sliding, a full and a state group on small CPU caches.

- Saves: each group's blocks go under keys that name the group, the state page whole;
  loads copy them bit for bit into other engine blocks of each group.
- A load is all or nothing per request: one group lacking its block (here the state) makes
  the worker report the request failed (vLLM's ``failed_recving``, then it recomputes it),
  never a block id (vLLM takes none from a model with several groups).
- The scheduler side's lookup holds for every group: the least over the full-attention
  groups, the sliding group's window, and capped at a block boundary where the state group
  holds a state.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvbroker.integrations.vllm._format import prompt_keys
from kvbroker.integrations.vllm._groups import FULL, SLIDING, STATE, Group
from kvbroker.integrations.vllm._hybrid import (
    GroupLoad,
    GroupSave,
    HybridLoad,
    HybridScheduler,
)
from kvbroker.integrations.vllm._hybrid_worker import HybridWorker
from kvbroker.integrations._link import BrokerLink, Warnings
from kvbroker.integrations.vllm._scheduler import StepPlan

B, HEADS, DIM, BLOCKS = 4, 2, 8, 16
NS = "vllm/unit-hybrid"
GROUPS = [
    Group(0, SLIDING, B, ("sliding",), "float32", HEADS, DIM, window=5),
    Group(1, FULL, B, ("full",), "float32", HEADS, DIM),
    Group(
        2, STATE, B, ("state",), state_shapes=((3, 5),), state_dtypes=("float32",), page_nbytes=60
    ),
]
PROMPT = list(range(1, 11))  # 10 tokens: blocks 0, 1 (full) and a tail
KEYS = prompt_keys(PROMPT, B, namespace=NS, cache_salt="")


@pytest.fixture
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


def _worker(socket: str):
    gen = torch.Generator().manual_seed(0)
    caches = {
        "sliding": torch.randn(BLOCKS, HEADS, B, 2 * DIM, generator=gen),
        "full": torch.randn(BLOCKS, HEADS, B, 2 * DIM, generator=gen),
        "state": torch.randn(BLOCKS, 3, 5, generator=gen),
    }
    link = BrokerLink(socket, name="unit", role="kv_both", map_pools=True)
    worker = HybridWorker(
        groups=GROUPS,
        link=link,
        namespace=NS,
        block_size=B,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
    )
    worker.register(caches, "CPU_ATTN")
    return worker, caches


def _step(worker, plan, layers=("sliding", "full")):
    worker.bind(plan)
    worker.start_load()
    for name in layers:
        worker.save_layer(name)
    worker.wait_for_save()
    worker.unbind()


def _finish(worker, req_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if req_id in (worker.finished_loads() or set()):
            return
        time.sleep(0.01)
    pytest.fail(f"load of {req_id} never reported")


def _save(worker) -> None:
    """Blocks 0, 1 and the tail of the sliding and full groups (engine blocks 1, 2, 3), the
    state after 8 tokens (block 1's position, engine block 4)."""
    k = [GROUPS[0].key(h) for h in KEYS.keys], [GROUPS[1].key(h) for h in KEYS.keys]
    saves = [
        GroupSave("r", g, [(k[g][i], k[g][i - 1] if i else None, 1 + i) for i in range(3)])
        for g in (0, 1)
    ]
    saves.append(GroupSave("r", 2, [(GROUPS[2].key(KEYS.hashes[1]), None, 4)]))
    _step(worker, StepPlan(saves=saves))


def test_groups_round_trip_and_a_missing_state_fails_the_request(broker):
    worker, caches = _worker(broker.socket_path)
    try:
        _save(worker)
        assert worker.stats["saved_blocks"] == 7
        assert worker.stats["saved_state_bytes"] == 60
        with broker.client() as client:
            keys = sorted(o.key for o in client.list(namespace=NS))
        assert len(keys) == 7 and all(".g0/" in k or ".g1/" in k or ".g2/" in k for k in keys)
        # Load the window (sliding block 1 and the tail), the full group's three blocks and
        # the state into other engine blocks.
        load = HybridLoad(
            "q",
            [
                GroupLoad(0, [GROUPS[0].key(h) for h in KEYS.keys[1:]], [8, 9]),
                GroupLoad(1, [GROUPS[1].key(h) for h in KEYS.keys], [10, 11, 12]),
                GroupLoad(2, [GROUPS[2].key(KEYS.hashes[1])], [13]),
            ],
            tokens=9,
        )
        _step(worker, StepPlan(loads=[load]))
        _finish(worker, "q")
        assert worker.failed_loads() == set()
        assert worker.load_errors() == set()
        assert torch.equal(caches["sliding"][8:10], caches["sliding"][2:4])
        assert torch.equal(caches["full"][10:13], caches["full"][1:4])
        assert torch.equal(caches["state"][13], caches["state"][4])
        assert worker.stats["loaded_state_bytes"] == 60
        # The same load with a state no one saved: the attention groups load, the request
        # is reported failed as a whole, and no block id is reported.
        missing = HybridLoad(
            "q2", [*load.groups[:2], GroupLoad(2, [GROUPS[2].key(KEYS.hashes[0])], [14])], tokens=9
        )
        _step(worker, StepPlan(loads=[missing]))
        _finish(worker, "q2")
        assert worker.failed_loads() == {"q2"}
        assert worker.load_errors() == set()
        assert worker.stats["load_failed_blocks"] == 6
    finally:
        worker.close()


def _scheduler(socket: str) -> HybridScheduler:
    link = BrokerLink(socket, name="unit-scheduler", role="kv_both", map_pools=False)
    return HybridScheduler(
        link=link, namespace=NS, groups=GROUPS, tp_size=1, save=True, load=True, warnings=Warnings()
    )


def _request(req_id: str, tokens) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def test_lookup_lands_where_every_group_can_serve(broker):
    worker, _ = _worker(broker.socket_path)
    scheduler = _scheduler(broker.socket_path)
    try:
        _save(worker)
        # The whole prompt but its last token is held by both attention groups (tail
        # included); the state exists only at 8: the hit is 8 tokens, loaded asynchronously.
        assert scheduler.get_num_new_matched_tokens(_request("a", PROMPT), 0) == (8, True)
        # Without the state at 8, no boundary has one: no hit.
        with broker.client() as client:
            for obj in client.list(namespace=NS):
                if obj.key.startswith(GROUPS[2].key(KEYS.hashes[1])):
                    client.evict(obj.key, namespace=NS)
        assert scheduler.get_num_new_matched_tokens(_request("b", PROMPT), 0) == (0, False)
        # A longer prompt sharing the first 8 tokens: the state group needs a state at 8 and
        # the full group has blocks 0 and 1; put the state back, then the hit is 8 again,
        # and the allocation's plan names only the window's sliding block and the state.
        _save(worker)
        longer = _request("c", PROMPT[:8] + [99] * 7)
        assert scheduler.get_num_new_matched_tokens(longer, 0) == (8, True)
        ids = SimpleNamespace(get_block_ids=lambda: ([0, 5, 6, 7], [1, 2, 3, 4], [0, 9, 10, 11]))
        scheduler.update_state_after_alloc(longer, ids, 8)
        (plan,) = scheduler.pending_loads
        got = {g.group: (g.keys, g.block_ids) for g in plan.groups}
        assert got[0] == ([GROUPS[0].key(KEYS.hashes[1])], [5])  # the window: (8-5+1)//4 = 1
        assert got[1] == ([GROUPS[1].key(h) for h in KEYS.hashes[:2]], [1, 2])
        assert got[2] == ([GROUPS[2].key(KEYS.hashes[1])], [9])
    finally:
        scheduler.link.close()
        worker.close()


def test_a_requests_session_retains_its_saved_blocks_and_state_and_what_its_lookup_finds(broker):
    """Sessions through the hybrid halves: every group's saved blocks of a request naming a
    session (its state page too) are retained by it; a lookup naming another session renews
    that one and retains what it finds."""
    from kvbroker import blocks

    worker, _ = _worker(broker.socket_path)
    scheduler = _scheduler(broker.socket_path)
    try:
        conv = blocks.retention("conv-h", 600, 1)
        k = [GROUPS[0].key(h) for h in KEYS.keys], [GROUPS[1].key(h) for h in KEYS.keys]
        saves = [
            GroupSave(
                "r", g, [(k[g][i], k[g][i - 1] if i else None, 1 + i) for i in range(3)], conv
            )
            for g in (0, 1)
        ]
        saves.append(GroupSave("r", 2, [(GROUPS[2].key(KEYS.hashes[1]), None, 4)], conv))
        _step(worker, StepPlan(saves=saves))
        with broker.client() as client:
            (row,) = client.ops.sessions(namespace=NS)["sessions"]
        assert (row["name"], row["blocks"], row["priority"]) == ("conv-h", 7, 1)
        asked = _request("a", PROMPT)
        asked.kv_transfer_params = {"kvbroker": {"session": "conv-l"}}
        assert scheduler.get_num_new_matched_tokens(asked, 0) == (8, True)
        with broker.client() as client:
            got = {s["name"]: s["blocks"] for s in client.ops.sessions(namespace=NS)["sessions"]}
        assert got["conv-l"] > 0 and got["conv-h"] == 7
    finally:
        scheduler.link.close()
        worker.close()
