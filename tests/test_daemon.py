"""The daemon over its socket, with clients in other processes."""

import multiprocessing as mp
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

from kvbroker import (
    BadRequest,
    BrokerUnavailable,
    Client,
    Exists,
    LeaseExpired,
    NotFound,
    PoolFull,
    Timeout,
)
from kvbroker._wire.protocol import MAX_REQUEST

SIZES = [1024, 64 * 1024, 1 << 20, 32 << 20, 256 << 20]


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _publisher(sock: str, sizes: list[int], ready) -> None:
    with Client(sock, role="prefill") as c:
        for i, n in enumerate(sizes):
            c.put(f"obj-{n}", {"kv": _pattern(n, i), "tail": _pattern(17, i + 100)})
    ready.set()


def test_two_processes_exchange_1k_to_256m(make_daemon):
    d = make_daemon("--pool-size", "768M")
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_publisher, args=(d.socket_path, SIZES, ready))
    p.start()
    p.join(120)
    assert p.exitcode == 0 and ready.is_set()
    with d.client(role="decode") as c:
        for i, n in enumerate(SIZES):
            with c.claim(f"obj-{n}", consume=True) as lease:
                assert lease["kv"].nbytes == n
                assert np.array_equal(lease["kv"], _pattern(n, i))
                assert np.array_equal(lease["tail"], _pattern(17, i + 100))
        assert c.stat().used == 0  # every object consumed


def _hold_leases_then_hang(sock: str, ready) -> None:
    c = Client(sock)
    c.put("victim", {"x": b"a" * 100000})
    w = c.reserve("half-written", {"x": 1 << 20})
    w["x"][:10] = 1
    c.claim("victim")
    ready.set()
    time.sleep(60)


def test_sigkill_with_leases_leaves_pool_as_before(daemon):
    with daemon.client() as c:
        c.put("keep", {"x": b"k" * 5000})
        before = c.stat()
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        p = ctx.Process(target=_hold_leases_then_hang, args=(daemon.socket_path, ready))
        p.start()
        assert ready.wait(30)
        mid = c.stat()
        assert mid.write_leases == 1 and mid.read_leases == 1
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        # The daemon ends the dead connection's leases when it reads the EOF: soon, but on a
        # loaded machine not within any fixed second.
        deadline = time.monotonic() + 10
        while True:
            after = c.stat()
            if after.write_leases == after.read_leases == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert after.write_leases == 0 and after.read_leases == 0
        assert after.pending == 0 and len(after.clients) == 1
        # the object it sealed stays published; its half-written one is gone
        assert c.exists("victim") and c.exists("keep") and not c.exists("half-written")
        c.evict("victim")
        assert c.stat().pools[0].used == before.pools[0].used


def test_reserve_view_fill_and_seal_on_exit(client):
    with client.reserve("r", {"past_key.0": 4096, "past_value.0": 4096}) as w:
        w["past_key.0"][:] = 7
        w["past_value.0"][:] = 9
    with client.claim("r") as r:
        assert (r["past_key.0"] == 7).all() and (r["past_value.0"] == 9).all()
        with pytest.raises(ValueError):
            r["past_key.0"][0] = 1  # read-only view


def test_close_lands_pipelined_releases_before_returning(daemon, client):
    # A consume-claim's release is pipelined (its reply read by the next call). Closing the
    # client must still land it: once close returns, every other client sees the key freed.
    for i in range(20):
        client.put(f"once-{i}", {"x": b"kv"}, consumers=1)
        with Client(daemon.socket_path) as decoder:
            with decoder.claim(f"once-{i}", consume=True) as lease:
                assert bytes(lease["x"]) == b"kv"
            assert decoder._session._unanswered  # the release went out unanswered...
        assert not decoder._session._unanswered  # ...and close read its reply
        assert not client.exists(f"once-{i}")


def test_exception_in_reserve_block_aborts(client):
    with pytest.raises(RuntimeError):
        with client.reserve("boom", {"x": 4096}):
            raise RuntimeError("engine failed mid-write")
    assert not client.exists("boom")
    assert client.stat().pending == 0


def test_put_existing_key_copies_nothing_unless_replace(client):
    assert client.put("k", {"x": b"one"})
    assert client.put("k", {"x": b"two"}) is False
    assert bytes(client.get("k")["x"]) == b"one"
    assert client.put("k", {"x": b"three"}, replace=True)
    assert bytes(client.get("k")["x"]) == b"three"
    with pytest.raises(Exists):
        client.reserve("k", {"x": 1})


def test_put_torch_and_strided_numpy_bit_exact(client):
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    strided = np.arange(64 * 3, dtype=np.float16).reshape(64, 3)[:, 1]
    client.put("t", {"bf16": t, "strided": strided, "nc": t.transpose(0, 2)})
    out = {"bf16": torch.empty_like(t)}
    got = client.get("t", out)
    assert torch.equal(got["bf16"].view(torch.int16), t.view(torch.int16))
    assert np.array_equal(got["strided"].view(np.float16), strided)
    nc = torch.from_numpy(got["nc"]).view(torch.bfloat16).view(16, 8, 4)
    assert torch.equal(nc.view(torch.int16), t.transpose(0, 2).contiguous().view(torch.int16))


def test_claim_wait_then_timeout(daemon):
    with daemon.client() as c:
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            c.claim("never", wait=0.3)
        # it waited, then the daemon ended the wait (not the client's 30 s call timeout)
        assert 0.25 < time.monotonic() - t0 < 20
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_late_publisher, args=(daemon.socket_path,))
        p.start()
        with c.claim("late", wait=20) as lease:
            assert bytes(lease["x"]) == b"late!"
        p.join(10)


def _late_publisher(sock):
    time.sleep(0.3)
    with Client(sock) as c:
        c.put("late", {"x": b"late!"})


def test_errors_are_typed(client):
    with pytest.raises(NotFound):
        client.claim("missing")
    client.put("x", {"b": b"1"})
    with pytest.raises(BadRequest, match="bad regex"):
        client.claim("x", select="(")
    with pytest.raises(PoolFull, match="larger than any pool"):
        client.reserve("huge", {"x": 1 << 40})
    assert client.stat().read_leases == 0


def test_lease_expiry_and_fencing_over_the_wire(make_daemon):
    d = make_daemon("--pool-size", "16M", "--lease-ttl", "0.3s")
    with d.client() as c:
        c.put("k", {"x": b"abc"})
        lease = c.claim("k")
        time.sleep(0.8)
        with pytest.raises(LeaseExpired):
            lease.release()
        w = c.reserve("slow", {"x": 1 << 20})
        time.sleep(0.8)
        with pytest.raises(LeaseExpired):
            w.seal()
        s = c.stat()
        assert s.pools[0].quarantined >= 1 << 20 and not c.exists("slow")
    with d.client() as c:
        assert c.stat().pools[0].quarantined == 0  # freed when the writer's connection ended


def _hammer(sock, idx, n, errors):
    try:
        with Client(sock) as c:
            for i in range(n):
                data = _pattern(1000 + i, idx * 1000 + i)
                c.put(f"c{idx}-{i}", {"x": data})
                with c.claim(f"c{idx}-{i}", consume=True) as r:
                    if not np.array_equal(r["x"], data):
                        errors.put(f"client {idx}: bytes differ at {i}")
    except Exception as exc:  # reported to the parent
        errors.put(f"client {idx}: {exc!r}")


def test_concurrent_clients(daemon):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_hammer, args=(daemon.socket_path, i, 150, errors)) for i in range(6)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert errors.empty(), errors.get()
    with daemon.client() as c:
        s = c.stat()
        assert s.objects == 0 and s.pools[0].used == 0
        assert s.counters.publishes == 900 and s.counters.claims == 900


def _raw(sock_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(sock_path)
    return s


def _replies(s, n=1):
    u = msgpack.Unpacker(raw=False)
    out = []
    while len(out) < n:
        data = s.recv(65536)
        if not data:
            break
        u.feed(data)
        out.extend(u)
    return out


def test_malformed_frames_never_hurt_the_daemon_or_others(daemon):
    with daemon.client() as good:
        good.put("safe", {"x": b"safe"})
        lease = good.claim("safe")
        # unknown op, wrong types, non-map request: error replies, connection stays usable
        s = _raw(daemon.socket_path)
        s.sendall(msgpack.packb({"id": 1, "op": "hello", "args": {"version": 1}}))
        assert _replies(s)[0]["ok"]
        for bad in (
            {"id": 2, "op": "nope", "args": {}},
            {"id": 3, "op": "claim", "args": {"key": 7}},
            {"id": 4, "op": "reserve", "args": {"key": "k", "buffers": [1, 2]}},
            [1, 2, 3],
            {"id": "x", "op": "stat"},
        ):
            s.sendall(msgpack.packb(bad))
            r = _replies(s)[0]
            assert r["ok"] is False and r["error"]["code"] == "bad_request", r
        s.sendall(msgpack.packb({"id": 9, "op": "stat", "args": {}}))
        assert _replies(s)[0]["ok"]
        # undecodable bytes: protocol error and a clean disconnect
        s.sendall(b"\xc1\xc1\xc1")
        r = _replies(s)
        assert r and r[0]["error"]["code"] == "protocol"
        assert s.recv(100) == b""
        s.close()
        # oversized frame (a str header claiming 64 MiB, then more than the request limit)
        s = _raw(daemon.socket_path)
        try:
            s.sendall(b"\xdb" + struct.pack(">I", 64 << 20) + b"a" * (MAX_REQUEST + 65536))
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = _replies(s)
        assert (
            r and r[0]["error"]["code"] == "protocol" and "size limit" in r[0]["error"]["message"]
        )
        s.close()
        # the good client and its lease are untouched
        assert bytes(lease["x"]) == b"safe"
        lease.release()
        assert good.exists("safe") and good.stat().counters.errors >= 5


def test_requests_before_hello_are_refused(daemon):
    s = _raw(daemon.socket_path)
    s.sendall(msgpack.packb({"id": 1, "op": "stat", "args": {}}))
    r = _replies(s)[0]
    assert r["error"]["code"] == "protocol" and "hello" in r["error"]["message"]
    s.close()


def test_peer_credentials_recorded(client):
    me = [c for c in client.stat().clients if c.session == client.session_id][0]
    assert (me.pid, me.uid, me.gid) == (os.getpid(), os.getuid(), os.getgid())


def test_unavailable_names_the_socket(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(BrokerUnavailable, match="nobody.sock"):
        Client(path)


def test_second_daemon_refused_and_stale_socket_removed(daemon, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--socket",
            daemon.socket_path,
            "--pool-size",
            "4M",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1 and "another kvbroker daemon" in r.stderr
    # a stale socket file (no listener, no lock holder) is replaced
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    from tests.conftest import DaemonProcess

    d = DaemonProcess(stale, "--pool-size", "4M")
    with Client(stale) as c:
        assert c.stat().pid == d.proc.pid
    assert d.stop() == 0


def test_sigterm_ends_leases_and_unlinks_segments(make_daemon):
    d = make_daemon("--pool-size", "8M", "--pools", "2")
    with d.client() as c:
        names = [p["name"] for p in c.pools]
        c.put("k", {"x": b"1"})
        c.claim("k")
        assert all(os.path.exists("/dev/shm" + n) for n in names)
        assert os.path.exists(d.socket_path + ".lock")
        assert d.stop(signal.SIGTERM) == 0
    assert not any(os.path.exists("/dev/shm" + n) for n in names)
    assert not os.path.exists(d.socket_path)
    # a clean stop leaves nothing beside the socket: no lock file, no journal
    assert os.listdir(os.path.dirname(d.socket_path)) == ["kvb.log"]


def test_a_refused_start_says_why_first_in_human_units_and_leaves_nothing(tmp_path):
    sock = str(tmp_path / "k.sock")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--config",
            "/dev/null",
            "--socket",
            sock,
            "--pool-size",
            "900000G",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "ERROR" in lines[0] and "cannot reserve 878.9 TiB of shared memory" in lines[0]
    assert re.search(r"/dev/shm has [\d.]+ [KMGT]i?B free", lines[0]), lines[0]
    assert lines[-1].endswith("INFO kvbroker.daemon: stopped")
    assert sum("ERROR" in line for line in lines) == 1  # said once
    assert os.listdir(tmp_path) == []  # no <socket>.lock left behind
    # a metrics port in use: the same one-line refusal, not an internal error
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--config",
            "/dev/null",
            "--socket",
            sock,
            "--pool-size",
            "4M",
            "--metrics",
            f"127.0.0.1:{taken.getsockname()[1]}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    taken.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr
    assert "ERROR" in lines[0] and "cannot serve metrics on 127.0.0.1:" in lines[0], r.stderr
    assert lines[-1].endswith("INFO kvbroker.daemon: stopped")
    assert os.listdir(tmp_path) == []


def test_sigkilled_daemon_segments_reclaimed_by_next_one(make_daemon, tmp_path):
    d = make_daemon("--pool-size", "4M")
    with d.client(map_pools=False) as c:
        names = [p["name"] for p in c.pools]
    d.stop(signal.SIGKILL)
    assert all(os.path.exists("/dev/shm" + n) for n in names)
    from tests.conftest import DaemonProcess

    # The next daemon adopts them (warm restart, tests/test_restart.py); a cold one drops
    # them, and so does the adopting one when it stops cleanly.
    d2 = DaemonProcess(d.socket_path, "--pool-size", "4M", "--cold")
    assert not any(os.path.exists("/dev/shm" + n) for n in names)
    assert d2.stop() == 0


def test_pool_mapped_once_per_process(daemon):
    from kvbroker._client import client as _client

    with daemon.client() as a, daemon.client() as b:
        name = a.pools[0]["name"]
        assert a._mapping(0) is b._mapping(0)
        assert _client._process_maps.holders()[name] == 2
    assert name not in _client._process_maps.holders()


def test_threads_mapping_a_pool_at_once_hold_it_once_and_give_it_back(daemon, monkeypatch):
    """Two threads of one client (a vLLM worker's loader and its step) asking for a pool
    they have not mapped yet: it is held once, and unmapped when the client closes."""
    import threading

    from kvbroker._client import client as _client
    from kvbroker._client import mappings

    acquire = mappings.process_maps.acquire
    both_in = threading.Barrier(2, timeout=2)

    def slow_acquire(key, create):
        try:
            both_in.wait()  # without the client's lock, both threads get here
        except threading.BrokenBarrierError:
            pass  # with it, the second waits outside
        return acquire(key, create)

    monkeypatch.setattr(mappings.process_maps, "acquire", slow_acquire)
    with daemon.client(map_pools=False) as c:
        name = c.pools[0]["name"]
        got = []
        threads = [threading.Thread(target=lambda: got.append(c._mapping(0))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got[0] is got[1]
        assert _client._process_maps.holders()[name] == 1
    assert name not in _client._process_maps.holders()
