"""kvbroker as SGLang's HiCache storage backend, through SGLang's own interface.

Every engine here is its own process (tests/sglang_helpers/engine.py) holding SGLang's real
host pool class, ``MHATokenToKVPoolHost`` (built on CPU: SGLang builds it from CPU buffers as
it does from GPU ones), and the backend SGLang's ``StorageBackendFactory.create_backend(
"dynamic", HiCacheStorageConfig(...), pool)`` loads from the documented extra config, then
registered with the pool as SGLang's cache controller does. Pages are SGLang's page hashes
and host page slots; contents are random bits drawn from each hash over the model's heads,
compared bit for bit. Two engine processes share one daemon.
"""

from __future__ import annotations

import hashlib
import itertools
import signal
import time

import pytest

from kvbroker.testing import DaemonProcess
from tests.sglang_helpers.common import Engine, needs_sglang

pytestmark = needs_sglang

GEOMETRY = {"layers": 2, "heads_total": 4, "head_dim": 16, "page_size": 8, "pages": 32}
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_serial = itertools.count()


def page_hashes(n: int, tag: str = "") -> list[str]:
    """SGLang-like page hashes (SHA-256 hex), unique to this call."""
    base = f"{tag}-{next(_serial)}"
    return [hashlib.sha256(f"{base}/{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang-kvb")
    proc = DaemonProcess(
        str(d / "kvb.sock"), "--pool-size", "64M", "--page-size", "4K", ready_timeout=60
    )
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Two engine processes (A writes, B reads, and the other way round)."""
    d = tmp_path_factory.mktemp("sglang-engines")
    made = [Engine(d / "a.log"), Engine(d / "b.log")]
    yield made
    for e in made:
        e.close()


def create(
    engine: Engine,
    rank: str,
    socket: str,
    *,
    layout: str = "page_first",
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_lcm_size: int | None = None,
    mla: bool = False,
    hybrid: bool = False,
    unsupported: dict | None = None,
    **extra,
) -> dict:
    return engine.call(
        "create",
        rank=rank,
        layout=layout,
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_lcm_size=tp_lcm_size,
        mla=mla,
        # A call timeout (5 s by default) a loaded machine's daemon can miss turns a set into a
        # skipped write and takes the link down for its retry time: the tests that are about
        # the timeout pass their own.
        extra={"socket": socket, "timeout": 60, **extra},
        hybrid=hybrid,
        unsupported=unsupported or {},
        **GEOMETRY,
    )


def test_factory_loads_the_backend_from_the_documented_extra_config(daemon, engines):
    a, _ = engines
    made = create(a, "factory", daemon.socket_path)
    assert made["class"] == "KVBrokerStorage"
    assert made["module"] == "kvbroker.integrations.sglang.storage"
    assert made["is_hicache_storage"]
    assert made["namespace"].startswith("sglang/tiny-")
    assert not made["split"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_written_by_one_engine_are_read_bit_exact_by_another(daemon, engines, layout):
    a, b = engines
    create(a, f"w-{layout}", daemon.socket_path, layout=layout)
    create(b, f"r-{layout}", daemon.socket_path, layout=layout)
    hashes = page_hashes(6, layout)
    assert b.call("exists", rank=f"r-{layout}", hashes=hashes)["count"] == 0
    assert a.call("set", rank=f"w-{layout}", hashes=hashes, slot=3)["results"] == [True] * 6
    assert b.call("exists", rank=f"r-{layout}", hashes=hashes)["count"] == 6
    # Into other host slots than the writer's
    got = b.call("get", rank=f"r-{layout}", hashes=hashes, slot=10)
    assert got["results"] == [True] * 6
    assert got["exact"] == [True] * 6


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_latent_pages_are_shared_by_every_tp_size(daemon, engines, layout):
    """An MLA host pool (``MLATokenToKVPoolHost``): every TP rank holds the same latent rows,
    stored once (SGLang writes from one rank), read by an engine of any TP size."""
    a, b = engines
    w = create(
        a, f"mla-w-{layout}", daemon.socket_path, layout=layout, tp_rank=0, tp_size=2, mla=True
    )
    r = create(
        b, f"mla-r-{layout}", daemon.socket_path, layout=layout, tp_rank=0, tp_size=1, mla=True
    )
    assert w["namespace"] == r["namespace"]
    assert (
        w["namespace"] != create(b, f"mha-{layout}", daemon.socket_path, layout=layout)["namespace"]
    )
    hashes = page_hashes(4, "mla")
    assert a.call("set", rank=f"mla-w-{layout}", hashes=hashes, slot=1)["results"] == [True] * 4
    got = b.call("get", rank=f"mla-r-{layout}", hashes=hashes, slot=6)
    assert got["results"] == [True] * 4 and got["exact"] == [True] * 4


def test_sglangs_own_controller_backs_up_and_prefetches_through_the_backend(daemon, engines):
    """SGLang's HiCacheController methods (``_page_backup``, ``_storage_hit_query``,
    ``_page_transfer``, with the zero-copy page functions SGLang picks for ``interface_v1``),
    its own page hashes over token ids: engine A backs up a prompt, engine B prefetches a
    longer prompt that starts with it and gets exactly A's pages."""
    a, b = engines
    create(a, "ctrl-a", daemon.socket_path, layout="page_first_direct")
    create(b, "ctrl-b", daemon.socket_path, layout="page_first_direct")
    page = GEOMETRY["page_size"]
    prompt = list(range(1000, 1000 + 5 * page))  # SGLang backs up and prefetches whole pages
    backed = a.call("backup", rank="ctrl-a", tokens=prompt, slot=2)
    assert len(backed["hashes"]) == 5 and backed["completed_tokens"] == 5 * page
    longer = prompt[: 5 * page] + list(range(7, 7 + 2 * page))
    got = b.call("prefetch", rank="ctrl-b", tokens=longer, slot=9)
    assert got["hashes"] == backed["hashes"]  # SGLang's chain, the same in both processes
    assert got["hit_tokens"] == 5 * page and got["pages"] == 5
    assert got["exact"] == [True] * 5
    other = b.call("prefetch", rank="ctrl-b", tokens=list(range(3, 3 + 4 * page)), slot=0)
    assert other["hit_tokens"] == 0 and other["pages"] == 0


def test_exists_and_get_stop_at_the_first_missing_page(daemon, engines):
    a, b = engines
    create(a, "w-prefix", daemon.socket_path)
    create(b, "r-prefix", daemon.socket_path)
    hashes = page_hashes(5, "prefix")
    stored = hashes[:2] + hashes[3:]  # page 2 never written
    a.call("set", rank="w-prefix", hashes=hashes[:2], slot=0)
    a.call("set", rank="w-prefix", hashes=hashes[3:], slot=3, prefix=hashes[:3])
    assert len(stored) == 4
    assert b.call("exists", rank="r-prefix", hashes=hashes)["count"] == 2
    assert b.call("exists", rank="r-prefix", hashes=hashes[3:])["count"] == 2
    got = b.call("get", rank="r-prefix", hashes=hashes, slot=0)
    assert got["results"] == [True, True, False, False, False]
    assert got["exact"][:2] == [True, True]
    assert got["exact"][2:] == [False, False, False]  # left as they were (zeroed)
    assert b.call("exists", rank="r-prefix", hashes=page_hashes(3, "none"))["count"] == 0


def test_writing_pages_the_node_holds_copies_nothing(daemon, engines):
    a, _ = engines
    create(a, "w-again", daemon.socket_path)
    hashes = page_hashes(4, "again")
    a.call("set", rank="w-again", hashes=hashes[:2], slot=0)
    before = a.call("stats", rank="w-again")["totals"]
    assert a.call("set", rank="w-again", hashes=hashes, slot=0)["results"] == [True] * 4
    after = a.call("stats", rank="w-again")["totals"]
    assert after["written_blocks"] - before["written_blocks"] == 2
    assert after["existing_blocks"] - before.get("existing_blocks", 0) == 2


def test_sglangs_three_storage_threads_share_one_backend(daemon, engines):
    """Backup, prefetch I/O and prefetch-count threads call one backend at once, as SGLang's
    cache controller does: every write stored, every read bit-exact, every count right."""
    a, _ = engines
    create(a, "threads", daemon.socket_path)
    got = a.call("threads", rank="threads", rounds=6, pages=4, tag=page_hashes(1, "t")[0])
    assert got["problems"] == []
    assert got["stored"] == [4] * 6


def test_heterogeneous_tp_reads_its_heads_through_tp_lcm_size(daemon, engines):
    """Engine A: TP 1, tp_lcm_size 2 (each page stored as two head shards); engine B: TP 2
    (its two ranks in one process). Each reads what the other wrote, its own heads only."""
    a, b = engines
    sock = daemon.socket_path
    one = create(a, "tp1", sock, layout="page_head", tp_lcm_size=2)
    assert one["split"]
    for r in (0, 1):
        made = create(b, f"tp2-{r}", sock, layout="page_head", tp_rank=r, tp_size=2, tp_lcm_size=2)
        assert made["namespace"] == one["namespace"]
    hashes = page_hashes(3, "tp1to2")
    assert a.call("set", rank="tp1", hashes=hashes, slot=0)["results"] == [True] * 3
    for r in (0, 1):
        assert b.call("exists", rank=f"tp2-{r}", hashes=hashes)["count"] == 3
        got = b.call("get", rank=f"tp2-{r}", hashes=hashes, slot=5)
        assert got["results"] == [True] * 3 and got["exact"] == [True] * 3

    back = page_hashes(3, "tp2to1")
    b.call("set", rank="tp2-0", hashes=back, slot=0)
    # Only rank 0's heads are stored: a TP 1 reader needs both shards of a page
    assert a.call("exists", rank="tp1", hashes=back)["count"] == 0
    assert a.call("get", rank="tp1", hashes=back, slot=0)["results"] == [False] * 3
    b.call("set", rank="tp2-1", hashes=back, slot=0)
    assert a.call("exists", rank="tp1", hashes=back)["count"] == 3
    got = a.call("get", rank="tp1", hashes=back, slot=0)
    assert got["results"] == [True] * 3 and got["exact"] == [True] * 3


def test_other_tp_sizes_without_tp_lcm_size_miss_instead_of_reading_wrong_heads(daemon, engines):
    a, b = engines
    create(a, "tp1-plain", daemon.socket_path, layout="page_head")
    create(b, "tp2-plain", daemon.socket_path, layout="page_head", tp_rank=0, tp_size=2)
    hashes = page_hashes(2, "plain")
    a.call("set", rank="tp1-plain", hashes=hashes, slot=0)
    assert b.call("exists", rank="tp2-plain", hashes=hashes)["count"] == 0
    assert b.call("get", rank="tp2-plain", hashes=hashes, slot=0)["results"] == [False, False]


def test_layouts_salts_and_models_do_not_share_pages(daemon, engines):
    a, b = engines
    sock = daemon.socket_path
    create(a, "iso-w", sock, cache_salt="tenant-a")
    created = {
        "other layout": create(
            b, "iso-layout", sock, layout="page_first_direct", cache_salt="tenant-a"
        ),
        "other salt": create(b, "iso-salt", sock, cache_salt="tenant-b"),
        "other model": create(b, "iso-model", sock, cache_salt="tenant-a", model_id="org/other"),
        "same": create(b, "iso-same", sock, cache_salt="tenant-a"),
    }
    hashes = page_hashes(2, "iso")
    a.call("set", rank="iso-w", hashes=hashes, slot=0)
    counts = {
        what: b.call("exists", rank=rank, hashes=hashes)["count"]
        for what, rank in (
            ("other layout", "iso-layout"),
            ("other salt", "iso-salt"),
            ("other model", "iso-model"),
            ("same", "iso-same"),
        )
    }
    assert counts == {"other layout": 0, "other salt": 0, "other model": 0, "same": 2}
    assert created["other salt"]["namespace"] == created["same"]["namespace"]  # the key differs


def test_the_flat_page_interface_stores_the_same_blocks(daemon, engines):
    """Without ``interface_v1`` SGLang moves flat pages (``get_data_page(flat=True)``): they
    are the same blocks as the zero-copy path's, both ways."""
    a, b = engines
    create(a, "flat-w", daemon.socket_path, layout="layer_first")
    create(b, "flat-r", daemon.socket_path, layout="layer_first")
    hashes = page_hashes(3, "flat")
    assert a.call("legacy_set", rank="flat-w", hashes=hashes, slot=0)["stored"]
    got = b.call("get", rank="flat-r", hashes=hashes, slot=4)
    assert got["results"] == [True] * 3 and got["exact"] == [True] * 3
    more = page_hashes(2, "flat-v1")
    a.call("set", rank="flat-w", hashes=more, slot=0)
    got = b.call("legacy_get", rank="flat-r", hashes=more, slot=0)
    assert got["found"] == [True, True] and got["exact"] == [True, True]


def test_a_host_pool_keeping_pages_elsewhere_is_refused_at_start(daemon, engines):
    """A subclass of SGLang's MHA host pool may keep part of a page outside kv_buffer (the
    MXFP8 pool keeps its scales apart): kv_buffer alone would be restored with stale
    scales, so the backend refuses it at start, naming it (as an extra pool: a miss)."""
    a, _ = engines
    got = a.call(
        "create",
        rank="scaled",
        layout="page_first",
        tp_rank=0,
        tp_size=1,
        tp_lcm_size=None,
        extra={"socket": daemon.socket_path},
        subclass=True,
        expect_error=True,
        **GEOMETRY,
    )
    assert "ScaledMHAPool is not stored" in got["error"]


def span(slot: int, mamba_slot: int, swa_slot: int, window: int = 2) -> dict:
    return {"slot": slot, "mamba_slot": mamba_slot, "swa_slot": swa_slot, "window": window}


def test_hybrid_pools_written_by_one_engine_are_read_bit_exact_by_another(daemon, engines):
    """A hybrid model's rank (SGLang's MambaPoolHost and a sliding-window
    MHATokenToKVPoolHost beside its KV pool, registered through register_mem_host_pool_v2):
    engine A backs a span up (KV pages through v1, the span's last Mamba state and its
    last 2 window pages through batch_set_v2); engine B finds it with SGLang's trailing-page
    policy and loads all three bit-exact."""
    a, b = engines
    create(a, "hy-w", daemon.socket_path, hybrid=True)
    create(b, "hy-r", daemon.socket_path, hybrid=True)
    hashes = page_hashes(6, "hybrid")
    assert (
        b.call("hybrid_exists", rank="hy-r", hashes=hashes, **span(0, 3, 10))["kv_hit_pages"] == 0
    )
    stored = a.call("hybrid_set", rank="hy-w", hashes=hashes, **span(0, 3, 10))
    assert stored["results"] == {"kv": [True] * 6, "mamba": [True], "swa": [True, True]}
    found = b.call("hybrid_exists", rank="hy-r", hashes=hashes, **span(0, 3, 10))
    assert found == {"kv_hit_pages": 6, "hits": {"kv": 6, "mamba": 6, "swa": 6}, "restorable": [6]}
    # A shorter prefix has its KV pages, but no state was saved at its end: not restorable.
    short = b.call("hybrid_exists", rank="hy-r", hashes=hashes[:4], **span(0, 3, 10))
    assert short == {"kv_hit_pages": 0, "hits": {"kv": 4}, "restorable": []}
    got = b.call("hybrid_get", rank="hy-r", hashes=hashes, **span(8, 5, 20))
    assert got["results"] == {"kv": [True] * 6, "mamba": [True], "swa": [True, True]}
    assert got["exact_kv"] == [True] * 6 and got["exact_state"] and got["exact_swa"] == [True] * 2
    # keys name the pool: each pool's pages are its own (the KV rank sees none of them)
    totals = a.call("stats", rank="hy-w")["totals"]
    assert totals["mamba.written_blocks"] == 1 and totals["swa.written_blocks"] == 2
    assert b.call("stats", rank="hy-r")["totals"]["mamba.read_pages"] == 1
    # clear() drops every pool's pages of this rank
    assert a.call("clear", rank="hy-w")["cleared"]
    assert b.call("hybrid_exists", rank="hy-r", hashes=hashes, **span(0, 3, 10)) == {
        "kv_hit_pages": 0,
        "hits": {},
        "restorable": [],
    }


def test_hybrid_spans_through_sglangs_hybrid_cache_controller(daemon, engines):
    """SGLang's HybridCacheController (its backup, hit-query and prefetch-transfer methods,
    over a real HostPoolGroup of the three pools) backs a span up in engine A; engine B's
    controller finds it (every pool to the span's end, the one restorable stop point) and
    loads the KV pages, the Mamba state and the window pages bit-exact."""
    a, b = engines
    create(a, "hyc-w", daemon.socket_path, hybrid=True)
    create(b, "hyc-r", daemon.socket_path, hybrid=True)
    tokens = list(range(5000, 5048))  # 6 pages of 8
    backup = a.call("hybrid_backup", rank="hyc-w", tokens=tokens, **span(0, 3, 10))
    assert backup == {"completed_tokens": 48, "pool_hits": {"mamba": 1, "swa": 2}}
    got = b.call("hybrid_prefetch", rank="hyc-r", tokens=tokens, **span(8, 5, 20))
    assert got["hit_tokens"] == 48 and got["restorable"] == [6]
    assert got["query_pool_hit_pages"] == {"kv": 6, "mamba": 6, "swa": 6}
    assert got["sidecar_hits"] == [{"mamba": 1, "swa": 2}]
    assert got["exact_kv"] == [True] * 6 and got["exact_state"] and got["exact_swa"] == [True] * 2


def test_hybrid_pools_are_misses_not_errors_when_they_cannot_be_served(tmp_path, engines):
    """A pool kvbroker does not store, a daemon down, a full pool: misses and skipped writes
    in SGLang's v2 calls, never an exception in its storage threads."""
    a, b = engines
    sock = str(tmp_path / "hy.sock")
    # (the call timeout is no part of this test: a down daemon is refused at connect)
    create(a, "hy-down", sock, hybrid=True, retry_min=0.2, retry_max=0.2, timeout=30)
    hashes = page_hashes(3, "hy-down")
    down = a.call("hybrid_set", rank="hy-down", hashes=hashes, **span(0, 1, 4))
    assert down["results"] == {"kv": [False] * 3, "mamba": [False], "swa": [False, False]}
    assert (
        a.call("hybrid_exists", rank="hy-down", hashes=hashes, **span(0, 1, 4))["kv_hit_pages"] == 0
    )
    got = a.call("hybrid_get", rank="hy-down", hashes=hashes, **span(0, 1, 4))
    assert got["results"] == {"kv": [False] * 3, "mamba": [False], "swa": [False, False]}
    # 16 pages of 4 KiB: a window of 17 pages never fits, the state (one page) does
    daemon = DaemonProcess(sock, "--pool-size", "64K", "--page-size", "4K", ready_timeout=60)
    try:
        time.sleep(0.3)  # past the link's retry delay
        create(b, "hy-odd", sock, hybrid=True, unsupported={"deepseek_v4_c4": "paged"})
        odd = b.call("hybrid_set", rank="hy-odd", hashes=hashes, **span(0, 1, 4))
        assert odd["results"] == {
            "kv": [True] * 3,
            "mamba": [True],
            "swa": [True, True],
            "deepseek_v4_c4": [False],
        }
        # a hit needs every pool: one that is not stored leaves nothing restorable
        assert b.call("hybrid_exists", rank="hy-odd", hashes=hashes, **span(0, 1, 4)) == {
            "kv_hit_pages": 0,
            "hits": {"kv": 3, "mamba": 3, "swa": 3},
            "restorable": [],
        }
        big = page_hashes(17, "hy-full")
        full = a.call("hybrid_set", rank="hy-down", hashes=big, **span(0, 2, 5, window=17))
        assert full["results"] == {"kv": [False] * 17, "mamba": [True], "swa": [False] * 17}
        # 2 window pages skipped while the daemon was down, then the 17 refused
        assert a.call("stats", rank="hy-down")["totals"]["swa.write_skipped"] == 2 + 17
    finally:
        daemon.stop()


def test_stats_and_clear(daemon, engines):
    a, b = engines
    create(a, "st-w", daemon.socket_path)
    create(b, "st-r", daemon.socket_path)
    hashes = page_hashes(3, "stats")
    a.call("stats", rank="st-w")  # drains the metrics so far
    a.call("set", rank="st-w", hashes=hashes, slot=0)
    b.call("get", rank="st-r", hashes=hashes, slot=0)
    written, read = a.call("stats", rank="st-w"), b.call("stats", rank="st-r")
    assert written["metrics_type"] == "StorageMetrics"
    assert written["backup_pgs"] == [3] and read["prefetch_pgs"] == [3]
    assert read["totals"]["read_pages"] == 3
    assert b.call("clear", rank="st-r")["cleared"]
    assert a.call("exists", rank="st-w", hashes=hashes)["count"] == 0


def test_daemon_down_then_up_costs_misses_and_skipped_writes_only(tmp_path, engines):
    a, _ = engines
    sock = str(tmp_path / "later.sock")
    # A call timeout of 1 s was one a loaded machine's daemon could miss when it was up (a
    # miss where a hit is expected); the stopped daemon below costs one call of 10 s.
    create(a, "down", sock, retry_min=0.2, retry_max=0.2, timeout=10)
    hashes = page_hashes(2, "down")
    assert a.call("exists", rank="down", hashes=hashes)["count"] == 0
    assert a.call("set", rank="down", hashes=hashes, slot=0)["results"] == [False, False]
    assert a.call("get", rank="down", hashes=hashes, slot=0)["results"] == [False, False]
    daemon = DaemonProcess(sock, "--pool-size", "16M", "--page-size", "4K", ready_timeout=60)
    try:
        time.sleep(0.3)  # past the link's retry delay
        assert a.call("set", rank="down", hashes=hashes, slot=0)["results"] == [True, True]
        got = a.call("get", rank="down", hashes=hashes, slot=8)
        assert got["results"] == [True, True] and got["exact"] == [True, True]
        errors = a.call("stats", rank="down")["totals"].get("errors", 0)
        daemon.proc.send_signal(signal.SIGSTOP)  # hung: one call waits its timeout
        try:
            assert a.call("exists", rank="down", hashes=hashes)["count"] == 0
            assert a.call("set", rank="down", hashes=page_hashes(1, "hung"), slot=0)["results"] == [
                False
            ]
            # the timeout took the link down: the set was not even tried
            assert a.call("stats", rank="down")["totals"]["errors"] == errors + 1
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        time.sleep(0.3)
        assert a.call("exists", rank="down", hashes=hashes)["count"] == 2  # back
        daemon.proc.kill()  # gone mid-life: misses again, no exception
        daemon.proc.wait()
        assert a.call("exists", rank="down", hashes=hashes)["count"] == 0
        assert a.call("get", rank="down", hashes=hashes, slot=0)["results"] == [False, False]
        totals = a.call("stats", rank="down")["totals"]
        assert totals["write_skipped"] >= 2 and totals["read_missed_down"] >= 2
    finally:
        daemon.stop()


def test_a_full_pool_skips_the_batch_and_keeps_serving(tmp_path, engines):
    """A pool of 16 pages of 4 KiB, pages of 4 KiB: a batch of 32 cannot fit even after
    evicting everything, so it is refused whole; smaller batches are stored as before."""
    a, b = engines
    sock = str(tmp_path / "small.sock")
    daemon = DaemonProcess(sock, "--pool-size", "64K", "--page-size", "4K", ready_timeout=60)
    try:
        create(a, "full-w", sock)
        create(b, "full-r", sock)
        big = page_hashes(32, "full")
        assert a.call("set", rank="full-w", hashes=big, slot=0)["results"] == [False] * 32
        assert b.call("exists", rank="full-r", hashes=big)["count"] == 0  # nothing half stored
        assert a.call("stats", rank="full-w")["totals"]["write_skipped"] == 32
        small = page_hashes(8, "fits")
        assert a.call("set", rank="full-w", hashes=small, slot=0)["results"] == [True] * 8
        got = b.call("get", rank="full-r", hashes=small, slot=0)
        assert got["results"] == [True] * 8 and got["exact"] == [True] * 8
    finally:
        daemon.stop()
