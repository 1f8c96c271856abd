"""Same-node P/D handoff through the daemon's GPU staging rings (``._handoff``), without a GPU
and without vLLM.

What is real here: the daemon (a subprocess with ``KVBROKER_FAKE_GPUS``, so its ring service,
allocator, leases, TTLs, ``ring_lookup`` and the fencing of connections are the ones a GPU host
runs), the lookups, the selection, the gathers and scatters (torch ops on CPU tensors shaped
like vLLM's caches). What is faked, because it needs CUDA: the ring's device memory and its
CUDA IPC mapping, stood in for by one CPU buffer per ring (:class:`CpuRings`, the subset of
:class:`kvbroker.gpu.GpuClient` the handoff uses). ``tests/test_gpu_handoff.py`` runs the same
paths on a GPU, across two processes over CUDA IPC.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from test_vllm_gpu import _bits, _fmt, vllm_like

from kvbroker.errors import NotFound
from kvbroker.integrations.vllm._handoff import (
    HandoffConfig,
    find_runs,
    load_runs,
    publish_runs,
    run_key,
)
from kvbroker.integrations.vllm._paged import SaveItem, cuda_cache

NS = "vllm/handoff-test"
RING = 1 << 20


class _Region:
    def __init__(self, owner: CpuRings, reply: dict, kind: str) -> None:
        self.owner, self.kind = owner, kind
        self.lease, self.ring = reply["lease"], reply["device"]
        self.offset, self.nbytes = reply["offset"], reply["nbytes"]
        self.meta = reply.get("meta")
        self.tensor = owner.memory[self.ring][self.offset : self.offset + self.nbytes]
        self.device = torch.device("cpu")
        self.ended = False

    def seal(self) -> None:
        self.owner.client.ops.ring_seal(self.lease)
        self.ended = True

    def release(self) -> None:
        if not self.ended:
            self.ended = True
            self.owner.client.ops.ring_release(self.lease)


class CpuRings:
    """GpuClient's ring methods the handoff uses, over a fake-GPU daemon: the leases are the
    daemon's, the memory one CPU buffer per ring (shared by every CpuRings of a test)."""

    def __init__(self, client, memory: dict[int, torch.Tensor], ring: int = 0) -> None:
        self.client, self.memory, self.ring = client, memory, ring

    def local_ring(self) -> int:
        return self.ring

    def ring_reserve(
        self, nbytes, *, key=None, ring=None, namespace="default", meta=None, ttl=None, wait=5.0
    ):
        reply = self.client.ops.ring_reserve(
            self.ring if ring is None else ring,
            nbytes,
            namespace=namespace,
            key=key,
            meta=meta,
            ttl=ttl,
        )
        return _Region(self, reply, reply["kind"])

    def ring_read(self, key, *, namespace="default", consume=True, wait=None):
        reply = self.client.ops.ring_claim(key, namespace=namespace, consume=consume, wait=wait)
        return _Region(self, reply, "read")


@pytest.fixture
def ring_daemon(make_daemon):
    return make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "64K",
        "--gpu-ring",
        "1M",
        env={"KVBROKER_FAKE_GPUS": "2"},
    )


@pytest.fixture
def memory():
    return {i: torch.zeros(RING, dtype=torch.uint8) for i in range(2)}


HASHES = [f"{i:032x}" for i in range(1, 9)]


def _items(hashes, ids):
    return [
        SaveItem(h, hashes[i - 1] if i else None, b)
        for i, (h, b) in enumerate(zip(hashes, ids, strict=True))
    ]


def _used(client):
    return [r["used"] for r in client.stat().rings]


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_runs_hand_off_bit_exact_across_tp_layouts_and_free_the_rings(
    ring_daemon, memory, order, prefill_tp, decode_tp, monkeypatch
):
    from kvbroker.integrations.vllm import _handoff

    # gathers and scatters of 1, 2 or 3 blocks at a time: runs of 4 and 2 cut unevenly
    monkeypatch.setattr(_handoff, "CHUNK_BYTES", (2 + prefill_tp) * 2 * 2 * 16 * 8 * 2 * 4)
    L, B, H, N, D = 2, 10, 4, 16, 8
    full, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND")
    f6 = cuda_cache(full, "packed")
    src_ids = [7, 2, 9, 0, 4, 1]
    # two steps of a chunked prefill: two runs per producer rank and decode rank
    steps = [(HASHES[:4], src_ids[:4]), (HASHES[4:6], src_ids[4:6])]
    config = HandoffConfig(
        "ring", consumer_tp=decode_tp, rings=tuple(r % 2 for r in range(decode_tp))
    )
    per = H // prefill_tp
    with ring_daemon.client(map_pools=False) as p, ring_daemon.client(map_pools=False) as c:
        for r in range(prefill_tp):
            mine, _ = vllm_like(L, B, per, N, D, torch.bfloat16, "cpu", order, seed=9)
            for layer in range(L):
                mine[layer].copy_(full[layer][:, r * per : (r + 1) * per])
            fmt = _fmt(L, per, N, D, torch.bfloat16, r, prefill_tp, total=H)
            offset = 0
            for hashes, _ids in steps:
                items = _items(HASHES[: offset + len(hashes)], src_ids[: offset + len(hashes)])
                done, n, _ = publish_runs(
                    CpuRings(p, memory),
                    NS,
                    cuda_cache(mine, "packed"),
                    fmt,
                    [("req", items[offset:])],
                    config,
                )
                assert done == ["req"] and n == len(hashes)
                offset += len(hashes)
        assert sum(_used(c)) > 0
        runs = find_runs(
            c, NS, HASHES[:6], heads=H, consumer_tp=decode_tp, producer_tps=[decode_tp, prefill_tp]
        )
        assert [(x.start, x.count, x.producer_tp) for x in runs] == [
            (0, 4, prefill_tp),
            (4, 2, prefill_tp),
        ]
        per = H // decode_tp
        dst_ids = [5, 3, 8, 6, 2, 0]
        for r in range(decode_tp):
            out, _ = vllm_like(L, B, per, N, D, torch.bfloat16, "cpu", order, seed=5)
            o6 = cuda_cache(out, "packed")
            fmt = _fmt(L, per, N, D, torch.bfloat16, r, decode_tp, total=H)
            loaded, nbytes = load_runs(CpuRings(c, memory), NS, o6, fmt, dst_ids, runs, 0)
            assert loaded == 6 and nbytes == 6 * fmt.block_nbytes
            for a, b in zip(src_ids, dst_ids, strict=True):
                assert torch.equal(
                    _bits(o6[:, :, b]), _bits(f6[:, :, a, :, r * per : (r + 1) * per])
                )
        # every run was consume-read by the one decode rank it was for: the rings are empty
        assert _used(c) == [0, 0] and c.stat().rings[0]["objects"] == 0


def test_a_consumer_with_a_local_prefix_loads_only_the_rest_of_the_run(ring_daemon, memory):
    L, B, H, N, D = 2, 10, 2, 16, 8
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    s6 = cuda_cache(src, "packed")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    with ring_daemon.client(map_pools=False) as p, ring_daemon.client(map_pools=False) as c:
        publish_runs(
            CpuRings(p, memory),
            NS,
            s6,
            fmt,
            [("r", _items(HASHES[:5], [0, 1, 2, 3, 4]))],
            HandoffConfig("ring"),
        )
        runs = find_runs(c, NS, HASHES[:5], heads=H, consumer_tp=1, producer_tps=[1])
        out, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD", seed=3)
        o6 = cuda_cache(out, "packed")
        before = o6.clone()
        # blocks 0 and 1 are the consumer's own prefix-cache hits: load blocks 2..4
        assert load_runs(CpuRings(c, memory), NS, o6, fmt, [7, 8, 9], runs, 2)[0] == 3
        for a, b in zip([2, 3, 4], [7, 8, 9], strict=True):
            assert torch.equal(_bits(o6[:, :, b]), _bits(s6[:, :, a]))
        assert torch.equal(_bits(o6[:, :, :7]), _bits(before[:, :, :7]))
        assert _used(c)[0] == 0


def test_lookup_finds_only_whole_runs_of_this_prompt_for_every_rank(ring_daemon, memory):
    L, B, H, N, D = 1, 6, 4, 16, 8
    with ring_daemon.client(map_pools=False) as p, ring_daemon.client(map_pools=False) as c:
        cache, _ = vllm_like(L, B, 2, N, D, torch.bfloat16, "cpu", "NHD")
        fmt = _fmt(L, 2, N, D, torch.bfloat16, 0, 2, total=H)
        # only producer rank 0 of 2 handed its heads off: decode TP 1 needs both
        publish_runs(
            CpuRings(p, memory),
            NS,
            cuda_cache(cache, "packed"),
            fmt,
            [("r", _items(HASHES[:3], [0, 1, 2]))],
            HandoffConfig("ring", 1),
        )
        assert find_runs(c, NS, HASHES[:3], heads=H, consumer_tp=1, producer_tps=[1, 2]) == []
        # a prompt that shares the first block's hash but not the run: not this prompt's run
        fmt1 = _fmt(L, 2, N, D, torch.bfloat16, 1, 2, total=H)
        publish_runs(
            CpuRings(p, memory),
            NS,
            cuda_cache(cache, "packed"),
            fmt1,
            [("r", _items(HASHES[:3], [0, 1, 2]))],
            HandoffConfig("ring", 1),
        )
        assert [
            x.count for x in find_runs(c, NS, HASHES[:3], heads=H, consumer_tp=1, producer_tps=[2])
        ] == [3]
        other = [HASHES[0], "f" * 32, HASHES[2]]
        assert find_runs(c, NS, other, heads=H, consumer_tp=1, producer_tps=[2]) == []
        assert find_runs(c, NS, HASHES[:2], heads=H, consumer_tp=1, producer_tps=[2]) == []


def test_a_full_ring_sends_the_request_to_the_host_path_holding_nothing(ring_daemon, memory):
    L, B, H, N, D = 2, 40, 4, 16, 64  # 32 KiB per block: 33 blocks cannot fit in 1 MiB
    cache, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    hashes = [f"{i:032x}" for i in range(100, 140)]
    with ring_daemon.client(map_pools=False) as p:
        rings = CpuRings(p, memory)
        big = [
            ("big", _items(hashes[:33], list(range(33)))),
            ("small", _items(hashes[33:35], [33, 34])),
        ]
        done, n, nbytes = publish_runs(
            rings, NS, cuda_cache(cache, "packed"), fmt, big, HandoffConfig("ring")
        )
        assert done == ["small"] and n == 2 and nbytes == 2 * fmt.block_nbytes
        # heterogeneous TP: the second decode rank's run does not fit, the first's is released
        filler = rings.ring_reserve(RING - 2 * fmt.block_nbytes - fmt.block_nbytes // 2 * 3)
        tp2 = HandoffConfig("ring", consumer_tp=2)  # 2 blocks x 2 heads: 32 KiB per rank
        done, _, _ = publish_runs(
            rings,
            NS,
            cuda_cache(cache, "packed"),
            fmt,
            [("two", _items(hashes[35:37], [35, 36]))],
            tp2,
        )
        assert done == []
        stat = p.stat().rings[0]
        assert stat["leased_write"] == filler.nbytes  # only the filler is held
        assert stat["objects"] == 1  # "small"'s run, waiting for its consumer
        filler.release()


def test_a_run_gone_since_the_lookup_stops_the_load_there(ring_daemon, memory):
    L, B, H, N, D = 1, 8, 2, 16, 8
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6 = cuda_cache(src, "packed")
    with ring_daemon.client(map_pools=False) as p, ring_daemon.client(map_pools=False) as c:
        rings = CpuRings(p, memory)
        publish_runs(rings, NS, s6, fmt, [("r", _items(HASHES[:2], [0, 1]))], HandoffConfig("ring"))
        items = _items(HASHES[:4], [0, 1, 2, 3])[2:]
        publish_runs(rings, NS, s6, fmt, [("r", items)], HandoffConfig("ring"))
        runs = find_runs(c, NS, HASHES[:4], heads=H, consumer_tp=1, producer_tps=[1])
        assert len(runs) == 2
        # another consumer took the second run meanwhile
        CpuRings(p, memory).ring_read(run_key(HASHES[2], 0, 1, 0, 1), namespace=NS).release()
        out, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD", seed=2)
        assert (
            load_runs(
                CpuRings(c, memory), NS, cuda_cache(out, "packed"), fmt, [4, 5, 6, 7], runs, 0
            )[0]
            == 2
        )
        with pytest.raises(NotFound):
            c.ops.ring_claim(run_key(HASHES[0], 0, 1, 0, 1), namespace=NS)
        assert _used(c)[0] == 0


def test_runs_never_claimed_expire(ring_daemon, memory):
    L, B, H, N, D = 1, 4, 2, 16, 8
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    with ring_daemon.client(map_pools=False) as p:
        publish_runs(
            CpuRings(p, memory),
            NS,
            cuda_cache(src, "packed"),
            _fmt(L, H, N, D, torch.bfloat16),
            [("r", _items(HASHES[:2], [0, 1]))],
            HandoffConfig("ring", ttl=0.3),
        )
        assert _used(p)[0] > 0
        deadline = time.monotonic() + 60  # (a bound for a loaded machine)
        while _used(p)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _used(p)[0] == 0


_DIE_MID_HANDOFF = textwrap.dedent("""
    import os, sys, time
    from kvbroker import Client
    with Client(sys.argv[1], map_pools=False) as c:
        role = sys.argv[2]
        if role == "producer":  # reserved, writing, never sealed
            c.ops.ring_reserve(0, 300_000, namespace="vllm/handoff-test", key="run-x",
                               meta={"kvbroker.handoff": 1})
        else:  # consume-reading, never released
            c.ops.ring_claim("run-y", namespace="vllm/handoff-test", consume=True)
        print("holding", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("role", ["producer", "consumer"])
def test_a_process_killed_mid_handoff_leaves_no_ring_space_held(ring_daemon, role, tmp_path):
    script = tmp_path / "die.py"
    script.write_text(_DIE_MID_HANDOFF)
    with ring_daemon.client(map_pools=False) as admin:
        if role == "consumer":
            lease = admin.ops.ring_reserve(0, 300_000, namespace=NS, key="run-y", ttl=600)
            admin.ops.ring_seal(lease["lease"])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen(
            [sys.executable, str(script), ring_daemon.socket_path, role],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert proc.stdout.readline().strip() == "holding"
            held = admin.stat().rings[0]
            assert held["used"] >= 300_000
            assert (held["leased_write"] if role == "producer" else held["leased_read"]) >= 300_000
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        deadline = time.monotonic() + 60  # (a bound for a loaded machine)
        busy = ("leased_read", "leased_write")
        while any(admin.stat().rings[0][k] for k in busy) and time.monotonic() < deadline:
            time.sleep(0.05)
        ring = admin.stat().rings[0]
        assert (ring["leased_read"], ring["leased_write"]) == (0, 0)
        if role == "producer":  # the half-written run was discarded: never visible
            assert (ring["used"], ring["objects"]) == (0, 0)
            assert admin.ops.ring_lookup(["run-x"], namespace=NS)["objects"] == [None]
        else:  # the run is back for a retry (else its TTL frees it); read, it is freed
            assert ring["objects"] == 1
            got = admin.ops.ring_claim("run-y", namespace=NS, consume=True)
            admin.ops.ring_release(got["lease"])
            assert admin.stat().rings[0]["used"] == 0


def test_handoff_config_is_checked():
    assert HandoffConfig.from_extra({}) == HandoffConfig()
    cfg = HandoffConfig.from_extra(
        {"handoff": "ring+host", "handoff_tp_size": 2, "handoff_rings": [1, 0], "handoff_ttl": 5}
    )
    assert cfg.on and cfg.host_too and cfg.rings == (1, 0) and cfg.ttl == 5.0
    for bad in (
        {"handoff": "nvlink"},
        {"handoff_tp_size": 0},
        {"handoff_rings": "0"},
        {"handoff_tp_size": 2, "handoff_rings": [0]},
        {"handoff_ttl": -1},
        {"handoff_ttl": float("inf")},
        {"handoff_tp_size": True},
    ):
        with pytest.raises(ValueError):
            HandoffConfig.from_extra(bad)


# ------------------------------------------------------------------ the connector's halves
def _request(tokens):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id="r1",
        prompt_token_ids=tokens,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def _scheduler(socket, handoff, tp_size=1, peers=()):
    from kvbroker.integrations._link import BrokerLink, Warnings
    from kvbroker.integrations.vllm._scheduler import SchedulerSide

    link = BrokerLink(
        socket, name="sched", role="kv_consumer", map_pools=False, warnings=Warnings()
    )
    return SchedulerSide(
        link=link,
        namespace=NS,
        block_size=16,
        total_kv_heads=4,
        latent=False,
        tp_size=tp_size,
        peer_tp_sizes=peers,
        save=False,
        load=True,
        warnings=Warnings(),
        handoff=handoff,
    )


class _Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


@pytest.mark.parametrize("mode", ["off", "ring"])
def test_the_scheduler_picks_the_ring_per_request_and_plans_its_runs(ring_daemon, memory, mode):
    L, B, H, N, D = 1, 8, 4, 16, 8
    cache, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    side = _scheduler(ring_daemon.socket_path, HandoffConfig(mode))
    st = side.state(_request(list(range(1, 16 * 5 + 6))))  # 5 full blocks and a tail
    keys = st.keys.keys
    assert len(keys) == 6
    with ring_daemon.client(map_pools=False) as p:
        publish_runs(
            CpuRings(p, memory),
            NS,
            cuda_cache(cache, "packed"),
            _fmt(L, H, N, D, torch.bfloat16),
            [("r1", _items(keys, [0, 1, 2, 3, 4, 5]))],
            HandoffConfig("ring"),
        )
    # the engine's own prefix cache computed the first block: load the rest
    got = side.get_num_new_matched_tokens(_request(list(range(1, 16 * 5 + 6))), 16)
    if mode == "off":  # the host pools hold nothing, the rings are not looked in
        assert got == (0, False)
        return
    assert got == (16 * 5 + 4 - 16, False)  # n - 1 tokens: the last one is computed
    side.update_state_after_alloc(_request(None), _Blocks([9, 10, 11, 12, 13, 14]), 68)
    (spec,) = side.pending_loads
    assert spec.hashes == keys[1:6] and spec.block_ids == [10, 11, 12, 13, 14]
    assert spec.first == 1 and [(r.start, r.count) for r in spec.ring] == [(0, 6)]


def test_the_scheduler_takes_the_host_pools_where_they_hold_more(ring_daemon, memory):
    from kvbroker.integrations.vllm._cuda import save_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    L, B, H, N, D = 1, 8, 4, 16, 8
    cache, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    c6, fmt = cuda_cache(cache, "packed"), _fmt(L, H, N, D, torch.bfloat16)
    side = _scheduler(ring_daemon.socket_path, HandoffConfig("ring"))
    keys = side.state(_request(list(range(1, 16 * 6 + 1)))).keys.keys
    with ring_daemon.client() as p:
        publish_runs(
            CpuRings(p, memory),
            NS,
            c6,
            fmt,
            [("r1", _items(keys[:2], [0, 1]))],
            HandoffConfig("ring"),
        )
        save_cuda(p, NS, fmt, c6, _items(keys[:5], [0, 1, 2, 3, 4]), copier=copier_for("cpu"))
        assert side.get_num_new_matched_tokens(_request(list(range(1, 16 * 6 + 1))), 0) == (
            80,
            False,
        )
        side.update_state_after_alloc(_request(None), _Blocks([1, 2, 3, 4, 5, 6]), 80)
        (spec,) = side.pending_loads
        # the ring's run first (2 blocks), the host path for the 3 after it
        assert [(r.start, r.count) for r in spec.ring] == [(0, 2)] and len(spec.hashes) == 5


@pytest.mark.parametrize("mode", ["ring", "ring+host"])
def test_the_worker_hands_off_loads_the_ring_then_the_host_and_counts(ring_daemon, memory, mode):
    from types import SimpleNamespace

    from kvbroker.integrations._link import Warnings
    from kvbroker.integrations.vllm._handoff import Run
    from kvbroker.integrations.vllm._scheduler import LoadSpec
    from kvbroker.integrations.vllm._worker import WorkerSide

    L, B, H, N, D = 2, 12, 4, 16, 8
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND")
    fmt = _fmt(L, H, N, D, torch.bfloat16)

    def worker(cache, rings):
        w = WorkerSide(
            link=None,
            namespace=NS,
            block_size=N,
            total_kv_heads=H,
            latent=False,
            tp_rank=0,
            tp_size=1,
            warnings=Warnings(),
            handoff=HandoffConfig(mode),
        )
        w.fmt, w.cache, w._gpu = fmt, cuda_cache(cache, "packed"), rings
        return w

    with ring_daemon.client() as p, ring_daemon.client() as c:
        rings = CpuRings(p, memory)
        rings.stream = None
        prod = worker(src, rings)
        # a second request's run finds the ring full: it goes to the host path
        filler = rings.ring_reserve(RING - 4 * fmt.block_nbytes)
        requests = [
            ("a", _items(HASHES[:4], [3, 1, 4, 0])),
            ("b", _items(HASHES[4:8], [5, 9, 2, 6])),
        ]
        flat = [it for _, its in requests for it in its]
        host = prod._hand_off(rings, requests, flat)
        assert host == (flat if mode == "ring+host" else flat[4:])
        assert prod.take_stats()["handoff_saved_blocks"] == 4
        assert prod.totals["handoff_fallback_blocks"] == 4
        filler.release()
        from kvbroker.integrations.vllm._cuda import save_cuda
        from kvbroker.integrations.vllm._paged import copier_for

        save_cuda(p, NS, fmt, prod.cache, host, copier=copier_for("cpu"))
        out, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "HND", seed=4)
        cons = worker(out, CpuRings(c, memory))
        # a whole 8-block prompt: the first 4 blocks from the ring, the rest from the host
        spec = LoadSpec(
            "a", HASHES[:8], [11, 10, 9, 8, 7, 6, 5, 4], ring=(Run(HASHES[0], 0, 4, 1),)
        )
        assert cons._load_cuda(spec, c, None) == 8
        cons._account(spec, 8)
        s = SimpleNamespace(**cons.take_stats())
        assert (s.loaded_blocks, s.handoff_loaded_blocks, s.load_failed_blocks) == (8, 4, 0)
        for a, b in zip([3, 1, 4, 0, 5, 9, 2, 6], spec.block_ids, strict=True):
            assert torch.equal(_bits(cons.cache[:, :, b]), _bits(prod.cache[:, :, a]))
        assert _used(c) == [0, 0]
        # with "ring", the handed-off blocks were never in the host pools
        in_host = load_cuda_count(c, fmt, HASHES[:4])
        assert in_host == (4 if mode == "ring+host" else 0)


def load_cuda_count(client, fmt, hashes):
    from kvbroker.integrations.vllm._cuda import load_cuda
    from kvbroker.integrations.vllm._paged import copier_for

    scratch, _ = vllm_like(
        fmt.num_layers,
        8,
        fmt.local_heads,
        fmt.block_size,
        fmt.head_dim,
        torch.bfloat16,
        "cpu",
        "NHD",
    )
    return load_cuda(
        client,
        NS,
        fmt,
        cuda_cache(scratch, "packed"),
        hashes,
        list(range(len(hashes))),
        copier=copier_for("cpu"),
    )


@pytest.mark.parametrize("delta", [-64, 64])
def test_a_ring_object_whose_size_disagrees_with_its_meta_is_not_scattered(
    ring_daemon, memory, delta
):
    # A buggy or hostile producer seals, under a run's key, an object whose meta is the
    # run's but whose bytes are not as many as that shape holds: the consumer must refuse
    # it (load nothing, take the host path) instead of crashing its worker or scattering it.
    L, B, H, N, D = 1, 8, 2, 16, 8
    src, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD")
    fmt = _fmt(L, H, N, D, torch.bfloat16)
    s6 = cuda_cache(src, "packed")
    key = run_key(HASHES[0], 0, 1, 0, 1)
    with ring_daemon.client(map_pools=False) as p, ring_daemon.client(map_pools=False) as c:
        rings = CpuRings(p, memory)
        publish_runs(rings, NS, s6, fmt, [("r", _items(HASHES[:2], [0, 1]))], HandoffConfig("ring"))
        genuine = rings.ring_read(key, namespace=NS)
        meta, nbytes = genuine.meta, genuine.nbytes
        genuine.release()
        rings.ring_reserve(nbytes + delta, key=key, namespace=NS, meta=meta).seal()
        runs = find_runs(c, NS, HASHES[:2], heads=H, consumer_tp=1, producer_tps=[1])
        assert len(runs) == 1
        out, _ = vllm_like(L, B, H, N, D, torch.bfloat16, "cpu", "NHD", seed=2)
        before = [t.clone() for t in out]
        assert load_runs(
            CpuRings(c, memory), NS, cuda_cache(out, "packed"), fmt, [4, 5], runs, 0
        ) == (0, 0)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, before, strict=True))
        assert _used(c)[0] == 0  # consumed and freed all the same
