"""KVBrokerConnector with ``"load_async": true``, driven like tests/test_vllm_connector.py:
vLLM's own Scheduler, worker connectors over CPU-backend-shaped caches, a fake model whose KV
depends on the KV before it, a real daemon. vLLM parks a request whose blocks load in the
background and steps the others; each test ends by comparing the consumer's KV with an
uninterrupted computation's.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

from tests.vllm_helpers.common import needs_vllm, tiny_model

pytestmark = needs_vllm

BLOCK = 32
ASYNC = {"load_async": True}


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


P = _tokens(1, 100)  # 3 full blocks + a tail of 3 tokens (published as a 4th object)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


def _engine(model, socket, role, monkeypatch, **kw):
    from tests.vllm_helpers.harness import Engine

    return Engine(model, role=role, socket=socket, monkeypatch=monkeypatch, **kw)


def _produce(model, socket, monkeypatch, prompts, **kw):
    eng = _engine(model, socket, "kv_producer", monkeypatch, batched_tokens=64, **kw)
    for p in prompts:
        eng.add(p)
    eng.run()
    return eng


def _stat(steps, key):
    return sum(s.data.get(key, 0) for step in steps for s in step["stats"] if s is not None)


def _assert_exact(eng, req, prompt):
    from tests.vllm_helpers.harness import FakeModel

    np.testing.assert_array_equal(eng.cached_kv(req, prompt), FakeModel().truth(prompt))


def _reported(steps, req) -> list[int]:
    """The steps in which every rank had reported ``req``'s load over."""
    return [i for i, s in enumerate(steps) if req in s["loaded"]]


def _first_run(steps, req) -> int:
    return next(i for i, s in enumerate(steps) if req in s["output"].num_scheduled_tokens)


def _evictor(broker, check: bool = False):
    """A ``before_load`` hook evicting P's block 2 and its tail (a chain goes from its leaf)."""
    from kvbroker.integrations.vllm._format import prompt_keys

    def evict_block_2_and_tail(_out):
        with broker.client() as c:
            (ns,) = {o.namespace for o in c.list()}
            keys = prompt_keys(P, BLOCK, namespace=ns, cache_salt="").keys
            for key in reversed(keys[2:]):
                for o in c.list(namespace=ns):
                    if o.key.split("/")[0] == key:
                        count = c.evict(o.key, namespace=ns).count
                        assert not check or count == 1

    return evict_block_2_and_tail


def _forget_lookups(cons, monkeypatch) -> None:
    """The scheduler side forgets each request's lookup just before vLLM allocates for it."""
    side = cons.connector._scheduler
    update = side.update_state_after_alloc

    def forgetful(request, blocks, n):
        side.reqs[request.request_id].lookup = None
        update(request, blocks, n)

    monkeypatch.setattr(side, "update_state_after_alloc", forgetful)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2)])
def test_the_request_is_parked_while_its_blocks_load_then_runs_on_them(
    model, broker, monkeypatch, prefill_tp, decode_tp
):
    _produce(model, broker.socket_path, monkeypatch, [P], tp=prefill_tp)
    cons = _engine(
        model,
        broker.socket_path,
        "kv_consumer",
        monkeypatch,
        tp=decode_tp,
        extra={**ASYNC, "peer_tp_sizes": [prefill_tp]},
    )
    assert cons.connector.get_num_new_matched_tokens(_request(P), 0) == (99, True)
    req = cons.add(P)
    steps = cons.run()
    # The step that found the blocks ran nothing of the request: it started the load.
    assert req not in steps[0]["output"].num_scheduled_tokens
    (done,) = _reported(steps, req)  # once, after every rank's load was over
    first = _first_run(steps, req)
    assert first > done
    assert steps[first]["output"].num_scheduled_tokens[req] == 1  # 99 tokens loaded
    assert _stat(steps, "loaded_blocks") == 4 * decode_tp
    assert _stat(steps, "load_failed_blocks") == 0
    assert not any(s["invalid"] for s in steps)
    _assert_exact(cons, req, P)
    with broker.client() as c:  # the loads held their read leases only while copying
        assert sum(p.leased_read for p in c.stat().pools) == 0
    cons.close()


def _request(tokens):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id="probe",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )


def test_the_other_requests_keep_stepping_while_a_load_is_held_up(model, broker, monkeypatch):
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    other_prompt = _tokens(5, 40)
    other = cons.add(other_prompt, max_tokens=12)  # nothing of it in the broker: computed
    cons.step()  # its prefill
    worker = cons.workers[0]._worker
    gate, copying = threading.Event(), threading.Event()
    copy_in = worker._copy_in

    def held_up(spec, client, stream):
        copying.set()
        assert gate.wait(30)
        return copy_in(spec, client, stream)

    monkeypatch.setattr(worker, "_copy_in", held_up)
    req = cons.add(P)
    steps = [cons.step() for _ in range(6)]
    assert copying.is_set()  # the load started, and is stuck in its copy
    # Every step decoded the other request while the parked one waited for its blocks.
    assert [s["output"].num_scheduled_tokens.get(other) for s in steps] == [1] * 6
    assert not any(req in s["output"].num_scheduled_tokens or s["loaded"] for s in steps)
    gate.set()
    steps += cons.run()
    assert _stat(steps, "loaded_blocks") == 4
    _assert_exact(cons, req, P)
    _assert_exact(cons, other, other_prompt)
    cons.close()


def test_a_block_evicted_before_the_load_is_reported_with_it_and_recomputed(
    model, broker, monkeypatch
):
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)

    evict_block_2_and_tail = _evictor(broker, check=True)
    req = cons.add(P)
    steps = [cons.step(before_load=evict_block_2_and_tail)]
    steps += cons.run()
    (done,) = _reported(steps, req)
    # The two blocks it could not load are reported in the step that reports it over.
    assert len(steps[done]["invalid"]) == 2
    assert not any(s["invalid"] for i, s in enumerate(steps) if i != done)
    assert _stat(steps, "loaded_blocks") == 2
    assert _stat(steps, "load_failed_blocks") == 2
    # vLLM computes it from the first failed block: 100 - 64 tokens.
    assert steps[_first_run(steps, req)]["output"].num_scheduled_tokens[req] == len(P) - 64
    _assert_exact(cons, req, P)
    cons.close()


def test_a_daemon_killed_before_the_load_fails_it_whole_and_the_prompt_is_computed(
    model, tmp_path, monkeypatch
):
    from kvbroker.testing import DaemonProcess, drop_leftover_pools

    d = DaemonProcess(str(tmp_path / "kvb.sock"), "--pool-size", "64M", "--page-size", "4K")
    try:
        _produce(model, d.socket_path, monkeypatch, [P])
        cons = _engine(model, d.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
        req = cons.add(P)
        steps = [cons.step(before_load=lambda _out: d.stop(signal.SIGKILL))]
        steps += cons.run()
        (done,) = _reported(steps, req)
        assert len(steps[done]["invalid"]) == 4
        assert _stat(steps, "load_failed_blocks") == 4
        assert steps[_first_run(steps, req)]["output"].num_scheduled_tokens[req] == len(P)
        assert not cons.workers[0]._worker.link.up  # the connection error took the link down
        _assert_exact(cons, req, P)
        cons.close()
    finally:
        d.stop(signal.SIGKILL)
        drop_leftover_pools(d.socket_path)


def test_shutdown_waits_for_a_load_in_flight(model, broker, monkeypatch):
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    worker = cons.workers[0]._worker
    copy_in, ended = worker._copy_in, []

    def slow(spec, client, stream):
        time.sleep(0.3)
        n = copy_in(spec, client, stream)
        ended.append(n)
        return n

    monkeypatch.setattr(worker, "_copy_in", slow)
    cons.add(P)
    cons.step()  # parks the request, starts its load
    cons.close()  # while the load sleeps
    assert ended == [4]  # it ran to its end before the worker's client closed
    with broker.client() as c:
        assert sum(p.leased_read for p in c.stat().pools) == 0


def test_load_async_must_be_a_boolean(model, broker):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbroker.integrations.vllm.connector import KVBrokerConnector
    from tests.vllm_helpers.harness import kv_cache_config, vllm_config

    config = vllm_config(
        model, role="kv_consumer", socket=broker.socket_path, extra={"load_async": "yes"}
    )
    with pytest.raises(ValueError, match="load_async must be true or false"):
        KVBrokerConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(2, 64))


def test_a_request_whose_background_load_failed_is_loaded_synchronously_next_time(
    model, broker, monkeypatch
):
    """The worker cannot load at all (its link down) while the scheduler's lookups still find
    the blocks: vLLM requeues the request after its failed background load, the next lookup
    answers synchronously, that load fails too and vLLM computes the prompt in place; the
    request is not parked again and again."""
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    monkeypatch.setattr(cons.workers[0]._worker.link, "get", lambda: None)
    req = cons.add(P)
    steps = cons.run(max_steps=20)
    (done,) = _reported(steps, req)
    assert len(steps[done]["invalid"]) == 4
    parked = [
        i
        for i, s in enumerate(steps)
        if req not in s["output"].num_scheduled_tokens and not s["output"].finished_req_ids
    ]
    assert len(parked) <= 3, f"parked in steps {parked}"
    assert _stat(steps, "load_failed_blocks") == 8  # the background load, then the sync one
    # the whole prompt computed (after the failed synchronous load's step)
    assert sum(s["output"].num_scheduled_tokens.get(req, 0) for s in steps) >= len(P)
    _assert_exact(cons, req, P)
    cons.close()


def test_a_hung_daemon_costs_one_timeout_not_one_per_queued_load(model, tmp_path, monkeypatch):
    from kvbroker.testing import DaemonProcess, drop_leftover_pools

    prompts = [_tokens(20 + i, 70) for i in range(8)]
    d = DaemonProcess(str(tmp_path / "kvb.sock"), "--pool-size", "64M", "--page-size", "4K")
    try:
        _produce(model, d.socket_path, monkeypatch, prompts)
        # (all eight computed in one step: none reuses another's freed blocks before the KV
        # of every request is compared at the end)
        cons = _engine(
            model,
            d.socket_path,
            "kv_consumer",
            monkeypatch,
            batched_tokens=1024,
            extra={**ASYNC, "timeout": 0.5},
        )
        assert cons.workers[0]._worker.link.get() is not None  # connected before the hang
        reqs = [cons.add(p) for p in prompts]
        t = time.perf_counter()
        first = cons.step(before_load=lambda _out: d.proc.send_signal(signal.SIGSTOP))
        took, steps = [time.perf_counter() - t], [first]
        assert len(first["output"].kv_connector_metadata.plan.loads) == 8  # all parked at once
        while cons.scheduler.has_unfinished_requests() and len(steps) < 60:
            t = time.perf_counter()
            steps.append(cons.step())
            took.append(time.perf_counter() - t)
        d.proc.send_signal(signal.SIGCONT)
        assert not cons.scheduler.has_unfinished_requests()
        # The first load waits out its 0.5 s; the seven queued behind it fail at once.
        assert max(took) < 2.0, f"a step took {max(took):.2f} s"
        for r, p in zip(reqs, prompts, strict=True):
            _assert_exact(cons, r, p)
        cons.close()
    finally:
        d.proc.send_signal(signal.SIGCONT)
        d.stop(signal.SIGKILL)
        drop_leftover_pools(d.socket_path)


def test_a_loader_thread_that_cannot_start_fails_its_loads_not_the_step(model, broker, monkeypatch):
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)

    def cannot_start():
        raise RuntimeError("no thread for you")

    monkeypatch.setattr(cons.workers[0]._worker, "_loader_started", cannot_start)
    req = cons.add(P)
    steps = cons.run(max_steps=20)
    (done,) = _reported(steps, req)
    assert len(steps[done]["invalid"]) == 4
    _assert_exact(cons, req, P)
    cons.close()


def test_a_parked_request_whose_load_cannot_be_planned_is_reported_and_computed(
    model, broker, monkeypatch
):
    """vLLM parks a request as soon as the lookup says asynchronous: if the scheduler side then
    cannot plan its load (here: its lookup forgotten), a load that fails whole still goes to
    the workers, so the request is reported and computed instead of waiting forever."""
    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    _forget_lookups(cons, monkeypatch)
    req = cons.add(P)
    steps = cons.run(max_steps=20)
    (done,) = _reported(steps, req)
    assert steps[done]["invalid"]
    _assert_exact(cons, req, P)
    cons.close()


def test_a_failure_to_set_up_the_gpu_side_fails_the_loads_not_the_step(model, broker, monkeypatch):
    """CUDA caches register the pools for DMA (a GpuClient) before the first background load:
    a failure there (cudaHostRegister refused) becomes a failed load that vLLM recomputes."""
    from kvbroker.errors import KVBrokerError

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    worker = cons.workers[0]._worker
    monkeypatch.setattr(worker, "device", "cuda")  # the CUDA branch, without CUDA here

    def refused(client):
        raise KVBrokerError("cudaHostRegister of a pool: error 2")

    monkeypatch.setattr(worker, "_gpu_client", refused)
    req = cons.add(P)
    steps = cons.run(max_steps=20)
    (done,) = _reported(steps, req)
    assert len(steps[done]["invalid"]) == 4
    assert _stat(steps, "broker_errors") >= 1
    monkeypatch.setattr(worker, "device", "cpu")  # (its KV is read back from the CPU cache)
    _assert_exact(cons, req, P)
    cons.close()


def test_a_synchronous_load_whose_gpu_side_fails_is_counted_as_failed(model, broker, monkeypatch):
    from kvbroker.errors import KVBrokerError

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    worker = cons.workers[0]._worker
    monkeypatch.setattr(worker, "device", "cuda")

    def refused(client):
        raise KVBrokerError("cudaHostRegister of a pool: error 2")

    monkeypatch.setattr(worker, "_gpu_client", refused)
    req = cons.add(P)
    steps = cons.run(max_steps=20)
    assert _stat(steps, "loads") == 1
    assert _stat(steps, "load_failed_blocks") == 4
    assert _stat(steps, "broker_errors") == 1
    assert len(steps[0]["invalid"]) == 4
    monkeypatch.setattr(worker, "device", "cpu")
    _assert_exact(cons, req, P)
    cons.close()


def test_a_loader_thread_that_failed_to_start_is_replaced_for_the_next_load(
    model, broker, monkeypatch
):
    q = _tokens(7, 100)
    _produce(model, broker.socket_path, monkeypatch, [P, q])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    worker = cons.workers[0]._worker
    started, tries = worker._loader_started, []

    def fails_once():
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("no thread this time")
        started()

    monkeypatch.setattr(worker, "_loader_started", fails_once)
    first = cons.add(P)
    steps = cons.run(max_steps=20)
    assert _stat(steps, "load_failed_blocks") >= 4  # that one was computed
    _assert_exact(cons, first, P)  # (before the next request reuses its blocks)
    second = cons.add(q)
    steps = cons.run(max_steps=20)
    assert _stat(steps, "loaded_blocks") == 4  # in the background, on a new loader thread
    assert _stat(steps, "load_failed_blocks") == 0
    assert len(_reported(steps, second)) == 1
    _assert_exact(cons, second, q)
    cons.close()


def test_a_load_that_cannot_be_planned_fails_only_its_own_blocks(model, broker, monkeypatch):
    """The request's first blocks are a local prefix-cache hit shared with a running request:
    reporting them failed would make vLLM recompute that other request too."""
    shared = _tokens(8, 64)  # two blocks
    a_prompt, b_prompt = shared + _tokens(9, 40), shared + _tokens(10, 60)
    _produce(model, broker.socket_path, monkeypatch, [b_prompt])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, blocks=128)
    a = cons.add(a_prompt, max_tokens=30)
    for _ in range(3):  # its prefill, then it decodes
        cons.step()
    _forget_lookups(cons, monkeypatch)
    b = cons.add(b_prompt)
    before = cons.scheduler.requests[a].num_computed_tokens
    step = cons.step()
    assert step["invalid"]
    assert not step["invalid"] & set(cons.tables[a])  # a's blocks (the shared ones) are fine
    assert cons.scheduler.requests[a].num_computed_tokens == before + 1  # a just decoded on
    while b in cons.scheduler.requests:
        cons.step()
    _assert_exact(cons, b, b_prompt)  # (before a's next blocks reuse b's)
    cons.run()
    _assert_exact(cons, a, a_prompt)
    cons.close()


def test_kv_both_with_load_async_saves_only_recomputed_blocks_and_serves_exact_kv(
    model, broker, monkeypatch
):
    """A kv_both engine loads in the background while it saves what it computes: a background
    load that misses blocks 2 and 3 (evicted since the lookup) leaves them to vLLM, which
    computes them; they are saved then, and a fresh consumer loads the exact KV. A prompt the
    broker never had is computed and saved beside it."""
    import torch

    _produce(model, broker.socket_path, monkeypatch, [P])
    both = _engine(model, broker.socket_path, "kv_both", monkeypatch, extra=ASYNC)
    for cache in both.caches:  # the blocks it will write into hold garbage beforehand
        cache.normal_(generator=torch.Generator().manual_seed(1))

    evict_block_2_and_tail = _evictor(broker)
    other = _tokens(11, 70)
    req, fresh = both.add(P), both.add(other)
    steps = [both.step(before_load=evict_block_2_and_tail)]
    steps += both.run()
    (done,) = _reported(steps, req)
    assert len(steps[done]["invalid"]) == 2
    _assert_exact(both, req, P)
    _assert_exact(both, fresh, other)
    # block 2 and P's tail once recomputed, and the other prompt's 2 blocks and tail
    assert _stat(steps, "saved_blocks") == 5
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, extra=ASYNC)
    for prompt in (P, other):
        r = cons.add(prompt)
        got = cons.run()
        assert _stat(got, "load_failed_blocks") == 0
        _assert_exact(cons, r, prompt)
    cons.close()
    both.close()


def test_tp2_one_rank_cannot_load_and_the_request_is_computed_on_both(model, broker, monkeypatch):
    """vLLM unions the ranks' failed blocks and waits for every rank's report: rank 1's link
    is down, rank 0 loads everything; the request is computed, on both ranks, from the
    first block."""
    _produce(model, broker.socket_path, monkeypatch, [P], tp=2)
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch, tp=2, extra=ASYNC)
    monkeypatch.setattr(cons.workers[1]._worker.link, "get", lambda: None)
    req = cons.add(P)
    steps = cons.run(max_steps=30)
    (done,) = _reported(steps, req)  # once: after both ranks reported
    # rank 1's failed blocks come with its own report, which may be a step before rank 0's
    assert any(s["invalid"] for s in steps[: done + 1])
    assert sum(s["output"].num_scheduled_tokens.get(req, 0) for s in steps) >= len(P)
    _assert_exact(cons, req, P)
    cons.close()
