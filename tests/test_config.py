"""The TOML configuration: precedence file < KVBROKER_* < flags, and errors naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbroker._server.config import ConfigError, load_config, parse_listen_address


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "kvbroker.toml"
    path.write_text(text)
    return str(path)


def test_file_then_env_then_flags(tmp_path):
    path = _write(tmp_path, 'pool_size = "256M"\npools = 2\nlease_ttl = "1m"\n'
                            'socket = "/tmp/from-file.sock"\n')
    cfg = load_config(path, env={"KVBROKER_POOL_SIZE": "512M", "KVBROKER_LEASE_TTL": "90s"},
                      flags={"lease_ttl": "2m", "pools": None})
    assert cfg.pool_size == 512 << 20  # env beats the file
    assert cfg.lease_ttl == 120  # the flag beats both
    assert cfg.pools == 2  # a flag left unset (None) does not override
    assert cfg.socket_path == "/tmp/from-file.sock"
    assert cfg.config_path == path


def test_defaults_without_a_file(tmp_path):
    cfg = load_config(None, env={"KVBROKER_CONFIG": ""}, flags={})
    assert (cfg.pools, cfg.page_size, cfg.lease_ttl, cfg.drain_timeout) == (1, 65536, 30, 10)
    assert cfg.metrics is None and cfg.log_level == "info"


@pytest.mark.parametrize("text, message", [
    ('pool_sise = "1G"\n', "unknown key 'pool_sise' (did you mean 'pool_size'?)"),
    ('[serve]\npools = 2\n', "unknown key 'serve'"),
    ('pools = "4"\n', "pools: expected an integer, got '4'"),
    ("pools = 0\n", "pools: must be between 1 and 64, got 0"),
    ('pool_size = "lots"\n', "pool_size: not a size: 'lots'"),
    ("pool_size = 1.5\n", "pool_size: expected a size"),
    ('page_size = "3K"\n', "page_size: must be a power of two of at least 4K"),
    ('lease_ttl = "soon"\n', "lease_ttl: not a duration: 'soon'"),
    ("lease_ttl = 0\n", "lease_ttl: must be more than 0 seconds"),
    ("high_watermark = 1.5\n", "high_watermark: must be in (0, 1], got 1.5"),
    ("high_watermark = 0.5\nlow_watermark = 0.7\n",
     "low_watermark (0.7) must not exceed high_watermark (0.5"),
    ('log_level = "loud"\n', "log_level: expected one of debug, info, warning, error"),
    ('group = "no-such-group-kvb"\n', "group: no group 'no-such-group-kvb'"),
    ('metrics = "localhost"\n', "metrics: expected HOST:PORT"),
    ('pool_size = "4K"\npage_size = "64K"\n', "must hold at least one page"),
    ("pools = [\n", "not valid TOML"),
])  # fmt: skip
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


def test_serve_rejects_a_bad_config_before_starting(tmp_path):
    path = _write(tmp_path, "high_watermark = 2\n")
    res = subprocess.run(
        [sys.executable, "-m", "kvbroker", "serve", "--config", path,
         "--socket", str(tmp_path / "k.sock")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert f"kvbroker: configuration: {path}: high_watermark: must be in (0, 1], got 2" in (
        res.stderr
    )
    assert not (tmp_path / "k.sock").exists()


def test_env_numbers_arrive_as_text():
    cfg = load_config(None, env={"KVBROKER_POOLS": "3", "KVBROKER_HIGH_WATERMARK": "0.99",
                                 "KVBROKER_METRICS": "9464", "KVBROKER_LOG_LEVEL": "DEBUG"})
    assert (cfg.pools, cfg.high_watermark, cfg.metrics) == (3, 0.99, ("127.0.0.1", 9464))
    assert cfg.log_level == "debug"
