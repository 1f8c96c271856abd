"""Protocol fuzzing: malformed and hostile frames against a live daemon.

While fuzzing connections send garbage (bad msgpack, wrong types, huge lengths, truncated
frames, unknown ops, valid ops with wrong or random arguments, requests before hello), a
well-behaved client keeps publishing and claiming and checks every byte. Afterwards the
daemon is alive, never answered ``internal`` (an unhandled exception), the other client saw
nothing wrong, and the pools hold exactly the sealed objects.

The argument generator reads the one table of ops (``_protocol.OPS``), so a new op is fuzzed
without touching this file. ``KVBROKER_FUZZ_FRAMES`` sets the number of random frames
(default 100000).
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbroker import BadRequest, Client, NotFound, PoolFull
from kvbroker._wire.objects import BUFFER_ALIGN
from kvbroker._wire.protocol import ERROR_CODES, OPS, PROTOCOL_VERSION, check_reply as declared

FRAMES = int(os.environ.get("KVBROKER_FUZZ_FRAMES", "100000"))
PAGE = 4096
KEYS = [f"f{i}" for i in range(16)] + ["", "x" * 600, "ключ", "a/b", "\x00"]
NAMES = ["kv", "past_key.0", "past_value.1_P", "past_key.x", "a b", "", "k" * 600]
REGEXES = [
    ".*",
    "kv",
    "past_(key|value)\\.\\d+",
    "(",
    "[z-a]",
    "a{99999}",
    "\\",
    "(?P<x",
    "x" * 2000,
]


# -- generators ----------------------------------------------------------------------------
def junk(rng: random.Random, depth: int = 0):
    """Any msgpack value, biased towards the edges (type confusion, extremes)."""
    r = rng.random()
    if r < 0.15:
        return rng.choice([None, True, False])
    if r < 0.35:
        return rng.choice(
            [0, -1, 1, 2**31, -(2**63), 2**63 - 1, 2**64 - 1, rng.randrange(-5, 1000)]
        )
    if r < 0.45:
        return rng.choice([0.0, -0.0, 1e308, float("inf"), float("-inf"), float("nan"), 0.5])
    if r < 0.65:
        return rng.choice(KEYS + NAMES + REGEXES)
    if r < 0.72:
        return rng.randbytes(rng.randrange(0, 64))
    if depth > 2:
        return None
    if r < 0.86:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {
        rng.choice(["key", "lease", "buffers", "x", ""]): junk(rng, depth + 1)
        for _ in range(rng.randrange(0, 4))
    }


def plausible(rng: random.Random, name: str, types: tuple, leases: list[int]):
    """A value of (usually) the right type for argument ``name``."""
    if name in ("lease", "arena") and int in types:
        return rng.choice(leases) if leases and rng.random() < 0.7 else rng.randrange(-2, 10**6)
    if name == "leases":
        return [
            rng.choice(leases) if leases and rng.random() < 0.7 else junk(rng)
            for _ in range(rng.randrange(0, 4))
        ]
    if name == "namespace":
        return rng.choice(["fuzz", "fuzz2", "", "x" * 600, None])
    if name == "key":
        return rng.choice(KEYS)
    if name == "keys":
        return [rng.choice(KEYS) for _ in range(rng.randrange(0, 6))]
    if name in ("select", "match", "match_buffers"):
        return rng.choice(REGEXES + [None])
    if name == "buffers":
        return {
            rng.choice(NAMES): rng.choice([0, 1, 100, 4096, 70_000, 1 << 40, -5, 2**63 - 1])
            for _ in range(rng.randrange(0, 4))
        }
    if name == "blocks":
        return [
            {
                "key": rng.choice(KEYS),
                "parent": rng.choice(KEYS + [None]),
                "buffers": plausible(rng, "buffers", (dict,), leases),
            }
            if rng.random() < 0.8
            else junk(rng)
            for _ in range(rng.randrange(0, 4))
        ]
    if name == "checksums":
        return rng.choice([None, {"kv": 1}, [1, 2], {}])
    if name == "wait":  # a claim waits on its own connection only: keep the waits short
        return rng.choice([None, 0, -1, 0.001, 0.01, float("nan")])
    if name in ("ttl", "interval", "older_than"):
        return rng.choice([None, 0, -1, 0.001, 0.05, 1, 1e9, float("nan")])
    t = rng.choice(types)
    if t is bool:
        return rng.random() < 0.5
    if t is int:
        return rng.choice([0, 1, 3, -1, 1 << 40])
    if t is float:
        return rng.random()
    if t is str:
        return rng.choice(KEYS + ["default", "prefix"])
    if t is type(None):
        return None
    return junk(rng)


def tame(op: str, args):
    """Keep what is legitimate but would stall the fuzzer or hit the honest client out of it:
    a long ``wait`` (a claim may wait on its own connection) and evicting all namespaces
    (an operator's act: the honest client's namespace is not the fuzzer's to free)."""
    if not isinstance(args, dict):
        return args
    wait = args.get("wait")
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0.01:
        args["wait"] = 0.01
    if op == "evict" and not isinstance(args.get("namespace"), str):
        args["namespace"] = "fuzz"
    if args.get("namespace") == "honest":
        args["namespace"] = "fuzz"
    return args


def request(rng: random.Random, rid: int, leases: list[int]) -> dict:
    op = rng.choice(list(OPS) + ["nope", "", "_op_hello", "handle", "__class__"])
    spec = OPS.get(op)
    args: dict = {}
    if spec is not None:
        for name, arg in spec.args.items():
            r = rng.random()
            if r < 0.75:
                args[name] = plausible(rng, name, arg.types, leases)
            elif r < 0.9:
                args[name] = junk(rng)
        if rng.random() < 0.05:
            args["unexpected"] = 1
    msg = {"id": rid, "op": op, "args": tame(op, args)}
    r = rng.random()
    if r < 0.03:
        msg["args"] = junk(rng)
    elif r < 0.05:
        msg["id"] = junk(rng)
    elif r < 0.06:
        del msg["op"]
    return msg


def fatal_frame(rng: random.Random) -> bytes:
    """Bytes after which the daemon must drop the connection (never crash)."""
    return rng.choice(
        [
            b"\xc1",  # the one byte msgpack never uses
            b"\xdb" + struct.pack(">I", 2**31) + b"xx",  # str32 claiming 2 GiB
            b"\xdd" + struct.pack(">I", 2**30),  # array32 of a billion items
            b"\xdf" + struct.pack(">I", 2**30),  # map32 likewise
            b"\xc6" + struct.pack(">I", 2**31),  # bin32 of 2 GiB
            b"\xd4\x01\x00",  # an ext type (not allowed)
            b"\x91" * 2000 + b"\xc0",  # nesting 2000 deep
            msgpack.packb({1: "int keys are refused", "id": 1}),
            rng.randbytes(rng.randrange(1, 200)),  # noise (often fatal, sometimes not)
        ]
    )


# -- the hostile connection ----------------------------------------------------------------
class Hostile:
    """One raw connection: sends batches of frames, drains whatever comes back."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(20)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.replies: list = []
        self.closed = False

    def exchange(self, data: bytes, expect: int) -> None:
        """Send ``data``; read until ``expect`` replies came back or the daemon hung up."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True
            return
        got = 0
        deadline = time.monotonic() + 20
        while got < expect:
            # Pushes (a fuzzed watch) keep coming: bound the whole wait, not each recv.
            assert time.monotonic() < deadline, f"{expect - got} request(s) not answered"
            try:
                chunk = self.sock.recv(1 << 20)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self.unpacker.feed(chunk)
            for msg in self.unpacker:
                if isinstance(msg, dict) and "push" in msg:
                    continue
                self.replies.append(msg)
                got += 1

    def finish(self, data: bytes) -> None:
        """Send a last (malformed or truncated) frame and hang up the sending side; the
        daemon must close the connection, whatever it makes of the frame."""
        try:
            self.sock.sendall(data)
            self.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 20
            while self.sock.recv(1 << 20):
                assert time.monotonic() < deadline, "the daemon kept a hung-up connection"
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.closed = True

    def close(self) -> None:
        self.sock.close()


def check_reply(msg, op: str | None = None) -> None:
    """A well-formed reply; a successful one to ``op`` (when known) is of the type the op
    table declares for it."""
    assert isinstance(msg, dict) and "ok" in msg, msg
    if not msg["ok"]:
        assert msg["error"]["code"] in ERROR_CODES, msg
        assert msg["error"]["code"] != "internal", msg  # an unhandled exception in the daemon
    elif op in OPS:
        reason = declared(op, msg["result"])
        assert reason is None, (reason, msg)


# -- the well-behaved client ---------------------------------------------------------------
def pattern(key: str, n: int) -> np.ndarray:
    digest = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=32).digest(), np.uint8)
    return np.resize(digest, n)


class Honest(threading.Thread):
    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.stop = threading.Event()
        self.ops = 0
        self.pressure = 0
        self.errors: list[str] = []

    def run(self) -> None:
        try:
            with Client(self.path, name="honest", reconnect=0) as c:
                i = 0
                while not self.stop.is_set():
                    key = f"honest-{i % 64}"
                    n = 1 + (i * 7919) % 20000
                    i += 1
                    try:
                        c.put(
                            key, {"kv": pattern(key + str(i), n)}, namespace="honest", replace=True
                        )
                        lease = c.claim(key, namespace="honest")
                    except (NotFound, PoolFull):
                        # Fuzzed reservations fill the pool: eviction under pressure may
                        # take our object between put and claim. Legitimate, but counted.
                        self.pressure += 1
                        continue
                    with lease:
                        if not np.array_equal(lease["kv"], pattern(key + str(i), n)):
                            self.errors.append(f"bytes of {key} differ")
                    self.ops += 1
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")


@pytest.fixture
def fuzz_daemon(make_daemon):
    # Short TTLs so fuzzed reservations also expire (and quarantine) during the run; a
    # fuzzer cut off for a protocol error leaves its write pages quarantined for 1 s.
    return make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--lease-ttl",
        "2s",
        env={"KVBROKER_RESTART_QUARANTINE": "1"},
    )


def hello(rid: int = 0) -> bytes:
    return msgpack.packb({"id": rid, "op": "hello", "args": {"version": PROTOCOL_VERSION}})


def extent_bytes(sizes: list[int]) -> int:
    span = sum(-(-n // BUFFER_ALIGN) * BUFFER_ALIGN for n in sizes)
    return -(-max(span, 1) // PAGE) * PAGE


def check_accounting(c: Client) -> None:
    """No lease, reservation or quarantine left; used pages are exactly the objects'."""
    deadline = time.monotonic() + 60  # (bounds for a loaded machine, not expectations)
    while len(c.stat().clients) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # the daemon is still closing the fuzzers' connections
    while c.stat().pools[0].quarantined and time.monotonic() < deadline + 60:
        time.sleep(0.02)  # pages of fuzzers it cut off wait out restart_quarantine
    st = c.stat()
    assert len(st.clients) == 1
    want = 0
    objs = c.list(limit=10_000)
    for o in objs:
        with c.claim(o.key, namespace=o.namespace) as lease:
            want += extent_bytes([e[2] for e in lease.extents().values()])
    st = c.stat()
    pool = st.pools[0]
    assert (pool.leased_write, pool.quarantined) == (0, 0)
    assert st.objects == len(objs)
    assert st.used == want, (st.used, want)


def test_random_frames_daemon_survives_and_honest_client_unaffected(fuzz_daemon):
    rng = random.Random(1234)
    honest = Honest(fuzz_daemon.socket_path)
    honest.start()
    sent = replies = fatal = 0
    t0 = time.monotonic()
    leases: list[int] = []
    op_of: dict = {}  # request id -> op, for the replies' declared types (None: ambiguous)
    while sent < FRAMES:
        conn = Hostile(fuzz_daemon.socket_path)
        greet = rng.random() < 0.9
        if greet:
            conn.exchange(hello(), 1)
            sent += 1
        # A batch of well-framed requests, answered one by one, then maybe a fatal frame.
        for _ in range(rng.randrange(1, 8)):
            batch = []
            for _ in range(rng.randrange(20, 200)):
                sent += 1
                if rng.random() < 0.05:
                    batch.append(msgpack.packb(junk(rng)))  # not a map: an error, no close
                else:
                    msg = request(rng, sent, leases)
                    rid = msg.get("id")
                    if isinstance(rid, int) and not isinstance(rid, bool):
                        op_of[rid] = msg.get("op") if rid == sent and rid not in op_of else None
                    batch.append(msgpack.packb(msg))
            conn.exchange(b"".join(batch), len(batch))
            if conn.closed:
                break
        for msg in conn.replies:
            rid = msg.get("id") if isinstance(msg, dict) else None
            check_reply(msg, op_of.get(rid) if isinstance(rid, int) else None)
            res = msg.get("result") if isinstance(msg, dict) else None
            if isinstance(res, dict) and isinstance(res.get("lease"), int):
                leases.append(res["lease"])
        replies += len(conn.replies)
        del leases[:-256]
        if not conn.closed and rng.random() < 0.8:
            frame = fatal_frame(rng)
            if rng.random() < 0.3:  # truncated: half a frame, then hang up
                frame = msgpack.packb(request(rng, sent, leases))[:-1]
            conn.finish(frame)
            sent += 1
            fatal += 1
        conn.close()
    elapsed = time.monotonic() - t0
    honest.stop.set()
    honest.join(30)
    print(
        f"\n{sent} frames ({fatal} fatal) in {elapsed:.1f} s, {replies} replies; "
        f"honest client: {honest.ops} put+claim checked, {honest.pressure} lost to "
        f"eviction under pressure, {len(honest.errors)} errors"
    )
    assert not honest.errors, honest.errors[:5]
    assert honest.ops > 10 * honest.pressure
    assert fuzz_daemon.proc.poll() is None, fuzz_daemon.log()
    assert replies > FRAMES // 2
    with Client(fuzz_daemon.socket_path) as c:
        check_accounting(c)
    assert "Traceback" not in fuzz_daemon.log()


# -- hypothesis: every well-framed request gets exactly one well-formed reply -------------
_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def requests(draw):
    op = draw(st.sampled_from(sorted(OPS)) | st.text(max_size=12))
    spec = OPS.get(op)
    names = list(spec.args) if spec else []
    args = draw(
        st.dictionaries(
            st.sampled_from(names) if names else st.text(max_size=8),
            _value,
            max_size=len(names) + 1,
        )
    )
    return op, tame(op, args)


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    from conftest import DaemonProcess

    d = DaemonProcess(
        str(tmp_path_factory.mktemp("kvbf") / "kvb.sock"),
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--lease-ttl",
        "2s",
    )
    yield d
    assert d.stop() == 0, d.log()


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(requests(), min_size=1, max_size=20))
def test_every_request_gets_one_wellformed_reply(shared_daemon, batch):
    conn = Hostile(shared_daemon.socket_path)
    try:
        conn.exchange(hello(0), 1)
        frames = b"".join(
            msgpack.packb({"id": i + 1, "op": op, "args": args})
            for i, (op, args) in enumerate(batch)
        )
        conn.exchange(frames, len(batch))
        assert not conn.closed, conn.replies[-1:]
        assert [m["id"] for m in conn.replies[1:]] == list(range(1, len(batch) + 1))
        for msg, op in zip(conn.replies, ["hello"] + [op for op, _ in batch], strict=True):
            check_reply(msg, op)
    finally:
        conn.close()
    assert shared_daemon.proc.poll() is None


def test_backtracking_regex_cannot_stall_the_daemon(fuzz_daemon):
    """Patterns are matched by RE2 (linear time). With a backtracking engine each of these
    runs for hours against a 500-character key, and every other client waits: this test
    then never finishes (pytest-timeout fails it)."""
    with Client(fuzz_daemon.socket_path) as c:
        c.put("a" * 500 + "!", {"past_key.0": b"x"}, namespace="fuzz")
        for evil in ("(a+)+$", "(a|aa)*b", "(.*a){20}$", ".*.*.*.*.*.*.*!x"):
            assert c.list(match=evil) == []
            assert c.evict(match=evil, namespace="fuzz").count == 0
            assert c.evict(match_buffers=evil, namespace="fuzz", dry_run=True).count == 0
        assert c.exists("a" * 500 + "!", namespace="fuzz")
        with pytest.raises(BadRequest, match="bad regex"):
            c.list(match="(a)\\1")  # backreferences need backtracking: refused, clearly
