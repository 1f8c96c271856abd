"""Where the daemon's socket lives, and the human units used on the command line."""

from __future__ import annotations

import os
import re

__all__ = ["default_socket_path", "parse_size", "parse_duration", "format_size"]

SOCKET_ENV = "KVBROKER_SOCKET"


def default_socket_path() -> str:
    """``$KVBROKER_SOCKET``, else ``$XDG_RUNTIME_DIR/kvbroker.sock``, else
    ``/run/kvbroker/kvbroker.sock`` for root, else ``/tmp/kvbroker-$UID.sock``."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvbroker.sock")
    if os.geteuid() == 0:
        return "/run/kvbroker/kvbroker.sock"
    return f"/tmp/kvbroker-{os.geteuid()}.sock"


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """'1G', '512MiB', '4k', '1000000' -> bytes. K/M/G alone are binary (GiB), KB/MB/GB decimal."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 1G, 512M, 4096)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


_DURATION_UNITS = {"": 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|)")


def parse_duration(text: str | float) -> float:
    """'90s', '5m', '1h30m', '2d', '0.5' -> seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION_RE.finditer(s):
        if m.start() != pos or not m.group(0):
            break
        total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
        pos = m.end()
    if pos != len(s) or not s:
        raise ValueError(f"not a duration: {text!r} (try 30s, 5m, 1h, 2d)")
    return total


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
