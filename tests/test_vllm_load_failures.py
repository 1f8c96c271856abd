"""A failed load must not publish KV computed from the blocks it did not load.

vLLM recovers its own requests (it recomputes from the first invalid block), but the broker
keeps what a connector published: a block computed from unloaded bytes and sealed once is
served to every later consumer. These tests drive vLLM's own Scheduler (and AsyncScheduler)
with the harness's fake model, whose KV depends on the KV before it, fill the engine's cache
with garbage first so that an unloaded block really is wrong, and end by loading the prompts
into a fresh consumer and comparing with the truth. Also: the parallelisms the keys cannot
tell apart are refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_vllm_connector import (  # noqa: F401 - fixtures
    BLOCK,
    P,
    _consume,
    _engine,
    _produce,
    _stat,
    _tokens,
    broker,
    model,
)
from tests.vllm_helpers.common import needs_vllm

pytestmark = needs_vllm


def _evict_blocks(broker, prompt, first, *, only_suffix: str | None = None) -> int:
    """Evict the published blocks of ``prompt`` from block ``first`` on (leaves first); with
    ``only_suffix``, only the shards whose key ends with it. Returns how many went."""
    from kvbroker.integrations.vllm._format import prompt_keys

    evicted = 0
    with broker.client() as c:
        (ns,) = {o.namespace for o in c.list()}
        keys = prompt_keys(prompt, BLOCK, namespace=ns, cache_salt="").keys
        for key in reversed(keys[first:]):
            for o in c.list(namespace=ns):
                if o.key.split("/")[0] == key and (
                    only_suffix is None or o.key.endswith(only_suffix)
                ):
                    evicted += c.evict(o.key, namespace=ns).count
    return evicted


def _garbage(eng) -> None:
    import torch

    for cache in eng.caches:
        cache.normal_(generator=torch.Generator().manual_seed(1)).mul_(1e20)


def _consumer_gets_truth(model, broker, monkeypatch, *prompts, tp: int = 1) -> None:
    from tests.vllm_helpers.harness import FakeModel

    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, tp=tp)
    for prompt in prompts:
        rid, steps = _consume(cons, prompt)
        assert _stat(steps, "loaded_blocks") > 0  # the check below is about loaded bytes
        np.testing.assert_array_equal(cons.cached_kv(rid, prompt), FakeModel().truth(prompt))


def test_a_request_sharing_the_failed_blocks_in_the_same_step_does_not_publish_them(
    model, broker, monkeypatch
):
    """A's load fails for blocks 1..; B, scheduled in the same step, hits A's (unloaded)
    blocks in vLLM's prefix cache and would save them and its own blocks after them."""
    from tests.vllm_helpers.harness import FakeModel

    _produce(model, broker.socket_path, monkeypatch, [P])
    both = _engine(model, broker.socket_path, "kv_both", monkeypatch)
    _garbage(both)
    a = both.add(P)
    q = P[:96] + _tokens(11, 60)
    b = both.add(q)
    first = both.step(before_load=lambda _o: _evict_blocks(broker, P, 1))
    assert first["invalid"]  # the load failed
    both.run()
    np.testing.assert_array_equal(both.cached_kv(a, P), FakeModel().truth(P))  # vLLM recovered
    np.testing.assert_array_equal(both.cached_kv(b, q), FakeModel().truth(q))
    _consumer_gets_truth(model, broker, monkeypatch, P, q)


def test_async_scheduling_does_not_publish_the_next_chunk_of_a_failed_load(
    model, broker, monkeypatch
):
    """Under async scheduling step t+1 is planned before step t's failure is known: A's next
    chunk, computed from the unloaded blocks, must not be sealed."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from tests.vllm_helpers.harness import FakeModel

    base = _tokens(21, 96)
    _produce(model, broker.socket_path, monkeypatch, [base + [3]])
    eng = _engine(model, broker.socket_path, "kv_both", monkeypatch, batched_tokens=32)
    eng.scheduler = AsyncScheduler(
        vllm_config=eng.config,
        kv_cache_config=eng.scheduler.kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(eng.config),
        block_size=BLOCK,
    )
    _garbage(eng)
    tokens = base + _tokens(22, 200)
    a = eng.add(tokens)
    out0 = eng.scheduler.schedule()
    mro0, done0 = eng.execute(out0, before_load=lambda _o: _evict_blocks(broker, base + [3], 1))
    assert done0["invalid"]
    out1 = eng.scheduler.schedule()  # planned before step 0's output is known
    mro1, done1 = eng.execute(out1)
    assert sum(s.data["saved_blocks"] for s in done1["stats"] if s) == 0
    eng.scheduler.update_from_output(out0, mro0)
    eng.scheduler.update_from_output(out1, mro1)
    for _ in range(100):
        if not eng.scheduler.has_unfinished_requests():
            break
        out = eng.scheduler.schedule()
        mro, _ = eng.execute(out)
        eng.scheduler.update_from_output(out, mro)
    np.testing.assert_array_equal(eng.cached_kv(a, tokens), FakeModel().truth(tokens))
    _consumer_gets_truth(model, broker, monkeypatch, tokens)


def test_tp_ranks_agree_on_a_load_that_failed_on_one_of_them(model, broker, monkeypatch):
    """Rank 1's shard of block 2 is gone, rank 0's is there. In a real model every head's KV
    of layers >= 1 depends on all heads below (the all-reduce after attention), so rank 0
    must not publish its shards of what the step computed either."""
    base = _tokens(31, 96)
    _produce(model, broker.socket_path, monkeypatch, [base + [5]], tp=2)
    eng = _engine(model, broker.socket_path, "kv_both", monkeypatch, tp=2)
    _garbage(eng)
    q = base + _tokens(32, 100)
    eng.add(q)
    first = eng.step(
        before_load=lambda _o: _evict_blocks(broker, base + [5], 2, only_suffix="tp1of2")
    )
    assert first["invalid"]
    rank0, rank1 = (s.data for s in first["stats"])
    assert rank0["load_failed_blocks"] == 0 and rank1["load_failed_blocks"] > 0
    assert rank0["saved_blocks"] == 0 and rank1["saved_blocks"] == 0
    eng.run()
    _consumer_gets_truth(model, broker, monkeypatch, q, tp=2)


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_parallelisms_the_keys_cannot_tell_apart_are_refused(model, broker, name):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbroker.integrations.vllm.connector import KVBrokerConnector
    from tests.vllm_helpers.harness import kv_cache_config, vllm_config

    config = vllm_config(model, role="kv_both", socket=broker.socket_path)
    object.__setattr__(config.parallel_config, name, 2)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=name):
            KVBrokerConnector(config, role, kv_cache_config(2, 8))


def _unlinked_worker(tp_size: int = 1, **options):
    """A worker side without a broker link (namespace "ns", blocks of 16 tokens, 2 KV heads,
    rank 0), driven directly; ``options``: WorkerSide's other arguments."""
    from kvbroker.integrations._link import Warnings
    from kvbroker.integrations.vllm._worker import WorkerSide

    return WorkerSide(
        link=None,
        namespace="ns",
        block_size=16,
        total_kv_heads=2,
        latent=False,
        tp_rank=0,
        tp_size=tp_size,
        warnings=Warnings(),
        **options,
    )


def test_a_failure_taints_saves_until_a_plan_acknowledges_it():
    """The worker's memory of a failed load, driven directly: it lasts across plans built
    before the scheduler heard of it, ends with the plan that acknowledges it, and (a
    backstop) after FAILURE_MEMORY steps without one."""
    from kvbroker.integrations.vllm._scheduler import SaveSpec, StepPlan
    from kvbroker.integrations.vllm._worker import FAILURE_MEMORY, _LoadFailure

    w = _unlinked_worker()
    saves = [
        SaveSpec("a", [("a0", None, 10), ("a1", "a0", 11)]),
        SaveSpec("b", [("b0", None, 20), ("b1", "b0", 11), ("b2", "b1", 21)]),
        SaveSpec("c", [("c0", None, 30)]),
    ]
    w.bind(StepPlan())
    w._failures.append(_LoadFailure("a", frozenset({11}), w._step))
    for _ in range(3):  # plans that do not acknowledge it
        w.bind(StepPlan(saves=saves, acknowledged={99}))
        assert [i.block_hash for i in w._items()] == ["b0", "c0"]
    w.bind(StepPlan(saves=saves, acknowledged={11}))
    assert [i.block_hash for i in w._items()] == ["a0", "a1", "b0", "b1", "b2", "c0"]
    w._failures.append(_LoadFailure("a", frozenset({11}), w._step))
    for _ in range(FAILURE_MEMORY):
        w.bind(StepPlan(saves=saves))
    assert [i.block_hash for i in w._items()] == ["b0", "c0"]
    w.bind(StepPlan(saves=saves))
    assert len(w._items()) == 6


def _agree_in_rank(rank: int, port: int, counts: list[int], out) -> None:
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    from kvbroker.integrations.vllm.connector import _tp_agreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ps.get_tp_group = lambda: type("TP", (), {"cpu_group": dist.group.WORLD})()
        out.put((rank, _tp_agreement(2)(counts)))
    finally:
        dist.destroy_process_group()


def test_the_agreement_is_a_min_all_reduce_over_the_tp_group():
    """The real agreement (not the harness's threads): two processes in a gloo group."""
    import multiprocessing
    import socket

    from kvbroker.integrations.vllm.connector import _tp_agreement

    assert _tp_agreement(1) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_agree_in_rank, args=(r, port, c, out))
        for r, c in enumerate([[4, 0, 7], [4, 3, 2]])
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert got == {0: [4, 0, 2], 1: [4, 0, 2]}


def test_a_request_id_reused_after_an_abort_keeps_its_new_state():
    """vLLM reports an aborted request in the next step's finished_req_ids; by then a new
    request may reuse its id (request_finished already forgot the old one)."""
    from types import SimpleNamespace

    from kvbroker.integrations._link import Warnings
    from kvbroker.integrations.vllm._scheduler import SchedulerSide

    side = SchedulerSide(
        link=None,
        namespace="ns",
        block_size=16,
        total_kv_heads=2,
        latent=False,
        tp_size=1,
        save=True,
        load=False,
        warnings=Warnings(),
    )

    def request(tokens):
        return SimpleNamespace(
            request_id="r1",
            prompt_token_ids=tokens,
            cache_salt=None,
            lora_request=None,
            mm_features=None,
            prompt_embeds=None,
        )

    side.state(request(list(range(1, 65))))
    side.finished("r1")  # request_finished of the aborted request
    side.state(request(list(range(100, 164))))  # a new request, the same id
    output = SimpleNamespace(
        finished_req_ids={"r1"},
        num_scheduled_tokens={"r1": 64},
        scheduled_new_reqs=[
            SimpleNamespace(req_id="r1", block_ids=([7, 8, 9, 10],), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
    )
    plan = side.build(output)
    assert [len(s.items) for s in plan.saves] == [4]


def test_a_save_left_open_by_a_step_that_never_finished_is_aborted_at_the_next():
    from unittest import mock

    from kvbroker.integrations.vllm._paged import HostSave
    from kvbroker.integrations.vllm._scheduler import StepPlan

    w = _unlinked_worker()
    stale = mock.Mock(spec=HostSave, done=False, items=[1, 2])
    w.bind(StepPlan())
    w._save = stale  # reserved at its first layer; the step then died before wait_for_save
    w.bind(StepPlan())
    stale.abort.assert_called_once()
    assert w.stats["skipped_save_blocks"] == 2


def test_every_rank_reaches_the_agreement_whatever_its_loads_raise():
    """agree() is a collective: a rank that skipped it would leave the others blocked."""
    from kvbroker.integrations.vllm._scheduler import LoadSpec, StepPlan

    asked = []
    w = _unlinked_worker(tp_size=2, agree=lambda counts: asked.append(list(counts)) or counts)
    w.fmt = object()  # registered

    def load(spec):
        if spec.req_id == "bad":
            raise RuntimeError("something unexpected")
        return len(spec.block_ids)

    w._load = load
    w.bind(StepPlan(loads=[LoadSpec("bad", ["h0"], [3]), LoadSpec("ok", ["h1"], [4])]))
    w.start_load()
    assert asked == [[0, 1]]
    assert w.load_errors() == {3}
