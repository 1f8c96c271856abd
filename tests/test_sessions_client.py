"""Sessions through a real daemon: PrefixCache's session=, the CLI (sessions, retain, release,
stat), SIGHUP reloading [sessions], and a restart keeping them."""

import json
import signal
import time

from typer.testing import CliRunner

from kvbroker.cli import app
from kvbroker.prefix import PrefixCache
from kvbroker.testing import DaemonProcess, drop_leftover_pools

runner = CliRunner()
BS = 16
BLOCK = 64 << 10  # bytes per block: 16 of them fill 1 MiB


def cli(*args):
    return runner.invoke(app, [str(a) for a in args], env={"KVBROKER_SOCKET": None})


def conversation(pc, first, nblocks, **kw):
    tokens = list(range(first, first + nblocks * BS + 1))
    pc.publish(tokens, lambda i: {"kv": bytes(BLOCK)}, block_sizes={"kv": BLOCK}, **kw)
    return tokens


def overflow(c, n=80):
    """One-shot prompts: more than the whole pool."""
    for i in range(n):
        c.put(f"oneshot-{i}-{time.monotonic_ns()}", {"x": bytes(BLOCK)})


def test_prefix_cache_sessions_survive_overflow_cli_and_reload(tmp_path):
    cfg = tmp_path / "kvb.toml"
    cfg.write_text('[sessions]\npool_share = 0.5\nretain = "10m"\n')
    sock = str(tmp_path / "kvb.sock")
    d = DaemonProcess(
        sock, "--config", str(cfg), "--pool-size", "4M", "--page-size", "4K", ready_timeout=60
    )
    try:
        with d.client() as c:
            pc = PrefixCache(c, namespace="chat", block_size=BS, checksum=False)
            kept = conversation(pc, 0, 8, session="conv-42", retain="30m", priority=2)
            plain = conversation(pc, 100_000, 8)
            overflow(c)
            with pc.match(kept, session="conv-42") as m:  # a later turn: renews the session
                assert m.num_blocks == 8
            with pc.match(plain) as m:
                assert m.num_blocks == 0
            # the CLI
            r = cli("sessions", "-s", sock)
            assert r.exit_code == 0, r.output
            assert "conv-42" in r.stdout and "chat" in r.stdout and "512.0 KiB" in r.stdout, (
                r.stdout
            )
            listed = json.loads(cli("sessions", "--json", "-s", sock).stdout)
            (row,) = listed["sessions"]
            assert (row["blocks"], row["priority"], row["namespace"]) == (8, 2, "chat")
            assert 1790 < row["expires_in"] <= 1800
            assert listed["retained_cap"] == [2 << 20]
            r = cli("retain", "conv-42", "--for", "45m", "--priority", "3", "-s", sock)
            assert r.exit_code == 0 and "retained for 45m" in r.stdout, r.output
            snap = json.loads(cli("stat", "--json", "-s", sock).stdout)
            assert snap["retention"]["sessions"] == 1
            assert snap["retention"]["largest"][0]["priority"] == 3
            assert "sessions 1" in cli("stat", "-s", sock).stdout
            assert cli("retain", "nope", "--for", "1h", "-s", sock).exit_code == 1
            # SIGHUP: a lowered share applies at once (the session keeps what fits)
            cfg.write_text("[sessions]\npool_share = 0.125\n")
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while c.ops.sessions()["retained_cap"] != [512 << 10] and time.monotonic() < deadline:
                time.sleep(0.05)
            reply = c.ops.sessions()
            assert reply["retained_cap"] == [512 << 10]
            assert reply["retained_bytes"][0] <= 512 << 10
            # release: the blocks fall back to the LRU and go with the next overflow
            r = cli("release", "conv-42", "-s", sock)
            assert r.exit_code == 0 and "released" in r.stdout, r.output
            overflow(c)
            with pc.match(kept) as m:
                assert m.num_blocks == 0
            assert c.ops.sessions()["sessions"] == []
    finally:
        assert d.stop() == 0, d.log()


def test_a_restarted_daemon_keeps_the_sessions(tmp_path):
    sock = str(tmp_path / "kvb.sock")
    args = ("--pool-size", "4M", "--page-size", "4K")
    d = DaemonProcess(sock, *args, ready_timeout=60)
    try:
        with d.client() as c:
            pc = PrefixCache(c, namespace="agent", block_size=BS, checksum=False)
            kept = conversation(pc, 0, 6, session="tool-loop")
        d.proc.send_signal(signal.SIGUSR1)  # a restart: the pools and the journal are kept
        d.proc.wait(60)
    finally:
        d.stop()
    d2 = DaemonProcess(sock, *args, ready_timeout=60)
    try:
        with d2.client() as c:
            (row,) = c.ops.sessions()["sessions"]
            assert (row["name"], row["blocks"]) == ("tool-loop", 6)
            overflow(c)
            pc = PrefixCache(c, namespace="agent", block_size=BS, checksum=False)
            with pc.match(kept) as m:
                assert m.num_blocks == 6
    finally:
        assert d2.stop() == 0, d2.log()


def test_the_sessions_benchmark_keeps_every_reusable_token_that_lru_loses():
    """benchmarks/bench_sessions.py at a small size: with sessions every token a
    conversation's earlier turns published is found again, however many one-shot prompts
    overflowed the pool in between; plain LRU at the same pool size loses some."""
    import importlib.util
    import pathlib

    from kvbroker._bench._common import spawned_daemon

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_sessions.py"
    spec = importlib.util.spec_from_file_location("bench_sessions", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trace = bench.make_trace(3, 3, 6, 256, 64, 1024, seed=1)
    got = {}
    for retain in (False, True):
        with spawned_daemon(
            "4M", "--page-size", "4K", env={"KVBROKER_READ_REPLICAS": "0"}
        ) as socket:
            got[retain] = bench.replay(socket, trace, retain)
    assert got[True]["hit_of_reusable"] == 1.0
    assert got[False]["hit_of_reusable"] < 1.0
    assert got[True]["recomputed_tokens"] < got[False]["recomputed_tokens"]
    assert got[True]["retained_evicted"] == {}


def test_a_restart_keeps_what_the_tenant_quota_took(tmp_path):
    """A session that lost its retention to the tenant quota does not get it back from a
    warm restart after a crash, although the quota has room again by then: the journal says
    it was taken. (A SIGKILL: a clean restart rewrites the journal from what is retained.)"""
    cfg = tmp_path / "kvb.toml"
    cfg.write_text('[sessions]\ntenant_quota = "512K"\n')  # 8 blocks, not 12
    sock = str(tmp_path / "kvb.sock")
    args = ("--config", str(cfg), "--pool-size", "4M", "--page-size", "4K")
    d = DaemonProcess(sock, *args, ready_timeout=60)
    try:
        with d.client() as c:
            pc = PrefixCache(c, namespace="agent", block_size=BS, checksum=False)
            conversation(pc, 0, 4, session="important", priority=3)
            conversation(pc, 100_000, 4, session="old", priority=1)
            conversation(pc, 200_000, 4, session="new", priority=1)
            blocks = {r["name"]: r["blocks"] for r in c.ops.sessions()["sessions"]}
            assert blocks == {"important": 4, "old": 0, "new": 4}
            c.ops.unretain("new")  # the quota has room again; "old" stays unretained
    finally:
        d.stop(signal.SIGKILL)  # the pools and the journal stay for the next daemon
    try:
        d2 = DaemonProcess(sock, *args, ready_timeout=60)
        try:
            with d2.client() as c:
                blocks = {r["name"]: r["blocks"] for r in c.ops.sessions()["sessions"]}
                assert blocks == {"important": 4, "old": 0}
        finally:
            assert d2.stop() == 0, d2.log()
    finally:
        drop_leftover_pools(sock)


def test_client_put_and_reserve_take_a_session_as_prefix_cache_does(tmp_path):
    """Client.put (through the write arena and through reserve + seal), Client.reserve and
    a put that finds its key: the objects their session retains outlive one-shot prompts
    that overflow the pool; the same objects without a session do not."""
    sock = str(tmp_path / "kvb.sock")
    d = DaemonProcess(sock, "--pool-size", "4M", "--page-size", "4K", ready_timeout=60)
    try:
        with d.client() as c, d.client(arena_size=0) as direct:
            assert c.put("arena-put", {"x": bytes(BLOCK)}, session="agent", retain="30m")
            assert direct.put("reserved-put", {"x": bytes(BLOCK)}, session="agent", priority=3)
            with direct.reserve("lease", {"x": BLOCK}, session="agent") as lease:
                lease["x"][:] = 7
            direct.put("found", {"x": bytes(BLOCK)})
            assert not c.put("found", {"x": bytes(BLOCK)}, session="agent")  # retained as is
            c.put("plain", {"x": bytes(BLOCK)})
            (row,) = c.ops.sessions()["sessions"]
            assert (row["name"], row["blocks"], row["priority"]) == ("agent", 4, 3)
            assert 1790 < row["expires_in"] <= 1800
            overflow(c)
            kept = ["arena-put", "reserved-put", "lease", "found"]
            assert [k for k in kept + ["plain"] if c.exists(k)] == kept
            with c.claim("lease") as got:
                assert bytes(got["x"][:2]) == b"\x07\x07"
    finally:
        assert d.stop() == 0, d.log()
