"""Crash safety: clients and the daemon killed with SIGKILL at random points.

- Writers and readers (forked processes) are killed at random moments, over and over:
  afterwards no byte is leaked (the pools hold exactly the sealed objects' extents) and no
  partial object is visible (every object's bytes are the pattern its key derives).
- The daemon is killed mid-traffic and started again: every object sealed before the kill is
  intact (checked against the checksums recorded at seal and the key's pattern), and the
  clients carry on by themselves.

``KVBROKER_CRASH_CYCLES`` sets the number of client kills (default 1000).
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import time

import numpy as np
import pytest

from conftest import DaemonProcess
from kvbroker import Client, KVBrokerError, LeaseExpired, NotFound
from kvbroker._wire.objects import BUFFER_ALIGN

CYCLES = int(os.environ.get("KVBROKER_CRASH_CYCLES", "1000"))
PAGE = 4096
KEYS = 96  # writers reuse a small key space: replace, evict and claim all collide


def pattern(key: str, n: int) -> np.ndarray:
    """The bytes an object under ``key`` must hold: its key's digest, repeated."""
    digest = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=32).digest(), np.uint8)
    return np.resize(digest, n)


def size_of(key: str) -> int:
    return 1 + int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % (
        48 * 1024
    )


def extent_bytes(buffer_sizes: list[int]) -> int:
    """Pool bytes an object of these buffers holds: aligned buffers, then whole pages."""
    span = sum(-(-n // BUFFER_ALIGN) * BUFFER_ALIGN for n in buffer_sizes)
    return -(-max(span, 1) // PAGE) * PAGE


def _writer(sock: str, rng: random.Random, report: int) -> None:
    c = Client(sock, reconnect=0)
    while True:
        key = f"k{rng.randrange(KEYS)}"
        n = size_of(key)
        data = pattern(key, n)
        mode = rng.random()
        try:
            if mode < 0.5:
                c.put(
                    key, {"kv": data[: n // 2], "tail": data[n // 2 :]}, replace=rng.random() < 0.3
                )
            else:
                # Write slowly, in pieces, so that a kill lands mid-write often.
                with c.reserve(
                    key, {"kv": n // 2, "tail": n - n // 2}, replace=rng.random() < 0.3
                ) as lease:
                    lease["kv"][:] = data[: n // 2]
                    time.sleep(rng.random() * 0.002)
                    lease["tail"][:] = data[n // 2 :]
        except KVBrokerError:
            pass  # exists / pool full: the space of keys is small on purpose


def _reader(sock: str, rng: random.Random, report: int) -> None:
    c = Client(sock, reconnect=0)
    while True:
        key = f"k{rng.randrange(KEYS)}"
        try:
            lease = c.claim(key, consume=rng.random() < 0.2)
        except NotFound:
            continue
        n = size_of(key)
        got = np.concatenate([lease["kv"], lease["tail"]])
        if got.nbytes != n or not np.array_equal(got, pattern(key, n)):
            os.write(report, f"mismatch {key}\n".encode())
        time.sleep(rng.random() * 0.001)  # killed while holding the lease, sometimes
        lease.release()


def _spawn(role, sock: str, seed: int, report: int) -> int:
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            role(sock, random.Random(seed), report)
        finally:
            os._exit(0)
    return pid


def _check_pools(c: Client) -> int:
    """Every visible object is whole; the pools hold exactly their extents. Returns count."""
    objs = c.list(limit=10_000)
    want = 0
    for o in objs:
        with c.claim(o.key, namespace=o.namespace, verify=True) as lease:
            sizes = [lease[name].nbytes for name in lease]
            got = np.concatenate([lease["kv"], lease["tail"]])
            assert np.array_equal(got, pattern(o.key, size_of(o.key))), o.key
        want += extent_bytes(sizes)
    st = c.stat()
    assert st.pools[0].leased_write == 0 and st.pools[0].quarantined == 0
    assert st.used == want, (st.used, want)
    return len(objs)


def test_sigkill_writers_and_readers_leak_nothing(daemon_small, tmp_path):
    sock = daemon_small.socket_path
    rd, wr = os.pipe()
    os.set_blocking(rd, False)
    rng = random.Random(8)
    live: dict[int, float] = {}  # pid -> kill at
    kills = 0
    mismatches = []
    t0 = time.monotonic()
    try:
        while kills < CYCLES:
            while len(live) < 4:
                role = _writer if rng.random() < 0.6 else _reader
                pid = _spawn(role, sock, rng.randrange(1 << 30), wr)
                live[pid] = time.monotonic() + rng.random() * 0.05
            now = time.monotonic()
            for pid, at in list(live.items()):
                if at <= now:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    del live[pid]
                    kills += 1
            if select.select([rd], [], [], 0)[0]:
                mismatches.append(os.read(rd, 65536).decode())
            time.sleep(0.002)
    finally:
        for pid in live:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    elapsed = time.monotonic() - t0
    try:
        mismatches.append(os.read(rd, 65536).decode())
    except BlockingIOError:
        pass
    assert not "".join(mismatches), "".join(mismatches)
    # The daemon notices the dead connections; then only sealed objects may hold pages.
    with Client(sock) as c:
        deadline = time.monotonic() + 60
        while len(c.stat().clients) > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        n = _check_pools(c)
        st = c.stat()
        print(
            f"\n{kills} client kills in {elapsed:.1f} s; {n} objects left, "
            f"{st.counters.publishes} publishes, {st.counters.claims} claims"
        )
        assert st.counters.publishes > CYCLES // 10  # the workers did real work
        c.evict(all=True)
        assert c.stat().used == 0
    assert daemon_small.proc.poll() is None


@pytest.fixture
def daemon_small(socket_path):
    d = DaemonProcess(socket_path, "--pool-size", "8M", "--page-size", "4K", "--lease-ttl", "5s")
    yield d
    assert d.stop() == 0, d.log()


# -- the daemon killed mid-traffic ---------------------------------------------------------
def _traffic(sock: str, wid: int, ops: int, done: int) -> None:
    """Publish unique keys and read them back until ``ops`` succeeded after a restart;
    reports every key whose put returned (sealed), then 'ok'/'fail ...'."""
    c = Client(sock, reconnect=15)
    rng = random.Random(wid)
    restarted_ok = 0
    i = 0
    errors = 0
    try:
        while restarted_ok < ops:
            key = f"w{wid}-{i}"
            n = 1 + rng.randrange(32 * 1024)
            try:
                if c.put(
                    key, {"kv": pattern(key, n // 2), "tail": pattern(key + "/t", n - n // 2)}
                ):
                    os.write(done, f"sealed {key} {n}\n".encode())
                    i += 1
                back = c.get(f"w{wid}-{rng.randrange(i)}", verify=True) if i else None
                if back is not None and back["kv"].nbytes == 0 and back["tail"].nbytes == 0:
                    raise AssertionError("empty object")
            except LeaseExpired:
                errors += 1  # a put in flight when the daemon died: do it again
                if errors > 50:
                    raise
                continue
            if c.restarts:
                restarted_ok += 1
        os.write(done, f"ok {wid} {c.restarts} {errors}\n".encode())
    except BaseException as exc:
        os.write(done, f"fail {wid} {type(exc).__name__}: {exc}\n".encode())
    finally:
        os._exit(0)


def test_sigkill_daemon_mid_traffic_every_sealed_object_survives(socket_path):
    # Roomy enough that nothing is evicted: every acknowledged put must still be there.
    args = ("--pool-size", "256M", "--page-size", "4K")
    d = DaemonProcess(socket_path, *args)
    rd, wr = os.pipe()
    workers = []
    for wid in range(4):
        pid = os.fork()
        if pid == 0:
            os.close(rd)
            _traffic(socket_path, wid, 40, wr)
        workers.append(pid)
    os.close(wr)
    lines: list[str] = []
    buf = b""

    def drain(timeout: float) -> None:
        nonlocal buf
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if select.select([rd], [], [], 0.05)[0]:
                chunk = os.read(rd, 65536)
                if not chunk:
                    return
                buf += chunk
                *whole, buf = buf.split(b"\n")
                lines.extend(w.decode() for w in whole)

    try:
        deadline = time.monotonic() + 30
        while sum(ln.startswith("sealed") for ln in lines) < 200:  # traffic flows
            assert time.monotonic() < deadline and not any(ln.startswith("fail") for ln in lines), (
                lines[-5:]
            )
            drain(0.1)
        sealed_before = [ln for ln in lines if ln.startswith("sealed")]
        with Client(socket_path, map_pools=False) as probe:
            assert probe.stat().counters.evictions == 0, "the pool is too small for this test"
        d.stop(signal.SIGKILL)
        # pages lent for writing at the kill are quarantined this long (restart_quarantine)
        d2 = DaemonProcess(socket_path, *args, env={"KVBROKER_RESTART_QUARANTINE": "1"})
        deadline = time.monotonic() + 60
        while sum(ln.startswith(("ok", "fail")) for ln in lines) < len(workers):
            assert time.monotonic() < deadline, lines[-5:]
            drain(0.2)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
    assert not [ln for ln in lines if ln.startswith("fail")], lines
    assert all(int(ln.split()[2]) == 1 for ln in lines if ln.startswith("ok"))  # one restart
    with Client(socket_path) as c:
        assert c.epoch == 2
        sealed = [ln.split() for ln in lines if ln.startswith("sealed")]
        for _, key, n in sealed:  # before and after the kill: every acknowledged put
            n = int(n)
            got = c.get(key, verify=True)  # checksums recorded at seal
            assert np.array_equal(got["kv"], pattern(key, n // 2)), key
            assert np.array_equal(got["tail"], pattern(key + "/t", n - n // 2)), key
        deadline = time.monotonic() + 20
        while c.stat().pools[0].quarantined and time.monotonic() < deadline:
            time.sleep(0.05)
        st = c.stat()
        assert st.pools[0].quarantined == 0
        assert st.counters.evictions == 0
        assert st.objects == len(sealed)
        assert st.pools[0].leased_write == 0
        assert st.used == sum(
            extent_bytes([int(n) // 2, int(n) - int(n) // 2]) for _, _, n in sealed
        )
    print(
        f"\n{len(sealed_before)} objects sealed before the kill, {len(sealed)} in all, "
        "all intact after the restart"
    )
    assert d2.stop() == 0
