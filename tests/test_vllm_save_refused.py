"""A save the broker refuses is skipped, and the step goes on, in each of the worker's save
paths: the one-group worker's host path, the hybrid worker's host path and its staging path
(run on CPU caches, a memmove standing in for the DMA). No room (PoolFull, QuotaExceeded) is
only skipped; any other broker error is also counted (``broker_errors``) and handed to the
link, which drops a lost connection. Driven directly against a real daemon, no vLLM engine.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvbroker.errors import BrokerUnavailable, PoolFull, QuotaExceeded
from kvbroker.integrations._link import BrokerLink, Warnings
from kvbroker.integrations.vllm import _cuda
from kvbroker.integrations.vllm._format import prompt_keys
from kvbroker.integrations.vllm._groups import FULL, SLIDING, Group
from kvbroker.integrations.vllm._hybrid import GroupSave
from kvbroker.integrations.vllm._hybrid_worker import HybridWorker
from kvbroker.integrations.vllm._paged import HostSave, copier_for
from kvbroker.integrations.vllm._scheduler import SaveSpec, StepPlan
from kvbroker.integrations.vllm._worker import WorkerSide

B, HEADS, DIM, BLOCKS = 4, 2, 8, 8
NS = "vllm/unit-save-refused"
GROUPS = [
    Group(0, SLIDING, B, ("sliding",), "float32", HEADS, DIM, window=5),
    Group(1, FULL, B, ("full",), "float32", HEADS, DIM),
]
HASHES = prompt_keys(list(range(1, 11)), B, namespace=NS, cache_salt="").keys[:2]
REFUSALS = [
    (PoolFull("no room in the pool"), False),
    (QuotaExceeded("over the namespace's quota"), False),
    (BrokerUnavailable("the daemon went away"), True),  # not a matter of room
]


@pytest.fixture(scope="module")
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


def _caches(*names):
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(BLOCKS, HEADS, B, 2 * DIM, generator=gen) for n in names}


def _link(broker) -> BrokerLink:
    return BrokerLink(broker.socket_path, name="unit-refused", role="kv_both", map_pools=True)


def _one_group_worker(broker):
    worker = WorkerSide(
        link=_link(broker),
        namespace=NS,
        block_size=B,
        total_kv_heads=HEADS,
        latent=False,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
    )
    worker.register(_caches("model.layers.0.self_attn.attn"), "CPU_ATTN")
    plan = StepPlan(saves=[SaveSpec("r", [(HASHES[0], None, 1), (HASHES[1], HASHES[0], 2)])])
    return worker, plan, 2


def _hybrid_worker(broker, staged: bool):
    worker = HybridWorker(
        groups=GROUPS,
        link=_link(broker),
        namespace=NS,
        block_size=B,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
        staging_copier=copier_for("cpu") if staged else None,
    )
    worker.register(_caches("sliding", "full"), "CPU_ATTN")
    assert worker.staged == staged
    saves = [
        GroupSave("r", g.index, [(g.key(HASHES[0]), None, 1), (g.key(HASHES[1]), None, 2)])
        for g in GROUPS
    ]
    return worker, StepPlan(saves=saves), 4


def _refuse_with(monkeypatch, exc, staged: bool) -> None:
    def refused(*_args, **_kwargs):
        raise exc

    if staged:
        monkeypatch.setattr(_cuda, "save_cuda", refused)
    else:
        monkeypatch.setattr(HostSave, "reserve", refused)


@pytest.mark.parametrize(("exc", "counted"), REFUSALS, ids=[type(e).__name__ for e, _ in REFUSALS])
@pytest.mark.parametrize("path", ["one group, host", "hybrid, host", "hybrid, staging"])
def test_a_refused_save_is_skipped_and_only_a_broker_error_is_counted(
    broker, monkeypatch, path, exc, counted
):
    staged = path == "hybrid, staging"
    if path == "one group, host":
        worker, plan, blocks = _one_group_worker(broker)
    else:
        worker, plan, blocks = _hybrid_worker(broker, staged)
    try:
        _refuse_with(monkeypatch, exc, staged)
        worker.bind(plan)
        worker.start_load()
        worker.wait_for_save()  # raises nothing: the engine keeps serving
        worker.unbind()
        assert worker.stats["skipped_save_blocks"] == blocks
        assert worker.stats["saved_blocks"] == 0
        assert worker.stats["broker_errors"] == (1 if counted else 0)
        assert (worker.link.down_since is not None) == counted  # the link dropped a lost one
        with broker.client() as c:
            assert c.list(namespace=NS) == []
    finally:
        worker.close()
