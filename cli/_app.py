"""``kvbroker`` command line: serve, doctor, stat, ls, show, evict, verify, tui, bench.

Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running, 4 missing hardware or
software (``bench gpu`` without CUDA). Every error is one line on stderr.
This module must stay cheap to import: no torch, no numpy, no textual at import time.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvbroker._paths import format_size
from kvbroker._version import __version__
from kvbroker.errors import BrokerUnavailable, KVBrokerError

from ._common import (
    EXIT_ERROR,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    JsonOpt,
    OneLineGroup,
    SocketOpt,
    clean,
    fail,
    namespace_opt,
    user_default_socket,
)
from ._objects import evict, ls_, object_table, show
from ._stat import stat

app = typer.Typer(
    name="kvbroker",
    cls=OneLineGroup,
    help="Node-local KV-cache broker for disaggregated LLM serving.",
    no_args_is_help=True,
    # Plain Click help: readable at 80 columns, no boxes, no <bool> metavars on flags.
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"max_content_width": 100},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvbroker {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True,
        help="Print the version and exit.",
    ),  # fmt: skip
) -> None:
    """Node-local KV-cache broker for disaggregated LLM serving.

    Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running, 4 the command needs
    hardware or software this machine lacks. Every command honours KVBROKER_SOCKET.
    """


ConfigOpt = typer.Option(
    None, "--config", "-c", envvar="KVBROKER_CONFIG", metavar="FILE",
    help="TOML configuration file (KVBROKER_* variables and flags override it).",
    show_default="/etc/kvbroker/kvbroker.toml if it exists",
)  # fmt: skip


@app.command()
def serve(
    config: Optional[str] = ConfigOpt,
    socket: Optional[str] = typer.Option(
        None, "--socket", "-s", metavar="PATH",
        help="Daemon socket path (ignored when systemd passes one; KVBROKER_SOCKET sets it "
        "too).", show_default=user_default_socket(),
    ),  # fmt: skip
    pool_size: Optional[str] = typer.Option(
        None, metavar="SIZE", help="Bytes per pool, e.g. 1G, 512M.",
        show_default="1G, less to fit /dev/shm",
    ),
    pools: Optional[int] = typer.Option(
        None, metavar="N", help="Number of host pools.", show_default="1"
    ),
    page_size: Optional[str] = typer.Option(
        None, metavar="SIZE", help="Allocation granule (a power of two).", show_default="64K"
    ),
    lease_ttl: Optional[str] = typer.Option(
        None, metavar="DURATION", help="Default lease TTL.", show_default="30s"
    ),
    high_watermark: Optional[float] = typer.Option(
        None, metavar="FRACTION", help="Evict above this use.", show_default="0.95"
    ),
    low_watermark: Optional[float] = typer.Option(
        None, metavar="FRACTION", help="...down to this use.", show_default="0.90"
    ),
    group: Optional[str] = typer.Option(
        None, metavar="GROUP", help="Group whose members may connect (socket and pools mode 0660)."
    ),
    log_level: Optional[str] = typer.Option(
        None, metavar="LEVEL", help="debug, info, warning, error.", show_default="info"
    ),
    drain_timeout: Optional[str] = typer.Option(
        None, metavar="DURATION", help="On SIGTERM, wait this long for held leases to end.",
        show_default="10s",
    ),
    max_connections: Optional[int] = typer.Option(
        None, metavar="N", help="Most client connections at once.", show_default="1024"
    ),
    metrics: Optional[str] = typer.Option(
        None, metavar="HOST:PORT",
        help="Serve Prometheus metrics on HOST:PORT (a bare PORT means loopback).",
        show_default="off",
    ),  # fmt: skip
    gpu_ring: Optional[str] = typer.Option(
        None, metavar="SIZE",
        help="Allocate a GPU staging ring of this size on each visible GPU, shared "
        "with clients through CUDA IPC (e.g. 1G).", show_default="off",
    ),  # fmt: skip
    restart_quarantine: Optional[str] = typer.Option(
        None, metavar="DURATION",
        help="Keep pages a writer may still be copying into (after a daemon restart or a "
        "cut-off) out of use this long.", show_default="10s",
    ),  # fmt: skip
    keep_pools_on_exit: Optional[bool] = typer.Option(
        None, "--keep-pools-on-exit/--drop-pools-on-exit",
        help="On a clean stop, keep the pools and their index for the next daemon "
        "(after a crash the next daemon always adopts them).", show_default="drop",
    ),  # fmt: skip
    cold: bool = typer.Option(
        False, "--cold", help="Start empty: drop the pools and objects a previous daemon left."
    ),
) -> None:
    """Run the broker daemon in the foreground (as systemd's kvbroker.service does).

    Settings come from the configuration file, then KVBROKER_<KEY> variables, then these
    flags. SIGHUP re-reads them; SIGTERM drains leases, then stops.
    """
    import functools
    import logging

    from kvbroker._config import ConfigError, load_config
    from kvbroker._daemon import run_daemon
    from kvbroker._systemd import JournalFormatter, under_journal

    flags = {
        "socket": socket, "pool_size": pool_size, "pools": pools, "page_size": page_size,
        "lease_ttl": lease_ttl, "high_watermark": high_watermark,
        "low_watermark": low_watermark, "group": group, "log_level": log_level,
        "drain_timeout": drain_timeout, "max_connections": max_connections, "metrics": metrics,
        "keep_pools_on_exit": keep_pools_on_exit, "cold": True if cold else None,
        "gpu_ring": gpu_ring, "restart_quarantine": restart_quarantine,
    }  # fmt: skip
    reload_config = functools.partial(load_config, config, flags=flags)
    try:
        cfg = reload_config()
    except ConfigError as exc:
        raise fail(f"configuration: {exc}", 2) from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JournalFormatter() if under_journal()
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )  # fmt: skip
    logging.basicConfig(level=cfg.log_level.upper(), handlers=[handler])
    raise typer.Exit(run_daemon(cfg, reload_config))


@app.command()
def doctor(
    config: Optional[str] = ConfigOpt,
    socket: Optional[str] = typer.Option(
        None, "--socket", "-s", metavar="PATH", help="Socket path to check.",
        show_default=user_default_socket(),
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Check this host for what the service needs, and say how to fix what is missing.

    Exit status 1 when a check fails (warnings alone exit 0).
    """
    from kvbroker._config import ConfigError, load_config
    from kvbroker._doctor import render, run_checks

    try:
        cfg = load_config(config, flags={"socket": socket})
    except ConfigError as exc:
        raise fail(f"configuration: {exc}", 2) from None
    checks = run_checks(cfg)
    if as_json:
        typer.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        typer.echo(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(EXIT_ERROR)


app.command()(stat)
app.command("ls")(ls_)
app.command()(show)
app.command()(evict)


@app.command()
def tui(
    socket: Optional[str] = SocketOpt,
    interval: float = typer.Option(
        1.0, min=0.05, metavar="SECONDS", help="Seconds between snapshots."
    ),
) -> None:
    """Live monitor: pools, rates, clients, leases, transfers and objects."""
    from kvbroker.tui import run  # Textual loads here, never for the other commands

    run(socket, interval)


@app.command()
def verify(
    match: Optional[str] = typer.Option(
        None, "--match", "-m", metavar="REGEX", help="Only keys this regex (RE2) matches."
    ),
    namespace: Optional[str] = namespace_opt("Only objects of this namespace."),
    wide: bool = typer.Option(
        False, "--wide", "-w", help="Never cut namespaces and keys to fit the terminal."
    ),
    socket: Optional[str] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Re-hash sealed objects against the checksums recorded at seal; exit 1 on a mismatch.

    Maps the pools like any client and reads each object under a read lease (which also
    refreshes its place in the LRU order). Objects sealed without checksums are reported
    as unchecked, objects freed meanwhile as gone; neither fails the run.
    """
    from kvbroker import Client
    from kvbroker._integrity import verify_objects
    from kvbroker.errors import BadRequest

    try:
        client = Client(socket, name="kvbroker-verify", role="admin", map_pools=False,
                        timeout=30)  # fmt: skip
    except BrokerUnavailable as exc:
        raise fail(f"{exc} (start it with 'kvbroker serve')", EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:
        raise fail(f"{exc.code}: {exc}") from None
    try:
        checks = list(verify_objects(client, match=match, namespace=namespace))
    except BrokerUnavailable as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    except BadRequest as exc:
        if str(exc).startswith("bad regex"):
            raise fail(f"--match: {exc}", EXIT_USAGE) from None
        raise fail(f"{exc.code}: {exc}") from None
    except KVBrokerError as exc:
        raise fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()
    tally = {s: sum(1 for c in checks if c.status == s)
             for s in ("ok", "mismatch", "unchecked", "gone")}  # fmt: skip
    if as_json:
        typer.echo(json.dumps({"objects": [c.to_dict() for c in checks], **tally}, indent=2))
    else:
        rows = []
        for c in checks:
            bad = [clean(b) for b in c.bad]
            bad = f" ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})" if bad else ""
            status = (c.status.upper() if c.bad else c.status) + bad
            rows.append((c.namespace, c.key, [format_size(c.nbytes), str(c.buffers),
                                              "  " + status]))  # fmt: skip
        lines = object_table(rows, [("SIZE", 11), ("BUFS", 6), ("  STATUS", 10)], wide=wide)
        typer.echo("\n".join(line.rstrip() for line in lines))
        typer.echo(", ".join(f"{n} {s}" for s, n in tally.items()))
    if tally["mismatch"]:
        raise typer.Exit(EXIT_ERROR)


def main() -> None:
    app()


# `kvbroker bench SCENARIO ...`: one subcommand per scenario (cli/_bench.py).
from kvbroker.cli._bench import bench_app  # noqa: E402  (typer only; scenarios load lazily)

app.add_typer(bench_app, name="bench")
