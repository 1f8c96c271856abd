"""KVBrokerConnector's scheduler and worker hooks driven directly: vLLM's own Scheduler, one
worker connector per TP rank over CPU-backend-shaped caches, a fake model whose KV depends on
the KV before it (tests/vllm_helpers/harness.py), a real daemon. Every test ends by comparing the
KV the consumer holds with what an uninterrupted computation gives, so a block loaded wrong,
or lost without vLLM recomputing it, fails it.
"""

from __future__ import annotations

import logging
import random
import signal
import time

import numpy as np
import pytest

from tests.vllm_helpers.common import needs_vllm, tiny_model

pytestmark = needs_vllm

BLOCK = 32


def _tokens(seed: int, n: int) -> list[int]:
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
    """Run ``prompts`` through a producer (prefill in 64-token chunks); returns it."""
    eng = _engine(model, socket, "kv_producer", monkeypatch, batched_tokens=64, **kw)
    for p in prompts:
        eng.add(p)
    eng.run()
    return eng


def _consume(eng, prompt, **kw):
    req = eng.add(prompt)
    steps = eng.run(**kw)
    return req, steps


def _stat(steps, key):
    return sum(s.data.get(key, 0) for step in steps for s in step["stats"] if s is not None)


def _assert_exact(eng, req, prompt):
    from tests.vllm_helpers.harness import FakeModel

    np.testing.assert_array_equal(eng.cached_kv(req, prompt), FakeModel().truth(prompt))


def test_consumer_loads_what_the_producer_saved(model, broker, monkeypatch):
    prod = _produce(model, broker.socket_path, monkeypatch, [P])
    with broker.client() as c:
        assert len(c.list()) == 4  # 3 blocks + the tail
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    req, steps = _consume(cons, P)
    # 99 tokens loaded (4 blocks), only the last prompt token computed.
    assert steps[0]["output"].num_scheduled_tokens[req] == 1
    assert _stat(steps, "loaded_blocks") == 4
    assert _stat(steps, "load_failed_blocks") == 0
    _assert_exact(cons, req, P)
    prod.close()
    cons.close()


def test_partial_hit_loads_the_shared_blocks_and_computes_the_rest(model, broker, monkeypatch):
    _produce(model, broker.socket_path, monkeypatch, [P])
    q = P[:70] + _tokens(2, 80)  # shares blocks 0 and 1 with P
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    from tests.vllm_helpers.harness import Engine  # noqa: F401

    req, steps = _consume(cons, q)
    assert steps[0]["output"].num_scheduled_tokens[req] == len(q) - 64
    assert _stat(steps, "loaded_blocks") == 2
    _assert_exact(cons, req, q)


def test_lookup_is_side_effect_free_and_holds_nothing(model, broker, monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    req = Request(
        request_id="x",
        prompt_token_ids=P,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    with broker.client() as c:
        before = [(o.key, o.nbytes) for o in c.list()]
        leased_before = c.stat().counters.bytes_out
        answers = [cons.connector.get_num_new_matched_tokens(req, 0) for _ in range(3)]
        assert answers == [(99, False)] * 3
        assert cons.connector.get_num_new_matched_tokens(req, 64) == (35, False)
        stat = c.stat()
        assert [(o.key, o.nbytes) for o in c.list()] == before
        assert sum(p.leased_read + p.leased_write for p in stat.pools) == 0
        # It only counts (match_prefix hold=False): no block was leased, not even for a
        # moment, and no release is left to send.
        assert stat.counters.bytes_out == leased_before
        assert stat.counters.prefix_queries >= 4


def test_block_evicted_between_lookup_and_load_is_recomputed(model, broker, monkeypatch, caplog):
    from kvbroker.integrations.vllm._format import prompt_keys

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)

    def evict_block_2_and_tail(_out):
        with broker.client() as c:
            (ns,) = {o.namespace for o in c.list()}
            keys = prompt_keys(P, BLOCK, namespace=ns, cache_salt="").keys
            for key in reversed(keys[2:]):  # a chain is evicted from its leaf
                for o in c.list(namespace=ns):
                    if o.key.split("/")[0] == key:
                        assert c.evict(o.key, namespace=ns).count == 1

    req = cons.add(P)
    caplog.set_level(logging.WARNING, logger="kvbroker.integrations.vllm")
    steps = [cons.step(before_load=evict_block_2_and_tail)]
    steps += cons.run()
    assert steps[0]["output"].num_scheduled_tokens[req] == 1  # the lookup saw 99 tokens
    assert _stat(steps, "loaded_blocks") == 2
    assert _stat(steps, "load_failed_blocks") == 2
    assert len(steps[0]["invalid"]) == 2
    # vLLM rescheduled from the first failed block: 100 - 64 tokens recomputed.
    assert steps[1]["output"].num_scheduled_tokens[req] == len(P) - 64
    warnings = [r for r in caplog.records if "could not load" in r.getMessage()]
    assert len(warnings) == 1 and "recomputes" in warnings[0].getMessage()
    _assert_exact(cons, req, P)


def test_daemon_down_lookups_return_zero_saves_are_skipped_then_it_reconnects(
    model, tmp_path, monkeypatch, caplog
):
    from kvbroker.testing import running_daemon

    caplog.set_level(logging.WARNING, logger="kvbroker.integrations.vllm")
    socket = str(tmp_path / "none.sock")
    # Each failed connect doubles the links' backoff (from retry_min, 0.05 s): the longer a
    # loaded machine takes over the steps while the daemon is down, the longer the wait
    # before the next try. Capped at 0.1 s, the 0.2 s below is past it whatever that took.
    both = _engine(model, socket, "kv_both", monkeypatch, extra={"retry_max": 0.1})
    started = time.monotonic()
    req, steps = _consume(both, P)
    assert time.monotonic() - started < 10
    assert steps[0]["output"].num_scheduled_tokens[req] == len(P)  # computed, nothing loaded
    assert _stat(steps, "skipped_save_blocks") == 4
    _assert_exact(both, req, P)
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    # The daemon comes up on that socket: after the backoff both sides reconnect.
    with running_daemon(pool_size="64M") as d:
        monkeypatch.setattr(both.connector._scheduler.link, "socket", d.socket_path)
        for w in both.workers:
            monkeypatch.setattr(w._worker.link, "socket", d.socket_path)
        time.sleep(0.2)  # past the links' backoff (retry_max)
        q = _tokens(3, 70)
        _req2, steps2 = _consume(both, q)
        assert _stat(steps2, "saved_blocks") == 3  # 2 blocks + tail
        with d.client() as c:
            assert len(c.list()) == 3
        assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_daemon_killed_between_lookup_and_load_is_recomputed(model, tmp_path, monkeypatch):
    from kvbroker.testing import DaemonProcess, drop_leftover_pools

    d = DaemonProcess(str(tmp_path / "kvb.sock"), "--pool-size", "64M", "--page-size", "4K")
    try:
        _produce(model, d.socket_path, monkeypatch, [P])
        cons = _engine(model, d.socket_path, "kv_consumer", monkeypatch)
        req = cons.add(P)
        steps = [cons.step(before_load=lambda _out: d.stop(signal.SIGKILL))]
        steps += cons.run()
        assert steps[0]["output"].num_scheduled_tokens[req] == 1  # the lookup had found it
        assert _stat(steps, "load_failed_blocks") == 4
        _assert_exact(cons, req, P)
    finally:
        d.stop(signal.SIGKILL)
        drop_leftover_pools(d.socket_path)


def test_forward_dying_mid_step_aborts_the_save_and_leaves_nothing(model, broker, monkeypatch):
    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch)
    prod.add(P)
    # Layer 0 ran (its KV was copied into reserved blocks), layer 1 never did.
    step = prod.step(layers_to_run=[0])
    assert sum(s.data["skipped_save_blocks"] for s in step["stats"] if s) == 4
    with broker.client() as c:
        stat = c.stat()
        assert c.list() == []
        assert sum(p.used + p.leased_write for p in stat.pools) == 0
        assert stat.counters.aborts >= 4 or stat.counters.publishes == 0


def test_request_aborted_mid_prefill_leaves_only_complete_blocks(model, broker, monkeypatch):
    from vllm.v1.request import RequestStatus

    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch, batched_tokens=64)
    long = _tokens(9, 200)
    req = prod.add(long)
    prod.step()  # first chunk: 64 tokens, blocks 0 and 1
    prod.scheduler.finish_requests(req, RequestStatus.FINISHED_ABORTED)
    prod.run()
    with broker.client() as c:
        objects = c.list()
        stat = c.stat()
    assert len(objects) == 2  # the two blocks the first chunk completed; no tail, no more
    assert sum(p.leased_read + p.leased_write for p in stat.pools) == 0


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_tp_shards_reshard_between_prefill_and_decode(
    model, broker, monkeypatch, prefill_tp, decode_tp
):
    _produce(model, broker.socket_path, monkeypatch, [P], tp=prefill_tp)
    with broker.client() as c:
        assert len(c.list()) == 4 * prefill_tp  # each rank its own shard of each block
    cons = _engine(
        model,
        broker.socket_path,
        "kv_consumer",
        monkeypatch,
        tp=decode_tp,
        extra={"peer_tp_sizes": [prefill_tp]},
    )
    req, steps = _consume(cons, P)
    assert steps[0]["output"].num_scheduled_tokens[req] == 1
    assert _stat(steps, "loaded_blocks") == 4 * decode_tp  # every rank loaded its heads
    _assert_exact(cons, req, P)


def test_cache_salt_separates_prompts(model, broker, monkeypatch):
    prod = _engine(model, broker.socket_path, "kv_producer", monkeypatch)
    prod.add(P, cache_salt="tenant-a")
    prod.run()
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    other = cons.add(P, cache_salt="tenant-b")
    steps = cons.run()
    assert steps[0]["output"].num_scheduled_tokens[other] == len(P)
    same = cons.add(P, cache_salt="tenant-a")
    steps = cons.run()
    assert steps[0]["output"].num_scheduled_tokens[same] == 1


def test_kv_both_never_publishes_blocks_whose_load_failed(model, broker, monkeypatch):
    """A kv_both engine whose load of blocks 2 and 3 fails (evicted since the lookup) must not
    save them in that step (they hold whatever was there) nor anything computed from them;
    once vLLM recomputed them they are saved, right, and a fresh consumer loads the exact KV."""
    from kvbroker.integrations.vllm._format import prompt_keys

    _produce(model, broker.socket_path, monkeypatch, [P])
    both = _engine(model, broker.socket_path, "kv_both", monkeypatch)
    # blocks this engine will write into hold garbage beforehand
    for cache in both.caches:
        cache.normal_(generator=__import__("torch").Generator().manual_seed(1))

    def evict_block_2_and_tail(_out):
        with broker.client() as c:
            (ns,) = {o.namespace for o in c.list()}
            keys = prompt_keys(P, BLOCK, namespace=ns, cache_salt="").keys
            for key in reversed(keys[2:]):
                for o in c.list(namespace=ns):
                    if o.key.split("/")[0] == key:
                        c.evict(o.key, namespace=ns)

    req = both.add(P)
    steps = [both.step(before_load=evict_block_2_and_tail)]
    steps += both.run()
    _assert_exact(both, req, P)
    assert _stat(steps, "saved_blocks") == 2  # block 2 and the tail, after the recompute
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    req2, steps2 = _consume(cons, P)
    assert _stat(steps2, "loaded_blocks") == 4
    _assert_exact(cons, req2, P)


def test_worker_stats_travel_through_vllms_connector_stats_hook(model, broker, monkeypatch):
    """What the workers count reaches vLLM's stats logger: get_kv_connector_stats ->
    (serialized) -> build_kv_connector_stats -> aggregate over workers and steps -> reduce."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(
        model, broker.socket_path, "kv_consumer", monkeypatch, tp=2, extra={"peer_tp_sizes": [1]}
    )
    _req, steps = _consume(cons, P)
    logging_ = KVConnectorLogging(cons.config.kv_transfer_config)
    for step in steps:
        for stats in step["stats"]:
            if stats is not None:
                logging_.observe(stats.to_dict())
    reduced = logging_.transfer_stats_accumulator.reduce()
    assert reduced["loaded_blocks"] == 8  # 4 blocks on each of 2 ranks
    assert reduced["load_failed_blocks"] == 0
    assert reduced["loaded_MiB"] > 0


def test_workers_report_their_totals_to_the_daemon_for_kvbroker_stat(model, broker, monkeypatch):
    """Each worker tells the daemon its totals (at most every REPORT_EVERY s): `kvbroker stat`
    shows what the connector loaded and saved, per client, beside the daemon's own counters."""
    from kvbroker.cli._stat import render

    _produce(model, broker.socket_path, monkeypatch, [P])
    cons = _engine(model, broker.socket_path, "kv_consumer", monkeypatch)
    _consume(cons, P)
    with broker.client() as c:
        stat = c.stat()
    loaded = [cl.reported for cl in stat.clients if cl.reported.get("loaded_blocks")]
    assert loaded and loaded[0]["loaded_blocks"] == 4 and loaded[0]["loaded_tokens"] == 4 * 32
    assert "reports: " in render(stat) and "loaded_blocks 4" in render(stat)
    cons.close()


def test_an_unknown_extra_config_key_is_logged_at_start(model, broker, caplog):
    """A misspelt key ("sock", "load_asnyc") silently meant the default; the connector now
    names it at start, with the key it was probably meant to be. Known keys are not named."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvbroker.integrations.vllm.connector import KVBrokerConnector
    from tests.vllm_helpers.harness import kv_cache_config, vllm_config

    caplog.set_level(logging.WARNING, logger="kvbroker.integrations.vllm")
    extra = {"load_asnyc": True, "sock": "/nowhere", "timeout": 5, "namespace": "vllm"}
    config = vllm_config(model, role="kv_consumer", socket=broker.socket_path, extra=extra)
    KVBrokerConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(2, 64)).shutdown()
    said = [r.getMessage() for r in caplog.records if "kv_connector_extra_config" in r.getMessage()]
    assert len(said) == 2, said
    assert "'load_asnyc' (did you mean 'load_async'?) is ignored" in said[0]
    assert "'sock' (did you mean 'socket'?) is ignored" in said[1]
