"""Every CLI command, through Typer's CliRunner and as a real process, against a real daemon."""

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvbroker.cli import app

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, list(args), env=env)


@pytest.fixture
def loaded(daemon):
    with daemon.client() as c:
        c.put("req-1", {"past_key.0": b"k" * 5000, "past_value.0": b"v" * 5000}, namespace="pd")
        c.put("req-2", {"past_key.0": b"k" * 100}, namespace="pd")
        c.put("blk-1", {"past_key.0_img": b"x" * 10}, namespace="prefix")
    return daemon


def test_stat_human_and_json(loaded):
    r = run("stat", "--socket", loaded.socket_path)
    assert r.exit_code == 0, r.output
    assert "objects 3" in r.output and "POOL" in r.output and "publishes 3" in r.output
    r = run("stat", "--json", "--socket", loaded.socket_path)
    snap = json.loads(r.output)
    assert snap["objects"] == 3 and snap["counters"]["publishes"] == 3
    assert snap["pools"][0]["capacity"] == 64 << 20


def test_socket_from_environment(loaded):
    r = run("stat", "--json", env={"KVBROKER_SOCKET": loaded.socket_path})
    assert r.exit_code == 0 and json.loads(r.output)["objects"] == 3


def test_ls_filters(loaded):
    r = run("ls", "--socket", loaded.socket_path, "--json")
    assert {o["key"] for o in json.loads(r.output)} == {"req-1", "req-2", "blk-1"}
    r = run("ls", "--socket", loaded.socket_path, "--match", "^req", "--json")
    assert {o["key"] for o in json.loads(r.output)} == {"req-1", "req-2"}
    r = run("ls", "--socket", loaded.socket_path, "-n", "prefix")
    assert r.exit_code == 0 and "blk-1" in r.output and "req-1" not in r.output


def test_evict_variants(loaded):
    s = loaded.socket_path
    r = run("evict", "--all", "--dry-run", "--json", "--socket", s)
    assert json.loads(r.output)["count"] == 3 and json.loads(r.output)["dry_run"]
    r = run("evict", "req-1", "--socket", s)
    assert r.exit_code == 0 and "evicted 1 object" in r.output
    r = run("evict", "req-1", "--socket", s)
    assert r.exit_code == 1 and "no object" in r.output
    r = run("evict", "--match-buffers", r"past_key\.\d+_img", "--json", "--socket", s)
    assert [o["key"] for o in json.loads(r.output)["objects"]] == ["blk-1"]
    r = run("evict", "--older-than", "1h", "--socket", s)
    assert "evicted 0 object" in r.output
    r = run("evict", "--all", "--socket", s)
    assert "evicted 1 object" in r.output
    assert json.loads(run("stat", "--json", "--socket", s).output)["objects"] == 0


def test_evict_keeps_leased(loaded):
    with loaded.client() as c, c.claim("req-2", namespace="pd"):
        r = run("evict", "--all", "--socket", loaded.socket_path)
        assert "1 leased object(s) kept" in r.output


def test_usage_errors(loaded):
    assert run("evict", "--socket", loaded.socket_path).exit_code == 2
    r = run("evict", "--older-than", "soon", "--socket", loaded.socket_path)
    assert r.exit_code == 2 and "not a duration" in r.output
    r = run("ls", "--match", "(", "--socket", loaded.socket_path)
    assert r.exit_code == 2 and "bad regex" in r.output  # a usage error (issue 19)
    assert run("serve", "--pool-size", "lots").exit_code == 2


def test_daemon_not_running_exits_3(tmp_path):
    for args in (["stat"], ["ls"], ["evict", "--all"]):
        r = run(*args, "--socket", str(tmp_path / "none.sock"))
        assert r.exit_code == 3, r.output
        assert "none.sock" in r.output


def test_real_processes_and_no_torch_on_fast_paths(loaded):
    env = {**os.environ, "KVBROKER_SOCKET": loaded.socket_path}
    probe = (
        "import sys, runpy; sys.argv = ['kvbroker'] + sys.argv[1:];"
        "\ntry: runpy.run_module('kvbroker', run_name='__main__')"
        "\nexcept SystemExit as e: code = e.code"
        "\nheavy = [m for m in ('torch', 'numpy', 'textual') if m in sys.modules]"
        "\nassert not heavy, heavy"
        "\nsys.exit(code)"
    )
    for args in (["--help"], ["stat"], ["ls"]):
        r = subprocess.run(
            [sys.executable, "-c", probe, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "kvbroker", "evict", "--all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0 and "evicted 3 object" in r.stdout
