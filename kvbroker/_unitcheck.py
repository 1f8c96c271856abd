"""Does the daemon's configured socket match the systemd socket unit's ``ListenStream=``?

Under socket activation systemd binds ``ListenStream=`` and hands the daemon that socket; the
TOML ``socket`` key is what clients and ``kvbroker doctor`` are told. The two are set by hand
in two files, so this module compares them: :func:`check_socket_unit` returns the verdict
and a fix, in the shape doctor's checks take (status ok / warn / fail / skip, detail, fix);
``kvbroker doctor`` runs it (``kvbroker._server.doctor.check_socket_unit``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["UNIT_PATHS", "SocketUnitCheck", "listen_streams", "check_socket_unit"]

# Where systemd looks for kvbroker.socket, most local first (an /etc copy overrides /usr/lib).
UNIT_PATHS = (
    "/etc/systemd/system/kvbroker.socket",
    "/run/systemd/system/kvbroker.socket",
    "/usr/local/lib/systemd/system/kvbroker.socket",
    "/usr/lib/systemd/system/kvbroker.socket",
    "/lib/systemd/system/kvbroker.socket",
)


class SocketUnitCheck(NamedTuple):
    status: str  # "ok" | "warn" | "fail" | "skip"
    detail: str
    fix: str = ""


def listen_streams(text: str) -> list[str]:
    """The ``ListenStream=`` values of a socket unit's text, in order; an empty assignment
    resets the list, as systemd does (so drop-ins can replace it)."""
    out: list[str] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section != "Socket" or "=" not in line:
            continue
        key, value = (p.strip() for p in line.split("=", 1))
        if key == "ListenStream":
            if value:
                out.append(value)
            else:
                out.clear()
    return out


def _read_unit(path: str) -> str:
    """The unit file and its drop-ins (``<unit>.d/*.conf`` beside it), in systemd's order."""
    parts = [open(path).read()]
    drop_dir = path + ".d"
    if os.path.isdir(drop_dir):
        for name in sorted(os.listdir(drop_dir)):
            if name.endswith(".conf"):
                with open(os.path.join(drop_dir, name)) as f:
                    parts.append(f.read())
    return "\n".join(parts)


def check_socket_unit(socket_path: str, unit_paths: Iterable[str] = UNIT_PATHS) -> SocketUnitCheck:
    """Compare the configured ``socket_path`` with the first socket unit found."""
    for path in unit_paths:
        if os.path.isfile(path):
            break
    else:
        return SocketUnitCheck("skip", "no kvbroker.socket unit installed")
    streams = listen_streams(_read_unit(path))
    if not streams:
        return SocketUnitCheck(
            "warn",
            f"{path} has no ListenStream=",
            f"add ListenStream={socket_path} to its [Socket] section",
        )
    if socket_path in streams:
        return SocketUnitCheck("ok", f"socket {socket_path} is {path}'s ListenStream=")
    return SocketUnitCheck(
        "fail",
        f"the configuration says socket = {socket_path!r} but {path} listens on "
        f"{', '.join(streams)}: clients told the first would not find the daemon",
        f'make them equal: socket = "{streams[0]}" in the configuration, or '
        f"ListenStream={socket_path} in a drop-in ('systemctl edit kvbroker.socket')",
    )
