"""Daemon-owned GPU staging rings, without a GPU: the ring service over fake devices
(``KVBROKER_FAKE_GPUS``), in-process with hypothesis and through a real daemon subprocess."""

from __future__ import annotations

from itertools import pairwise
import json
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker import Client
from kvbroker._server.rings import RING_ALIGN, FakeRings, RingService
from kvbroker._server.policy import Policy
from kvbroker.errors import BadRequest, Exists, Forbidden, LeaseExpired, NotFound, PoolFull, Timeout

RING = 1 << 20  # the smallest ring `--gpu-ring` accepts


class _Session:
    """What RingService needs of a broker session: an id and the policy's access rights
    (the default policy: every namespace open)."""

    def __init__(self, sid: int) -> None:
        self.id = sid
        self.access = Policy().access(0, 0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _service(size=64 * RING_ALIGN, devices=2, **kw) -> RingService:
    return RingService(FakeRings(devices), size, **kw)


def _reserve(svc, s, nbytes, device=0, key=None, ttl=None):
    return svc.handle(
        s,
        "ring_reserve",
        {
            "device": device,
            "nbytes": nbytes,
            "namespace": "ns",
            "key": key,
            "meta": None,
            "ttl": ttl,
        },
    )


def _claim(svc, s, key, consume=True):
    return svc.handle(
        s, "ring_claim", {"namespace": "ns", "key": key, "consume": consume, "wait": None}
    )


def _held_regions(svc, device=0):
    return [(r.offset, r.end) for r in svc.rings[device].allocator.live()]


# ------------------------------------------------------------------------ in-process service
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["scratch", "write", "seal", "claim", "read", "release", "drop", "tick"]
            ),
            st.integers(0, 2),
            st.integers(1, 40 * RING_ALIGN),
            st.integers(0, 10**6),
        ),
        max_size=60,
    )
)
def test_service_never_overlaps_and_every_path_frees(ops):
    clock = _Clock()
    svc = _service(clock=clock, object_ttl=5.0)
    sessions = [_Session(i) for i in range(3)]
    leases: dict[int, tuple[int, dict]] = {}  # lease -> (session index, reply)
    sealed: list[str] = []
    serial = 0
    for op, who, n, pick in ops:
        s = sessions[who]
        try:
            if op in ("scratch", "write"):
                serial += 1
                key = f"k{serial}" if op == "write" else None
                reply = _reserve(svc, s, n, key=key)
                assert reply["offset"] % RING_ALIGN == 0
                leases[reply["lease"]] = (who, {**reply, "key": key})
            elif op == "seal" and leases:
                lid = list(leases)[pick % len(leases)]
                owner, reply = leases[lid]
                if reply["kind"] == "write":
                    svc.handle(sessions[owner], "ring_seal", {"lease": lid})
                    del leases[lid]
                    sealed.append(reply["key"])
            elif op in ("claim", "read") and sealed:
                key = sealed[pick % len(sealed)]
                reply = _claim(svc, s, key, consume=op == "claim")
                leases[reply["lease"]] = (who, {**reply, "kind": "read", "key": key})
            elif op == "release" and leases:
                lid = list(leases)[pick % len(leases)]
                owner, _ = leases.pop(lid)
                svc.handle(sessions[owner], "ring_release", {"lease": lid})
            elif op == "drop":
                svc.close_session(s)
                leases = {lid: v for lid, v in leases.items() if v[0] != who}
            elif op == "tick":
                clock.now += 3.0
        except (PoolFull, NotFound):
            pass
        regions = sorted(_held_regions(svc))
        for (_a0, a1), (b0, _b1) in pairwise(regions):
            assert a1 <= b0, regions  # no two live regions overlap
        snap = svc.snapshot()[0]
        assert 0 <= snap["used"] <= snap["capacity"]
        assert snap["leased_write"] == sum(
            -(-v["nbytes"] // RING_ALIGN) * RING_ALIGN
            for _, v in leases.values()
            if v["kind"] != "read" and v["device"] == 0
        )
    # every connection gone and every sealed object past its TTL: the ring is empty again
    for s in sessions:
        svc.close_session(s)
    clock.now += 10.0
    svc.expire()
    assert svc.leases == {} and svc.pending == {} and svc.objects == {}
    for ring in svc.rings:
        assert ring.allocator.used == 0
        assert ring.allocator.largest_free == svc.size


def test_oversize_fails_at_once_and_full_ring_says_so():
    svc = _service(size=8 * RING_ALIGN)
    s = _Session(1)
    with pytest.raises(PoolFull, match="never fits"):
        _reserve(svc, s, 8 * RING_ALIGN + 1)
    a = _reserve(svc, s, 6 * RING_ALIGN)
    with pytest.raises(PoolFull, match="full for now"):
        _reserve(svc, s, 4 * RING_ALIGN)
    svc.handle(s, "ring_release", {"lease": a["lease"]})
    assert _reserve(svc, s, 8 * RING_ALIGN)["offset"] == 0  # empty ring restarts at 0


def test_fifo_wrap_and_bad_requests():
    svc = _service(size=8 * RING_ALIGN)
    s, other = _Session(1), _Session(2)
    a = _reserve(svc, s, 3 * RING_ALIGN)
    b = _reserve(svc, s, 3 * RING_ALIGN)
    assert (a["offset"], b["offset"]) == (0, 3 * RING_ALIGN)
    svc.handle(s, "ring_release", {"lease": a["lease"]})
    c = _reserve(svc, s, 3 * RING_ALIGN)  # does not fit before the end: wraps to 0
    assert c["offset"] == 0
    with pytest.raises(Forbidden, match="another connection"):
        svc.handle(other, "ring_release", {"lease": c["lease"]})
    svc.handle(s, "ring_release", {"lease": c["lease"]})
    with pytest.raises(LeaseExpired, match="released"):
        svc.handle(s, "ring_release", {"lease": c["lease"]})
    with pytest.raises(BadRequest, match="no GPU ring 5"):
        _reserve(svc, s, 10, device=5)
    with pytest.raises(BadRequest, match="positive"):
        _reserve(svc, s, 0)
    with pytest.raises(BadRequest, match="write lease"):
        svc.handle(s, "ring_seal", {"lease": b["lease"]})


def test_keyed_objects_seal_claim_consume_and_reader_crash():
    svc = _service()
    w, r1, r2 = _Session(1), _Session(2), _Session(3)
    lease = _reserve(svc, w, 1000, key="req")["lease"]
    with pytest.raises(Exists, match="being published"):
        _reserve(svc, w, 10, key="req")
    with pytest.raises(NotFound):
        _claim(svc, r1, "req")  # not sealed: invisible
    svc.handle(w, "ring_seal", {"lease": lease})
    with pytest.raises(Exists, match="already published"):
        _reserve(svc, w, 10, key="req")
    got = _claim(svc, r1, "req")
    assert got["nbytes"] == 1000 and got["device"] == 0
    with pytest.raises(NotFound):
        _claim(svc, r2, "req")  # consumed: one-shot
    svc.close_session(r1)  # the reader crashed before releasing: the object comes back
    got = _claim(svc, r2, "req")
    assert svc.snapshot()[0]["leased_read"] == 1024
    svc.handle(r2, "ring_release", {"lease": got["lease"]})
    assert svc.rings[0].allocator.used == 0 and svc.objects == {}


def test_reader_crash_after_the_key_was_reserved_again_leaks_nothing():
    # A consume-claim unlinks the key, so a second writer may reserve it; if the reader then
    # disconnects, its object must not come back under that key (the second seal would
    # replace it in no dict, its region never freed: the FIFO ring jams for good).
    svc = _service(devices=1)
    w, reader, w2, s = _Session(1), _Session(2), _Session(3), _Session(4)
    svc.handle(w, "ring_seal", {"lease": _reserve(svc, w, 1000, key="k")["lease"]})
    _claim(svc, reader, "k")
    second = _reserve(svc, w2, 2000, key="k")["lease"]
    svc.close_session(reader)
    # the old object was freed, not re-linked: only the second writer's region is held
    assert len(_held_regions(svc)) == 1 and svc.rings[0].allocator.used == 2048
    svc.handle(w2, "ring_seal", {"lease": second})
    got = _claim(svc, s, "k")
    assert got["nbytes"] == 2000  # the second writer's object
    svc.handle(s, "ring_release", {"lease": got["lease"]})
    assert svc.objects == {} and svc.leases == {} and svc.pending == {}
    assert svc.rings[0].allocator.used == 0
    for _ in range(3 * 64):  # laps of the whole ring: nothing left behind blocks the FIFO
        lease = _reserve(svc, s, 16 * RING_ALIGN)["lease"]
        svc.handle(s, "ring_release", {"lease": lease})
    assert svc.rings[0].allocator.used == 0 and _held_regions(svc) == []


def test_reader_crash_with_no_new_writer_still_leaves_the_object_for_a_retry():
    svc = _service(devices=1)
    w, reader, w2, r2 = _Session(1), _Session(2), _Session(3), _Session(4)
    svc.handle(w, "ring_seal", {"lease": _reserve(svc, w, 1000, key="k")["lease"]})
    _claim(svc, reader, "k")
    # a writer that reserved the key and gave up before the reader died changes nothing
    svc.handle(w2, "ring_release", {"lease": _reserve(svc, w2, 500, key="k")["lease"]})
    svc.close_session(reader)
    with pytest.raises(Exists, match="already published"):
        _reserve(svc, w2, 500, key="k")
    got = _claim(svc, r2, "k")
    assert got["nbytes"] == 1000
    svc.handle(r2, "ring_release", {"lease": got["lease"]})
    assert svc.objects == {} and svc.rings[0].allocator.used == 0


def test_writer_disconnect_discards_and_unclaimed_objects_expire():
    clock = _Clock()
    svc = _service(clock=clock, object_ttl=2.0)
    w = _Session(1)
    _reserve(svc, w, 500, key="half-written")
    _reserve(svc, w, 500)  # scratch
    svc.close_session(w)
    assert svc.rings[0].allocator.used == 0 and svc.pending == {}
    lease = _reserve(svc, w, 500, key="orphan", ttl=1.0)["lease"]
    svc.handle(w, "ring_seal", {"lease": lease})
    reader = _Session(2)
    held = _claim(svc, reader, "orphan", consume=False)
    clock.now += 5.0
    svc.expire()
    assert svc.rings[0].allocator.used == RING_ALIGN * 2  # a reader holds it: not expired
    svc.handle(reader, "ring_release", {"lease": held["lease"]})
    svc.expire()
    assert svc.rings[0].allocator.used == 0 and svc.counters["expired"] == 1


def test_snapshot_occupancy_map():
    svc = _service(size=64 * RING_ALIGN, devices=1)
    w, r = _Session(1), _Session(2)
    _reserve(svc, w, 16 * RING_ALIGN)  # scratch: w
    lease = _reserve(svc, w, 16 * RING_ALIGN, key="a")["lease"]
    svc.handle(w, "ring_seal", {"lease": lease})  # sealed: s
    snap = svc.snapshot(occupancy_cells=8)[0]
    assert snap["occupancy"] == "wwss...."
    _claim(svc, r, "a", consume=False)
    snap = svc.snapshot(occupancy_cells=8)[0]
    assert snap["occupancy"] == "wwrr...."
    assert (snap["objects"], snap["leased_read"], snap["leased_write"]) == (
        1,
        16 * RING_ALIGN,
        16 * RING_ALIGN,
    )
    assert snap["largest_free"] == 32 * RING_ALIGN and snap["used"] == 32 * RING_ALIGN


# -------------------------------------------------------------- through a daemon subprocess
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


def test_rings_op_shares_one_handle_per_gpu(ring_daemon):
    with ring_daemon.client(map_pools=False) as c:
        rings = c._call("rings")["rings"]
    assert [r["index"] for r in rings] == [0, 1]
    assert all(len(r["handle"]) == 64 and r["capacity"] == RING for r in rings)
    assert rings[0]["handle"] != rings[1]["handle"]
    assert "GPU ring 1: 1.0 MiB" in ring_daemon.log()


def test_no_rings_without_the_option(daemon):
    with daemon.client(map_pools=False) as c:
        with pytest.raises(BadRequest, match="no GPU rings"):
            c._call("rings")
        with pytest.raises(BadRequest, match="gpu-ring"):
            c._call("ring_reserve", device=0, nbytes=10)
        assert c.stat().rings == ()


def test_daemon_reserve_seal_claim_release_and_stat(ring_daemon):
    with ring_daemon.client(map_pools=False) as w, ring_daemon.client(map_pools=False) as r:
        lease = w._call("ring_reserve", device=1, nbytes=300_000, key="req", meta={"x": 1})
        assert lease["kind"] == "write" and lease["device"] == 1
        w._call("ring_seal", lease=lease["lease"])
        got = r._call("ring_claim", key="req")
        assert (got["device"], got["offset"], got["nbytes"], got["meta"]) == (
            1,
            lease["offset"],
            300_000,
            {"x": 1},
        )
        ring = r.stat().rings[1]
        assert ring["leased_read"] == 300_032 and ring["used"] == 300_032
        assert "r" in ring["occupancy"] and ring["device"] == "fake:01:00.0"
        r._call("ring_release", lease=got["lease"])
        ring = r.stat().rings[1]
        assert (ring["used"], ring["objects"], ring["leased_read"]) == (0, 0, 0)
        with pytest.raises(PoolFull, match="never fits"):
            w._call("ring_reserve", device=0, nbytes=RING + 1)
        with pytest.raises(BadRequest, match="nbytes must be int"):
            w._call("ring_reserve", device=0, nbytes="big")


def test_daemon_frees_ring_space_of_a_client_that_disconnects(ring_daemon):
    with ring_daemon.client(map_pools=False) as admin:
        c = ring_daemon.client(map_pools=False)
        c._call("ring_reserve", device=0, nbytes=400_000)  # scratch
        c._call("ring_reserve", device=0, nbytes=400_000, key="unsealed")
        with pytest.raises(PoolFull, match="full for now"):
            admin._call("ring_reserve", device=0, nbytes=400_000)
        assert admin.stat().rings[0]["leased_write"] == 2 * 400_128  # 256-byte aligned
        c.close()
        deadline = time.monotonic() + 5
        while admin.stat().rings[0]["used"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert admin.stat().rings[0]["used"] == 0
        admin._call("ring_reserve", device=0, nbytes=RING)  # the whole ring is free again


def test_daemon_waiting_claim_is_answered_by_a_later_seal(ring_daemon):
    with ring_daemon.client(map_pools=False) as w, ring_daemon.client(map_pools=False) as r:
        result = {}

        def claim():
            result["reply"] = r._call("ring_claim", key="later", wait=10.0)

        t = threading.Thread(target=claim)
        t.start()
        time.sleep(0.2)
        lease = w._call("ring_reserve", device=0, nbytes=100, key="later")
        w._call("ring_seal", lease=lease["lease"])
        t.join(10)
        assert result["reply"]["offset"] == lease["offset"]
        with pytest.raises(Timeout, match="not published within"):
            r._call("ring_claim", key="never", wait=0.2)


def test_stat_cli_shows_ring_occupancy(ring_daemon):
    with ring_daemon.client(map_pools=False) as c:
        c._call("ring_reserve", device=1, nbytes=RING // 2)
        base = [sys.executable, "-m", "kvbroker", "stat", "--socket", ring_daemon.socket_path]
        table = subprocess.run(base, capture_output=True, text=True, timeout=60)
        assert table.returncode == 0, table.stderr
        lines = [ln for ln in table.stdout.splitlines() if ln.startswith(("RING", "0 ", "1 "))]
        ring1 = next(ln for ln in lines if ln.startswith("1 ") and "fake:01" in ln)
        assert "512.0 KiB" in ring1 and "1.0 MiB" in ring1
        js = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=60)
        rings = json.loads(js.stdout)["rings"]
        assert rings[1]["used"] == RING // 2 and rings[0]["used"] == 0


def test_gpu_ring_config_key(tmp_path):
    from kvbroker._server.config import ConfigError, load_config

    cfg = tmp_path / "k.toml"
    cfg.write_text('gpu_ring = "2G"\n')
    assert load_config(str(cfg)).gpu_ring == 2 << 30
    cfg.write_text('gpu_ring = "off"\n')
    assert load_config(str(cfg)).gpu_ring is None
    cfg.write_text("gpu_ring = 10\n")
    with pytest.raises(ConfigError, match="at least 1M"):
        load_config(str(cfg))


def test_client_without_a_gpu_cannot_map_rings_but_plumbing_works(ring_daemon):
    # the wire ops need no torch: an operator tool can read ring state on any host
    with Client(ring_daemon.socket_path, map_pools=False) as c:
        code = "import sys, kvbroker._server.rings; print('torch' in sys.modules)"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == "False", out.stderr
        assert len(c.stat().rings) == 2


def test_tui_draws_ring_snapshots_as_pool_panels():
    from kvbroker._wire.stats import Statistics
    from tui._pool_view import PoolView

    svc = _service(size=64 * RING_ALIGN, devices=2)
    w = _Session(1)
    _reserve(svc, w, 16 * RING_ALIGN, device=1)
    snap = Statistics.from_dict(
        {
            "taken_at": 0.0,
            "version": "x",
            "pid": 1,
            "started_at": 0.0,
            "socket": "s",
            "objects": 0,
            "pending": 0,
            "read_leases": 0,
            "write_leases": 0,
            "pools": [],
            "clients": [],
            "counters": {},
            "rings": svc.snapshot(occupancy_cells=4),
        }
    )
    views = [PoolView.from_ring(i, r) for i, r in enumerate(snap.rings)]
    assert [v.key for v in views] == ["ring-0", "ring-1"]
    assert (views[1].capacity, views[1].used, views[1].leased_write) == (
        64 * RING_ALIGN,
        16 * RING_ALIGN,
        16 * RING_ALIGN,
    )
    assert views[1].occupancy == "w..." and views[0].occupancy == "...."
    assert views[1].title == "ring 1  fake GPU (KVBROKER_FAKE_GPUS)"


def test_lookup_names_sealed_objects_only_and_takes_no_lease():
    svc = _service(devices=2)
    w = _Session(1)
    lease = _reserve(svc, w, 1000, device=1, key="sealed")["lease"]
    svc.handle(w, "ring_seal", {"lease": lease})
    _reserve(svc, w, 500, key="pending")
    found = svc.handle(w, "ring_lookup", {"namespace": "ns", "keys": ["sealed", "pending", "x"]})
    assert found == {"objects": [{"device": 1, "nbytes": 1000, "meta": None}, None, None]}
    assert len(svc.leases) == 1  # the pending write lease only: a lookup holds nothing
    assert svc.handle(w, "ring_lookup", {"namespace": "other", "keys": ["sealed"]}) == {
        "objects": [None]
    }
    with pytest.raises(BadRequest, match="strings"):
        svc.handle(w, "ring_lookup", {"namespace": "ns", "keys": [1]})
    with pytest.raises(BadRequest, match="at most"):
        svc.handle(w, "ring_lookup", {"namespace": "ns", "keys": ["k"] * 5000})
