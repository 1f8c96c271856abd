"""vLLM's sleep mode (vLLM >= 0.33): its GPU worker calls the connector's
``unregister_kv_caches()`` before the KV cache is discarded and ``restore_kv_caches()`` after
the wake-up (``supports_sleep_mode()``, True by default, lets an engine with
``enable_sleep_mode`` start). vLLM's CPU worker ignores sleep, so the hooks are called here as
its GPU worker calls them, on the worker connectors of tests/vllm_helpers/harness.py (vLLM's own
Scheduler, a fake model whose KV depends on the KV before it, a real daemon), with the cache
overwritten in between as a discard leaves it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.vllm_helpers.common import needs_vllm, tiny_model

pytestmark = needs_vllm

BLOCK = 32


def _tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


P = _tokens(1, 100)  # 3 full blocks + a published tail


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


def _produce(model, socket, monkeypatch):
    eng = _engine(model, socket, "kv_producer", monkeypatch, batched_tokens=64)
    eng.add(P)
    eng.run()
    eng.close()


def _discard(eng) -> None:
    """What a sleep leaves in the KV cache: not the KV that was there."""
    for cache in eng.caches:
        cache.fill_(float("nan"))


def _assert_exact(eng, req, prompt):
    from tests.vllm_helpers.harness import FakeModel

    np.testing.assert_array_equal(eng.cached_kv(req, prompt), FakeModel().truth(prompt))


def _stat(steps, key):
    return sum(s.data.get(key, 0) for step in steps for s in step["stats"] if s is not None)


def _leased_reads(broker) -> int:
    with broker.client() as c:
        return sum(p.leased_read for p in c.stat().pools)


def test_unregister_waits_for_a_background_load_and_it_is_reported_failed_after_wake(
    model, broker, monkeypatch
):
    """vLLM's pause cannot finish with a load in flight (its prefix-cache reset refuses while
    a parked request holds blocks), so it unregisters none; the hook is still safe if one is:
    it returns after the load's last copy, and the load is reported failed."""
    _produce(model, broker.socket_path, monkeypatch)
    cons = _engine(
        model, broker.socket_path, "kv_consumer", monkeypatch, extra={"load_async": True}
    )
    connector = cons.workers[0]
    worker = connector._worker
    gate, copying, order = threading.Event(), threading.Event(), []
    copy_in = worker._copy_in

    def held_up(spec, client, stream):
        copying.set()
        assert gate.wait(60)
        n = copy_in(spec, client, stream)
        order.append("copied")
        return n

    monkeypatch.setattr(worker, "_copy_in", held_up)
    req = cons.add(P)
    steps = [cons.step()]  # parks the request and starts its load, which is held up
    assert copying.wait(60) and req not in steps[0]["output"].num_scheduled_tokens

    def sleep():
        connector.unregister_kv_caches()
        order.append("released")

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    sleeper.join(2.0)  # an unregister that does not wait for the load has returned by now
    gate.set()
    sleeper.join(60)
    assert order == ["copied", "released"]  # the cache was let go only after the last copy
    # the release frames are not waited for: another connection's stat may be answered first
    deadline = time.monotonic() + 10.0
    while _leased_reads(broker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _leased_reads(broker) == 0
    connector.unregister_kv_caches()  # idempotent
    _discard(cons)
    connector.restore_kv_caches()
    connector.restore_kv_caches()  # idempotent

    steps += cons.run()
    # Its blocks were loaded, then discarded by the sleep: all of them reported failed in the
    # step that reports the load over; vLLM looks the request up again, and it loads them
    # again (synchronously, as after any failed background load) into the restored cache.
    (done,) = [i for i, s in enumerate(steps) if req in s["loaded"]]
    assert len(steps[done]["invalid"]) == 4
    assert [_stat([s], "load_failed_blocks") for s in steps[done:]] == [4] + [0] * len(
        steps[done + 1 :]
    )
    first = next(i for i, s in enumerate(steps) if req in s["output"].num_scheduled_tokens)
    assert first > done and _stat(steps[first : first + 1], "loaded_blocks") == 4
    assert _stat(steps, "loaded_blocks") == 4
    assert steps[first]["output"].num_scheduled_tokens[req] == 1  # 99 tokens loaded
    _assert_exact(cons, req, P)

    assert _leased_reads(broker) == 0
    cons.close()


def _sleep_as_vllm_does(eng, *, around) -> None:
    """vLLM's EngineCore.sleep(level=1, mode="keep") on the harness: the running requests
    preempted and the prefix cache reset (its pause), each worker's ``unregister_kv_caches``,
    the discard (``around``), each worker's ``restore_kv_caches`` at the wake-up."""
    assert eng.scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    for w in eng.workers:
        w.unregister_kv_caches()
    around()
    for w in eng.workers:
        w.restore_kv_caches()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_request_kept_through_a_sleep_loads_its_prompt_again_and_runs_on(
    model, broker, monkeypatch, tp
):
    _produce(model, broker.socket_path, monkeypatch)
    cons = _engine(
        model, broker.socket_path, "kv_consumer", monkeypatch, tp=tp, extra={"peer_tp_sizes": [1]}
    )
    req = cons.add(P, max_tokens=6)
    steps = [cons.step() for _ in range(3)]  # its load, then decoding
    assert _stat(steps, "loaded_blocks") == 4 * tp
    assert cons.scheduler.requests[req].num_output_tokens >= 2
    _sleep_as_vllm_does(cons, around=lambda: _discard(cons))
    more = cons.run()
    # Preempted by the sleep, it is looked up and loaded again into the restored cache (the
    # discard left NaN in every block: a block neither loaded nor recomputed shows here).
    assert _stat(more, "loaded_blocks") == 4 * tp and not any(s["invalid"] for s in more)
    _assert_exact(cons, req, P)
    assert _leased_reads(broker) == 0
    cons.close()


def test_a_step_while_the_cache_is_released_is_refused(model, broker, monkeypatch):
    from kvbroker.errors import KVBrokerError

    _produce(model, broker.socket_path, monkeypatch)
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    cons.workers[0].unregister_kv_caches()
    cons.add(P)
    out = cons.scheduler.schedule()
    with pytest.raises(KVBrokerError, match="restore_kv_caches"):
        cons.workers[0].bind_connector_metadata(out.kv_connector_metadata)
    cons.close()


def test_the_connector_overrides_the_hooks_vllm_calls_around_sleep():
    """Where vLLM has sleep-mode hooks (0.33), they are these names and ours replace them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvbroker.integrations.vllm import KVBrokerConnector

    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        pytest.skip(
            "this vLLM has no sleep-mode hooks for connectors (0.32): the 0.33 pass "
            "of `make test` runs this"
        )
    for name in ("unregister_kv_caches", "restore_kv_caches"):
        assert name in vars(KVConnectorBase_V1), name
        assert getattr(KVBrokerConnector, name) is not getattr(KVConnectorBase_V1, name), name
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="KVBrokerConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvbroker.integrations.vllm",
    )
    assert KVBrokerConnector.supports_sleep_mode(config)
