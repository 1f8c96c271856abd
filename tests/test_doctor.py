"""``kvbroker doctor``: each check finds what it is about and says how to fix it."""

from __future__ import annotations

import json
import os
import socket
import platform
import subprocess
import sys

import pytest

from kvbroker._server.daemon import DaemonConfig
from kvbroker._server.doctor import check_memlock, check_shm, check_socket_dir, render, run_checks


def test_shm_too_small_fails_with_a_fix():
    c = check_shm(DaemonConfig(pool_size=1 << 50, pools=2))
    assert c.status == "fail"
    assert "pools need 2048.0 TiB (2 x 1024.0 TiB)" in c.detail
    assert "--shm-size" in c.fix and "remount" in c.fix


def test_shm_big_enough_passes():
    c = check_shm(DaemonConfig(pool_size=1 << 20, pools=1))
    assert c.status == "ok", c


def test_memlock_compares_against_the_pools():
    assert check_memlock(DaemonConfig(pool_size=4096, page_size=4096)).status == "ok"
    c = check_memlock(DaemonConfig(pool_size=1 << 50))
    if c.detail != "unlimited":
        assert c.status in ("warn", "fail") and "LimitMEMLOCK=infinity" in c.fix


def test_socket_dir_checks(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    c = check_socket_dir(DaemonConfig(socket_path=str(loose / "k.sock")))
    assert c.status == "fail" and "anyone may replace the socket" in c.detail

    fresh = check_socket_dir(DaemonConfig(socket_path=str(tmp_path / "new" / "k.sock")))
    assert fresh.status == "ok" and "will be created" in fresh.detail

    tight = tmp_path / "tight"
    tight.mkdir(mode=0o755)
    path = str(tight / "k.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        os.chmod(path, 0o666)
        c = check_socket_dir(DaemonConfig(socket_path=path))
        assert c.status == "fail" and "every user may connect" in c.detail
        os.chmod(path, 0o660)
        assert check_socket_dir(DaemonConfig(socket_path=path)).status == "ok"


def test_render_prints_fixes_for_failures():
    checks = run_checks(DaemonConfig(pool_size=1 << 50))
    text = render(checks)
    assert "FAIL  /dev/shm" in text and "fix: grow it" in text
    assert text.splitlines()[-1].startswith(f"{sum(c.status == 'fail' for c in checks)} failed")


def _doctor(tmp_path, *args):
    env = {**os.environ, "KVBROKER_CONFIG": ""}
    return subprocess.run(
        [sys.executable, "-m", "kvbroker", "doctor", "--socket", str(tmp_path / "k.sock"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_doctor_command_exit_status(tmp_path):
    conf = tmp_path / "big.toml"
    conf.write_text('pool_size = "1000T"\n')
    bad = _doctor(tmp_path, "--config", str(conf))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL  /dev/shm" in bad.stdout
    conf.write_text('pool_size = "1M"\npage_size = "4K"\n')
    ok = _doctor(tmp_path, "--config", str(conf), "--json")
    checks = {c["name"]: c for c in json.loads(ok.stdout)}
    assert checks["/dev/shm"]["status"] == "ok"
    assert set(checks) >= {
        "memlock",
        "/dev/shm",
        "socket directory",
        "GPU visibility",
        "cudaHostRegister",
        "service user",
    }
    assert ok.returncode == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)


def test_doctor_imports_torch_only_for_a_gpu():
    code = (
        "import sys; from kvbroker._server.doctor import run_checks; "
        "from kvbroker._server.daemon import DaemonConfig; run_checks(DaemonConfig(pool_size=1<<20)); "
        "import glob; print('torch' in sys.modules, bool(glob.glob('/dev/nvidia[0-9]*')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    imported, gpu = (word == "True" for word in out)
    if not gpu:
        assert not imported, "torch imported on a host without a GPU"


def test_checksum_hash_warns_on_an_xxhash_without_simd_dispatch(monkeypatch):
    from kvbroker._server.doctor import check_checksum_hash
    from kvbroker._wire import checksum

    monkeypatch.setattr(checksum, "simd_dispatch", lambda: False)
    c = check_checksum_hash(DaemonConfig())
    assert c.status == "warn", c
    assert "SSE2 only" in c.detail and "GB/s on one core" in c.detail
    assert "xxhash>=4.1" in c.fix
    monkeypatch.setattr(checksum, "simd_dispatch", lambda: True)
    c = check_checksum_hash(DaemonConfig())
    assert c.status == "ok" and "AVX2 / AVX-512 chosen at run time" in c.detail, c
    assert "checksum hash" in render(run_checks(DaemonConfig()))


def test_copy_engine_check_says_which_loops_run(monkeypatch):
    from kvbroker._server.doctor import check_copy_engine

    pytest.importorskip("kvbroker._copyhash", reason="C loops not built here")
    monkeypatch.delenv("KVBROKER_NATIVE_COPY", raising=False)
    c = check_copy_engine(DaemonConfig())
    assert c.status == "ok" and "one GIL release per range" in c.detail, c
    if platform.machine() in ("x86_64", "AMD64"):  # (SSE2 is always there)
        assert "store non-temporally" in c.detail, c
    monkeypatch.setenv("KVBROKER_NATIVE_COPY", "0")
    c = check_copy_engine(DaemonConfig())
    assert c.status == "warn" and "KVBROKER_NATIVE_COPY=0" in c.detail, c
    monkeypatch.setitem(sys.modules, "kvbroker._copyhash", None)  # as if never built
    c = check_copy_engine(DaemonConfig())
    assert c.status == "warn" and "was not built" in c.detail and "python3-dev" in c.fix, c


def test_copy_engine_check_names_why_the_one_pass_loop_is_off(monkeypatch):
    """A one-pass loop that disagreed with xxHash is a warning, not 'no AVX2'."""
    from kvbroker import _copyhash
    from kvbroker._server.doctor import check_copy_engine

    pytest.importorskip("kvbroker._copyhash", reason="C loops not built here")
    monkeypatch.delenv("KVBROKER_NATIVE_COPY", raising=False)
    for state, status, says in [
        ("digests differ", "warn", "disagreed with xxHash"),
        ("no AVX2", "ok", "no AVX2 here"),
        ("one pass", "ok", "in one pass (AVX2)"),
        ("not built", "ok", "no one-pass loop for this architecture"),
    ]:
        monkeypatch.setattr(_copyhash, "fused_state", lambda s=state: s)
        c = check_copy_engine(DaemonConfig())
        assert c.status == status and says in c.detail, (state, c)
    assert "report the CPU" in c.fix or c.status == "ok"


def test_copy_engine_check_fails_where_the_c_loops_digests_are_wrong(monkeypatch):
    """Wrong digests from the C loops make every client's engine fall back to the Python
    loops (kvbroker._client.engine checks them at import): said so, not 'C loops'."""
    from kvbroker import _copyhash
    from kvbroker._server.doctor import check_copy_engine

    pytest.importorskip("kvbroker._copyhash", reason="C loops not built here")
    monkeypatch.delenv("KVBROKER_NATIVE_COPY", raising=False)
    real = _copyhash.hash_chunks
    monkeypatch.setattr(_copyhash, "hash_chunks", lambda b, n: [d ^ 1 for d in real(b, n)])
    c = check_copy_engine(DaemonConfig())
    assert c.status == "warn" and "digests are not xxhash's" in c.detail, c
    monkeypatch.setattr(_copyhash, "hash_chunks", real)
    assert check_copy_engine(DaemonConfig()).status == "ok"


def test_prefix_scan_check_says_which_pass_runs(monkeypatch):
    from kvbroker._server.doctor import check_prefix_scan

    pytest.importorskip("kvbroker._prefixscan", reason="C pass not built here")
    c = check_prefix_scan(DaemonConfig())
    assert c.status == "ok" and "csrc/prefixscan.c" in c.detail, c
    assert "prefix scan" in render(run_checks(DaemonConfig()))
    monkeypatch.setitem(sys.modules, "kvbroker._prefixscan", None)  # as if never built
    c = check_prefix_scan(DaemonConfig())
    assert c.status == "warn" and "was not built" in c.detail and "python3-dev" in c.fix, c


def test_the_installed_xxhash_chooses_its_simd_path_at_run_time():
    # pyproject asks for xxhash>=4.1, the first whose x86-64 wheels carry xxHash's dispatcher;
    # an install that resolved an older one hashes every host checksum at SSE2 speed.
    import platform

    from kvbroker._wire.checksum import simd_dispatch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert simd_dispatch() is None
    else:
        assert simd_dispatch() is True


def test_peer_tls_check_handshakes_with_itself(tmp_path):
    """[transfer]: off is skipped; peers without the TLS files fail naming them; the node's
    own certificate verified by its CA (an in-memory handshake) reports the hosts it names;
    a CA that did not sign it fails."""
    from kvbroker._server.doctor import check_peer_tls
    from kvbroker.testing import peer_certificates

    mine = peer_certificates(tmp_path / "fleet", {"a": ["10.0.0.1", "node-a.example"]})["a"]
    other = peer_certificates(tmp_path / "other", {"x": ["10.0.0.1"]}, ca_name="other")["x"]
    cfg = DaemonConfig()
    assert check_peer_tls(cfg).status == "skip"
    cfg.transfer_peers = ("10.0.0.2:7070",)
    c = check_peer_tls(cfg)
    assert c.status == "fail" and "cert_file and key_file and ca_file not set" in c.detail
    cfg.transfer_cert_file, cfg.transfer_key_file = mine["cert_file"], mine["key_file"]
    cfg.transfer_ca_file = mine["ca_file"]
    c = check_peer_tls(cfg)  # valid for 2 days: a warning to renew
    assert c.status == "warn" and "names 10.0.0.1, node-a.example" in c.detail, c
    cfg.transfer_ca_file = other["ca_file"]
    c = check_peer_tls(cfg)
    assert c.status == "fail" and "certificate verify failed" in c.detail, c


def test_disk_tier_settings_without_directories_are_said(make_daemon):
    """[tier.disk] size (or another of its keys) set but no directories: the operator asked
    for a disk tier and gets none. doctor warns, naming the keys, and so does the daemon's
    log at start; unset, nothing is said."""
    from kvbroker._server import doctor

    cfg = DaemonConfig(tier_disk_size=512 << 30, tier_disk_policy="sealed")
    c = doctor.check_disk_tier(cfg)
    assert c.status == "warn" and c.fix, c
    assert c.detail.startswith("[tier.disk] size, [tier.disk] policy set, but no [tier.disk] ")
    assert doctor.check_disk_tier(DaemonConfig()).status == "skip"
    d = make_daemon("--pool-size", "4M", env={"KVBROKER_TIER_DISK_SIZE": "1G"})
    with d.client() as client:
        assert client.stat().disk is None
    assert "[tier.disk] size set, but no [tier.disk] directories: no disk tier" in d.log()


def test_disk_tier_check_names_the_file_system_and_o_direct(tmp_path, monkeypatch):
    from kvbroker._server import disk_store, doctor

    assert doctor.check_disk_tier(DaemonConfig()).status == "skip"
    cfg = DaemonConfig(tier_disk_directories=(str(tmp_path / "tier"),), tier_disk_size=1 << 20)
    c = doctor.check_disk_tier(cfg)
    assert c.status == "ok", c
    assert "O_DIRECT" in c.detail and "missing (the daemon creates it)" in c.detail
    assert "no read replicas beside it" in c.detail  # and why
    fstype = doctor._filesystem(str(tmp_path))[1]
    assert fstype != "?" and fstype in c.detail
    # A file system that refuses O_DIRECT: the fallback is said, with a fix.
    monkeypatch.setattr(
        disk_store, "probe_direct", lambda d: "open with O_DIRECT: Invalid argument"
    )
    c = doctor.check_disk_tier(cfg)
    assert c.status == "warn" and "buffered I/O" in c.detail and "O_DIRECT" in c.fix
    # More than the file system has free: a failure.
    big = DaemonConfig(tier_disk_directories=(str(tmp_path),), tier_disk_size=1 << 62)
    assert doctor.check_disk_tier(big).status == "fail"
