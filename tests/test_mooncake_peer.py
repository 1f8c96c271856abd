"""benchmarks/mooncake_peer.py, the Mooncake side of ``kvbroker bench peer``, without Mooncake.

A fake ``mooncake`` package stands in for the wheel: ``mooncake.store.MooncakeDistributedStore``
keeps objects in a dict (and, like Mooncake, refuses a plain remove while a read lease holds
the object), and ``mooncake_master`` / ``mooncake_client`` are scripts that listen on their
port until SIGTERM. The driver's own code runs as it does against Mooncake: its orchestration
(ports, start, readiness, stop by process id), its workers, its loop and checks, its JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from kvbroker import _bench
from kvbroker.cli import app

ROOT = pathlib.Path(__file__).resolve().parent.parent
DRIVER = ROOT / "benchmarks" / "mooncake_peer.py"
KiB = 1 << 10

FAKE_STORE = textwrap.dedent('''
    """A stand-in for mooncake.store (tests/test_mooncake_peer.py)."""
    import ctypes, os, socket

    if os.environ.get("FAKE_MOONCAKE_NO_VERBS"):
        raise ImportError("libibverbs.so.1: cannot open shared object file: No such file")

    def _reachable(addr):
        host, port = addr.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return True
        except OSError:
            return False

    class MooncakeDistributedStore:
        def __init__(self):
            self.objects, self.leased, self.pool, self.registered = {}, set(), [], set()
            self.capacity = None

        def setup(self, host, metadata, segment, local_buffer, protocol, devices, master):
            assert metadata == "P2PHANDSHAKE" and protocol == "tcp"
            self.capacity = segment or None
            return 0 if _reachable(master) else -1

        def setup_dummy(self, pool_size, local_buffer, client):
            return 0 if _reachable(client) else -1

        def alloc_from_mem_pool(self, size):
            buf = ctypes.create_string_buffer(size)
            self.pool.append(buf)
            return ctypes.addressof(buf)

        def register_buffer(self, addr, size):
            self.registered.add(addr)
            return 0

        def unregister_buffer(self, addr):
            self.registered.discard(addr)
            return 0

        def put_from(self, key, addr, size):
            if addr not in self.registered or key in self.objects:
                return -1
            used = sum(len(v) for v in self.objects.values())
            if self.capacity is not None and used + size > self.capacity:
                return -200  # no space
            self.objects[key] = ctypes.string_at(addr, size)
            return 0

        def get_into(self, key, addr, size):
            data = self.objects.get(key)
            if data is None or addr not in self.registered:
                return -704
            if os.environ.get("FAKE_MOONCAKE_CORRUPT") and len(data) > 100:
                data = data[:50] + bytes(1) + data[51:]
            ctypes.memmove(addr, data, len(data))
            self.leased.add(key)
            return len(data)

        def remove(self, key, force=False):
            if key not in self.objects:
                return -704
            if key in self.leased and not force:
                return -706  # OBJECT_HAS_LEASE
            del self.objects[key]
            self.leased.discard(key)
            return 0

        def close(self):
            return 0
''')

FAKE_DAEMON = textwrap.dedent('''
    """A stand-in for mooncake_master / mooncake_client: listen on the port, wait for SIGTERM."""
    import os, signal, socket, sys

    port = next(int(a.split("=", 1)[1]) for a in sys.argv
                if a.startswith(("--rpc_port=", "--port=")))
    with open(os.path.join(os.environ["FAKE_MOONCAKE_RECORD"], str(os.getpid())), "w") as f:
        f.write(" ".join(sys.argv))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(16)
    while True:
        s.accept()[0].close()
''')


@pytest.fixture
def fake_mooncake(tmp_path, monkeypatch):
    """PYTHONPATH with the fake package; returns the folder where each fake daemon leaves
    its command line, named by its process id."""
    pkg = tmp_path / "site" / "mooncake"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text(FAKE_STORE)
    for name in ("mooncake_master", "mooncake_client"):
        exe = pkg / name
        exe.write_text(f"#!{sys.executable}\n{FAKE_DAEMON}")
        exe.chmod(0o755)
    record = tmp_path / "daemons"
    record.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_MOONCAKE_RECORD", str(record))
    return record


def run_driver(tmp_path, *args):
    out = tmp_path / "peer.json"
    p = subprocess.run(
        [
            sys.executable,
            str(DRIVER),
            "--json-out",
            str(out),
            "--workdir",
            str(tmp_path / "run"),
            "--segment",
            str(1 << 20),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    results = json.loads(out.read_text()) if out.exists() else None
    return p, results


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_driver_speaks_the_peer_protocol(fake_mooncake, tmp_path):
    p, results = run_driver(
        tmp_path, "--modes", "dummy,embedded,tcp", "--sizes", "4096,65536", "--ops", "5"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r["mode"] for r in results] == ["dummy", "embedded", "tcp"]
    for r in results:
        assert "error" not in r, r
        assert r["setup_s"] >= 0
        assert [z["size"] for z in r["sizes"]] == [4096, 65536]
        for z in r["sizes"]:
            assert z["data_ok"] and z["errors"] == []
            for op in ("put", "get", "memcpy"):
                st = z[op]
                assert st["n"] == 5
                assert 0 < st["median_ms"] <= st["p90_ms"] <= st["p99_ms"]
                assert st["GBps_at_median"] == pytest.approx(z["size"] / st["median_ms"] / 1e6)
        assert r["prefault_s"] >= 0
    # each mode on a Mooncake of its own: a master each, a real client for dummy and tcp,
    # all stopped (by process id) when the driver is done
    lines = {int(f.name): f.read_text() for f in fake_mooncake.iterdir()}
    assert sorted(line.split()[0].rsplit("/", 1)[1] for line in lines.values()) == [
        "mooncake_client",
        "mooncake_client",
        "mooncake_master",
        "mooncake_master",
        "mooncake_master",
    ]
    assert not [pid for pid in lines if alive(pid)]
    assert "dummy" in p.stdout and "put+get ms" in p.stdout  # the table


def test_the_driver_catches_wrong_bytes(fake_mooncake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MOONCAKE_CORRUPT", "1")
    p, results = run_driver(tmp_path, "--modes", "embedded", "--sizes", "4096", "--ops", "3")
    assert p.returncode == 1
    (z,) = results[0]["sizes"]
    assert not z["data_ok"]
    assert "bytes differ" in z["errors"][0]


def test_the_driver_says_what_the_wheel_needs(fake_mooncake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MOONCAKE_NO_VERBS", "1")
    p, results = run_driver(tmp_path, "--modes", "dummy", "--sizes", "4096", "--ops", "3")
    assert p.returncode == 1 and results is None
    assert "libibverbs.so.1: cannot open shared object file" in p.stderr
    assert "libibverbs1 libnl-3-200 libnl-route-3-200" in p.stderr and "dpkg -x" in p.stderr
    assert os.listdir(fake_mooncake) == []  # found out before starting anything


def test_the_driver_without_mooncake(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # no mooncake package there
    if importlib.util.find_spec("mooncake") is not None:
        pytest.skip("Mooncake is installed in this environment")
    p, results = run_driver(tmp_path, "--sizes", "4096", "--ops", "3")
    assert p.returncode == 1 and results is None
    assert "pip install mooncake-transfer-engine-non-cuda" in p.stderr


def test_library_env_puts_the_unpacked_debs_first(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("mooncake_peer", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for sub in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu"):
        (tmp_path / "root" / sub).mkdir(parents=True)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/x")
    env = mod.library_env([str(tmp_path / "root")])
    assert env["LD_LIBRARY_PATH"].split(":") == [
        str(tmp_path / "root/usr/lib/x86_64-linux-gnu"),
        str(tmp_path / "root/usr/lib"),
        str(tmp_path / "root/lib/x86_64-linux-gnu"),
        str(tmp_path / "root/lib"),
        "/opt/x",
    ]


def test_bench_peer_finds_the_driver_of_the_source_tree(
    fake_mooncake, daemon, tmp_path, monkeypatch
):
    monkeypatch.delenv("KVBROKER_PEER_SCRIPT", raising=False)
    peer = _bench.scenario("peer")
    assert peer.default_peer_script() == str(DRIVER)
    out = tmp_path / "peer.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "peer",
            "--mooncake-python",
            sys.executable,
            "--socket",
            daemon.socket_path,
            "--sizes",
            "16K,64K",
            "--ops",
            "3",
            "--json-out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["params"]["peer_script"] == str(DRIVER)
    assert [r["size"] for r in data["rows"]] == [16 * KiB, 64 * KiB]
    for r in data["rows"]:
        assert r["dummy_roundtrip_ms"] > 0 and r["embedded_roundtrip_ms"] > 0


def test_an_installed_kvbroker_asks_for_the_driver(tmp_path, monkeypatch):
    peer = _bench.scenario("peer")
    monkeypatch.delenv("KVBROKER_PEER_SCRIPT", raising=False)
    site = tmp_path / "site-packages" / "kvbroker" / "_bench"
    monkeypatch.setattr(peer, "__file__", str(site / "peer.py"))
    with pytest.raises(peer.PeerFailed, match="pass --peer-script FILE"):
        peer.default_peer_script()
    res = CliRunner().invoke(app, ["bench", "peer", "--mooncake-python", sys.executable])
    assert res.exit_code == 1
    assert "pass --peer-script FILE" in res.output
    assert len(res.output.strip().splitlines()) == 1
    monkeypatch.setenv("KVBROKER_PEER_SCRIPT", "/somewhere/driver.py")
    assert peer.default_peer_script() == "/somewhere/driver.py"
