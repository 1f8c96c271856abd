"""The hybrid connector's worker on CUDA caches: device staging and DMA per KV cache group.

No vLLM engine (none on the GPU host): the caches are vLLM 0.32-shaped
(:mod:`kvbroker._bench.vllm_caches`: a sliding, a full and a Mamba group overlaying one pool,
NHD or HND) and the worker is driven with hand-made plans, as the scheduler side makes them.
Each test runs on ``cuda`` (skipped without CUDA) and on ``cpu`` tensors through the same
staging code, a memmove standing in for the DMA (``staging_copier``), so the addressing is
checked on every machine.

- Every group's blocks round-trip bit for bit into other engine blocks (the window's sliding
  blocks, the full group's run, the state page), and not one other byte of the pool changes:
  the null block, the other blocks, a state page's padding.
- A state page is saved and loaded whole: every layer's state tensors, one broker page.
- A plan naming the null block is refused by the worker (the load fails whole, the save is
  skipped) and the null block is not touched.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from kvbroker._bench.vllm_caches import AttentionGroupShape, StateGroupShape, hybrid_pool
from kvbroker.integrations._link import BrokerLink, Warnings
from kvbroker.integrations.vllm._format import prompt_keys
from kvbroker.integrations.vllm._groups import FULL, SLIDING, STATE, Group
from kvbroker.integrations.vllm._hybrid import GroupLoad, GroupSave, HybridLoad
from kvbroker.integrations.vllm._hybrid_worker import HybridWorker
from kvbroker.integrations.vllm._paged import copier_for
from kvbroker.integrations.vllm._scheduler import StepPlan

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not CUDA, reason="needs CUDA (torch sees no CUDA device)"),
        ],
    ),
]
B, HEADS, DIM, BLOCKS = 16, 2, 32, 24
NS = "vllm/unit-hybrid-staged"
SHAPES = [
    AttentionGroupShape(2, HEADS, B, DIM),
    AttentionGroupShape(2, HEADS, B, DIM),
    StateGroupShape(2, ((3, 40), (2, 8, 16)), ("bfloat16", "float32")),
]
PAGE = SHAPES[0].page_nbytes()
STATE_PAGE = 2 * SHAPES[2].content_nbytes()  # a broker page: both layers' state tensors


def _names(g: int) -> tuple[str, ...]:
    return tuple(f"g{g}.l{layer}" for layer in range(SHAPES[g].layers))


GROUPS = [
    Group(0, SLIDING, B, _names(0), "bfloat16", HEADS, DIM, window=40),
    Group(1, FULL, B, _names(1), "bfloat16", HEADS, DIM),
    Group(
        2,
        STATE,
        B,
        _names(2),
        state_shapes=SHAPES[2].shapes,
        state_dtypes=SHAPES[2].dtypes,
        page_nbytes=PAGE,
    ),
]
PROMPT = list(range(1, 4 * B + 6))  # 4 full blocks and a tail
KEYS = prompt_keys(PROMPT, B, namespace=NS, cache_salt="")


@pytest.fixture
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


def _worker(socket: str, device: str, order: str):
    caches, raw = hybrid_pool(SHAPES, BLOCKS, device, order)
    link = BrokerLink(socket, name="unit-staged", role="kv_both", map_pools=True)
    worker = HybridWorker(
        groups=GROUPS,
        link=link,
        namespace=NS,
        block_size=B,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
        staging_copier=copier_for("cpu") if device == "cpu" else None,
    )
    worker.register(caches, "FLASH_ATTN")
    assert worker.staged
    return worker, caches, raw


def _step(worker, plan):
    worker.bind(plan)
    worker.start_load()
    for g in GROUPS[:2]:
        for name in g.layer_names:
            worker.save_layer(name)
    worker.wait_for_save()
    worker.unbind()


def _finish(worker, req_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if req_id in (worker.finished_loads() or set()):
            return
        time.sleep(0.01)
    pytest.fail(f"load of {req_id} never reported")


def _bits(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _moved(raw, caches, moves):
    """``raw`` after copying, for each ``(group, src block, dst block)``, every layer's bytes
    of the group's block ``src`` into its block ``dst`` (through views of the same strides)."""
    out = raw.clone()
    for g, src, dst in moves:
        for name in GROUPS[g].layer_names:
            v = caches[name]
            twin = torch.as_strided(out.view(v.dtype), v.shape, v.stride(), v.storage_offset())
            twin[dst] = v[src]
    return out


def _save_all(worker):
    """Sliding and full blocks 0..3 and the tail (sliding at engine blocks 1-5, full at 6-10);
    the state after block 3 at engine block 11."""
    saves = []
    for g, first in ((0, 1), (1, 6)):
        k = [GROUPS[g].key(h) for h in KEYS.keys]
        saves.append(
            GroupSave("r", g, [(k[i], k[i - 1] if i else None, first + i) for i in range(len(k))])
        )
    saves.append(GroupSave("r", 2, [(GROUPS[2].key(KEYS.hashes[3]), None, 11)]))
    _step(worker, StepPlan(saves=saves))


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("device", DEVICES)
def test_every_group_round_trips_bit_exact_and_nothing_else_moves(broker, device, order):
    worker, caches, raw = _worker(broker.socket_path, device, order)
    try:
        _save_all(worker)
        assert worker.stats["saved_blocks"] == 11 and worker.stats["skipped_save_blocks"] == 0
        assert worker.stats["saved_state_bytes"] == STATE_PAGE
        with broker.client() as client:
            objs = {o.key: o for o in client.list(namespace=NS)}
            state = [o for k, o in objs.items() if k.startswith(GROUPS[2].key(KEYS.hashes[3]))]
            assert len(objs) == 11 and len(state) == 1 and state[0].nbytes == STATE_PAGE
        before = raw.clone()
        # the window of a 69-token hit (sliding blocks 2, 3 and the tail), the full group's
        # five blocks and the state, each into other engine blocks
        load = HybridLoad(
            "q",
            [
                GroupLoad(0, [GROUPS[0].key(h) for h in KEYS.keys[2:]], [12, 13, 14]),
                GroupLoad(1, [GROUPS[1].key(h) for h in KEYS.keys], [15, 16, 17, 18, 19]),
                GroupLoad(2, [GROUPS[2].key(KEYS.hashes[3])], [20]),
            ],
            tokens=len(PROMPT) - 1,
        )
        _step(worker, StepPlan(loads=[load]))
        _finish(worker, "q")
        assert worker.failed_loads() == set()
        assert worker.stats["loaded_state_bytes"] == STATE_PAGE
        want = _moved(
            before,
            caches,
            [(0, 3, 12), (0, 4, 13), (0, 5, 14)]
            + [(1, 6 + i, 15 + i) for i in range(5)]
            + [(2, 11, 20)],
        )
        assert not torch.equal(want, before)  # (the loads move something)
        assert torch.equal(raw, want)  # every loaded byte, and not one byte more
        for layer in range(2):  # the null block of every layer region, by name
            at = layer * BLOCKS * PAGE
            assert torch.equal(raw[at : at + PAGE], before[at : at + PAGE])
        for name in GROUPS[2].layer_names:  # the state whole, each tensor's bytes
            assert torch.equal(_bits(caches[name][20]), _bits(caches[name][11]))
    finally:
        worker.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_naming_the_null_block_is_refused_and_the_block_untouched(broker, device):
    worker, _caches, raw = _worker(broker.socket_path, device, "NHD")
    try:
        _save_all(worker)
        before = raw.clone()
        bad = HybridLoad(
            "n",
            [GroupLoad(0, [GROUPS[0].key(h) for h in KEYS.keys[2:]], [0, 13, 14])],
            tokens=len(PROMPT) - 1,
        )
        _step(worker, StepPlan(loads=[bad]))
        _finish(worker, "n")
        assert worker.failed_loads() == {"n"}
        assert torch.equal(raw, before)
        k = [GROUPS[1].key(h) for h in KEYS.keys]
        saved = worker.stats["saved_blocks"]
        _step(worker, StepPlan(saves=[GroupSave("s", 1, [(k[0] + "x", None, 0)])]))
        assert worker.stats["saved_blocks"] == saved
        assert worker.stats["skipped_save_blocks"] == 1
    finally:
        worker.close()


@pytest.mark.parametrize("shape", ["gemma3", "qwen3next"])
def test_the_hybrid_benchmark_runs_on_cpu_tensors(tmp_path, shape):
    """``benchmarks/bench_vllm_gpu.py --hybrid`` (its GPU run is the coordinator's) on CPU
    tensors, one layer per group: every group saved and loaded, bit-exact, and the results
    file says what ran where and under what load."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_SOCKET"}
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "benchmarks", "bench_vllm_gpu.py"),
            "--device",
            "cpu",
            "--hybrid",
            shape,
            "--layers",
            "1",
            "--tokens",
            "1100",
            "--reps",
            "1",
            "--out",
            str(tmp_path),
            "--name",
            "h",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "h.json") as f:
        r = json.load(f)
    h = r["hybrid"]
    assert h["bit_exact"] is True and h["skipped_save_blocks"] == 0
    assert r["commit"] and r["command"].endswith("--name h") and r["machine"]["device"] == "CPU"
    for when in ("before", "after"):
        assert "loadavg_1min" in r["conditions"][when] and "cpu_pressure" in r["conditions"][when]
    if shape == "gemma3":  # 68 blocks per group saved; the full group's 68 and 5 windows loaded
        assert len(h["groups"]) == 6 and h["save_blocks"] == 6 * 68
        assert h["load_blocks"] == 68 + 5 * len(range((68 * 16 - 1024 + 1) // 16, 68))
    else:  # 2 blocks of the full group, and each GDN group's state at the end, both ways
        assert h["save_blocks"] == h["load_blocks"] == 2 + 3
        assert h["state_page_bytes"] == 3 * (3 * 8192 + 32 * 128 * 128) * 2
    assert h["save_s"] > 0 and h["load_s"] > 0
