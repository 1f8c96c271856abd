"""The TOML configuration: precedence file < KVBROKER_* < flags, and errors naming the key;
every setting declared once (config.SETTINGS) shows up in TOML, the environment, `serve`'s
options and the SIGHUP reload."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import secrets
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvbroker._server.config import (
    KEYS,
    OTHER_VARIABLES,
    SETTINGS,
    TO_BROKER,
    ConfigError,
    DaemonConfig,
    load_config,
    parse_listen_address,
)
from kvbroker.cli import app


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "kvbroker.toml"
    path.write_text(text)
    return str(path)


def test_file_then_env_then_flags(tmp_path):
    path = _write(
        tmp_path,
        'pool_size = "256M"\npools = 2\nlease_ttl = "1m"\nsocket = "/tmp/from-file.sock"\n',
    )
    cfg = load_config(
        path,
        env={"KVBROKER_POOL_SIZE": "512M", "KVBROKER_LEASE_TTL": "90s"},
        flags={"lease_ttl": "2m", "pools": None},
    )
    assert cfg.pool_size == 512 << 20  # env beats the file
    assert cfg.lease_ttl == 120  # the flag beats both
    assert cfg.pools == 2  # a flag left unset (None) does not override
    assert cfg.socket_path == "/tmp/from-file.sock"
    assert cfg.config_path == path


def test_defaults_without_a_file(tmp_path):
    cfg = load_config(None, env={"KVBROKER_CONFIG": ""}, flags={})
    assert (cfg.pools, cfg.page_size, cfg.lease_ttl, cfg.drain_timeout) == (1, 65536, 30, 10)
    assert cfg.metrics is None and cfg.log_level == "info"


@pytest.mark.parametrize(
    "text, message",
    [
        ('pool_sise = "1G"\n', "unknown key 'pool_sise' (did you mean 'pool_size'?)"),
        ("[serve]\npools = 2\n", "unknown key 'serve'"),
        ('pools = "4"\n', "pools: expected an integer, got '4'"),
        ("pools = 0\n", "pools: must be between 1 and 64, got 0"),
        ('pool_size = "lots"\n', "pool_size: not a size: 'lots'"),
        ("pool_size = 1.5\n", "pool_size: expected a size"),
        ('page_size = "3K"\n', "page_size: must be a power of two of at least 4K"),
        ('lease_ttl = "soon"\n', "lease_ttl: not a duration: 'soon'"),
        ("lease_ttl = 0\n", "lease_ttl: must be more than 0 seconds"),
        ("high_watermark = 1.5\n", "high_watermark: must be in (0, 1], got 1.5"),
        (
            "high_watermark = 0.5\nlow_watermark = 0.7\n",
            "low_watermark (0.7) must not exceed high_watermark (0.5",
        ),
        ('log_level = "loud"\n', "log_level: expected one of debug, info, warning, error"),
        ('group = "no-such-group-kvb"\n', "group: no group 'no-such-group-kvb'"),
        ('metrics = "localhost"\n', "metrics: expected HOST:PORT"),
        ('pool_size = "4K"\npage_size = "64K"\n', "must hold at least one page"),
        ("pools = [\n", "not valid TOML"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={}, flags={})
    assert str(exc.value).startswith(path + ": ")
    assert message in str(exc.value)


def test_bad_env_and_flag_values_name_their_source(tmp_path):
    with pytest.raises(ConfigError, match=r"^KVBROKER_POOLS: expected an integer, got 'x'"):
        load_config(None, env={"KVBROKER_POOLS": "x"}, flags={})
    with pytest.raises(ConfigError, match=r"^--drain-timeout: not a duration"):
        load_config(None, env={}, flags={"drain_timeout": "later"})


def test_a_named_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_config(str(tmp_path / "missing.toml"), env={})
    with pytest.raises(ConfigError, match="no such configuration file"):
        load_config(None, env={"KVBROKER_CONFIG": str(tmp_path / "missing.toml")})


def test_listen_addresses_default_to_loopback():
    assert parse_listen_address("9464") == ("127.0.0.1", 9464)
    assert parse_listen_address(":9464") == ("127.0.0.1", 9464)
    assert parse_listen_address("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen_address("[::1]:9464") == ("::1", 9464)
    assert parse_listen_address("") is None and parse_listen_address("off") is None
    with pytest.raises(ValueError, match="at most 65535"):
        parse_listen_address(":70000")


def test_read_replicas_beside_a_disk_tier_is_a_config_error(tmp_path):
    """Replicas answer from the journal, which lists the pools' objects only: beside a disk
    tier they would call a block on disk absent. Asked for both, the start stops, naming
    where each came from; auto (and 0) run none beside a disk tier."""
    path = _write(
        tmp_path,
        f'read_replicas = 2\npool_size = "4M"\n[tier.disk]\ndirectories = ["{tmp_path}"]\n'
        'size = "1M"\n',
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={}, flags={})
    msg = str(exc.value)
    assert msg.startswith(f"{path}: read_replicas: read_replicas = 2 cannot run beside [tier.disk]")
    assert "from the journal, which lists the pools' objects only" in msg
    assert "set read_replicas to 0 or auto" in msg
    env = {"KVBROKER_TIER_DISK_DIRECTORIES": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"^--read-replicas: read_replicas = 1 cannot run"):
        load_config(None, env=env, flags={"read_replicas": "1"})
    for replicas in ("auto", "0"):
        cfg = load_config(None, env=env, flags={"read_replicas": replicas})
        assert cfg.tier_disk_directories and not cfg.read_replicas
    res = subprocess.run(
        [sys.executable, "-m", "kvbroker", "serve", "--config", path, "--read-replicas", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVBROKER_SOCKET": str(tmp_path / "k.sock")},
    )
    assert res.returncode == 2, res.stderr
    assert "--read-replicas: read_replicas = 2 cannot run beside [tier.disk]" in res.stderr


def test_serve_rejects_a_bad_config_before_starting(tmp_path):
    path = _write(tmp_path, "high_watermark = 2\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--config",
            path,
            "--socket",
            str(tmp_path / "k.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert f"kvbroker: configuration: {path}: high_watermark: must be in (0, 1], got 2" in (
        res.stderr
    )
    assert not (tmp_path / "k.sock").exists()


def test_env_numbers_arrive_as_text():
    cfg = load_config(
        None,
        env={
            "KVBROKER_POOLS": "3",
            "KVBROKER_HIGH_WATERMARK": "0.99",
            "KVBROKER_METRICS": "9464",
            "KVBROKER_LOG_LEVEL": "DEBUG",
        },
    )
    assert (cfg.pools, cfg.high_watermark, cfg.metrics) == (3, 0.99, ("127.0.0.1", 9464))
    assert cfg.log_level == "debug"


# -- one declaration per setting: every surface comes from config.SETTINGS ------------------
_FLAGGED = [k for k in SETTINGS if k.flags]
_ids = lambda k: k.name  # noqa: E731


def _toml_value(v) -> str:
    if isinstance(v, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _toml(key) -> str:
    """``key = <its example>`` as TOML (a table for [isolation], [quotas], ...)."""
    if key.table:
        body = "".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in key.example.items())
        return f"[{key.name}]\n{body}"
    if key.section:  # [transfer] listen = ...
        return f"[{key.section}]\n{key.toml_name} = {json.dumps(key.example)}\n"
    return f"{key.name} = {json.dumps(key.example)}\n"  # JSON strings, numbers and bools are TOML


def _text(value) -> str:
    if isinstance(value, list):  # a list in a variable: comma-separated ([transfer] peers)
        return ",".join(map(str, value))
    return json.dumps(value) if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("key", SETTINGS, ids=_ids)
def test_a_declared_setting_is_a_field_a_toml_key_and_a_variable(tmp_path, key):
    default, want = getattr(DaemonConfig(), key.attr), key.parse(key.example)
    assert want != default, "the example must differ from the default"
    cfg = load_config(_write(tmp_path, _toml(key)), env={})
    assert getattr(cfg, key.attr) == want
    if key.table:  # a table has no one-line form: the variable says where to put it
        with pytest.raises(ConfigError, match=rf"^{key.env}: set it as an? \[{key.name}\] table"):
            load_config(None, env={key.env: "x"})
    else:
        assert getattr(load_config(None, env={key.env: _text(key.example)}), key.attr) == want
    assert key.help


def test_serve_has_one_option_per_flagged_setting_and_no_other():
    r = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", r.output)) - {"--config", "--help"}
    declared = {
        f for k in _FLAGGED for decl in k.flags for f in decl.split("/") if f.startswith("--")
    }
    assert shown == declared
    assert {k.name for k in _FLAGGED} >= {"socket", "pool_size", "lease_ttl", "cold"}


@pytest.mark.parametrize("key", _FLAGGED, ids=_ids)
def test_a_flag_reaches_the_daemons_configuration(tmp_path, monkeypatch, key):
    import kvbroker._server.daemon as daemon_mod

    got = []
    monkeypatch.setattr(daemon_mod, "run_daemon", lambda cfg, reload: got.append(cfg) or 0)
    monkeypatch.delenv("KVBROKER_READ_REPLICAS", raising=False)  # conftest's: not a flag
    flag = key.flags[0].split("/")[0]
    args = [flag] if key.text is bool else [flag, _text(key.example)]
    r = CliRunner().invoke(app, ["serve", "--config", _write(tmp_path, ""), *args])
    assert r.exit_code == 0, r.output
    assert getattr(got[0], key.attr) == key.parse(key.example)
    others = [k for k in SETTINGS if k is not key and k.attr != "socket_path"]
    assert all(getattr(got[0], k.attr) == getattr(DaemonConfig(), k.attr) for k in others)


@pytest.mark.parametrize("key", SETTINGS, ids=_ids)
def test_sighup_applies_a_reloadable_setting_and_names_the_others(caplog, key):
    from kvbroker._server.daemon import Daemon

    new = DaemonConfig()
    setattr(new, key.attr, key.parse(key.example))
    d = Daemon(DaemonConfig(), reload_config=lambda: new)
    before = getattr(d.config, key.attr)
    level = logging.getLogger().level
    try:
        with caplog.at_level(logging.INFO, logger="kvbroker.daemon"):
            d.reload()
    finally:
        logging.getLogger().setLevel(level)
    if key.reloadable:
        assert getattr(d.config, key.attr) == getattr(new, key.attr)
        assert f"{key.attr} {before!r} -> " in caplog.text and "needs a restart" not in caplog.text
    else:
        assert getattr(d.config, key.attr) == before
        assert f"{key.attr} changed" in caplog.text and "needs a restart" in caplog.text


def test_sighup_reaches_the_broker_and_the_connections(tmp_path):
    """Each reloadable setting's ``reload`` lands where the running daemon reads it."""
    from kvbroker._server.broker import Broker
    from kvbroker._server.daemon import Daemon
    from kvbroker._server.pool import HostPool

    class Transport:
        limit = None

        def set_write_buffer_limits(self, high):
            self.limit = high

    class Conn:
        transport, closed = Transport(), False

    new = DaemonConfig()
    for key in SETTINGS:
        if key.reloadable:
            setattr(new, key.attr, key.parse(key.example))
    to_broker = [k.attr for k in SETTINGS if k.reload is TO_BROKER]
    assert to_broker
    pool = HostPool(0, f"/kvbcfg.{os.getpid()}.{secrets.token_hex(3)}", 1 << 20, 4096)
    level = logging.getLogger().level
    try:
        d = Daemon(DaemonConfig(), reload_config=lambda: new)
        d.broker = Broker([pool])
        conn = Conn()
        d.connections.add(conn)
        missing = [a for a in to_broker if not hasattr(d.broker, a)]
        assert not missing, f"Broker has no attribute {missing}"  # setattr would invent one
        d.reload()
        assert {a: getattr(d.broker, a) for a in to_broker} == {
            a: getattr(new, a) for a in to_broker
        }
        assert (d.broker.policy, d.broker.quotas) == (new.isolation, new.quotas)
        assert d.broker.retention.settings == new.retention_settings()  # [sessions]
        assert conn.transport.limit == new.max_write_buffer
        assert logging.getLogger().level == getattr(logging, new.log_level.upper())
        assert d.config == new
    finally:
        logging.getLogger().setLevel(level)
        pool.unlink()


def test_an_unknown_toml_key_is_refused(tmp_path):
    path = _write(tmp_path, "max_conections = 10\n")
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'max_conections' \(did you mean "
        r"'max_connections'\?\)",
    ):
        load_config(path, env={})


def test_an_unknown_variable_is_refused_like_an_unknown_key():
    with pytest.raises(ConfigError) as exc:
        load_config(None, env={"KVBROKER_POOLSIZE": "1G"})
    assert str(exc.value) == (
        "unknown variable 'KVBROKER_POOLSIZE' (did you mean 'KVBROKER_POOL_SIZE'?)"
    )
    with pytest.raises(ConfigError, match=r"^unknown variable 'KVBROKER_XYZZY'$"):
        load_config(None, env={"KVBROKER_XYZZY": ""})
    # variables other parts of kvbroker read are not settings, and not unknown either
    cfg = load_config(
        None,
        env={
            **dict.fromkeys(OTHER_VARIABLES, "1"),
            "KVBROKER_CONFIG": "",
            "OTHER_PREFIX_POOLSIZE": "x",
        },
    )
    assert cfg == load_config(None, env={})


def test_serve_and_doctor_refuse_an_unknown_variable(tmp_path):
    env = {**os.environ, "KVBROKER_POOLSIZE": "1G"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbroker",
            "serve",
            "--config",
            _write(tmp_path, ""),
            "--socket",
            str(tmp_path / "k.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2
    assert (
        "kvbroker: configuration: unknown variable 'KVBROKER_POOLSIZE' (did you mean "
        "'KVBROKER_POOL_SIZE'?)"
    ) in res.stderr
    assert not (tmp_path / "k.sock").exists()
    r = CliRunner().invoke(
        app, ["doctor", "--config", _write(tmp_path, "")], env={"KVBROKER_POOLSIZE": "1G"}
    )
    assert r.exit_code == 2 and "did you mean 'KVBROKER_POOL_SIZE'?" in r.output


def test_every_kvbroker_variable_in_the_repository_is_known():
    """A new KVBROKER_* knob elsewhere must be declared (a setting, or OTHER_VARIABLES), or
    every daemon started under it would refuse to start. A REMOVED one is declared too: a
    daemon refuses it naming what to set instead (a benchmark may still drive an old
    daemon with it)."""
    from kvbroker._server.config import REMOVED, env_name

    root = pathlib.Path(__file__).resolve().parent.parent
    known = {k.env for k in SETTINGS} | OTHER_VARIABLES.keys() | {env_name(k) for k in REMOVED}
    paths = [root / "README.md", root / "Makefile"] + [
        p
        for folder in (
            "kvbroker",
            "cli",
            "tui",
            "tests",
            "benchmarks",
            "examples",
            "systemd",
            "docs",
        )
        for p in (root / folder).rglob("*")
        if p.suffix in (".py", ".md", ".toml", ".service", ".socket", ".sh")
        and p != pathlib.Path(__file__).resolve()  # this file names unknown ones on purpose
        # records of past runs (an experiment's setting that never landed, say), not knobs
        and "results" not in p.relative_to(root).parts
    ]
    found = {
        name: str(p.relative_to(root))
        for p in paths
        for name in re.findall(r"KVBROKER_[A-Z0-9_]*[A-Z0-9]", p.read_text())
    }
    unknown = {n: where for n, where in found.items() if n not in known}
    assert not unknown, f"undeclared KVBROKER_* variables: {unknown}"
    assert len(KEYS) == len(SETTINGS)


def test_a_removed_setting_is_refused_naming_what_to_set(tmp_path):
    """The shared-token peer channel is gone (issue 38): its key and variable are refused
    with the mutual TLS settings to set, not as unknown."""
    path = _write(tmp_path, '[transfer]\ntoken_file = "/etc/kvbroker/peer.token"\n')
    with pytest.raises(
        ConfigError,
        match=r"\[transfer\] token_file: .*set \[transfer\] "
        r"cert_file, key_file and ca_file",
    ):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"^KVBROKER_TRANSFER_TOKEN_FILE: .*cert_file"):
        load_config(None, env={"KVBROKER_TRANSFER_TOKEN_FILE": "/x"})
