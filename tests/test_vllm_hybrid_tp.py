"""Hybrid models between TP layouts: a gated-delta (GDN) state group and a full-attention group
published by engines of one TP size and read by an engine of another (``peer_tp_sizes``),
driven without vLLM against a real daemon, on CPU caches (the host path and the staging path).

vLLM shards a GDN layer's state per rank: its SSM state ``[value heads, Dv, Dk]`` by value
heads, its conv state ``[kernel - 1, channels]`` by channels, each of the q, k and v blocks on
its own (rank ``r`` holds ``[q_r | k_r | v_r]``). The tests make a model's whole state, lay
each rank's shard of it into that rank's cache as vLLM would, and check:

- 2 -> 1 and 1 -> 2: the reader's state page is exactly its shard of the whole state (every
  layer, both tensors), the attention heads too; the scheduler side's lookup finds the hit
  through the other layout's pages, and none once one rank's page is gone.
- The groups' namespace is the same for every TP size where the state can be resharded.
- What cannot be resharded is refused with a clear error: a kind of state kvbroker does not
  know, Mamba2 groups that vLLM replicates across ranks, shapes that are not vLLM's layout.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvbroker.integrations._link import BrokerLink, Warnings
from kvbroker.integrations.vllm._format import prompt_keys
from kvbroker.integrations.vllm._groups import (
    check_peer_layouts,
    groups_of,
    hybrid_namespace,
    state_splits,
)
from kvbroker.integrations.vllm._hybrid import GroupLoad, GroupSave, HybridLoad, HybridScheduler
from kvbroker.integrations.vllm._hybrid_worker import HybridWorker
from kvbroker.integrations.vllm._paged import copier_for
from kvbroker.integrations.vllm._scheduler import StepPlan

B, HEADS, DIM, BLOCKS = 4, 2, 8, 12
HK, HV, DK, DV, KERNEL = 2, 4, 8, 8, 4
CONV = (HK * DK, HK * DK, HV * DV)  # q, k, v channels
SPLITS = ((1, ((HK, DK), (HK, DK), (HV, DV))), (0, ((HV, 1),)))
STATE_LAYERS = 2
NS = "vllm/unit-hybrid-tp"
HF = SimpleNamespace(
    linear_num_key_heads=HK,
    linear_num_value_heads=HV,
    linear_key_head_dim=DK,
    linear_value_head_dim=DV,
)
GDN = SimpleNamespace(name="GDN_ATTN")
PROMPT = list(range(1, 11))  # blocks 0, 1 and a tail; the state at 8
KEYS = prompt_keys(PROMPT, B, namespace=NS, cache_salt="")


# vLLM's spec classes, duck-typed by name (groups_of reads type(spec).__name__)
class FullAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def gdn_shapes(tp: int):
    return ((KERNEL - 1, sum(CONV) // tp), (HV // tp, DV, DK))


def kv_config(tp: int, mamba_type=GDN, shapes=None):
    shapes = shapes or gdn_shapes(tp)
    state = MambaSpec(
        block_size=B,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        page_size_bytes=4096,
        mamba_cache_mode="align",
        mamba_type=mamba_type,
        num_speculative_blocks=0,
        tp_replicated=False,
    )
    attn = FullAttentionSpec(
        block_size=B, num_kv_heads=HEADS // tp, head_size=DIM, dtype=torch.float32
    )
    return SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(
                layer_names=[f"state.{i}" for i in range(STATE_LAYERS)], kv_cache_spec=state
            ),
            SimpleNamespace(layer_names=["attn"], kv_cache_spec=attn),
        ]
    )


def groups(tp: int):
    return groups_of(kv_config(tp), tp_size=tp, total_kv_heads=HEADS, hf_config=HF)


@pytest.fixture(scope="module")
def whole():
    """The model's state at one position (per layer: conv, ssm) and its attention blocks."""
    g = torch.Generator().manual_seed(7)
    states = [
        (
            torch.randn(KERNEL - 1, sum(CONV), generator=g).to(torch.bfloat16),
            torch.randn(HV, DV, DK, generator=g),
        )
        for _ in range(STATE_LAYERS)
    ]
    attn = torch.randn(3, HEADS, B, 2 * DIM, generator=g)  # blocks 0, 1 and the tail
    return states, attn


def shard(states, rank: int, tp: int):
    """Rank ``rank`` of ``tp``'s state tensors, as vLLM lays them out."""
    out = []
    for conv, ssm in states:
        pieces, at = [], 0
        for size in CONV:
            step = size // tp
            pieces.append(conv[:, at + rank * step : at + (rank + 1) * step])
            at += size
        out.append((torch.cat(pieces, 1), ssm[rank * HV // tp : (rank + 1) * HV // tp]))
    return out


def page_bytes(layer_state) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in layer_state])


def make_worker(socket: str, rank: int, tp: int, path: str, peers=()):
    """A worker of TP rank ``rank`` of ``tp``: a zeroed attention cache and state layers of
    vLLM's shapes (one int8 ``[blocks, 1, 1, bytes]`` tensor per layer)."""
    gs = groups(tp)
    content = sum(
        torch.empty(s, dtype=d).nbytes
        for s, d in zip(gdn_shapes(tp), (torch.bfloat16, torch.float32), strict=True)
    )
    caches = {
        f"state.{i}": torch.zeros(BLOCKS, 1, 1, content, dtype=torch.int8)
        for i in range(STATE_LAYERS)
    }
    caches["attn"] = torch.zeros(BLOCKS, HEADS // tp, B, 2 * DIM)
    link = BrokerLink(socket, name=f"unit-tp{rank}of{tp}", role="kv_both", map_pools=True)
    worker = HybridWorker(
        groups=gs,
        link=link,
        namespace=NS,
        block_size=B,
        tp_rank=rank,
        tp_size=tp,
        peer_tp_sizes=peers,
        warnings=Warnings(),
        staging_copier=copier_for("cpu") if path == "staged" else None,
    )
    worker.register(caches, "CPU_ATTN" if path == "host" else "FLASH_ATTN")
    return worker, caches


def put(caches, states, attn, rank: int, tp: int, state_block: int, attn_blocks) -> None:
    for i, layer in enumerate(shard(states, rank, tp)):
        caches[f"state.{i}"][state_block].view(-1)[:] = page_bytes(layer).view(torch.int8)
    heads = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
    for j, b in enumerate(attn_blocks):
        caches["attn"][b] = attn[j, heads]


def save(worker) -> None:
    gs = worker.groups
    k = [gs[1].key(h) for h in KEYS.keys]
    worker.bind(
        StepPlan(
            saves=[
                GroupSave("r", 1, [(k[i], k[i - 1] if i else None, 1 + i) for i in range(3)]),
                GroupSave("r", 0, [(gs[0].key(KEYS.hashes[1]), None, 4)]),
            ]
        )
    )
    worker.save_layer("attn")
    worker.wait_for_save()
    worker.unbind()
    assert worker.stats["saved_blocks"] == 4 and worker.stats["skipped_save_blocks"] == 0


def load(worker) -> None:
    gs = worker.groups
    spec = HybridLoad(
        "q",
        [
            GroupLoad(1, [gs[1].key(h) for h in KEYS.keys], [7, 8, 9]),
            GroupLoad(0, [gs[0].key(KEYS.hashes[1])], [10]),
        ],
        tokens=9,
    )
    worker.bind(StepPlan(loads=[spec]))
    worker.start_load()
    worker.wait_for_save()
    worker.unbind()
    deadline = time.monotonic() + 60
    while "q" not in (worker.finished_loads() or set()):
        assert time.monotonic() < deadline, "load never reported"
        time.sleep(0.01)
    assert worker.failed_loads() == set()


def check(caches, states, attn, rank: int, tp: int) -> None:
    for i, layer in enumerate(shard(states, rank, tp)):
        assert torch.equal(caches[f"state.{i}"][10].view(-1).view(torch.uint8), page_bytes(layer))
    heads = slice(rank * HEADS // tp, (rank + 1) * HEADS // tp)
    for j, b in enumerate([7, 8, 9]):
        assert torch.equal(caches["attn"][b], attn[j, heads])


@pytest.fixture
def broker():
    from kvbroker.testing import running_daemon

    with running_daemon(pool_size="64M") as daemon:
        yield daemon


@pytest.mark.parametrize("path", ["host", "staged"])
def test_tp2_pages_load_resharded_into_tp1(broker, whole, path):
    states, attn = whole
    producers = [make_worker(broker.socket_path, r, 2, path) for r in range(2)]
    reader, caches = make_worker(broker.socket_path, 0, 1, path, peers=(2,))
    try:
        for r, (w, c) in enumerate(producers):
            put(c, states, attn, r, 2, 4, [1, 2, 3])
            save(w)
        load(reader)
        check(caches, states, attn, 0, 1)
        assert reader.stats["loaded_state_bytes"] == reader.formats[0].block_nbytes
    finally:
        reader.close()
        for w, _ in producers:
            w.close()


@pytest.mark.parametrize("path", ["host", "staged"])
def test_tp1_pages_load_resharded_into_each_tp2_rank(broker, whole, path):
    states, attn = whole
    producer, pc = make_worker(broker.socket_path, 0, 1, path)
    readers = [make_worker(broker.socket_path, r, 2, path, peers=(1,)) for r in range(2)]
    try:
        put(pc, states, attn, 0, 1, 4, [1, 2, 3])
        save(producer)
        for r, (w, c) in enumerate(readers):
            load(w)
            check(c, states, attn, r, 2)
    finally:
        producer.close()
        for w, _ in readers:
            w.close()


def test_the_lookup_needs_every_rank_of_the_other_layout(broker, whole):
    states, attn = whole
    producers = [make_worker(broker.socket_path, r, 2, "host") for r in range(2)]
    link = BrokerLink(broker.socket_path, name="unit-tp-scheduler", role="kv_both", map_pools=False)
    scheduler = HybridScheduler(
        link=link,
        namespace=NS,
        groups=groups(1),
        tp_size=1,
        peer_tp_sizes=(2,),
        save=True,
        load=True,
        warnings=Warnings(),
    )
    request = SimpleNamespace(
        request_id="a",
        prompt_token_ids=PROMPT,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )
    try:
        for r, (w, c) in enumerate(producers):
            put(c, states, attn, r, 2, 4, [1, 2, 3])
            save(w)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (8, True)
        rank1 = groups(2)[0].key(KEYS.hashes[1]) + "/state.tp1of2"
        with broker.client() as client:
            client.evict(rank1, namespace=NS)
        request.request_id = "b"
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        link.close()
        for w, _ in producers:
            w.close()


def test_every_tp_layout_of_a_reshardable_model_shares_the_namespace():
    one, two = groups(1), groups(2)
    assert two[0].state_splits == one[0].state_splits == SPLITS
    assert hybrid_namespace("m", one) == hybrid_namespace("m", two)
    # a state this cannot reshard keeps its layout in the namespace
    odd = groups_of(
        kv_config(2, mamba_type=SimpleNamespace(name="SHORT_CONV")),
        tp_size=2,
        total_kv_heads=HEADS,
        hf_config=HF,
    )
    assert odd[0].state_splits == ()
    assert hybrid_namespace("m", odd) != hybrid_namespace("m", two)


def test_what_cannot_be_resharded_is_refused_by_name():
    check_peer_layouts(groups(2), [1, 2])
    with pytest.raises(ValueError, match="group 0.*TP 4"):  # 2 key heads over 4 ranks
        check_peer_layouts(groups(2), [4])
    short = groups_of(
        kv_config(2, mamba_type=SimpleNamespace(name="SHORT_CONV")),
        tp_size=2,
        total_kv_heads=HEADS,
        hf_config=HF,
    )
    with pytest.raises(ValueError, match="cannot be resharded between TP 2 and TP 1"):
        check_peer_layouts(short, [1])
    check_peer_layouts(short, [2])  # the same layout reads it
    # Mamba2 (Granite-4 tiny's sizes): one group over 2 ranks is replicated by vLLM (each
    # rank's conv state then holds the whole group: 4*64/2 + 2*16 channels), not resharded;
    # read at TP 1, it cannot be laid out for TP 2 either
    mamba2 = SimpleNamespace(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=64)
    m2 = SimpleNamespace(name="MAMBA2")
    assert state_splits(m2, ((3, 128 + 32), (2, 64, 16)), mamba2, 2) == ()
    tp1 = state_splits(m2, ((3, 256 + 32), (4, 64, 16)), mamba2, 1)
    assert tp1 == ((1, ((4, 64), (1, 16), (1, 16))), (0, ((4, 1),)))
    spec = kv_config(1, mamba_type=m2, shapes=((3, 288), (4, 64, 16)))
    granite = groups_of(spec, tp_size=1, total_kv_heads=HEADS, hf_config=mamba2)
    with pytest.raises(ValueError, match=r"\[4, 1, 1\] heads or groups do not split over TP 2"):
        check_peer_layouts(granite, [2])
    mamba2.mamba_n_groups = 2  # two groups split over 2 ranks: resharded
    assert state_splits(m2, ((3, 128 + 32), (2, 64, 16)), mamba2, 2) == (
        (1, ((4, 64), (2, 16), (2, 16))),
        (0, ((4, 1),)),
    )
    # shapes that are not the layout the config says: not resharded
    assert state_splits(GDN, ((3, 40), (2, DV, DK)), HF, 2) == ()


def test_a_rank_page_of_another_layout_is_refused_not_resharded(broker, whole):
    """Every rank's page of the other TP layout is checked against its own format: a rank-1
    page some other writer stored with different parts (a dtype here; same size) fails the
    load, so vLLM recomputes, and the engine's state block is left as it was."""
    from kvbroker import blocks
    from kvbroker.integrations.vllm._state import state_format

    states, attn = whole
    producers = [make_worker(broker.socket_path, r, 2, "host") for r in range(2)]
    reader, caches = make_worker(broker.socket_path, 0, 1, "host", peers=(2,))
    try:
        for r, (w, c) in enumerate(producers):
            put(c, states, attn, r, 2, 4, [1, 2, 3])
            save(w)
        fmt = state_format(groups(2)[0], 1, 2)
        key = fmt.key(groups(2)[0].key(KEYS.hashes[1]))
        meta = fmt.meta()
        first = meta["parts"][0]
        meta["parts"][0] = [first[0], "float16" if first[1] != "float16" else "bfloat16", first[2]]
        with broker.client() as client:
            client.evict(key, namespace=NS)
            r = blocks.reserve(client, NS, [{"key": key, "parent": None}], fmt.buffers(), meta)
            r.view(0, fmt.packed)[:] = 1
            blocks.seal(client, r.taken)
        gs = reader.groups
        reader.bind(
            StepPlan(
                loads=[
                    HybridLoad(
                        "q",
                        [
                            GroupLoad(1, [gs[1].key(h) for h in KEYS.keys], [7, 8, 9]),
                            GroupLoad(0, [gs[0].key(KEYS.hashes[1])], [10]),
                        ],
                        tokens=9,
                    )
                ]
            )
        )
        reader.start_load()
        reader.wait_for_save()
        reader.unbind()
        deadline = time.monotonic() + 60
        while "q" not in (reader.finished_loads() or set()):
            assert time.monotonic() < deadline, "load never reported"
            time.sleep(0.01)
        assert reader.failed_loads() == {"q"}
        for i in range(STATE_LAYERS):
            assert not caches[f"state.{i}"][10].any()
    finally:
        reader.close()
        for w, _ in producers:
            w.close()
