"""Buffer checksums: recorded at seal, verified on claim/get and by `kvbroker verify`.

Corruption is made the way it happens in real life: through another mapping of the pool's
shared-memory segment, behind the broker's back.
"""

import json
import mmap

import numpy as np
import posix_ipc
import pytest
import xxhash
from typer.testing import CliRunner

from kvbroker import BadRequest, ChecksumMismatch, KVBrokerError
from kvbroker._wire import checksum as cs
from kvbroker._wire.checksum import CHUNK
from kvbroker._client.integrity import copy_hashed
from kvbroker._client.copy import copy_into
from kvbroker.cli import app

runner = CliRunner()


def corrupt(client, key, buffer, at=0, namespace="default"):
    """Flip one byte of a sealed buffer through a second mapping of its pool."""
    with client.claim(key, namespace=namespace) as lease:
        pool, offset, nbytes = lease.extents()[buffer]
    assert at < nbytes
    info = client.pools[pool]
    shm = posix_ipc.SharedMemory(info["name"])
    try:
        mm = mmap.mmap(shm.fd, info["size"])
    finally:
        shm.close_fd()
    try:
        mm[offset + at] ^= 0x5A
    finally:
        mm.close()


@pytest.mark.parametrize("nbytes", [0, 1, 4095, CHUNK, 3 * CHUNK + 17])
def test_copy_hashed_equals_one_shot_hash(nbytes):
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    assert copy_hashed(dst, src, copy_into) == [cs.KIND_XXH3C, cs.digest(src.tobytes())]
    assert np.array_equal(dst, src)


def test_copy_hashed_strided_and_bytes():
    src = np.arange(4096, dtype=np.int32).reshape(64, 64)[:, ::2]  # not contiguous
    dst = np.zeros(src.nbytes, dtype=np.uint8)
    assert copy_hashed(dst, src, copy_into) == cs.encode(cs.digest(np.ascontiguousarray(src)))
    assert np.array_equal(dst.view(np.int32), np.ascontiguousarray(src).reshape(-1))
    raw = b"abc" * 1000
    dst = np.zeros(len(raw), dtype=np.uint8)
    assert copy_hashed(dst, raw, copy_into) == cs.encode(cs.digest(raw))


def test_put_records_checksums_returned_by_lookup_and_claim(client):
    a = np.random.default_rng(1).integers(0, 256, 3 * CHUNK + 5, dtype=np.uint8)
    client.put("k", {"past_key.0": a, "past_value.0": b"xyz", "empty": b""})
    sums = client.lookup("k").checksums
    assert sums == {
        "past_key.0": [cs.KIND_XXH3C, cs.digest(a)],
        "past_value.0": [cs.KIND_XXH3C, cs.digest(b"xyz")],
        "empty": [cs.KIND_XXH3C, cs.digest(b"")],
    }
    with client.claim("k", select=r"past_value\.\d+", verify=True) as lease:
        assert lease.checksums == {"past_value.0": sums["past_value.0"]}
    got = client.get("k", verify=True)
    assert np.array_equal(got["past_key.0"], a) and bytes(got["past_value.0"]) == b"xyz"


def test_reserve_hashes_the_written_view_at_seal(client):
    with client.reserve("w", {"x": 10_000}) as lease:
        lease["x"][:] = 7
    assert client.lookup("w").checksums == {"x": cs.encode(cs.digest(b"\x07" * 10_000))}
    with client.reserve("nosum", {"x": 10}, checksum=False) as lease:
        lease["x"][:] = 1
    assert client.lookup("nosum").checksums is None
    with client.claim("nosum", verify=True) as lease:  # nothing recorded: nothing to check
        assert lease.checksums is None


def test_corrupted_byte_is_never_served(client):
    a = np.arange(2 * CHUNK, dtype=np.uint8)
    client.put("k", {"a": a, "b": b"fine"})
    corrupt(client, "k", "a", at=CHUNK + 3)
    with pytest.raises(ChecksumMismatch) as err:
        client.claim("k", verify=True)
    assert err.value.buffers == ("a",) and err.value.code == "checksum_mismatch"
    assert "default/k" in str(err.value)
    out = {"a": np.zeros(a.nbytes, dtype=np.uint8)}
    with pytest.raises(ChecksumMismatch):
        client.get("k", out, verify=True)
    # The lease of the failed claim was released; the good buffer still verifies alone.
    assert client.stat().read_leases == 0
    with client.claim("k", select="b", verify=True) as lease:
        assert bytes(lease["b"]) == b"fine"
    # Without verify the bytes are served as they are (the caller did not ask).
    assert client.get("k")["a"][CHUNK + 3] != a[CHUNK + 3]


def test_seal_rejects_malformed_checksums(client):
    lease = client.reserve("k", {"a": 4, "b": 4})
    lease.checksums = {"a": 1}  # b missing
    with pytest.raises(BadRequest, match="missing"):
        lease.seal()
    assert client.lookup("k") is None  # nothing half-sealed
    assert client.stat().write_leases == 0  # the refused lease was aborted, pages freed

    lease2 = client.reserve("k2", {"a": 4})
    with pytest.raises(BadRequest, match="64-bit"):
        client._call("seal", lease=lease2.id, checksums={"a": -1})
    with pytest.raises(BadRequest, match="checksums must"):
        client._call("seal", lease=lease2.id, checksums={"a": 1, "zz": 2})
    with pytest.raises(BadRequest, match="unknown checksum kind"):
        client._call("seal", lease=lease2.id, checksums={"a": [7, 1]})
    for bad in ([1, -1], [1], [1, 2, 3], [True, 5], ["1", 5], True, 1.5, "12"):
        with pytest.raises(BadRequest, match="checksum of 'a'"):
            client._call("seal", lease=lease2.id, checksums={"a": bad})
    client._call("seal", lease=lease2.id, checksums={"a": (1 << 64) - 1})
    assert client.lookup("k2").checksums == {"a": (1 << 64) - 1}
    lease3 = client.reserve("k3", {"a": 4})
    client._call("seal", lease=lease3.id, checksums={"a": [1, (1 << 64) - 1]})
    assert client.lookup("k3").checksums == {"a": [1, (1 << 64) - 1]}


def _seal_legacy(client, key, buffers, namespace="default"):
    """Seal ``buffers`` with kind-0 checksums (xxh3_64 of each whole buffer), as clients from
    before kind 1 did."""
    lease = client.reserve(key, {n: len(b) for n, b in buffers.items()}, namespace=namespace)
    for name, data in buffers.items():
        lease[name][:] = np.frombuffer(data, dtype=np.uint8)
    lease.checksums = {n: xxhash.xxh3_64_intdigest(b) for n, b in buffers.items()}
    lease.seal()


def test_objects_sealed_with_legacy_whole_buffer_checksums_still_verify(daemon, client):
    big = np.random.default_rng(5).integers(0, 256, 2 * CHUNK + 99, dtype=np.uint8).tobytes()
    _seal_legacy(client, "old", {"a": big, "b": b"small"})
    assert client.lookup("old").checksums == {
        "a": xxhash.xxh3_64_intdigest(big),
        "b": xxhash.xxh3_64_intdigest(b"small"),
    }
    client.claim("old", verify=True).release()
    got = client.get("old", verify=True)
    assert bytes(got["a"]) == big and bytes(got["b"]) == b"small"
    out = {"a": np.zeros(len(big), dtype=np.uint8)}
    client.get("old", out, verify=True)
    assert out["a"].tobytes() == big
    assert "1 ok, 0 mismatch" in _verify(daemon.socket_path).output

    corrupt(client, "old", "a", at=CHUNK + 5)
    with pytest.raises(ChecksumMismatch) as err:
        client.claim("old", verify=True)
    assert err.value.buffers == ("a",)
    with pytest.raises(ChecksumMismatch):
        client.get("old", verify=True)
    r = _verify(daemon.socket_path, "--json")
    assert r.exit_code == 1 and json.loads(r.output)["objects"][0]["bad"] == ["a"]


def test_a_swapped_chunk_pair_is_caught(client):
    """Two chunks exchanged: every byte is still there, each chunk still hashes the same; the
    combined checksum must not."""
    a = np.random.default_rng(9).integers(0, 256, 3 * CHUNK, dtype=np.uint8)
    client.put("k", {"a": a})
    swapped = a.copy()
    swapped[:CHUNK], swapped[CHUNK : 2 * CHUNK] = a[CHUNK : 2 * CHUNK], a[:CHUNK]
    with client.claim("k") as lease:
        pool, offset, nbytes = lease.extents()["a"]
    info = client.pools[pool]
    shm = posix_ipc.SharedMemory(info["name"])
    try:
        mm = mmap.mmap(shm.fd, info["size"])
    finally:
        shm.close_fd()
    try:
        mm[offset : offset + nbytes] = swapped.tobytes()
    finally:
        mm.close()
    with pytest.raises(ChecksumMismatch):
        client.claim("k", verify=True)


def test_daemon_requiring_checksums_refuses_seal_without(make_daemon):
    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_REQUIRE_CHECKSUMS": "true"}
    )
    with d.client() as c:
        with pytest.raises(BadRequest, match="require_checksums"):
            c.put("k", {"a": b"x"}, checksum=False)
        assert c.put("k", {"a": b"x"})
        assert c.lookup("k").checksums is not None


def _verify(socket_path, *args):
    return runner.invoke(app, ["verify", "--socket", socket_path, *args])


def test_cli_verify_table_json_and_exit_code(daemon, client):
    client.put("good", {"a": b"1" * 5000}, namespace="pd")
    client.put("bad", {"a": b"2" * 5000, "b": b"3"}, namespace="pd")
    client.put("other", {"a": b"4"}, namespace="prefix")
    client.put("plain", {"a": b"5"}, namespace="pd", checksum=False)
    r = _verify(daemon.socket_path)
    assert r.exit_code == 0, r.output
    assert "3 ok, 0 mismatch, 1 unchecked, 0 gone" in r.output

    corrupt(client, "bad", "a", at=4999, namespace="pd")
    r = _verify(daemon.socket_path)
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.output.splitlines() if " bad " in f" {ln} ")
    assert "MISMATCH (a)" in line
    r = _verify(daemon.socket_path, "--json", "--namespace", "pd")
    assert r.exit_code == 1
    report = json.loads(r.output)
    assert report["mismatch"] == 1 and report["ok"] == 1 and report["unchecked"] == 1
    assert {o["key"]: o["status"] for o in report["objects"]} == {
        "good": "ok",
        "bad": "mismatch",
        "plain": "unchecked",
    }
    assert next(o for o in report["objects"] if o["key"] == "bad")["bad"] == ["a"]
    # Selecting around the bad object passes.
    r = _verify(daemon.socket_path, "--match", "^(good|other)$", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["ok"] == 2
    assert client.stat().read_leases == 0  # verify released everything it read


def test_cli_verify_without_daemon(tmp_path):
    r = _verify(str(tmp_path / "none.sock"))
    assert r.exit_code == 3


def test_checksum_mismatch_is_a_kvbroker_error():
    assert issubclass(ChecksumMismatch, KVBrokerError)
    from kvbroker.errors import error_for_code

    assert isinstance(error_for_code("checksum_mismatch", "x"), ChecksumMismatch)


def test_prefix_blocks_carry_checksums_and_corruption_is_caught(make_daemon):
    from kvbroker.prefix import PrefixCache

    d = make_daemon(
        "--pool-size", "8M", "--page-size", "4K", env={"KVBROKER_REQUIRE_CHECKSUMS": "true"}
    )
    with d.client() as c:
        pc = PrefixCache(c, namespace="pfx", block_size=4)
        tokens = list(range(13))  # three full blocks
        blocks = [{"kv": np.full(5000, i, dtype=np.uint8), "empty": b""} for i in range(3)]
        assert pc.publish(tokens, blocks) == 3  # accepted by a daemon requiring checksums
        keys = pc.keys(pc.hashes(tokens))
        for i, key in enumerate(keys):
            assert c.lookup(key, namespace="pfx").checksums == {
                "kv": cs.encode(cs.digest(bytes([i]) * 5000)),
                "empty": cs.encode(cs.digest(b"")),
            }
        corrupt(c, keys[1], "kv", at=4999, namespace="pfx")
        with pytest.raises(ChecksumMismatch):
            c.claim(keys[1], namespace="pfx", verify=True)
        c.claim(keys[0], namespace="pfx", verify=True).release()
        # checksum=False publishes unchecked blocks, which this daemon refuses
        with pytest.raises(BadRequest, match="require_checksums"):
            PrefixCache(c, namespace="pfx2", block_size=4, checksum=False).publish(tokens, blocks)
        assert c.list(namespace="pfx2") == []
        assert c.stat().write_leases == 0  # the refused blocks' leases were aborted


# -- which kind a client seals with: what the daemon's hello lists --------------------------
def test_hello_lists_the_checksum_kinds_and_the_client_seals_kind_1(client):
    assert client._session.hello["checksum_kinds"] == sorted(cs.KINDS) == [0, 1]
    assert client.checksum_kinds == (0, 1) and client.checksum_kind == cs.KIND_XXH3C
    assert cs.seal_kind([0, 1]) == 1 and cs.seal_kind([0]) == 0 and cs.seal_kind(None) == 0


@pytest.fixture
def old_daemon(daemon, monkeypatch):
    """The daemon as one from before kind 1 looks to a client: its hello has no
    ``checksum_kinds``, and a seal or publish carrying ``[kind, value]`` is refused the way
    that daemon's check refused it. Yields the list of checksums maps the seals carried."""
    from kvbroker._client.client import Client
    from kvbroker._client.ops import Ops

    hello = Ops.hello

    def old_hello(self, *args, **kw):
        reply = dict(hello(self, *args, **kw))
        del reply["checksum_kinds"]
        return reply

    call = Client._request
    sealed: list = []

    def old_call(self, op, args):
        maps = {
            "seal": [args.get("checksums")],
            "publish": [args.get("checksums")],
            "seal_many": args.get("checksums") or [],
        }.get(op, [])
        for sums in maps:
            if sums:
                sealed.append(sums)
                if any(not isinstance(v, int) for v in sums.values()):
                    raise BadRequest("checksum must be an unsigned 64-bit integer")
        return call(self, op, args)

    monkeypatch.setattr(Ops, "hello", old_hello)
    monkeypatch.setattr(Client, "_request", old_call)
    yield daemon, sealed


def test_against_a_daemon_without_kind_1_every_publish_seals_kind_0(old_daemon):
    """put (arena and reserve paths), a filled reserve lease, prefix blocks and empty buffers
    all seal the whole-buffer xxh3_64 (a bare integer) that such a daemon accepts; the objects
    verify on claim and get, and a flipped byte is still caught."""
    from kvbroker.prefix import PrefixCache

    daemon, sealed = old_daemon
    big = np.random.default_rng(11).integers(0, 256, 2 * CHUNK + 99, dtype=np.uint8)
    with daemon.client() as c:
        assert c.checksum_kind == cs.KIND_XXH3 and c.checksum_kinds == (0,)
        assert c.put("small", {"a": b"tiny", "e": b""})  # the write arena's one round trip
        assert c.put("big", {"a": big, "strided": big[::2]})
        with c.reserve("filled", {"a": 5000}) as lease:
            lease["a"][:] = 7
        pc = PrefixCache(c, namespace="pfx", block_size=4)
        assert (
            pc.publish(list(range(8)), [{"kv": np.full(300, i, dtype=np.uint8)} for i in range(2)])
            == 2
        )
        assert len(sealed) == 5 and all(isinstance(v, int) for s in sealed for v in s.values())
        want = {
            "small": {"a": xxhash.xxh3_64_intdigest(b"tiny"), "e": xxhash.xxh3_64_intdigest(b"")},
            "big": {
                "a": xxhash.xxh3_64_intdigest(big.tobytes()),
                "strided": xxhash.xxh3_64_intdigest(big[::2].tobytes()),
            },
            "filled": {"a": xxhash.xxh3_64_intdigest(bytes([7]) * 5000)},
        }
        for key, sums in want.items():
            assert c.lookup(key).checksums == sums, key
            c.claim(key, verify=True).release()
            c.get(key, verify=True)
        corrupt(c, "big", "a", at=2 * CHUNK + 50)
        with pytest.raises(ChecksumMismatch) as err:
            c.get("big", verify=True)
        assert err.value.buffers == ("a",)


def test_the_fake_old_daemon_refuses_kind_1(old_daemon):
    """The fixture above must be able to fail: a client that ignored the hello and sealed
    kind 1 is refused by it."""
    daemon, _ = old_daemon
    with daemon.client() as c:
        c.checksum_kind = cs.KIND_XXH3C
        with pytest.raises(BadRequest, match="64-bit"):
            c.put("k", {"a": b"abc"})


def test_a_failed_consumer_does_not_consume(client):
    """A consume claim whose reader fails — an exception inside its block, a checksum
    mismatch in get(verify=True), an `out` name the object lacks — ends without counting:
    the object stays for a retry (as when a consumer crashes), and a good read consumes it."""
    from kvbroker.errors import BadRequest, ChecksumMismatch

    data = np.arange(8192, dtype=np.uint8)
    client.put("once", {"a": data, "b": data[:100]})
    with pytest.raises(RuntimeError):
        with client.claim("once", consume=True):
            raise RuntimeError("the engine failed while copying")
    assert client.exists("once")
    with pytest.raises(BadRequest, match=r"\['c'\].*\['a', 'b'\]"):
        client.get("once", {"c": np.zeros(4, dtype=np.uint8)}, consume=True)
    with pytest.raises(BadRequest, match="select='a'"):
        client.get("once", {"b": np.zeros(100, dtype=np.uint8)}, select="a", consume=True)
    assert client.exists("once")
    corrupt(client, "once", "a", at=17)
    with pytest.raises(ChecksumMismatch):
        client.get("once", consume=True, verify=True)
    assert client.exists("once")
    assert client.stat().read_leases == 0
    client.get("once", consume=True)
    assert not client.exists("once")
