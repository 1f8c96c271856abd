"""``kvbroker`` command line: serve, doctor, stat, ls, evict (and what later issues add).

Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running.
This module must stay cheap to import: no torch, no numpy, no textual at import time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

from kvbroker._wire.paths import format_size, parse_duration, parse_size
from kvbroker.cli._settings import with_setting_flags
from kvbroker.errors import BrokerUnavailable, KVBrokerError

EXIT_OK, EXIT_ERROR, EXIT_UNAVAILABLE = 0, 1, 3

app = typer.Typer(
    name="kvbroker",
    help="Node-local KV-cache broker for disaggregated LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SocketOpt = typer.Option(
    None, "--socket", "-s", envvar="KVBROKER_SOCKET", help="Daemon socket path.",
    show_default="$XDG_RUNTIME_DIR/kvbroker.sock",
)  # fmt: skip
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")


def _fail(message: str, code: int = EXIT_ERROR) -> typer.Exit:
    typer.echo(f"kvbroker: {message}", err=True)
    return typer.Exit(code)


def _connect(socket: str | None):
    from kvbroker import Client

    try:
        return Client(socket, name="kvbroker-cli", role="admin", map_pools=False, timeout=10)
    except BrokerUnavailable as exc:
        raise _fail(f"{exc} (start it with 'kvbroker serve')", EXIT_UNAVAILABLE) from None


def _run(socket: str | None, fn):
    client = _connect(socket)
    try:
        return fn(client)
    except BrokerUnavailable as exc:
        raise _fail(str(exc), EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:
        raise _fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()


def _size(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=what) from None


ConfigOpt = typer.Option(
    None, "--config", "-c", envvar="KVBROKER_CONFIG",
    help="TOML configuration file (KVBROKER_* variables and flags override it).",
    show_default="/etc/kvbroker/kvbroker.toml if it exists",
)  # fmt: skip


@app.command()
@with_setting_flags  # one option per setting with a flag (kvbroker/_server/config.py)
def serve(config: Optional[str] = ConfigOpt, *, flags: dict) -> None:
    """Run the broker daemon in the foreground (as systemd's kvbroker.service does).

    Settings come from the configuration file, then KVBROKER_<KEY> variables, then these
    flags. SIGHUP re-reads them; SIGTERM drains leases, then stops.
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
        raise _fail(f"configuration: {exc}", 2) from None
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
    socket: Optional[str] = typer.Option(None, "--socket", "-s", help="Socket path to check."),
    as_json: bool = JsonOpt,
) -> None:
    """Check this host for what the service needs, and say how to fix what is missing.

    Exit status 1 when a check fails (warnings alone exit 0).
    """
    from kvbroker._server.config import ConfigError, load_config
    from kvbroker._server.doctor import render, run_checks

    try:
        cfg = load_config(config, flags={"socket": socket})
    except ConfigError as exc:
        raise _fail(f"configuration: {exc}", 2) from None
    checks = run_checks(cfg)
    if as_json:
        typer.echo(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        typer.echo(render(checks))
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(EXIT_ERROR)


@app.command()
def stat(socket: Optional[str] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Pools, objects, leases, clients and counters of the running daemon."""
    snap = _run(socket, lambda c: c.stat())
    if as_json:
        typer.echo(json.dumps(snap.to_dict(), indent=2))
        return
    typer.echo(_render_stat(snap))


def _render_stat(s) -> str:
    c = s.counters
    lines = [
        f"kvbroker {s.version}  pid {s.pid}  socket {s.socket}  up {s.uptime:.0f} s",
        f"objects {s.objects}  pending {s.pending}  "
        f"leases: {s.read_leases} read, {s.write_leases} write  clients {len(s.clients)}",
        "",
        f"{'POOL':<5}{'CAPACITY':>12}{'USED':>12}{'FREE':>12}{'LEASED':>12}"
        f"{'OBJECTS':>9}{'FRAG':>7}",
    ]
    for p in s.pools:
        lines.append(
            f"{p.index:<5}{format_size(p.capacity):>12}{format_size(p.used):>12}"
            f"{format_size(p.free):>12}{format_size(p.leased_read + p.leased_write):>12}"
            f"{p.objects:>9}{p.fragmentation:>7.1%}"
        )
    if s.rings:
        lines += ["", f"{'RING':<5}{'CAPACITY':>12}{'USED':>12}{'FREE':>12}{'LEASED':>12}"
                      f"{'OBJECTS':>9}  DEVICE"]  # fmt: skip
        for r in s.rings:
            lines.append(
                f"{r.index:<5}{format_size(r.capacity):>12}{format_size(r.used):>12}"
                f"{format_size(r.free):>12}{format_size(r.leased_read + r.leased_write):>12}"
                f"{r.objects:>9}  {r.device} {r.name}"
            )
    lines += [
        "",
        f"publishes {c.publishes}  claims {c.claims}  in {format_size(c.bytes_in)}  "
        f"out {format_size(c.bytes_out)}",
        f"hits {c.hits}  misses {c.misses}  evictions {c.evictions} "
        f"({format_size(c.evicted_bytes)})  expired leases {c.expired_leases}  "
        f"aborts {c.aborts}",
    ]
    lines += _render_fleet(s)
    if s.namespaces:
        lines += ["", f"{'NAMESPACE':<24}{'OBJECTS':>9}{'BYTES':>12}{'USED':>12}{'QUOTA':>12}"]
        for n in s.namespaces:
            quota = format_size(n.quota) if n.quota is not None else "-"
            lines.append(f"{n.namespace[:23]:<24}{n.objects:>9}{format_size(n.bytes):>12}"
                         f"{format_size(n.used):>12}{quota:>12}")  # fmt: skip
    if s.clients:

        lines += ["", f"{'SESSION':<9}{'PID':>8}{'UID':>7}  {'ROLE':<10}{'LEASES':>7}  NAME"]
        for cl in s.clients:
            lines.append(
                f"{cl.session:<9}{cl.pid:>8}{cl.uid:>7}  {cl.role[:10]:<10}"
                f"{cl.read_leases + cl.write_leases:>7}  {cl.name}"
            )
    return "\n".join(lines)


def _render_fleet(s) -> list[str]:
    """Peers, pulls and served bytes ([transfer]); the KV event stream ([events])."""
    out = []
    t = s.transfer
    if t is not None:
        out += ["", f"transfer: node {t.node}  "
                    f"{'serving on ' + t.listen if t.listen else 'not serving'}  "
                    f"peer connections {t.serving}  leases held for peers {t.leases_served}",
                f"pulls {t.pulls} ({format_size(t.bytes_pulled)})  in flight {t.in_flight}  "
                f"failures {t.failures}  served {t.pins_served} pins "
                f"({format_size(t.bytes_served)})  refused {t.refused}"]  # fmt: skip
        for p in t.peers:
            out.append(f"  peer {p.address} ({p.node or '?'}): "
                       f"{'connected' if p.connected else 'disconnected'}")
        if t.last_failure:
            out.append(f"  last failure: {t.last_failure}")
    e = s.events
    if e is not None:
        out += ["", f"events: {e.endpoint} topic {e.topic} ({e.format})  sent "
                    f"{e.events_published}  dropped {e.events_dropped}  queued {e.queued}  "
                    f"next seq {e.next_seq}"]  # fmt: skip
    return out


def _age(t: float) -> str:
    d = max(0.0, time.time() - t)
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= secs:
            return f"{d / secs:.0f}{unit}"
    return f"{d:.0f}s"


@app.command("ls")
def ls_(
    match: Optional[str] = typer.Option(None, "--match", "-m", help="Regex over keys."),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n"),
    limit: int = typer.Option(1000, min=0, help="At most this many objects."),
    socket: Optional[str] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List sealed objects."""
    objs = _run(socket, lambda c: c.list(match, namespace=namespace, limit=limit))
    if as_json:
        typer.echo(json.dumps([o.to_dict() for o in objs], indent=2))
        return
    typer.echo(f"{'NAMESPACE':<16}{'KEY':<40}{'SIZE':>11}{'BUFS':>6}{'READERS':>8}{'AGE':>6}")
    for o in objs:
        typer.echo(
            f"{o.namespace[:15]:<16}{o.key[:39]:<40}{format_size(o.nbytes):>11}"
            f"{o.buffers:>6}{o.readers:>8}{_age(o.created_at):>6}"
        )


@app.command()
def evict(
    key: Optional[str] = typer.Argument(None, help="Evict this key."),
    match: Optional[str] = typer.Option(None, "--match", "-m", help="Regex over keys."),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n"),
    match_buffers: Optional[str] = typer.Option(None, help="Regex over buffer names."),
    older_than: Optional[str] = typer.Option(None, help="Age, e.g. 10m, 2h."),
    all_: bool = typer.Option(False, "--all", help="Every unleased object."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would go; free nothing."),
    socket: Optional[str] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Free sealed objects (leased ones are never evicted)."""
    if not (key or match or namespace or match_buffers or older_than or all_):
        raise typer.BadParameter(
            "say what to evict: KEY, --match, --namespace, --match-buffers, --older-than or --all"
        )
    age = None
    if older_than is not None:
        try:
            age = parse_duration(older_than)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--older-than") from None
    res = _run(socket, lambda c: c.evict(
        key, match=match, namespace=namespace, match_buffers=match_buffers, older_than=age,
        all=all_, dry_run=dry_run,
    ))  # fmt: skip
    if as_json:
        typer.echo(json.dumps({
            "count": res.count, "bytes": res.bytes, "skipped_leased": res.skipped_leased,
            "dry_run": res.dry_run, "objects": [o.to_dict() for o in res.objects],
        }, indent=2))  # fmt: skip
        return
    verb = "would evict" if dry_run else "evicted"
    for o in res.objects:
        typer.echo(f"{verb} {o.namespace}/{o.key} ({format_size(o.nbytes)})")
    typer.echo(f"{verb} {res.count} object(s), {format_size(res.bytes)}"
               + (f"; {res.skipped_leased} leased object(s) kept" if res.skipped_leased else ""))
    if key and res.count == 0 and not res.skipped_leased:
        raise _fail(f"no object {key!r}")


@app.command()
def tui(
    socket: Optional[str] = SocketOpt,
    interval: float = typer.Option(1.0, min=0.05, help="Seconds between snapshots."),
) -> None:
    """Live monitor: pools, rates, clients, leases, transfers and objects."""
    from kvbroker.tui import run  # Textual loads here, never for the other commands

    run(socket, interval)


@app.command()
def fetch(
    key: str = typer.Argument(..., help="Key of the object to pull."),
    peer: str = typer.Option(..., "--peer", "-p", help="HOST:PORT of the broker holding it "
                             "(its [transfer] listen)."),
    namespace: str = typer.Option("default", "--namespace", "-n"),
    socket: Optional[str] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Pull a sealed object from another node's broker into this node's pools (one NIXL
    READ, checksums verified), unless it is here already."""
    t0 = time.perf_counter()
    reply = _run(socket, lambda c: c.fetch(key, peer, namespace=namespace))
    dt = time.perf_counter() - t0
    if as_json:
        typer.echo(json.dumps({**reply, "seconds": dt}))
    elif reply["fetched"]:
        typer.echo(f"pulled {namespace}/{key} ({format_size(reply['nbytes'])}) from {peer} "
                   f"in {dt * 1e3:.1f} ms")
    else:
        typer.echo(f"{namespace}/{key} is here already ({format_size(reply['nbytes'])}); "
                   "nothing pulled")


@app.command()
def verify(
    match: Optional[str] = typer.Option(None, "--match", "-m", help="Regex over keys."),
    namespace: Optional[str] = typer.Option(None, "--namespace", "-n"),
    socket: Optional[str] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Re-hash sealed objects against the checksums recorded at seal; exit 1 on a mismatch.

    Maps the pools like any client and reads each object under a read lease (which also
    refreshes its place in the LRU order). Objects sealed without checksums are reported
    as unchecked, objects freed meanwhile as gone; neither fails the run.
    """
    from kvbroker import Client
    from kvbroker._client.integrity import verify_objects

    try:
        client = Client(socket, name="kvbroker-verify", role="admin", map_pools=False,
                        timeout=30)  # fmt: skip
    except BrokerUnavailable as exc:
        raise _fail(f"{exc} (start it with 'kvbroker serve')", EXIT_UNAVAILABLE) from None
    try:
        checks = list(verify_objects(client, match=match, namespace=namespace))
    except BrokerUnavailable as exc:
        raise _fail(str(exc), EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:
        raise _fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()
    tally = {s: sum(1 for c in checks if c.status == s)
             for s in ("ok", "mismatch", "unchecked", "gone")}  # fmt: skip
    if as_json:
        typer.echo(json.dumps({"objects": [c.to_dict() for c in checks], **tally}, indent=2))
    else:
        typer.echo(f"{'NAMESPACE':<16}{'KEY':<40}{'SIZE':>11}{'BUFS':>6}  STATUS")
        for c in checks:
            bad = f" ({', '.join(c.bad[:4])}{', ...' if len(c.bad) > 4 else ''})" if c.bad else ""
            typer.echo(f"{c.namespace[:15]:<16}{c.key[:39]:<40}{format_size(c.nbytes):>11}"
                       f"{c.buffers:>6}  {c.status.upper() if c.bad else c.status}{bad}")  # fmt: skip
        typer.echo(", ".join(f"{n} {s}" for s, n in tally.items()))
    if tally["mismatch"]:
        raise typer.Exit(EXIT_ERROR)


def main() -> None:
    app()


# `kvbroker bench SCENARIO ...`: one subcommand per scenario (cli/_bench.py).
from kvbroker.cli._bench import bench_app  # noqa: E402  (typer only; scenarios load lazily)

app.add_typer(bench_app, name="bench")
