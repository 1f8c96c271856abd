"""``kvbroker ping`` and doctor's daemon check: does a daemon answer on the socket, how fast."""

from __future__ import annotations

import json
import time

import typer

from ._common import EXIT_UNAVAILABLE, JsonOpt, SocketOpt, clean, connect, fail


def ping(
    count: int = typer.Option(1, "--count", "-c", min=1, metavar="N", help="Send N pings."),
    interval: float = typer.Option(
        1.0, "--interval", "-i", min=0.0, metavar="SECONDS", help="Seconds between pings."
    ),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Round trips to the daemon: its version and pid, the time to connect and each ping's.

    Exit status 3 when no daemon answers (as every command).
    """
    from kvbroker.errors import BrokerUnavailable, KVBrokerError

    t0 = time.perf_counter()
    client = connect(socket)
    connect_s = time.perf_counter() - t0
    rtts = []
    try:
        pong = client.ops.ping()
        for n in range(count):
            if n:
                time.sleep(interval)
            rtt = client.ping()
            rtts.append(rtt)
            if not as_json:
                typer.echo(
                    f"pong from kvbroker {pong['server_version']} (pid "
                    f"{pong['server_pid']}) on {clean(client.socket_path)}: "
                    f"{rtt * 1e3:.3f} ms"
                )
    except KeyboardInterrupt:
        pass
    except BrokerUnavailable as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:
        raise fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()
    uptime = time.time() - pong["started_at"]
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "socket": client.socket_path,
                    "server_version": pong["server_version"],
                    "server_pid": pong["server_pid"],
                    "uptime": uptime,
                    "epoch": pong["epoch"],
                    "connect_ms": connect_s * 1e3,
                    "rtt_ms": [r * 1e3 for r in rtts],
                },
                indent=2,
            )
        )
        return
    ms = [r * 1e3 for r in rtts]
    typer.echo(
        f"{len(ms)} ping(s): min/avg/max {min(ms):.3f}/{sum(ms) / len(ms):.3f}/"
        f"{max(ms):.3f} ms; connected in {connect_s * 1e3:.1f} ms; daemon up "
        f"{_duration(uptime)}"
    )


def _duration(s: float) -> str:
    s = max(0.0, s)
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= secs:
            return f"{s / secs:.1f}{unit}"
    return f"{s:.0f}s"


def daemon_check(socket_path: str):
    """doctor's check that a daemon answers on ``socket_path`` (a Check of kvbroker's doctor)."""
    from kvbroker import Client
    from kvbroker._server.doctor import Check
    from kvbroker.errors import BrokerUnavailable, KVBrokerError

    name = "daemon"
    try:
        t0 = time.perf_counter()
        with Client(
            socket_path,
            name="kvbroker-doctor",
            role="admin",
            map_pools=False,
            timeout=5,
            reconnect=0,
        ) as c:
            pong = c.ops.ping()
            rtt = c.ping()
            took = time.perf_counter() - t0
    except BrokerUnavailable as exc:
        if "permission denied" in str(exc):
            return Check(
                name,
                "fail",
                str(exc),
                "add this user to the socket's group: 'usermod -aG kvbroker USER' "
                "(then log in again)",
            )
        return Check(
            name,
            "warn",
            f"{exc}",
            "start it: 'systemctl start kvbroker' (the service) or 'kvbroker serve'",
        )
    except KVBrokerError as exc:
        return Check(name, "fail", f"the daemon on {socket_path} refused: {exc.code}: {exc}")
    return Check(
        name,
        "ok",
        f"kvbroker {pong['server_version']} (pid {pong['server_pid']}) "
        f"answers on {socket_path}: ping {rtt * 1e3:.2f} ms, connect + hello "
        f"{(took - rtt) * 1e3:.1f} ms",
    )
