"""``kvbroker`` command line: serve, doctor, stat, ping, ls, show, evict, sessions,
retain, release, verify, tui, bench.

Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running, 4 missing hardware or
software (``bench gpu`` without CUDA). Every error is one line on stderr.
This module must stay cheap to import: no torch, no numpy, no textual at import time.
"""

from __future__ import annotations

import json
import sys
import time

import typer

from kvbroker._version import __version__
from kvbroker._wire.paths import format_size
from kvbroker.cli._settings import with_setting_flags

from ._common import (
    EXIT_ERROR,
    JsonOpt,
    OneLineGroup,
    SocketOpt,
    clean,
    fail,
    namespace_opt,
    run,
    user_default_socket,
)
from ._here import python_here_check, shadowed_message, shadowing_directory
from ._objects import evict, ls_, object_table, show
from ._ping import daemon_check, ping
from ._sessions import release, retain, sessions
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
        False,
        "--version",
        "-V",
        callback=_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Node-local KV-cache broker for disaggregated LLM serving.

    Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running, 4 the command needs
    hardware or software this machine lacks. Every command honours KVBROKER_SOCKET.
    """


ConfigOpt = typer.Option(
    None,
    "--config",
    "-c",
    envvar="KVBROKER_CONFIG",
    metavar="FILE",
    help="TOML configuration file (KVBROKER_* variables and flags override it).",
    show_default="/etc/kvbroker/kvbroker.toml if it exists",
)


@app.command()
@with_setting_flags  # one option per setting with a flag (kvbroker/_server/config.py)
def serve(config: str | None = ConfigOpt, *, flags: dict) -> None:
    """Run the broker daemon in the foreground (as systemd's kvbroker.service does).

    Settings come from the configuration file, then KVBROKER_<KEY> variables, then these
    flags. SIGHUP re-reads them; SIGTERM drains leases, then stops and frees the pools;
    SIGUSR1 (systemctl restart) drains the same way, then keeps the pools for the next daemon.
    """
    import functools
    import logging

    from kvbroker._server.config import ConfigError, load_config
    from kvbroker._server.daemon import run_daemon
    from kvbroker._server.systemd import JournalFormatter, under_journal

    reload_config = functools.partial(load_config, config, flags=flags)
    try:
        cfg = reload_config()
    except ConfigError as exc:
        raise fail(f"configuration: {exc}", 2) from None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JournalFormatter()
        if under_journal()
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=cfg.log_level.upper(), handlers=[handler])
    raise typer.Exit(run_daemon(cfg, reload_config))


@app.command()
def doctor(
    config: str | None = ConfigOpt,
    socket: str | None = typer.Option(
        None,
        "--socket",
        "-s",
        metavar="PATH",
        help="Socket path to check.",
        show_default=user_default_socket(),
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Check this host for what the service needs, and say how to fix what is missing;
    last, whether a daemon answers on the socket.

    Exit status 1 when a check fails (warnings alone exit 0; no daemon running is a warning).
    """
    from kvbroker._server.config import ConfigError, load_config
    from kvbroker._server.doctor import render, run_checks

    try:
        cfg = load_config(config, flags={"socket": socket})
    except ConfigError as exc:
        raise fail(f"configuration: {exc}", 2) from None
    checks = run_checks(cfg)
    checks.append(python_here_check())
    checks.append(daemon_check(cfg.socket_path))
    if as_json:
        typer.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        typer.echo(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(EXIT_ERROR)


app.command()(stat)
app.command()(ping)
app.command("ls")(ls_)
app.command()(show)
app.command()(evict)
app.command()(sessions)
app.command()(retain)
app.command()(release)


@app.command()
def tui(
    socket: str | None = SocketOpt,
    interval: float = typer.Option(
        1.0, min=0.05, metavar="SECONDS", help="Seconds between snapshots."
    ),
) -> None:
    """Live monitor: pools, rates, clients, leases, transfers and objects."""
    from kvbroker.tui import run  # Textual loads here, never for the other commands

    run(socket, interval)


@app.command()
def fetch(
    key: str = typer.Argument(..., help="Key of the object to pull."),
    peer: str = typer.Option(
        ...,
        "--peer",
        "-p",
        metavar="HOST:PORT",
        help="HOST:PORT of the broker holding it (its [transfer] listen).",
    ),
    namespace: str | None = namespace_opt("Namespace of the object (default: default)."),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Pull a sealed object from another node's broker into this node's pools (one NIXL
    READ, checksums verified), unless it is here already."""
    namespace = namespace or "default"
    t0 = time.perf_counter()
    reply = run(socket, lambda c: c.fetch(key, peer, namespace=namespace))
    dt = time.perf_counter() - t0
    if as_json:
        typer.echo(json.dumps({**reply, "seconds": dt}))
    elif reply["fetched"]:
        typer.echo(
            f"pulled {namespace}/{key} ({format_size(reply['nbytes'])}) from {peer} "
            f"in {dt * 1e3:.1f} ms"
        )
    else:
        typer.echo(
            f"{namespace}/{key} is here already ({format_size(reply['nbytes'])}); nothing pulled"
        )


@app.command()
def verify(
    match: str | None = typer.Option(
        None, "--match", "-m", metavar="REGEX", help="Only keys this regex (RE2) matches."
    ),
    namespace: str | None = namespace_opt("Only objects of this namespace."),
    wide: bool = typer.Option(
        False, "--wide", "-w", help="Never cut namespaces and keys to fit the terminal."
    ),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Re-hash sealed objects against the checksums recorded at seal; exit 1 on a mismatch.

    Maps the pools like any client and reads each object under a read lease (which also
    refreshes its place in the LRU order). Objects sealed without checksums are reported
    as unchecked, objects freed meanwhile as gone; neither fails the run.
    """
    from kvbroker._client.integrity import verify_objects

    checks = run(
        socket,
        lambda c: list(verify_objects(c, match=match, namespace=namespace)),
        name="kvbroker-verify",
        timeout=30,
    )
    tally = {
        s: sum(1 for c in checks if c.status == s) for s in ("ok", "mismatch", "unchecked", "gone")
    }
    if as_json:
        typer.echo(json.dumps({"objects": [c.to_dict() for c in checks], **tally}, indent=2))
    else:
        rows = []
        for c in checks:
            bad = [clean(b) for b in c.bad]
            bad = f" ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})" if bad else ""
            status = (c.status.upper() if c.bad else c.status) + bad
            rows.append(
                (c.namespace, c.key, [format_size(c.nbytes), str(c.buffers), "  " + status])
            )
        lines = object_table(rows, [("SIZE", 11), ("BUFS", 6), ("  STATUS", 10)], wide=wide)
        typer.echo("\n".join(line.rstrip() for line in lines))
        typer.echo(", ".join(f"{n} {s}" for s, n in tally.items()))
    if tally["mismatch"]:
        raise typer.Exit(EXIT_ERROR)


def main() -> None:
    # `python -m kvbroker` started beside a clone (a directory named kvbroker) runs this with
    # the clone for the package: the commands that need `from kvbroker import Client` fail
    # with Python's "(unknown location)" (serve, which does not, runs). Say why, in one line.
    where = shadowing_directory()
    if where is not None:
        typer.echo(shadowed_message(where), err=True)
    app()


# `kvbroker bench SCENARIO ...`: one subcommand per scenario (cli/_bench.py).
from kvbroker.cli._bench import bench_app  # noqa: E402  (typer only; scenarios load lazily)

app.add_typer(bench_app, name="bench")
