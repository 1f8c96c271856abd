"""Two daemons on this host pulling from each other through NIXL (issue 18, phase 2).

Each daemon has its own socket and its own control port on 127.0.0.1; bytes move with one NIXL
READ over UCX TCP. What is checked:

- a remote claim (``claim(..., peer=)``, ``get``) bit-exact, metadata travelling (meta,
  consumers, checksums), never pulled twice, concurrent claims sharing one pull, a consume
  counted on the owner, ``exists``/``lookup`` with a peer moving nothing, a prefix match
  pulling every missing block in one pull, ``fetch``;
- failures ending cleanly, with nothing sealed on B and no lease left on A: peer down,
  wrong token, a byte corrupted in A's pool (ChecksumMismatch naming the peer), A's lease
  expired before the release (TransferFailed), B's pool full (PoolFull), A SIGKILLed
  mid-READ (and B pulling again from A restarted warm, which holds no lease);
- KV events from a daemon: 10,000 prefix blocks published then evicted, decoded with vLLM's
  own ``KVEventBatch``, every BlockStored/BlockRemoved in order, the start filled by replay;
- the same pull across two network namespaces joined by a veth pair (root and ``ip``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvbroker import Client
from kvbroker.errors import (
    ChecksumMismatch,
    NotFound,
    PeerUnavailable,
    PoolFull,
    TransferFailed,
)
from kvbroker.prefix import PrefixCache
from kvbroker.testing import DaemonProcess, drop_leftover_pools

try:
    from kvbroker._server.transfer import load_nixl

    load_nixl()
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"NIXL not installed ({e}): pip install 'kvbroker[transfer]'",
                allow_module_level=True)

TOKEN = b"fleet-test-token-0123456789"


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet", numbered=True)
    tok = d / "token"
    tok.write_bytes(TOKEN)
    tok.chmod(0o600)
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """A daemon of the fleet: its own socket, and a control port when it serves."""

    def __init__(self, base, name: str, *, listen: bool = True, token=None, port: int = 0,
                 pool: str = "128M", extra_env: dict | None = None, args=()) -> None:
        self.dir = base / name
        self.dir.mkdir(exist_ok=True)
        self.name = name
        self.port = port or (_free_port() if listen else 0)
        env = {"UCX_TLS": "tcp", "KVBROKER_TRANSFER_NODE": name,
               "KVBROKER_TRANSFER_TOKEN_FILE": str(token or base / "token"),
               "KVBROKER_TRANSFER_LISTEN": f"127.0.0.1:{self.port}" if listen else "off",
               **(extra_env or {})}
        self.env = env
        self.args = ("--pool-size", pool, "--page-size", "4K", *args)
        self.proc = DaemonProcess(str(self.dir / "kvb.sock"), *self.args, env=env,
                                  ready_timeout=60)
        self.address = f"127.0.0.1:{self.port}"

    def client(self, **kw) -> Client:
        return self.proc.client(**kw)

    def stat(self):
        with self.client(map_pools=False) as c:
            return c.stat()

    def restart(self) -> None:
        self.proc.stop()
        self.proc = DaemonProcess(str(self.dir / "kvb.sock"), *self.args, env=self.env,
                                  ready_timeout=60)

    def stop(self) -> int:
        running = self.proc.proc.poll() is None
        rc = self.proc.stop()
        drop_leftover_pools(self.proc.socket_path)
        return rc if running else 0


@pytest.fixture(scope="module")
def pair(fleet_dir):
    a = Node(fleet_dir, "node-a")
    b = Node(fleet_dir, "node-b", extra_env={"KVBROKER_TRANSFER_PEERS": a.address})
    yield a, b
    assert b.stop() == 0, b.proc.log()
    assert a.stop() == 0, a.proc.log()


def _data(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _nothing_left(a: Node, b: Node, key: str | None = None, ns: str = "default") -> None:
    """No lease held on A for peers, nothing half-written on B, no pull in flight."""
    sa, sb = a.stat(), b.stat()
    assert sa.transfer.leases_served == 0, sa.leases
    assert sb.pending == 0 and sb.write_leases == 0
    assert sb.transfer.in_flight == 0
    if key is not None:
        with b.client(map_pools=False) as c:
            assert not c.exists(key, namespace=ns)


# -- what works -------------------------------------------------------------------------------

def test_remote_claim_bit_exact_metadata_travels_and_never_twice(pair):
    a, b = pair
    x, y = _data(32 << 20, 1), _data(1000, 2)
    with a.client() as ca, b.client() as cb:
        ca.put("obj", {"x": x, "y": y}, meta={"layer": 7}, consumers=3)
        before = b.stat().transfer.pulls
        with cb.claim("obj", peer=a.address, verify=True) as lease:
            assert np.array_equal(lease["x"], x) and np.array_equal(lease["y"], y)
            assert lease.meta == {"layer": 7}
        info = cb.lookup("obj")
        assert info.meta == {"layer": 7}
        assert info.checksums == ca.lookup("obj").checksums  # sealed there, verified here
        got = cb.get("obj", peer=a.address, verify=True)  # here now: not pulled again
        assert np.array_equal(got["x"], x)
        assert cb.fetch("obj", a.address)["fetched"] is False
        st = b.stat().transfer
        assert st.pulls == before + 1 and st.bytes_pulled >= x.nbytes
        assert st.peers[0].node == "node-a" and st.peers[0].connected
        sa = a.stat().transfer
        assert sa.serving >= 1 and sa.bytes_served >= x.nbytes
        cb.evict("obj")
        ca.evict("obj")
    _nothing_left(a, b)


def test_concurrent_claims_share_one_pull(pair):
    a, b = pair
    x = _data(8 << 20, 3)
    with a.client() as ca:
        ca.put("shared", {"x": x})
    before = b.stat().transfer.pulls
    results, errors = [], []

    def claim():
        try:
            with b.client() as c, c.claim("shared", peer=a.address) as lease:
                results.append(np.array_equal(lease["x"], x))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and results == [True] * 4
    assert b.stat().transfer.pulls == before + 1
    with a.client() as ca, b.client() as cb:
        ca.evict("shared")
        cb.evict("shared")
    _nothing_left(a, b)


def test_consume_counts_on_the_owner(pair):
    a, b = pair
    x = _data(1 << 20, 4)
    with a.client() as ca, b.client() as cb:
        ca.put("once", {"x": x}, consumers=1)
        with cb.claim("once", peer=a.address, consume=True) as lease:
            assert np.array_equal(lease["x"], x)
        assert not ca.exists("once"), "the consume must count on the owner"
        assert not cb.exists("once"), "the local copy was consumed too"
        ca.put("twice", {"x": x}, consumers=2)
        cb.get("twice", peer=a.address, consume=True)
        assert ca.lookup("twice") is not None  # one of two consumes left
        ca.evict("twice")
    _nothing_left(a, b)


def test_exists_and_lookup_with_a_peer_move_nothing(pair):
    a, b = pair
    with a.client() as ca, b.client() as cb:
        ca.put("there", {"x": b"abc"}, meta={"m": 1})
        before = b.stat().transfer.pulls
        assert cb.exists("there", peer=a.address)
        assert cb.lookup("there", peer=a.address).meta == {"m": 1}
        assert not cb.exists("there")
        assert not cb.exists("nowhere", peer=a.address)
        assert b.stat().transfer.pulls == before
        with pytest.raises(NotFound, match="node|peer|not published"):
            cb.claim("nowhere", peer=a.address)
        ca.evict("there")
    _nothing_left(a, b)


def test_prefix_match_pulls_the_missing_blocks_in_one_pull(pair):
    a, b = pair
    bs = 16
    tokens = list(range(1000, 1000 + 12 * bs + 1))
    blocks = [{"k": _data(8192, 100 + i), "v": _data(8192, 200 + i)} for i in range(12)]
    with a.client() as ca, b.client() as cb:
        pa, pb = PrefixCache(ca, block_size=bs), PrefixCache(cb, block_size=bs)
        assert pa.publish(tokens, blocks) == 12
        assert pb.publish(tokens[: 3 * bs], blocks[:3]) == 3  # B holds the first 3 itself
        before = b.stat().transfer
        with pb.match(tokens, peer=a.address) as m:
            assert m.num_blocks == 12
            for i, blk in enumerate(m.blocks):
                assert np.array_equal(blk["k"], blocks[i]["k"])
                assert np.array_equal(blk["v"], blocks[i]["v"])
        after = b.stat().transfer
        assert after.pulls == before.pulls + 1  # 9 blocks, one pin, one READ
        assert after.bytes_pulled - before.bytes_pulled == 9 * 2 * 8192
        with pb.match(tokens, peer=a.address) as m:  # all here now: nothing moves
            assert m.num_blocks == 12
        assert b.stat().transfer.pulls == after.pulls
        ca.evict(namespace="prefix", all=True)
        cb.evict(namespace="prefix", all=True)
    _nothing_left(a, b)


def test_fetch_command_stat_and_prometheus(pair):
    from typer.testing import CliRunner

    from kvbroker._server.metrics import BrokerCollector
    from kvbroker.cli import app

    a, b = pair
    with a.client() as ca:
        ca.put("cli", {"x": _data(1 << 20, 9)})
    sock = b.proc.socket_path
    r = CliRunner().invoke(app, ["fetch", "cli", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 0 and "pulled default/cli (1.0 MiB) from" in r.output, r.output
    r = CliRunner().invoke(app, ["fetch", "cli", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 0 and "here already" in r.output, r.output
    r = CliRunner().invoke(app, ["fetch", "nope", "--peer", a.address, "--socket", sock])
    assert r.exit_code == 1 and "not_found" in r.output
    r = CliRunner().invoke(app, ["stat", "--socket", sock])
    assert f"peer {a.address} (node-a): connected" in r.output, r.output
    metrics = {m.name: m for m in BrokerCollector(b.stat).collect()}
    assert metrics["kvbroker_pulled_bytes"].samples[0].value >= 1 << 20
    assert {s.labels["code"] for s in metrics["kvbroker_pull_failures"].samples} >= {"not_found"}
    assert metrics["kvbroker_peer_up"].samples[0].labels["node"] == "node-a"
    served = {m.name: m for m in BrokerCollector(a.stat).collect()}
    assert served["kvbroker_served_bytes"].samples[0].value >= 1 << 20
    assert served["kvbroker_peer_leases"].samples[0].value == 0
    with a.client() as ca, b.client() as cb:
        ca.evict("cli")
        cb.evict("cli")
    _nothing_left(a, b)


# -- failures end cleanly ----------------------------------------------------------------------

def test_peer_down_is_peer_unavailable(pair):
    a, b = pair
    with b.client() as cb:
        with pytest.raises(PeerUnavailable, match=f"127.0.0.1:{_free_port()}|unavailable"):
            cb.claim("k", peer=f"127.0.0.1:{_free_port()}")
    assert b.stat().transfer.failures_by_code.get("peer_unavailable", 0) >= 1
    _nothing_left(a, b)


def test_corrupt_byte_in_owner_pool_is_checksum_mismatch(pair):
    import mmap

    import posix_ipc

    a, b = pair
    x = _data(4 << 20, 5)
    with a.client() as ca, b.client() as cb:
        ca.put("bad", {"x": x})
        with ca.claim("bad") as lease:
            pool, offset, _ = lease._extents["x"]
        name = ca.pools[pool]["name"]
        shm = posix_ipc.SharedMemory(name)
        mm = mmap.mmap(shm.fd, ca.pools[pool]["size"])
        shm.close_fd()
        try:
            mm[offset + 12345] ^= 0x01  # one bit of A's pool, under its seal
            with pytest.raises(ChecksumMismatch, match=f"peer {a.address}"):
                cb.claim("bad", peer=a.address)
            assert not cb.exists("bad")
            mm[offset + 12345] ^= 0x01  # repaired: the next pull succeeds
            with cb.claim("bad", peer=a.address, verify=True) as lease:
                assert np.array_equal(lease["x"], x)
        finally:
            mm.close()
        cb.evict("bad")
        ca.evict("bad")
    _nothing_left(a, b)


def test_wrong_token_is_refused(pair, fleet_dir):
    a, _ = pair
    bad = fleet_dir / "bad-token"
    bad.write_bytes(b"not-the-fleet-token-at-all")
    bad.chmod(0o600)
    refused = a.stat().transfer.refused
    intruder = Node(fleet_dir, "intruder", listen=False, token=bad)
    try:
        with a.client() as ca, intruder.client() as ci:
            ca.put("secret", {"x": b"0123456789"})
            with pytest.raises(PeerUnavailable, match="wrong token"):
                ci.claim("secret", peer=a.address)
            assert not ci.exists("secret")
            ca.evict("secret")
        assert a.stat().transfer.refused == refused + 1
        assert a.stat().transfer.leases_served == 0
    finally:
        assert intruder.stop() == 0


def test_pool_full_on_the_puller(pair, fleet_dir):
    a, _ = pair
    small = Node(fleet_dir, "small", listen=False, pool="8M")
    try:
        with a.client() as ca, small.client() as cs:
            ca.put("big", {"x": _data(16 << 20, 6)})
            with pytest.raises(PoolFull):
                cs.claim("big", peer=a.address)
            assert not cs.exists("big")
            ca.evict("big")
        _nothing_left(a, small)
        assert small.stat().pools[0].used == 0
    finally:
        assert small.stop() == 0


def test_owner_lease_expired_before_release(pair, fleet_dir):
    """The pin's TTL (1 ms) passes during the READ: the owner says so at the release, and
    the puller seals nothing."""
    a, _ = pair
    hasty = Node(fleet_dir, "hasty", listen=False,
                 extra_env={"KVBROKER_TRANSFER_PIN_TTL": "1ms"})
    try:
        with a.client() as ca, hasty.client() as ch:
            ca.put("slow", {"x": _data(16 << 20, 7)})
            with pytest.raises(TransferFailed, match="lease ended"):
                ch.claim("slow", peer=a.address)
            assert not ch.exists("slow")
            assert ca.exists("slow")  # not consumed by a failed pull
            ca.evict("slow")
        _nothing_left(a, hasty)
        assert a.stat().counters.expired_leases >= 1
    finally:
        assert hasty.stop() == 0


def test_owner_killed_mid_read_then_restarted_warm(fleet_dir):
    a = Node(fleet_dir, "victim", pool="768M", args=("--keep-pools-on-exit",))
    b = Node(fleet_dir, "survivor", listen=False, pool="768M")
    try:
        x = _data(512 << 20, 8)
        with a.client() as ca:
            ca.put("huge", {"x": x})
        del x
        outcome = []

        def pull():
            try:
                with b.client() as cb, cb.claim("huge", peer=a.address):
                    outcome.append("sealed")
            except Exception as exc:  # noqa: BLE001
                outcome.append(exc)

        # A runs only in short slices until B holds the write lease its pin answer made, and
        # is stopped from then on: B cannot seal before A answers its release, so the kill
        # always lands mid-pull (the READ needs A's side progressing too), never after.
        victim = a.proc.proc
        victim.send_signal(signal.SIGSTOP)
        t = threading.Thread(target=pull)
        t.start()
        deadline = time.monotonic() + 120
        while b.stat().write_leases == 0:
            assert t.is_alive() and time.monotonic() < deadline, (outcome, b.proc.log())
            victim.send_signal(signal.SIGCONT)
            time.sleep(0.005)
            victim.send_signal(signal.SIGSTOP)
        assert b.stat().transfer.in_flight == 1
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        t.join(180)
        assert not t.is_alive(), "the pull hung after its peer died"
        assert len(outcome) == 1 and isinstance(outcome[0], (PeerUnavailable, TransferFailed)), \
            outcome
        with b.client(map_pools=False) as cb:
            assert not cb.exists("huge")
        sb = b.stat()
        assert sb.pending == 0 and sb.write_leases == 0 and sb.transfer.in_flight == 0
        a.restart()  # warm: the journal and pools of the killed daemon
        sa = a.stat()
        assert sa.objects == 1 and sa.read_leases == 0 and sa.transfer.leases_served == 0
        with b.client() as cb:
            cb.evict("huge")
            with cb.claim("huge", peer=a.address, verify=True) as lease:
                assert lease["x"][:4096].tobytes() == _data(4096, 8).tobytes()
        assert a.stat().read_leases == 0
    finally:
        assert b.stop() == 0
        a.stop()


# -- KV events ---------------------------------------------------------------------------------

@pytest.mark.vllm
def test_daemon_events_10k_blocks_in_order_with_vllm_classes(fleet_dir):
    zmq = pytest.importorskip("zmq")
    try:
        from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                                KVEventBatch)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"vLLM not importable ({type(e).__name__}: {e})")
    import msgspec

    from kvbroker._server.events import external_hash

    pub, rep = _free_port(), _free_port()
    node = Node(fleet_dir, "events", listen=False, pool="96M", extra_env={
        "KVBROKER_EVENTS_PUBLISH": f"tcp://*:{pub}",  # binds (a host connects)
        "KVBROKER_EVENTS_REPLAY": f"tcp://127.0.0.1:{rep}",
        "KVBROKER_EVENTS_FORMAT": "tagged", "KVBROKER_EVENTS_MODEL": "llama"})
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(f"tcp://127.0.0.1:{pub}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@events@llama")
    time.sleep(0.5)
    n, bs = 10_000, 4
    tokens = list(range(7, 7 + n * bs))
    try:
        with node.client() as c:
            pc = PrefixCache(c, block_size=bs, checksum=False)
            size = {"kv": 64}
            zero = {"kv": b"\0" * 64}
            assert pc.publish(tokens[: 5000 * bs], lambda i: zero, block_sizes=size) == 5000
            assert pc.publish(tokens, lambda i: zero, block_sizes=size) == 5000  # 2 requests
            keys = pc.keys(pc.hashes(tokens))
            assert c.evict(namespace="prefix", all=True).count == n
            c.evict(all=True)  # AllBlocksCleared

        batches: dict[int, bytes] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not sub.poll(1000):
                if batches and _complete(batches):
                    break
                continue
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@events@llama"
            batches[int.from_bytes(seq, "big")] = payload
        # What PUB sent before the subscription arrived (on a loaded machine, possibly all
        # of it): replay fills it.
        if min(batches, default=1) > 0:
            d = ctx.socket(zmq.DEALER)
            d.connect(f"tcp://127.0.0.1:{rep}")
            d.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert d.poll(10_000), "no replay reply"
                frames = d.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                batches.setdefault(int.from_bytes(frames[2], "big"), frames[3])
            d.close(linger=0)
        seqs = sorted(batches)
        assert seqs == list(range(len(seqs))), "a gap in sequence numbers"
        events = []
        for s in seqs:
            batch = msgspec.msgpack.decode(batches[s], type=KVEventBatch)
            events += batch.events
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert isinstance(events[0], AllBlocksCleared) and isinstance(events[-1], AllBlocksCleared)
        hashes = [external_hash(k) for k in keys]
        assert [e.block_hashes[0] for e in stored] == hashes
        assert [e.parent_block_hash for e in stored] == [None, *hashes[:-1]]
        assert all(e.token_ids == tokens[i * bs:(i + 1) * bs] and e.block_size == bs
                   and e.medium == "CPU" for i, e in enumerate(stored))
        assert removed == hashes[::-1]  # evicted leaf first, every one of them
        st = node.stat().events
        assert st.events_dropped == 0 and st.events_published == 2 * n + 2
    finally:
        sub.close(linger=0)
        assert node.stop() == 0


def _complete(batches) -> bool:
    import msgpack

    last = batches[max(batches)]
    evs = msgpack.unpackb(last)[1]
    return bool(evs) and evs[-1].get("type") == "AllBlocksCleared" and len(batches) > 2


# -- across a network stack: two namespaces, one veth pair -------------------------------------

def _netns_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (ip netns)")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) on this host")
    probe = subprocess.run(["ip", "netns", "add", "kvbprobe"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"ip netns does not work here: {probe.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", "kvbprobe"], capture_output=True)


def test_pull_across_two_network_namespaces(fleet_dir):
    """A in netns kvba (10.77.0.1), B in kvbb (10.77.0.2), one veth pair between them: the
    control channel and UCX's TCP both cross that link (A serves only B's address)."""
    _netns_or_skip()
    ip = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    tag = str(os.getpid() % 10000)
    na, nb = f"kvba{tag}", f"kvbb{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    procs = []
    try:
        ip("netns", "add", na)
        ip("netns", "add", nb)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", na)
        ip("link", "set", vb, "netns", nb)
        ip("-n", na, "addr", "add", "10.77.0.1/24", "dev", va)
        ip("-n", nb, "addr", "add", "10.77.0.2/24", "dev", vb)
        for ns, dev in ((na, va), (nb, vb)):
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        script = os.path.join(os.path.dirname(__file__), "_netns_node.py")
        env = dict(os.environ, UCX_TLS="tcp", PYTHONPATH=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))
        a = subprocess.Popen(["ip", "netns", "exec", na, sys.executable, script, "serve",
                              str(fleet_dir / "nsa"), str(fleet_dir / "token"), "10.77.0.1",
                              "10.77.0.2"], stdout=subprocess.PIPE, env=env, text=True)
        procs.append(a)
        assert a.stdout.readline().strip() == "ready", "the serving node did not start"
        b = subprocess.run(["ip", "netns", "exec", nb, sys.executable, script, "pull",
                            str(fleet_dir / "nsb"), str(fleet_dir / "token"), "10.77.0.2",
                            "10.77.0.1:7070"], capture_output=True, env=env, text=True,
                           timeout=300)
        assert b.returncode == 0, b.stdout + b.stderr
        assert "bit-exact" in b.stdout
        # the link saw the bytes: the veth pair's counters on A's side
        rx = subprocess.run(["ip", "-n", na, "-s", "link", "show", va], capture_output=True,
                            text=True).stdout
        tx_bytes = int(rx.split("TX:")[1].split("\n")[1].split()[0])
        assert tx_bytes >= 16 << 20, rx
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin = None
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        for ns in (na, nb):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
