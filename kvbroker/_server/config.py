"""The daemon's configuration: a TOML file, overridden by ``KVBROKER_*`` variables, then flags.

Every ``serve`` option has one key here (``pool_size`` <-> ``KVBROKER_POOL_SIZE`` <->
``--pool-size``). Each value is checked where it is read, so an error names the file and key,
the variable or the flag that holds the bad value, never just "invalid configuration".
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from .daemon import DaemonConfig
from .._wire.paths import default_socket_path, parse_duration, parse_size

__all__ = ["DEFAULT_CONFIG_PATH", "ConfigError", "load_config", "parse_listen_address", "KEYS"]

DEFAULT_CONFIG_PATH = "/etc/kvbroker/kvbroker.toml"
CONFIG_ENV = "KVBROKER_CONFIG"
ENV_PREFIX = "KVBROKER_"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message says where."""


# -- value parsers: raise ValueError with what was wrong; the caller adds where ------------
def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size like 1G, 512M or a byte count, got {value!r}")
    n = parse_size(value)
    if n <= 0:
        raise ValueError(f"must be more than 0 bytes, got {value!r}")
    return n


def _gpu_ring(value: Any) -> int | None:
    """Bytes of GPU staging ring per GPU; 0, "off" or "" turn rings off."""
    if value in (0, "0", "", "off"):
        return None
    n = _size(value)
    if n < 1 << 20:
        raise ValueError(f"a GPU ring needs at least 1M, got {value!r}")
    return n


def _page_size(value: Any) -> int:
    n = _size(value)
    if n < 4096 or n & (n - 1):
        raise ValueError(f"must be a power of two of at least 4K, got {value!r}")
    return n


def _duration(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration like 30s, 5m or a number of seconds, got {value!r}")
    seconds = parse_duration(value)
    if seconds < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return seconds


def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    if seconds <= 0:
        raise ValueError(f"must be more than 0 seconds, got {value!r}")
    return seconds


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {value}")
        return value

    return parse


def _ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a fraction like 0.9, got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")
    return float(value)


def _group(value: Any) -> int | None:
    import grp

    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a group name or gid, got {value!r}")
    if isinstance(value, int) or value.isdigit():
        return int(value)
    if value == "":
        return None
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise ValueError(f"no group {value!r} on this host") from None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"expected true or false, got {value!r}")


def _isolation(value: Any):
    from .policy import parse_isolation

    if not isinstance(value, dict):  # an environment variable or a flag
        raise ValueError("set it as an [isolation] table in the configuration file")
    return parse_isolation(value, where="")


def _quotas(value: Any):
    from .policy import parse_quotas

    if not isinstance(value, dict):
        raise ValueError("set it as a [quotas] table in the configuration file")
    return parse_quotas(value, _size, where="")


def _log_level(value: Any) -> str:

    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def _socket(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a socket path, got {value!r}")
    if len(os.fsencode(value)) > 107:
        raise ValueError(f"Unix socket paths are limited to 107 bytes, got {len(value)}")
    return value


_ADDRESS_RE = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d+)$")


def parse_listen_address(value: Any) -> tuple[str, int] | None:
    """'HOST:PORT', '[::1]:PORT', ':PORT' or 'PORT' -> (host, port); '' or 'off' -> None.
    A missing host means loopback: metrics are not for the whole network unless asked."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    text = value.strip()
    if text.lower() in ("", "off", "no", "false"):
        return None
    if text.isdigit():
        text = ":" + text
    m = _ADDRESS_RE.match(text)
    if not m:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {value!r}")
    host = m.group("v6") or m.group("host") or "127.0.0.1"
    port = int(m.group("port"))
    if port > 65535:
        raise ValueError(f"port must be at most 65535, got {port}")
    return host, port


@dataclass(frozen=True)
class Key:
    parse: Callable[[Any], Any]
    field: str  # the DaemonConfig attribute it sets
    help: str

    def parse_text(self, text: str) -> Any:
        """An environment variable's value: numbers arrive as text there, unlike in TOML."""
        if self.parse in _NUMERIC:
            try:
                return self.parse(float(text) if self.parse is _ratio else int(text))
            except ValueError:
                pass  # let parse() word the error about the text itself
        return self.parse(text)


_POOLS, _CONNECTIONS = _int_in(1, 64), _int_in(1, 1 << 20)
_LEASES = _int_in(1, 1 << 24)
_NUMERIC = (_POOLS, _CONNECTIONS, _LEASES, _ratio)


def _write_buffer(value: Any) -> int:
    n = _size(value)
    if n < 64 * 1024:
        raise ValueError(f"must be at least 64K (replies must fit), got {value!r}")
    return n

KEYS: dict[str, Key] = {
    "socket": Key(_socket, "socket_path", "Unix socket the daemon listens on"),
    "pool_size": Key(_size, "pool_size", "bytes per host pool, e.g. 1G"),
    "pools": Key(_POOLS, "pools", "number of host pools"),
    "page_size": Key(_page_size, "page_size", "allocation granule, a power of two"),
    "lease_ttl": Key(_positive_duration, "lease_ttl", "default lease TTL"),
    "high_watermark": Key(_ratio, "high_watermark", "evict above this fraction of a pool"),
    "low_watermark": Key(_ratio, "low_watermark", "...down to this fraction"),
    "group": Key(_group, "group", "group whose members may connect"),
    "log_level": Key(_log_level, "log_level", "debug, info, warning or error"),
    "max_connections": Key(_CONNECTIONS, "max_connections", "client connections"),
    "busy_poll": Key(_duration, "busy_poll", "keep polling this long after a request"),
    "drain_timeout": Key(_duration, "drain_timeout", "SIGTERM waits this long for leases"),
    "metrics": Key(parse_listen_address, "metrics", "HOST:PORT for Prometheus, off if empty"),
    "isolation": Key(_isolation, "isolation", "[isolation] namespace access policy"),
    "quotas": Key(_quotas, "quotas", "[quotas] namespace = byte limit"),
    "require_checksums": Key(_bool, "require_checksums",
                             "refuse seals that carry no checksum per buffer"),
    "max_leases_per_client": Key(_LEASES, "max_leases_per_client",
                                 "leases one connection may hold at once"),
    "max_write_buffer": Key(_write_buffer, "max_write_buffer",
                            "unread replies a connection may pile up before it is cut off"),

    "gpu_ring": Key(_gpu_ring, "gpu_ring", "GPU staging ring per visible GPU, e.g. 1G; off"),
    "keep_pools_on_exit": Key(_bool, "keep_pools_on_exit",
                              "a clean stop keeps pools and index for the next daemon"),
    "cold": Key(_bool, "cold", "start empty: drop what a previous daemon left"),
    "journal": Key(_bool, "journal", "keep the index in a journal for warm restarts"),
    "restart_quarantine": Key(_duration, "restart_quarantine",
                              "pages lent at a crash or cut-off wait this long before reuse"),
}


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _read_file(path: str, required: bool) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such configuration file") from None
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for key, value in data.items():
        if key not in KEYS:
            hint = difflib.get_close_matches(key, KEYS, n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            if isinstance(value, dict):
                extra += ("; the only sections are [isolation] and [quotas], put every other "
                          "key at the top")  # fmt: skip
            raise ConfigError(f"{path}: unknown key {key!r}{extra}")
    return data


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """The :class:`DaemonConfig` from ``path`` (else ``$KVBROKER_CONFIG``, else the default
    file if it exists), then ``KVBROKER_*`` variables, then ``flags`` (key -> value, None
    meaning not given). Raises :class:`ConfigError` naming the bad key."""
    env = os.environ if env is None else env
    required = path is not None or bool(env.get(CONFIG_ENV))
    path = path or env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH
    layers: list[tuple[Callable[[str], str], Mapping[str, Any]]] = [
        (lambda k: f"{path}: {k}", _read_file(path, required)),
        (env_name, {k: env[env_name(k)] for k in KEYS if env.get(env_name(k)) is not None}),
        (flag_name, {k: v for k, v in (flags or {}).items() if v is not None}),
    ]
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name, layer in layers:
        for key, raw in layer.items():
            if key not in KEYS:
                raise ConfigError(f"{name(key)}: unknown setting")
            try:
                if name is env_name:
                    values[key] = KEYS[key].parse_text(raw)
                else:
                    values[key] = KEYS[key].parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{name(key)}: {exc}") from None
            where[key] = name(key)
    cfg = DaemonConfig(socket_path=values.pop("socket", None) or default_socket_path())
    for key, value in values.items():
        setattr(cfg, KEYS[key].field, value)
    if cfg.low_watermark > cfg.high_watermark:
        raise ConfigError(
            f"{where.get('low_watermark', 'low_watermark')}: low_watermark "
            f"({cfg.low_watermark:g}) must not exceed high_watermark ({cfg.high_watermark:g}, "
            f"from {where.get('high_watermark', 'the default')})"
        )
    if cfg.pool_size is not None and cfg.pool_size < cfg.page_size:
        raise ConfigError(
            f"{where['pool_size']}: a pool ({cfg.pool_size} bytes) must hold at least one page "
            f"({cfg.page_size} bytes)"
        )
    cfg.config_path = path if os.path.exists(path) else None
    return cfg
