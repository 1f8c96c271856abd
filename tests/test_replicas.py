"""Read replicas (kvbroker._server.replica, .replicas; kvbroker._client.replica): they answer
exists and match_prefix(hold=False) as the daemon would, see every acknowledged change, and
never make a client fail where the daemon alone would have answered."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import socket
import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker._client import replica as replica_client
from kvbroker._client.replica import RETRY_AFTER
from kvbroker._server import config_values as parse
from kvbroker._server.broker import Broker
from kvbroker._server.journal import Journal, JournalError
from kvbroker._server.pool import HostPool
from kvbroker._server.replica import REPORT_PERIOD, JournalFollower
from kvbroker._server.replicas import Replicas, auto_count
from kvbroker._wire.protocol import PROTOCOL_VERSION

PAGE = 4096


def _wait(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _replica_pid(client) -> int:
    client.exists("warm-up")  # opens the replica connection
    return client._replica._session.hello["server_pid"]


def _replicas_answer(d, n: int, timeout: float = 60.0) -> None:
    """Wait until each of the daemon's ``n`` replicas answers a hello: a replica's process
    imports for a second or more on a loaded machine, and a client asking it meanwhile is
    sent to the daemon (a fallback these tests would count)."""
    hello = msgpack.packb({"id": 1, "op": "hello", "args": {"version": PROTOCOL_VERSION}})

    def answers(path: str) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(timeout)
                s.connect(path)
                s.sendall(hello)
                return msgpack.unpackb(s.recv(1 << 16))["ok"]
        except (OSError, ValueError):
            return False

    for i in range(n):
        _wait(
            functools.partial(answers, f"{d.socket_path}.r{i}"), timeout, f"replica {i} to answer"
        )


@pytest.fixture
def replicated(make_daemon, monkeypatch):
    # A client gives up on a replica that takes REPLICA_TIMEOUT (1 s) to answer and asks the
    # daemon: on a loaded machine a healthy replica can be that slow, and these tests count
    # the fallbacks. A hung replica is the one test that needs the real bound (it sets it).
    monkeypatch.setattr(replica_client, "REPLICA_TIMEOUT", 60.0)
    d = make_daemon("--pool-size", "64M", "--page-size", "4K", "--read-replicas", "2")
    d.wait_ready()
    _replicas_answer(d, 2)

    def hellos_reported() -> bool:  # a replica reports its counts every REPORT_PERIOD: a test's
        with d.client() as c:  # "before" taken ahead of that report would count these hellos
            return c.stat().counters.replica_requests >= 2

    _wait(hellos_reported, 60.0, "the replicas to report the readiness hellos")
    return d


# -- through a real daemon ---------------------------------------------------------------------
def test_every_acknowledged_change_is_seen_through_a_replica(replicated):
    with replicated.client() as reader, replicated.client() as writer:
        assert reader._replica is not None and reader._replica.path.startswith(
            replicated.socket_path + ".r"
        )
        assert not reader.exists("a")
        writer.put("a", {"x": b"1"})
        assert reader.exists("a")  # put acknowledged to another client: seen at once
        writer.put("a", {"x": b"22"}, replace=True)
        assert reader.exists("a")
        writer.put("c", {"x": b"1"})
        writer.get("c", consume=True)  # consumed: freed when released (sent without waiting)
        assert not writer.exists("c")  # its own release first: the daemon answers, in order
        writer.put("c2", {"x": b"1"})
        assert writer.exists("c2") and not writer.exists("c")
        writer.evict("a")
        assert not reader.exists("a") and not reader.exists("c")
        writer.put("n", {"x": b"1"}, namespace="other")
        assert reader.exists("n", namespace="other") and not reader.exists("n")
        assert reader._replica.fallbacks == 0
        assert writer.stat().read_replicas == 2
        pid = _replica_pid(reader)
        assert pid != replicated.proc.pid  # answered by another process


def test_match_without_hold_through_a_replica_counts_and_agrees_with_the_daemon(replicated):
    keys = [f"blk{i}" for i in range(12)]
    with replicated.client() as c:
        for k in keys[:7]:
            c.put(k, {"x": b"kv"})
        before = c.stat().counters
        got = c.ops.match_prefix(keys, block_tokens=16, hold=False)
        assert got["matched"] == 7 and got["lease"] is None
        assert (
            c.ops.match_prefix(["blk0", "nope", "blk2"], block_tokens=16, hold=False)["matched"]
            == 1
        )
        held = c.ops.match_prefix(keys, block_tokens=16)  # hold=True: the daemon answers
        assert held["matched"] == 7 and held["lease"] is not None
        c.ops.release(held["lease"])
        assert c._replica.fallbacks == 0

        def counted():
            now = c.stat().counters
            return now.prefix_queries - before.prefix_queries == 3

        _wait(counted, what="the replica's report")  # (it reports every REPORT_PERIOD)
        now = c.stat().counters
        assert now.prefix_hit_blocks - before.prefix_hit_blocks == 7 + 1 + 7
        assert now.prefix_hit_tokens - before.prefix_hit_tokens == (7 + 1 + 7) * 16
        # what the replicas answered, on its own and within all requests: the hello and
        # the two matches (the held match and the stat went to the daemon)
        assert now.replica_requests - before.replica_requests == 3
        assert now.requests - before.requests >= 3 + 2


def test_a_killed_replica_costs_nothing_and_is_replaced(replicated):
    with replicated.client() as c:
        c.put("k", {"x": b"1"})
        pid = _replica_pid(c)
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _gone(pid), what="the replica to die")
        assert c.exists("k") and not c.exists("nope")  # the daemon answered
        assert c._replica.fallbacks >= 1
        time.sleep(RETRY_AFTER + 0.2)  # the daemon replaces it within a second
        _wait(lambda: c.exists("k") and c._replica._session is not None, what="a new replica")
        assert _replica_pid(c) != pid
        s = c.stat()
        assert s.counters.replica_exits == 1 and s.read_replicas == 2
    assert "read replica" in replicated.log()
    from kvbroker.cli._stat import render

    assert "read replicas 2 (answered " in render(s) and ", exited 1)" in render(s)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_compacted_journal_is_followed(replicated):
    journal = replicated.socket_path + ".journal"
    with replicated.client() as c, replicated.client() as w:
        inode = os.stat(journal).st_ino
        w.put("kept", {"x": b"1"})
        for i in range(2200):  # > 4096 records, twice what is live: the daemon compacts
            w.put(f"t{i}", {"x": b"1"})
            w.evict(f"t{i}")
        _wait(lambda: os.stat(journal).st_ino != inode, what="a compaction")
        w.put("after", {"x": b"1"})
        assert c.exists("kept") and c.exists("after") and not c.exists("t5")
        assert c._replica.fallbacks == 0


def test_hostile_bytes_to_a_replica_hurt_only_their_connection(replicated):
    path = replicated.socket_path + ".r0"
    with replicated.client() as c:
        c.put("k", {"x": b"1"})

        def raw(data: bytes) -> bytes:
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.settimeout(5)
            s.sendall(data)
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
                    if len(out) > 1 << 16:
                        break
            except (TimeoutError, ConnectionResetError):
                pass
            s.close()
            return out

        assert raw(b"\xc1" * 64) == b""  # malformed msgpack: closed, nothing answered
        assert raw(b"\xc6\xff\xff\xff\xff" + b"\0" * 1024) == b""  # a 4 GiB bin: refused
        unpacker = msgpack.Unpacker(raw=False)
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.settimeout(5)
        for msg in (
            {"id": 1, "op": "exists", "args": {"key": "k"}},  # before hello
            {"id": 2, "op": "hello", "args": {"version": PROTOCOL_VERSION}},
            {"id": 3, "op": "claim", "args": {"key": "k"}},  # not a replica's
            {"id": 4, "op": "exists", "args": {"key": 7}},  # a bad argument
            {"id": 5, "op": "match_prefix", "args": {"keys": ["k"]}},  # hold=True
            {"id": 6, "op": "exists", "args": {"key": "k"}},
        ):
            s.sendall(msgpack.packb(msg))
        replies = []
        while len(replies) < 6:
            unpacker.feed(s.recv(65536))
            replies.extend(unpacker)
        s.close()
        by = {r["id"]: r for r in replies}
        assert by[1]["error"]["code"] == "protocol"
        assert by[2]["ok"] and by[2]["result"]["replica"] is True
        assert (
            by[3]["error"]["code"] == "bad_request"
            and "ask the daemon" in by[3]["error"]["message"]
        )
        assert by[4]["error"]["code"] == "bad_request"
        assert by[5]["error"]["code"] == "bad_request"
        assert by[6]["result"] is True
        assert c.exists("k") and c._replica.fallbacks == 0  # the others never noticed


def test_a_draining_daemon_stops_its_replicas_and_answers_itself(replicated):
    with replicated.client() as holder, replicated.client() as c:
        c.put("k", {"x": b"1"})
        assert c.exists("k")
        lease = holder.claim("k")  # the drain waits for it
        replicated.proc.send_signal(signal.SIGTERM)
        _wait(
            lambda: not os.path.exists(replicated.socket_path + ".r0"), what="the replicas to stop"
        )
        assert c.exists("k") and not c.exists("nope")  # the daemon, still draining
        assert c._replica.fallbacks >= 1
        lease.release()
    assert replicated.proc.wait(15) == 0


def test_no_replicas_without_a_journal(make_daemon):
    d = make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--read-replicas",
        "2",
        env={"KVBROKER_JOURNAL": "false"},
    )
    d.wait_ready()
    with d.client() as c:
        assert c._replica is None
        c.put("k", {"x": b"1"})
        assert c.exists("k")
    assert not os.path.exists(d.socket_path + ".r0")
    assert "none started (journal = false" in d.log()


# -- the setting ---------------------------------------------------------------------------
def test_read_replicas_setting():
    assert parse.replicas("auto") is None and parse.replicas(0) == 0
    assert parse.replicas(3) == 3 and parse.replicas("3") == 3
    for bad in (-1, 65, True, "x", 1.5):
        with pytest.raises(ValueError):
            parse.replicas(bad)
    assert [auto_count(n) for n in (1, 2, 7, 8, 12, 16, 64)] == [0, 0, 0, 2, 3, 4, 4]


# -- the follower, against the journal the broker writes ----------------------------------------
@pytest.fixture
def journaled(tmp_path):
    pool = HostPool(0, f"/kvbrt.{os.getpid()}.{secrets.token_hex(3)}", 512 * PAGE, PAGE)
    b = Broker([pool])
    path = str(tmp_path / "j")
    b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
    s = b.open_session(pid=1, uid=0, gid=0)
    b.handle(s, "hello", {"version": PROTOCOL_VERSION, "name": "t"})
    yield b, s, path
    pool.unlink()


def _visible(b: Broker) -> set[tuple[str, str]]:
    return set(b.objects)


def _followed(f: JournalFollower) -> set[tuple[str, str]]:
    return {(ns, k) for ns, space in f.by_namespace.items() for k in space}


_op = st.tuples(
    st.sampled_from(["put", "replace", "evict", "consume"]),
    st.sampled_from(["a", "b"]),
    st.integers(0, 5),
)
_ops = st.lists(_op, max_size=30)


@settings(max_examples=60)
@given(ops=_ops, cuts=st.lists(st.integers(0, 1 << 16), max_size=8))
def test_the_follower_sees_what_the_broker_published_even_mid_record(ops, cuts, tmp_path_factory):
    pool = HostPool(0, f"/kvbrt.{os.getpid()}.{secrets.token_hex(3)}", 512 * PAGE, PAGE)
    try:
        b = Broker([pool])
        path = str(tmp_path_factory.mktemp("j") / "j")
        b.attach_journal(Journal(path, 1, [pool.describe()]), 1)
        s = b.open_session(pid=1, uid=0, gid=0)
        b.handle(s, "hello", {"version": PROTOCOL_VERSION, "name": "t"})
        follower = JournalFollower(path)
        for op, ns, i in ops:
            key = f"k{i}"
            there = (ns, key) in b.objects
            if op in ("put", "replace") and (op == "replace" or not there):
                r = b.handle(
                    s,
                    "reserve",
                    {
                        "namespace": ns,
                        "key": key,
                        "buffers": {"x": 100 * (i + 1)},
                        "replace": op == "replace",
                    },
                )
                b.handle(s, "seal", {"lease": r["lease"]})
            elif op == "evict":
                b.handle(s, "evict", {"namespace": ns, "key": key})
            elif op == "consume" and there:
                c = b.handle(s, "claim", {"namespace": ns, "key": key, "consume": True})
                b.handle(s, "release", {"lease": c["lease"], "consume": True})
            follower.catch_up()
            assert follower.problem is None and _followed(follower) == _visible(b)
        # The same file read by a follower that sees it grow a few bytes at a time, cut
        # anywhere (the daemon may be mid-write): never more than the whole records say.
        with open(path, "rb") as fh:
            data = fh.read()
        grown = str(tmp_path_factory.mktemp("g") / "j")
        with open(grown, "wb"):
            pass
        late = JournalFollower(grown)
        for cut in sorted({min(c, len(data)) for c in cuts} | {len(data)}):
            with open(grown, "r+b") as f:
                f.seek(0, 2)
                f.write(data[f.tell() : cut])
            late.catch_up()
            with open(grown + ".copy", "wb") as f:
                f.write(data[:cut])
            try:
                rec = Journal.load(grown + ".copy")
            except JournalError:  # cut inside the header: nothing to follow yet
                rec = None
            if rec is None:
                assert not _followed(late) and late.problem is not None
            else:
                assert _followed(late) == {(o["namespace"], o["key"]) for o in rec.objects.values()}
        assert _followed(late) == _visible(b)
    finally:
        pool.unlink()


def test_a_damaged_record_stops_the_follower_until_the_file_is_replaced(journaled):
    b, s, path = journaled
    for key in ("a", "b"):
        r = b.handle(s, "reserve", {"key": key, "buffers": {"x": 10}})
        b.handle(s, "seal", {"lease": r["lease"]})
    f = JournalFollower(path)
    f.catch_up()
    assert f.problem is None and _followed(f) == {("default", "a"), ("default", "b")}
    with open(path, "rb") as fh:
        data = fh.read()
    r = b.handle(s, "reserve", {"key": "c", "buffers": {"x": 10}})
    b.handle(s, "seal", {"lease": r["lease"]})
    with open(path, "r+b") as fh:  # flip a byte inside the record(s) just appended
        fh.seek(len(data) + 20)
        byte = fh.read(1)
        fh.seek(len(data) + 20)
        fh.write(bytes([byte[0] ^ 0xFF]))
    f.catch_up()
    assert f.problem is not None and "damaged" in f.problem and not f.by_namespace
    b.compact_journal()  # a new file: read from its start
    f.catch_up()
    assert f.problem is None and _followed(f) == _visible(b)
    assert f.replays == 2


def test_a_removed_journal_makes_the_follower_refuse(journaled):
    path = journaled[2]
    f = JournalFollower(path)
    f.catch_up()
    assert f.problem is None
    os.unlink(path)  # what the daemon does when a write fails: the journal is off
    f.catch_up()
    assert f.problem is not None and "cannot read the journal" in f.problem


def test_the_daemon_applies_a_replicas_report(journaled):
    b, s, _ = journaled
    for key in ("a", "b", "c"):
        r = b.handle(s, "reserve", {"key": key, "buffers": {"x": 10}})
        b.handle(s, "seal", {"lease": r["lease"]})
    assert next(b.directory.evictable()).key == "a"  # the oldest: the first to be evicted

    class _D:  # what Replicas reads of its daemon
        broker = b

    reps = Replicas(_D())
    before = b.counters["prefix_queries"]
    reps._apply(
        msgpack.packb(
            {"c": {"prefix_queries": 2, "bogus": 5, "hits": -3}, "t": {"default": ["a", "gone"]}}
        )
    )
    assert b.counters["prefix_queries"] == before + 2 and "bogus" not in b.counters
    assert [o.key for o in b.directory.evictable()] == ["b", "c", "a"]  # a: most recently matched
    reps._apply(b"\xc1not msgpack")  # ignored, logged
    assert REPORT_PERIOD < 1


def test_a_reload_to_a_closed_policy_stops_the_replicas_and_back(make_daemon, tmp_path):
    conf = tmp_path / "kvbroker.toml"
    open_conf = 'pool_size = "16M"\npage_size = "4K"\n'
    conf.write_text(open_conf)
    d = make_daemon("--config", str(conf), env={"KVBROKER_READ_REPLICAS": "2"})
    d.wait_ready()
    _replicas_answer(d, 2)
    replica = d.socket_path + ".r0"
    with d.client() as c:
        c.put("k", {"x": b"1"})
        assert os.path.exists(replica) and c.exists("k")
        conf.write_text(open_conf + '[isolation]\nmode = "tenant"\n')
        d.proc.send_signal(signal.SIGHUP)
        _wait(lambda: not os.path.exists(replica), what="the replicas to stop")
        assert "isolation is no longer open" in d.log()
        assert c.exists("k") and c._replica.fallbacks >= 1  # the daemon answers (as root)
        with d.client() as fresh:
            assert fresh._replica is None  # hello names none
        conf.write_text(open_conf)
        d.proc.send_signal(signal.SIGHUP)
        _wait(lambda: os.path.exists(replica), what="the replicas to start again")
        _replicas_answer(d, 2)
        with d.client() as again:
            assert again._replica is not None and again.exists("k")
            _wait(lambda: again._replica._session is not None, what="a replica connection")


# -- what a review found ------------------------------------------------------------------
def test_a_report_of_many_long_keys_arrives_whole_and_later_ones_too(replicated):
    keys = [f"{i:06d}-" + "k" * 119 for i in range(1500)]  # ~190 KB of keys: many messages
    with replicated.client() as c:
        for k in keys:
            c.put(k, {"x": b"1"})
        before = c.stat().counters
        assert c.ops.match_prefix(keys, block_tokens=1, hold=False)["matched"] == 1500
        for _ in range(20):
            assert c.ops.match_prefix(keys[:2], block_tokens=1, hold=False)["matched"] == 2
        _wait(
            lambda: c.stat().counters.prefix_queries - before.prefix_queries == 21,
            what="every report",
        )
        assert c.stat().counters.prefix_hit_blocks - before.prefix_hit_blocks == 1500 + 40
        assert c._replica.fallbacks == 0


def test_replicas_do_not_outlive_a_killed_daemon(make_daemon):
    d = make_daemon("--pool-size", "16M", "--page-size", "4K", "--read-replicas", "2")
    d.wait_ready()
    _replicas_answer(d, 2)
    with d.client() as c:
        pid = _replica_pid(c)
    d.proc.kill()
    d.proc.wait(10)
    _wait(lambda: _gone(pid), what="the orphaned replica to exit")
    # and one that starts after its daemon died exits at once
    from kvbroker._server import replica

    assert replica.main(["0", "/nonexistent", "0", str(os.getpid() + 10**6), "{}"]) is None


def test_a_hung_replica_sends_its_clients_to_the_daemon_within_a_second(replicated, monkeypatch):
    monkeypatch.setattr(replica_client, "REPLICA_TIMEOUT", 1.0)  # the real bound
    with replicated.client(timeout=60) as c:
        c.put("k", {"x": b"1"})
        _wait(lambda: c.exists("k") and c._replica._session is not None, what="a replica")
        pid = c._replica._session.hello["server_pid"]
        # Not tried again for RETRY_AFTER: so long here that no stall of the machine ends it.
        monkeypatch.setattr(replica_client, "RETRY_AFTER", 3600.0)
        fallbacks = c._replica.fallbacks
        os.kill(pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert c.exists("k")  # no Timeout: the daemon answered
            # after the replica's bound, not the call's own (60 s)
            assert time.monotonic() - t < 30 and c._replica.fallbacks == fallbacks + 1
            opened = []
            transport = replica_client.UnixTransport
            monkeypatch.setattr(
                replica_client,
                "UnixTransport",
                lambda *a, **kw: opened.append(a) or transport(*a, **kw),
            )
            assert c.exists("k") and c._replica.fallbacks == fallbacks + 2
            assert opened == []  # the daemon answered at once: the replica was not tried again
        finally:
            os.kill(pid, signal.SIGCONT)


def test_a_replica_keeps_the_daemons_connection_limits(make_daemon):
    d = make_daemon(
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        "--read-replicas",
        "1",
        # The squatters must still be connected when `other` asks the replica: a hello_timeout
        # of 1 s can run out first on a loaded machine (and the replica has room again).
        env={"KVBROKER_MAX_CONNECTIONS_PER_UID": "3", "KVBROKER_HELLO_TIMEOUT": "10s"},
    )
    d.wait_ready()
    path = d.socket_path + ".r0"
    with d.client() as c:
        c.put("k", {"x": b"1"})
        squatters = []
        for _ in range(3):
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            squatters.append(s)
        # (the replica accepts in order: the squatters before `other`)
        with d.client() as other:  # its own connection: the daemon's second, the replica full
            assert other.exists("k") and other._replica.fallbacks >= 1
        for s in squatters:  # never said hello: closed after hello_timeout
            s.settimeout(60)
            assert s.recv(1) == b""
            s.close()


def test_a_replica_answers_ttl_as_the_daemon_does(replicated):
    from kvbroker.errors import BadRequest

    with replicated.client() as c:
        c.put("k", {"x": b"1"})
        assert c.ops.match_prefix(["k"], block_tokens=1, hold=False)["ttl"] == 30.0
        with pytest.raises(BadRequest, match="ttl must be in"):
            c.ops.match_prefix(["k"], block_tokens=1, hold=False, ttl=-5)
        assert c._replica.fallbacks == 0


def test_a_forked_client_uses_a_connection_of_its_own(replicated):
    with replicated.client() as c:
        c.put("k", {"x": b"1"})
        assert c.exists("k")
        parent_session = c._replica._session
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own replica connection, the parent's left alone
            ok = c.exists("k") and c._replica._session is not parent_session
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.close(w)
        assert os.read(r, 1) == b"1"
        os.waitpid(pid, 0)
        assert c.exists("k") and c._replica._session is parent_session


def test_replica_housekeeping_never_raises(journaled, caplog):
    b, _, _ = journaled

    class _D:
        broker = b
        draining = False

    reps = Replicas(_D())
    from kvbroker._server.replicas import _Slot

    slot = _Slot("/nonexistent/r0")
    dead = __import__("subprocess").Popen(["true"])
    dead.wait()
    slot.proc, slot.started = dead, time.monotonic()
    reps._slots = [slot]

    def fail(_slot):
        raise OSError(24, "Too many open files")

    reps._spawn = fail
    reps.check()  # the death: backed off
    assert slot.proc is None and slot.failures == 1
    slot.due = 0
    reps.check()  # the failed start: logged, backed off further
    assert slot.failures == 2 and slot.due > time.monotonic()
    assert "cannot start read replica 0" in caplog.text
    b.journal.failed = "no space left"
    reps.check()  # the journal failed: nothing left to follow
    assert not reps._slots and b.replica_paths == ()
