"""The SGLang backend's data path (:mod:`kvbroker.integrations.sglang._pages`) against a real
daemon, without SGLang: a host pool is a numpy buffer shaped as SGLang's ``page_first`` MHA
pool. What SGLang sees of it (through its own classes): tests/test_sglang_storage.py."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

from kvbroker import blocks
from kvbroker._client.ops import Ops
from kvbroker.integrations._link import BrokerLink, Warnings
from kvbroker.integrations.sglang._format import PageGeometry, Sharding
from kvbroker.integrations.sglang._pages import PageStore, Source
from kvbroker.integrations.sglang._states import StateStore

LAYERS, HEADS, DIM, PAGE, PAGES = 2, 4, 16, 8, 12


def store(socket: str, *, checksum: bool = True) -> tuple[PageStore, np.ndarray]:
    """A rank's page store over a ``page_first`` host buffer ``[K/V, token, layer, head,
    dim]`` of int16 random bits."""
    shape = (2, PAGES * PAGE, LAYERS, HEADS, DIM)
    buf = np.random.default_rng(7).integers(-(2**15), 2**15, shape, dtype=np.int16)
    geometry = PageGeometry.of("page_first", shape, 2, PAGE, PAGES * PAGE, paired=True)
    link = BrokerLink(socket, name="pages-test", role="kv_both", warnings=Warnings())
    pages = PageStore(
        link,
        "sglang/pages-test",
        cache_salt="",
        sharding=Sharding(HEADS, 1, 0, 1),
        geometry=geometry,
        host=Source(buf.reshape(-1).view(np.uint8)),
        checksum=checksum,
    )
    return pages, buf


def hashes(n: int, tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class Waits:
    """Counts the requests a client waits for (round trips) and those it sends without."""

    def __init__(self, client) -> None:
        self.waited: list[str] = []
        self.sent: list[str] = []
        inner = client.ops

        def call(op, args):
            self.waited.append(op)
            return inner._call(op, args)

        def submit(op, args):
            self.sent.append(op)
            return inner._submit(op, args)

        client.ops = Ops(call, inner._send, submit)


def test_a_batch_write_is_one_round_trip(daemon):
    pages, buf = store(daemon.socket_path)
    client = pages.link.get()
    waits = Waits(client)
    for batch in range(3):
        keys = hashes(4, f"one-trip-{batch}")
        waits.waited.clear()
        slots = range(4 * batch, 4 * batch + 4)
        assert pages.write(keys, [pages.host_page(t * PAGE) for t in slots])
        assert waits.waited == ["reserve_blocks"], waits.waited
        assert waits.sent[-1] == "seal_many"
        # the same connection (any of SGLang's threads) sees the batch sealed
        assert pages.count(keys) == 4
    # and another engine reads it, bit-exact
    other, other_buf = store(daemon.socket_path)
    keys = hashes(4, "one-trip-2")
    assert other.read(keys, [other.host_page(t * PAGE) for t in range(4)]) == 4
    assert np.array_equal(other_buf[:, : 4 * PAGE], buf[:, 8 * PAGE : 12 * PAGE])
    assert pages.totals().get("seal_failed", 0) == 0
    other.link.close()
    pages.link.close()


def test_a_refused_seal_is_counted_its_leases_freed_and_the_next_write_goes_on(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_REQUIRE_CHECKSUMS": "true"}
    )
    pages, _ = store(d.socket_path, checksum=False)  # this daemon refuses such seals
    first = hashes(3, "refused-a")
    assert pages.write(first, [pages.host_page(t * PAGE) for t in range(3)])  # sent
    second = hashes(3, "refused-b")
    pages.write(second, [pages.host_page(t * PAGE) for t in range(3, 6)])  # reads the refusal
    assert pages.totals()["seal_failed"] == 3
    pages.settle()
    assert pages.totals()["seal_failed"] == 6
    assert pages.link.warnings.counts["error_seal"] == 2
    assert pages.count(first) == 0 and pages.count(second) == 0
    with d.client() as c:  # the refused batches' pages went back to the pool
        stat = c.stat()
        assert stat.used == 0 and stat.write_leases == 0, (stat.used, stat.write_leases)
    pages.link.close()


def mamba_pool(slots: int, seed: int):
    """A stand-in for SGLang's ``MambaPoolHost`` in its ``page_first`` layout (what
    :class:`StateStore` reads of it): an SSM state ``[slot, layer, 2, 4, 8]`` fp32 and one
    conv state ``[slot, layer, 6, 3]`` bf16, random bits (zeros for ``seed`` None)."""
    import torch

    g = torch.Generator().manual_seed(seed or 0)
    temporal = torch.randn(slots, 2, 2, 4, 8, generator=g)
    conv = torch.randn(slots, 2, 6, 3, generator=g).to(torch.bfloat16)
    if seed is None:
        temporal.zero_(), conv.zero_()
    return SimpleNamespace(layout="page_first", temporal_buffer=temporal, conv_buffer=[conv])


def state_store(socket: str, pool) -> StateStore:
    link = BrokerLink(socket, name="states-test", role="kv_both", warnings=Warnings())
    return StateStore(
        link, "sglang/states-test", cache_salt="", pool=pool, tp_rank=0, tp_size=1, tag="@mamba"
    )


@pytest.mark.parametrize("bad", ["truncated", "longer", "other_meta"])
def test_a_bad_state_page_mid_span_ends_the_read_keeping_the_pages_before_it(daemon, bad):
    """Another writer stored page 2 of a 5-page span with fewer bytes, more bytes, or another
    pool's parts (the same size): the read loads pages 0 and 1, says 2, and never copies
    page 2 or what follows it."""
    import torch

    written = mamba_pool(8, seed=3)
    writer = state_store(daemon.socket_path, written)
    span = hashes(5, f"bad-state-{bad}")
    assert writer.write(span[:2], [0, 1])
    fmt, n = writer.format, writer.page_nbytes
    meta = fmt.meta()
    size = {"truncated": n - 8, "longer": n + 8, "other_meta": n}[bad]
    if bad == "other_meta":  # the conv state as fp16: the same bytes, another layout
        meta["parts"] = [list(p) for p in meta["parts"]]
        meta["parts"][1][1] = "float16"
    client = writer.link.get()
    (key,) = writer.keys.blocks(span[2:3])
    r = blocks.reserve(
        client, writer.namespace, [{"key": key, "parent": None}], {fmt.packed: size}, meta
    )
    r.view(0, fmt.packed)[:] = 0x5A
    r.seal(r.checksums())
    assert writer.write(span, [0, 1, 2, 3, 4])  # pages 3 and 4; 2 is already there
    assert writer.count(span) == 5

    read = mamba_pool(8, seed=None)
    reader = state_store(daemon.socket_path, read)
    assert reader.read(span, [3, 4, 5, 6, 7]) == 2
    assert torch.equal(read.temporal_buffer[3:5], written.temporal_buffer[0:2])
    assert torch.equal(read.conv_buffer[0][3:5], written.conv_buffer[0][0:2])
    # the bad page and those after it: not a byte copied
    assert not read.temporal_buffer[5:].any() and not read.conv_buffer[0][5:].any()
    assert reader.totals()["read_bad_pages"] == 1
    assert reader.totals()["read_missed"] == 3
    reader.link.close()
    writer.link.close()


@pytest.mark.parametrize("bad", ["truncated", "longer", "other_buffer"])
def test_a_malformed_kv_page_mid_chain_ends_the_read_keeping_the_pages_before_it(daemon, bad):
    """Another engine of the namespace stored page 2 of a 5-page chain with fewer bytes, more
    bytes or another buffer: every read through it loaded nothing (a ValueError of the copy,
    logged as an unexpected error with its traceback on every read). The read loads pages 0
    and 1, counts and warns of page 2 (rate-limited), and copies nothing of it or after it."""
    writer, written = store(daemon.socket_path)
    chain = hashes(5, f"malformed-{bad}")
    assert writer.write(chain[:2], [writer.host_page(t * PAGE) for t in range(2)])
    n = writer.block_nbytes
    buffers = {
        "truncated": {"page": n - 8},
        "longer": {"page": n + 4096},
        "other_buffer": {"kv": n},
    }[bad]
    client = writer.link.get()
    keys = writer.keys.blocks(chain)
    r = blocks.reserve(client, writer.namespace, [{"key": keys[2], "parent": keys[1]}], buffers)
    for name in buffers:
        r.view(0, name)[:] = 0x5A
    r.seal(r.checksums())
    assert writer.write(chain, [writer.host_page(t * PAGE) for t in range(5)])  # 3 and 4
    assert writer.count(chain) == 5

    reader, read = store(daemon.socket_path)
    read[:] = 0
    for _ in range(3):
        assert reader.read(chain, [reader.host_page(t * PAGE) for t in range(5)]) == 2
    assert np.array_equal(read[:, : 2 * PAGE], written[:, : 2 * PAGE])
    assert not read[:, 2 * PAGE :].any()  # the bad page and those after it: not a byte
    totals = reader.totals()
    assert totals["read_bad_pages"] == 3 and totals["read_pages"] == 6
    assert totals.get("errors", 0) == 0
    assert reader.link.warnings.counts["bad_kv_page"] == 3
    assert reader.link.up  # the broker is fine: the link stays
    reader.link.close()
    writer.link.close()
