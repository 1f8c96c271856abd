"""The value parsers of the daemon's settings: a TOML value (or a variable's text, or a
flag's value) to the setting, or ValueError saying what was wrong with it.

Each :class:`~kvbroker._server.config.Key` in :data:`~kvbroker._server.config.SETTINGS`
names its parser here; the caller (:func:`~kvbroker._server.config.load_config`) adds where
the value came from (file and key, variable or flag). A new setting whose values none of
these parse gets its parser here. Cheap to import: the CLI imports it for ``serve``'s
options (``grp`` and :mod:`kvbroker._server.policy` are imported when a value needs them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from .._wire.paths import parse_duration, parse_size

__all__ = [
    "CONNECTIONS",
    "LEASES",
    "LOG_LEVELS",
    "POOLS",
    "boolean",
    "duration",
    "event_format",
    "gpu_ring",
    "group",
    "int_in",
    "isolation",
    "log_level",
    "model_name",
    "node_name",
    "optional_path",
    "page_size",
    "parse_listen_address",
    "peers",
    "positive_duration",
    "quotas",
    "ratio",
    "replicas",
    "serve_rules",
    "size",
    "socket_path",
    "tenant_pools",
    "write_buffer",
    "zmq_endpoint",
    "optional_size",
]

LOG_LEVELS = ("debug", "info", "warning", "error")


def size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a size like 1G, 512M or a byte count, got {value!r}")
    n = parse_size(value)
    if n <= 0:
        raise ValueError(f"must be more than 0 bytes, got {value!r}")
    return n


def optional_size(value: Any) -> int | None:
    """A size, or "off" (None): no such limit."""
    if value in ("off", ""):
        return None
    return size(value)


def gpu_ring(value: Any) -> int | None:
    """Bytes of GPU staging ring per GPU; 0, "off" or "" turn rings off."""
    if value in (0, "0", "", "off"):
        return None
    n = size(value)
    if n < 1 << 20:
        raise ValueError(f"a GPU ring needs at least 1M, got {value!r}")
    return n


def page_size(value: Any) -> int:
    n = size(value)
    if n < 4096 or n & (n - 1):
        raise ValueError(f"must be a power of two of at least 4K, got {value!r}")
    return n


def duration(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration like 30s, 5m or a number of seconds, got {value!r}")
    seconds = parse_duration(value)
    if seconds < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return seconds


def positive_duration(value: Any) -> float:
    seconds = duration(value)
    if seconds <= 0:
        raise ValueError(f"must be more than 0 seconds, got {value!r}")
    return seconds


def int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        if not lo <= value <= hi:
            raise ValueError(f"must be between {lo} and {hi}, got {value}")
        return value

    return parse


def replicas(value: Any) -> int | None:
    """``read_replicas``: "auto" (None: sized from the CPUs at start) or a count, 0 for none."""
    if value == "auto" or value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'expected "auto" or a number of replicas, got {value!r}')
    if not 0 <= value <= 64:
        raise ValueError(f'must be "auto" or between 0 and 64, got {value}')
    return value


def ratio(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a fraction like 0.9, got {value!r}")
    if not 0 < value <= 1:
        raise ValueError(f"must be in (0, 1], got {value}")
    return float(value)


def group(value: Any) -> int | None:
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


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"expected true or false, got {value!r}")


def isolation(value: Any):
    from .policy import parse_isolation

    if not isinstance(value, dict):  # an environment variable or a flag
        raise ValueError("set it as an [isolation] table in the configuration file")
    return parse_isolation(value, where="")


def quotas(value: Any):
    from .policy import parse_quotas

    if not isinstance(value, dict):
        raise ValueError("set it as a [quotas] table in the configuration file")
    return parse_quotas(value, size, where="")


def tenant_pools(value: Any):
    from .policy import parse_tenant_pools

    if not isinstance(value, dict):
        raise ValueError(
            "set it as a [tenant_pools] table ([tenant_pools.NAME] tables) in the "
            "configuration file"
        )
    return parse_tenant_pools(value, size, where="")


def log_level(value: Any) -> str:

    if not isinstance(value, str) or value.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return value.lower()


def socket_path(value: Any) -> str:
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


def write_buffer(value: Any) -> int:
    n = size(value)
    if n < 64 * 1024:
        raise ValueError(f"must be at least 64K (replies must fit), got {value!r}")
    return n


POOLS, CONNECTIONS, LEASES = int_in(1, 64), int_in(1, 1 << 20), int_in(1, 1 << 24)
IO_THREADS = int_in(1, 64)


def peers(value: Any) -> tuple[str, ...]:
    """A list of HOST:PORT (TOML), or one comma-separated string (a variable)."""
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of HOST:PORT strings, got {value!r}")
    for v in value:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"expected HOST:PORT, got {v!r}")
    return tuple(value)


def serve_rules(value: Any) -> tuple[tuple[str | None, str], ...]:
    """``[transfer] serve``: the namespaces peers may pull from this daemon, as globs
    (``"team-a/*"``), each for every configured peer or, written ``"HOST=GLOB"``, for the
    peer of that host only. A list (TOML) or one comma-separated string (a variable).
    Returns ``(host or None, glob)`` pairs."""
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f'expected a list of namespace globs ("prefix", "team-a/*", '
            f'"HOST=GLOB" for one peer), got {value!r}'
        )
    rules = []
    for v in value:
        host, sep, glob = v.rpartition("=")
        if (sep and not host) or not glob or len(glob) > 512:
            raise ValueError(f"expected a namespace glob or HOST=GLOB, got {v!r}")
        rules.append((host.lower() if sep else None, glob))
    return tuple(rules)


def directories(value: Any) -> tuple[str, ...]:
    """A list of absolute directory paths (TOML), or one comma-separated string (a
    variable); empty: none."""
    if isinstance(value, str):
        value = [v for v in (p.strip() for p in value.split(",")) if v]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"expected a list of directory paths, got {value!r}")
    for v in value:
        if not v.startswith("/"):
            raise ValueError(f"expected an absolute directory path, got {v!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"a directory is named twice in {list(value)!r}")
    return tuple(value)


def disk_policy(value: Any) -> str:
    if value not in ("evicted", "sealed"):
        raise ValueError(
            f'expected "evicted" (write back what the pools would evict) or '
            f'"sealed" (every sealed object), got {value!r}'
        )
    return value


def optional_path(value: Any) -> str | None:
    if not isinstance(value, str):
        raise ValueError(f"expected a file path, got {value!r}")
    return value or None


def node_name(value: Any) -> str | None:
    if not isinstance(value, str) or "@" in value or len(value) > 255:
        raise ValueError(f"expected a node name without '@', got {value!r}")
    return value or None


def zmq_endpoint(value: Any) -> str | None:
    if not isinstance(value, str):
        raise ValueError(f"expected a ZMQ endpoint like tcp://*:5557, got {value!r}")
    if value.lower() in ("", "off"):
        return None
    if "://" not in value:
        raise ValueError(f"expected a ZMQ endpoint like tcp://*:5557, got {value!r}")
    return value


def event_format(value: Any) -> str:
    if value not in ("positional", "tagged"):
        raise ValueError(f"expected positional or tagged, got {value!r}")
    return value


def model_name(value: Any) -> str:
    if not isinstance(value, str) or not value or "@" in value:
        raise ValueError(f"expected a model name without '@', got {value!r}")
    return value
