"""kvbroker.testing: what users' own test suites get (a private daemon, pytest fixtures)."""

import os
import signal

import pytest

from kvbroker.testing import drop_leftover_pools, running_daemon


def test_running_daemon_serves_a_private_socket_and_cleans_up():
    with running_daemon(pool_size="8M") as daemon, daemon.client() as c:
        assert c.put("k", {"x": b"abc"})
        assert bytes(c.get("k")["x"]) == b"abc"
        assert c.stat().pools[0].capacity == 8 << 20
        names = [p["name"] for p in c.pools]
        sock_dir = os.path.dirname(daemon.socket_path)
    assert not os.path.exists(sock_dir)  # the temporary directory went with it
    for name in names:  # and the pools were unlinked
        assert not os.path.exists("/dev/shm" + name)


def test_running_daemon_reports_a_daemon_that_did_not_exit_cleanly():
    with pytest.raises(RuntimeError, match="exited with"):
        with running_daemon() as daemon:
            with daemon.client() as c:
                names = [p["name"] for p in c.pools]
            daemon.proc.kill()
            daemon.proc.wait()
            assert all(os.path.exists("/dev/shm" + n) for n in names)  # kept for a successor
    for name in names:  # which a private socket never gets: they went with it
        assert not os.path.exists("/dev/shm" + name)


def test_drop_leftover_pools_frees_what_a_killed_daemon_left(make_daemon):
    d = make_daemon("--pool-size", "4M")
    with d.client() as c:
        names = [p["name"] for p in c.pools]
        c.put("k", {"x": b"kv"})
    d.stop(signal.SIGKILL)
    assert drop_leftover_pools(d.socket_path) == names
    assert not any(os.path.exists("/dev/shm" + n) for n in names)
    assert drop_leftover_pools(d.socket_path) == []  # nothing left: a no-op


def test_bad_arguments_fail_with_the_daemons_message():
    with pytest.raises(RuntimeError, match="pool"):
        with running_daemon(pool_size="nonsense"):
            pass


def test_pytest_plugin_fixtures_in_a_users_suite(pytester):
    pytester.makeconftest('pytest_plugins = ["kvbroker.testing"]\n')
    pytester.makepyfile(
        """
        def test_engine_connector(kvbroker_client, kvbroker_daemon):
            kvbroker_client.put("req-1", {"past_key.0": b"k" * 100})
            with kvbroker_daemon.client() as other:
                with other.claim("req-1", consume=True) as lease:
                    assert bytes(lease["past_key.0"]) == b"k" * 100
            assert not kvbroker_client.exists("req-1")
        """
    )
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_daemon_log_is_readable_after_stop(tmp_path):
    from kvbroker.testing import DaemonProcess

    d = DaemonProcess(str(tmp_path / "kvb.sock"), "--pool-size", "4M")
    assert d.stop() == 0
    log = d.log()  # the log file is closed now; reading it must still work
    assert "stopped" in log
    drop_leftover_pools(d.socket_path)


def test_running_daemon_starts_no_read_replicas_unless_asked(monkeypatch):
    """A user's test daemon answers every read itself (counters at once), whatever the CPU
    count of the machine running the suite; replicas when the test asks, either way."""
    monkeypatch.delenv("KVBROKER_READ_REPLICAS", raising=False)  # (tests/conftest.py sets it)
    with running_daemon() as daemon, daemon.client() as c:
        argv = daemon.proc.args
        assert argv[argv.index("--read-replicas") + 1] == "0"  # not `auto`
        assert c.stat().read_replicas == 0
    with running_daemon("--read-replicas", "1") as daemon, daemon.client() as c:
        assert daemon.proc.args.count("--read-replicas") == 1
        assert c.stat().read_replicas == 1
    with running_daemon(env={"KVBROKER_READ_REPLICAS": "2"}) as daemon, daemon.client() as c:
        assert "--read-replicas" not in daemon.proc.args
        assert c.stat().read_replicas == 2
