"""The disk tier in a real daemon ([tier.disk] on a temporary directory): what a pool evicts
is claimed back bit-exact, a prefix match counts and leases a chain spanning both tiers,
evict --tier, and a daemon killed, the page cache dropped and the pools gone (as after a
reboot) serving its disk objects again, a damaged slot or index record dropped, never
served."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from conftest import DaemonProcess, drop_leftover_pools
from kvbroker import KVBrokerError, NotFound
from kvbroker import blocks as kvblocks
from kvbroker._server.config import env_name
from kvbroker._server.disk_store import INDEX_NAME, SLOTS_NAME
from kvbroker.prefix import PrefixCache

POOL = ("--pool-size", "4M", "--page-size", "4K")
OBJ = 256 << 10  # 16 of them fill the pool


def pattern(key: str, n: int = OBJ) -> np.ndarray:
    seed = int.from_bytes(key.encode()[-8:].rjust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def tier_env(directory, **more: str) -> dict[str, str]:
    """[tier.disk] through its variables: directories, a 64M size, and ``more`` settings."""
    return {
        env_name("tier_disk_directories"): str(directory),
        env_name("tier_disk_size"): "64M",
        **{env_name(f"tier_disk_{k}"): v for k, v in more.items()},
    }


@pytest.fixture
def daemons(socket_path):
    started: list[DaemonProcess] = []

    def start(env: dict, *args: str) -> DaemonProcess:
        d = DaemonProcess(socket_path, *POOL, "--read-replicas", "0", *args, env=env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    drop_leftover_pools(socket_path)


def wait_for(what, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_what_the_pool_evicts_is_claimed_back_from_disk(daemons, tmp_path):
    d = daemons(tier_env(tmp_path / "disk"))
    with d.client() as c:
        keys = [f"obj{i}" for i in range(48)]  # 12 MiB through a 4 MiB pool
        for k in keys:
            assert c.put(k, {"past_key.0": pattern(k)})
        st = c.stat()
        assert st.counters.evictions > 0 and st.disk is not None and st.disk.only_on_disk > 0
        for k in keys:  # every one of them, most from disk, bit-exact
            assert c.exists(k)
            got = c.get(k, verify=True)
            assert np.array_equal(got["past_key.0"], pattern(k)), k
        st = c.stat()
        assert st.disk.promoted > 0 and st.disk.dropped_damaged == 0
        assert st.disk.promoted_bytes >= st.disk.promoted * OBJ
        # The operator's surfaces: stat's text, Prometheus.
        from cli._stat import render
        from kvbroker._server.metrics import BrokerCollector

        text = render(st)
        assert f"promoted {st.disk.promoted} " in text and "O_DIRECT" in text
        metrics = {
            m.name: m.samples[0].value
            for m in BrokerCollector(lambda: st).collect()
            if m.name.startswith("kvbroker_disk")
        }
        assert metrics["kvbroker_disk_promotions"] == st.disk.promoted
        assert metrics["kvbroker_disk_objects"] == st.disk.objects
        assert metrics["kvbroker_disk_o_direct"] == 1.0
        # A put over a key that is on disk only needs replace, and replaces the disk copy.
        only_disk = next(k for k in keys if not c.list(match=f"^{k}$", tier="dram"))
        assert not c.put(only_disk, {"past_key.0": pattern("other")})
        assert c.put(only_disk, {"past_key.0": pattern("other")}, replace=True)
        c.evict(match=".", tier="dram")  # everything to disk; the new version goes there
        assert np.array_equal(c.get(only_disk)["past_key.0"], pattern("other"))


def test_a_prefix_chain_spanning_both_tiers_is_counted_and_leased(daemons, tmp_path):
    d = daemons(tier_env(tmp_path / "disk"))
    with d.client() as c:
        cache = PrefixCache(c, block_size=4)
        tokens = list(range(4 * 8))
        blocks = [{"past_key.0": pattern(f"blk{i}", 64 << 10)} for i in range(8)]
        assert cache.publish(tokens, blocks) == 8
        hashes = cache.hashes(tokens)
        # The chain's last 5 blocks go to disk (leaves first: a parent goes after its children).
        for h in reversed(hashes[3:]):
            assert c.evict(h, namespace="prefix", tier="dram").count == 1
        assert len(c.list(namespace="prefix", tier="dram")) == 3
        assert cache.match(tokens + [0], hold=False).num_blocks == 8  # both tiers counted
        with cache.match(tokens + [0]) as m:  # one lease over the chain, promoted first
            assert m.num_blocks == 8
            for i, blk in enumerate(m.blocks):
                assert np.array_equal(blk["past_key.0"], blocks[i]["past_key.0"]), i
        assert c.stat().disk.promoted == 5


def test_blocks_on_disk_are_reported_existing_not_reserved_again(daemons, tmp_path):
    """reserve_blocks answers a block on the disk tier as one in a pool (no lease): a
    PrefixCache publishing a chain again writes none of it, nor replaces its disk copies."""
    d = daemons(tier_env(tmp_path / "disk"))
    with d.client() as c:
        cache = PrefixCache(c, block_size=4)
        tokens = list(range(100, 100 + 4 * 6))
        blocks = [{"past_key.0": pattern(f"again{i}", 64 << 10)} for i in range(6)]
        assert cache.publish(tokens, blocks) == 6
        for h in reversed(cache.hashes(tokens)[2:]):  # 4 of them to disk only
            assert c.evict(h, namespace="prefix", tier="dram").count == 1
        before = c.stat()
        assert before.disk.only_on_disk == 4
        assert cache.publish(tokens, blocks) == 0  # nothing new: 2 in the pool, 4 on disk
        keys = [{"key": h, "parent": None} for h in cache.hashes(tokens)]
        r = kvblocks.reserve(c, "prefix", keys, {"past_key.0": 64 << 10})
        assert r.leases == [None] * 6
        after = c.stat()
        assert after.counters.publishes == before.counters.publishes
        assert after.disk.only_on_disk == 4 and after.disk.promoted == 0
        with cache.match(tokens + [0]) as m:  # the disk copies are the ones first written
            assert m.num_blocks == 6
            for i, blk in enumerate(m.blocks):
                assert np.array_equal(blk["past_key.0"], blocks[i]["past_key.0"]), i


def test_evict_by_tier(daemons, tmp_path):
    # (buffered I/O here: o_direct = false, as where the file system refuses O_DIRECT)
    d = daemons(tier_env(tmp_path / "disk", policy="sealed", o_direct="false"))
    with d.client() as c:
        assert not c.stat().disk.o_direct
        for k in ("a", "b", "c"):
            c.put(k, {"past_key.0": pattern(k, 8192)})
        wait_for(lambda: c.stat().disk.objects == 3)  # policy sealed: all written back
        r = c.evict("a", tier="disk")  # its disk copy only: still in the pool
        assert (r.count, r.on_disk) == (0, 1) and c.list(match="^a$", tier="dram")
        r = c.evict("b", tier="dram")  # from the pool only: still claimable
        assert r.count == 1 and not c.list(match="^b$", tier="dram") and c.exists("b")
        r = c.evict(all=True)  # everywhere
        assert r.count == 3 and r.on_disk == 2  # c had a copy, b was on disk only
        assert not any(c.exists(k) for k in "abc") and c.stat().disk.objects == 0


def test_cli_evict_tier_disk_of_a_key_reports_the_copy_it_dropped(daemons, tmp_path):
    """`kvbroker evict --tier disk KEY` drops the key's disk copy and keeps it in the pool:
    that is success (exit 0), not "no object"; a key with no disk copy exits 1 saying so."""
    from typer.testing import CliRunner

    from kvbroker.cli import app

    d = daemons(tier_env(tmp_path / "disk", policy="sealed", o_direct="false"))
    with d.client() as c:
        for k in ("a", "b"):
            c.put(k, {"past_key.0": pattern(k, 8192)})
        wait_for(lambda: c.stat().disk.objects == 2)  # policy sealed: both written back
        assert c.evict("b", tier="disk").on_disk == 1  # b: in the pool only from now on
        s = ["--socket", d.socket_path]
        r = CliRunner().invoke(app, ["evict", "a", "--tier", "disk", "--dry-run", *s])
        assert r.exit_code == 0 and "would drop 1 disk copy" in r.output, r.output
        assert c.stat().disk.objects == 1  # a dry run drops nothing
        r = CliRunner().invoke(app, ["evict", "a", "--tier", "disk", *s])
        assert r.exit_code == 0, r.output
        assert "1 disk copy dropped" in r.output and "no object" not in r.output
        assert c.stat().disk.objects == 0 and c.list(match="^a$")  # still in the pool
        r = CliRunner().invoke(app, ["evict", "b", "--tier", "disk", *s])
        assert r.exit_code == 1 and "no disk copy of 'b'" in r.output, r.output
        assert c.list(match="^b$")


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _flip(path, offset: int, mask: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def test_a_reboot_keeps_what_the_index_vouches_for(daemons, tmp_path, socket_path):
    disk = tmp_path / "disk"
    env = tier_env(disk, policy="sealed")
    d = daemons(env)
    keys = [f"k{i}" for i in range(10)]
    with d.client() as c:
        for k in keys:
            c.put(
                k,
                {"past_key.0": pattern(k, 20000), "past_value.0": pattern(k + "v", 9000)},
                meta={"k": k},
            )
        wait_for(lambda: (st := c.stat().disk).objects == len(keys) and not st.index_pending)
    d.stop(signal.SIGKILL)
    drop_leftover_pools(socket_path)  # the pools die with the machine
    dropped = _drop_caches()  # (as root: what is read next comes from the device)
    d2 = daemons(env, "--cold")
    with d2.client() as c:
        st = c.stat()
        assert st.disk.recovered == len(keys) and st.objects == 0
        for k in keys:
            lease = c.claim(k, verify=True)  # the checksums recorded at the first seal
            with lease:
                assert lease.meta == {"k": k}
                assert lease.checksums  # the first seal's, carried through the disk
                assert np.array_equal(
                    np.frombuffer(lease["past_key.0"], np.uint8), pattern(k, 20000)
                )
                assert np.array_equal(
                    np.frombuffer(lease["past_value.0"], np.uint8), pattern(k + "v", 9000)
                )
    d2.stop()
    # Damage one slot's bytes and one index record, then start again.
    from kvbroker._server.disk_store import DiskIndex

    index = disk / INDEX_NAME
    entries = DiskIndex(str(index), [[(64 << 20) // 4096, 4096]]).load().entries
    by_key = {rec["k"]: rec for rec in entries.values()}
    _flip(disk / SLOTS_NAME, by_key["k3"]["s"] * 4096 + 5000)
    data = index.read_bytes()
    _flip(index, data.index(b"k7"), 0x20)
    d3 = daemons(env, "--cold")
    with d3.client() as c:
        st = c.stat()
        assert st.disk.recovered == len(keys) - 1 and st.disk.recovered_dropped == 1
        assert not c.exists("k7")
        with pytest.raises(NotFound, match="damaged"):
            c.claim("k3")  # its slot does not hash to its digest: dropped, never served
        assert not c.exists("k3") and c.stat().disk.dropped_damaged == 1
        for k in keys:
            if k not in ("k3", "k7"):
                assert np.array_equal(c.get(k)["past_key.0"], pattern(k, 20000))
    assert dropped or os.geteuid() != 0


def test_a_consumed_or_replaced_object_takes_its_disk_copy_with_it(daemons, tmp_path):
    d = daemons(tier_env(tmp_path / "disk", policy="sealed"))
    with d.client() as c:
        c.put("once", {"past_key.0": pattern("once", 8192)})
        c.put("twice", {"past_key.0": pattern("v1", 8192)})
        wait_for(lambda: c.stat().disk.objects == 2)
        c.get("once", consume=True)  # its last consumer: gone, from the disk too
        assert not c.exists("once")
        with pytest.raises(NotFound):
            c.claim("once")
        c.put("twice", {"past_key.0": pattern("v2", 8192)}, replace=True)
        c.evict("twice", tier="dram")  # the pool's copy out: what is on disk is v2 only
        assert np.array_equal(c.get("twice")["past_key.0"], pattern("v2", 8192))
        wait_for(lambda: (st := c.stat().disk).objects == 1 and st.only_on_disk == 0)


def test_a_prefix_key_that_is_not_a_string_ends_the_run_past_the_disk_blocks(daemons, tmp_path):
    # A match's keys are a list of anything on the wire; a key that is not a string is never
    # published, so the run ends there (as it does in the pools), whichever tier the blocks
    # before it are in: never an internal error for the asker.
    d = daemons(tier_env(tmp_path / "disk"))
    with d.client() as c:
        c.put("cold", {"past_key.0": pattern("cold", 8192)})
        assert c.evict("cold", tier="dram").count == 1 and c.exists("cold")
        for hold in (False, True):
            r = c.ops.match_prefix(["cold", ["not", "a", "key"], {"x": 1}], hold=hold)
            assert r["matched"] == 1, r
            if r["lease"] is not None:
                c.ops.release(r["lease"])
        assert np.array_equal(c.get("cold")["past_key.0"], pattern("cold", 8192))
        assert c.ping()


def test_a_pool_truncated_under_the_disk_tier_does_not_kill_the_daemon(daemons, tmp_path):
    # Whoever may map a pool may ftruncate it (a tenant owns its tenant pool; a group member
    # opens a shared one read-write): its own engines then read past the end and die of
    # SIGBUS. The daemon moves pool pages for the disk tier (demotion, write-back,
    # promotion): through the kernel (a short read, a refused write), never by loads and
    # stores into a mapping, or the SIGBUS kills it and every tenant's service with it.
    d = daemons(tier_env(tmp_path / "disk"))
    with d.client() as c:
        for k in ("a", "b", "cold"):
            assert c.put(k, {"past_key.0": pattern(k)})
        assert c.evict("cold", tier="dram").count == 1  # on disk only, before the attack
        name = c.pools[0]["name"]
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    try:
        os.ftruncate(fd, 4096)  # the attacker's whole act
    finally:
        os.close(fd)
    with d.client(map_pools=False) as c:
        c.evict("a", tier="dram")  # its pages cannot be read: not demoted (it is lost)
        assert d.proc.poll() is None and not c.exists("a")
        with pytest.raises(KVBrokerError):
            c.claim("cold")  # its pool cannot take it: refused, its disk copy kept
        assert d.proc.poll() is None and c.exists("cold")
        st = c.stat()
        assert st.disk.demoted == 1 and st.disk.errors >= 2 and st.disk.dropped_damaged == 0
        c.evict("b", tier="dram")  # and the daemon goes on answering
        assert c.ping() and d.proc.poll() is None


def test_an_evict_that_reads_every_disk_buffer_name_does_not_stall_other_clients(daemons, tmp_path):
    """match_buffers over the disk tier's objects of many buffers: seconds of regex searches
    (a tenant may put that many names on disk, as in its pools), read in slices of the loop
    as the pools' are (the pools' first, then the disk's), so another client's requests are
    answered meanwhile."""
    import threading

    d = daemons(tier_env(tmp_path / "disk"), "--pool-size", "256M")
    with d.client() as c:
        names = {f"b{j:05d}" + "x" * 40: 0 for j in range(4096)}
        for i in range(80):
            c.reserve(f"k{i}", names, checksum=False).seal()
        c.reserve("target", {"zzz-kv": 16}, checksum=False).seal()
        assert c.evict(match="^(k[0-9]+|target)$", tier="dram").count == 81
        assert c.stat().disk.only_on_disk == 81
        for i in range(8):  # and names enough in the pool to read them in slices too
            c.reserve(f"p{i}", names, checksum=False).seal()
        waits: list[float] = []
        done = threading.Event()

        def honest():
            with d.client() as h:
                while not done.is_set():
                    t = time.perf_counter()
                    h.ping()
                    waits.append(time.perf_counter() - t)
                    time.sleep(0.01)

        th = threading.Thread(target=honest)
        th.start()
        time.sleep(0.2)
        t = time.perf_counter()
        result = c.evict(match_buffers="zzz")  # the pools' names, then the disk's
        took = time.perf_counter() - t
        done.set()
        th.join()
        assert (result.count, result.on_disk) == (1, 1)
        assert not c.exists("target") and c.exists("k0") and c.exists("p0")
    assert took > 0.2, "the scan was too quick to show anything: make it bigger"
    assert max(waits) < took / 3, f"a ping waited {max(waits):.2f} s of the {took:.2f} s evict"
