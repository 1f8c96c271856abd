"""``kvbroker`` command line: serve, stat, ls, evict (and what later issues add).

Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running.
This module must stay cheap to import: no torch, no numpy, no textual at import time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer

from kvbroker._paths import format_size, parse_duration, parse_size
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


@app.command()
def serve(
    socket: Optional[str] = SocketOpt,
    pool_size: Optional[str] = typer.Option(
        None, help="Bytes per pool, e.g. 1G, 512M.", show_default="1G, less to fit /dev/shm"
    ),
    pools: int = typer.Option(1, min=1, max=64, help="Number of host pools."),
    page_size: str = typer.Option("64K", help="Allocation granule (a power of two)."),
    lease_ttl: str = typer.Option("30s", help="Default lease TTL."),
    high_watermark: float = typer.Option(0.95, min=0.01, max=1.0, help="Evict above this use."),
    low_watermark: float = typer.Option(0.90, min=0.01, max=1.0, help="...down to this use."),
    group: Optional[str] = typer.Option(
        None, help="Group whose members may connect (socket and pools mode 0660)."
    ),
    log_level: str = typer.Option("info", help="debug, info, warning, error."),
) -> None:
    """Run the broker daemon in the foreground."""
    import logging

    from kvbroker._daemon import DaemonConfig, run_daemon

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if low_watermark > high_watermark:
        raise typer.BadParameter("must not exceed --high-watermark", param_hint="--low-watermark")
    gid = None
    if group is not None:
        import grp

        try:
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
        except KeyError:
            raise typer.BadParameter(f"no group {group!r}", param_hint="--group") from None
    try:
        ttl = parse_duration(lease_ttl)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--lease-ttl") from None
    cfg = DaemonConfig(
        pool_size=_size(pool_size, "--pool-size"),
        pools=pools,
        page_size=_size(page_size, "--page-size"),
        lease_ttl=ttl,
        high_watermark=high_watermark,
        low_watermark=low_watermark,
        group=gid,
    )
    if socket:
        cfg.socket_path = socket
    raise typer.Exit(run_daemon(cfg))


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
    lines += [
        "",
        f"publishes {c.publishes}  claims {c.claims}  in {format_size(c.bytes_in)}  "
        f"out {format_size(c.bytes_out)}",
        f"hits {c.hits}  misses {c.misses}  evictions {c.evictions} "
        f"({format_size(c.evicted_bytes)})  expired leases {c.expired_leases}  "
        f"aborts {c.aborts}",
    ]
    if s.clients:
        lines += ["", f"{'SESSION':<9}{'PID':>8}{'UID':>7}  {'ROLE':<10}{'LEASES':>7}  NAME"]
        for cl in s.clients:
            lines.append(
                f"{cl.session:<9}{cl.pid:>8}{cl.uid:>7}  {cl.role[:10]:<10}"
                f"{cl.read_leases + cl.write_leases:>7}  {cl.name}"
            )
    return "\n".join(lines)


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


def main() -> None:
    app()
