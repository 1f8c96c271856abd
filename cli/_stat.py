"""``kvbroker stat``: the running daemon's pools, objects, leases, clients and counters."""

from __future__ import annotations

import json
import sys

import typer

from kvbroker._wire.paths import format_size

from ._common import (
    EXIT_UNAVAILABLE,
    JsonOpt,
    SocketOpt,
    clean,
    connect,
    fail,
    fit,
    output_width,
    run,
)

_CLEAR = "\x1b[H\x1b[2J"


def stat(
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
    watch: bool = typer.Option(
        False,
        "--watch",
        "-w",
        help="Print a new snapshot every --interval until Ctrl-C "
        "(the screen is redrawn on a terminal; --json: one object per line).",
    ),
    interval: float = typer.Option(
        2.0, "--interval", "-i", min=0.1, metavar="SECONDS", help="Seconds between snapshots."
    ),
    count: int = typer.Option(
        0, "--count", min=0, metavar="N", help="With --watch, stop after N snapshots (0: never)."
    ),
) -> None:
    """Pools, objects, leases, clients and counters of the running daemon."""
    if not watch:
        snap = run(socket, lambda c: c.stat())
        typer.echo(json.dumps(snap.to_dict(), indent=2) if as_json else render(snap))
        return
    from kvbroker.errors import BrokerUnavailable, KVBrokerError

    client = connect(socket)
    redraw = sys.stdout.isatty() and not as_json
    try:
        for n, snap in enumerate(client.watch(interval), 1):
            if as_json:
                typer.echo(json.dumps(snap.to_dict()))
            else:
                typer.echo((_CLEAR if redraw else ("\n" if n > 1 else "")) + render(snap))
            if count and n >= count:
                break
    except KeyboardInterrupt:
        pass
    except BrokerUnavailable as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:
        raise fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()


def render(s) -> str:
    c = s.counters
    width = output_width()
    lines = [
        f"kvbroker {clean(s.version)}  pid {s.pid}  socket {clean(s.socket)}  up {s.uptime:.0f} s",
        f"objects {s.objects}  pending {s.pending}  "
        f"leases: {s.read_leases} read, {s.write_leases} write  clients {len(s.clients)}"
        + (
            f"  read replicas {s.read_replicas} (answered {c.replica_requests}, "
            f"exited {c.replica_exits})"
            if s.read_replicas or c.replica_exits
            else ""
        ),
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
        lines += [
            "",
            f"{'RING':<5}{'CAPACITY':>12}{'USED':>12}{'FREE':>12}{'LEASED':>12}"
            f"{'OBJECTS':>9}  DEVICE",
        ]
        for r in s.rings:
            lines.append(
                f"{r.index:<5}{format_size(r.capacity):>12}{format_size(r.used):>12}"
                f"{format_size(r.free):>12}{format_size(r.leased_read + r.leased_write):>12}"
                f"{r.objects:>9}  {clean(r.device)} {clean(r.name)}"
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
    r = s.retention
    if r is not None and (r.sessions or r.evicted or r.dropped):
        held = "  ".join(
            f"pool {i} {format_size(b)} of {format_size(cap)}"
            for i, (b, cap) in enumerate(zip(r.retained_bytes, r.retained_cap, strict=True))
        )
        lines += ["", f"sessions {r.sessions}  retained blocks {r.retained_objects}  {held}"]
        for why, what in (("evicted", r.evicted), ("lost retention", r.dropped)):
            if what:
                lines.append(
                    f"  retained blocks {why}: "
                    + "  ".join(f"{clean(k)} {v:,}" for k, v in sorted(what.items()))
                )
    if s.namespaces:
        names = [clean(n.namespace) for n in s.namespaces]
        ns_w = max([9] + [len(x) for x in names]) + 2
        if width is not None:
            ns_w = min(ns_w, max(12, width - 45))
        lines += ["", f"{'NAMESPACE':<{ns_w}}{'OBJECTS':>9}{'BYTES':>12}{'USED':>12}{'QUOTA':>12}"]
        for name, n in zip(names, s.namespaces, strict=True):
            quota = format_size(n.quota) if n.quota is not None else "-"
            lines.append(
                f"{fit(name, ns_w - 2):<{ns_w}}{n.objects:>9}{format_size(n.bytes):>12}"
                f"{format_size(n.used):>12}{quota:>12}"
            )
    if s.clients:
        lines += ["", f"{'SESSION':<9}{'PID':>8}{'UID':>7}  {'ROLE':<10}{'LEASES':>7}  NAME"]
        for cl in s.clients:
            lines.append(
                f"{cl.session:<9}{cl.pid:>8}{cl.uid:>7}  {fit(clean(cl.role), 9):<10}"
                f"{cl.read_leases + cl.write_leases:>7}  {clean(cl.name)}"
            )
        for cl in s.clients:  # what clients say of themselves (the vLLM connector...)
            if cl.reported:
                said = "  ".join(f"{clean(k)} {v:,}" for k, v in sorted(cl.reported.items()))
                lines.append(f"  session {cl.session} reports: {said}")
    return "\n".join(lines)


def _render_fleet(s) -> list[str]:
    """Peers, pulls and served bytes ([transfer]); the KV event stream ([events])."""
    out = []
    t = s.transfer
    if t is not None:
        out += [
            "",
            f"transfer: node {t.node}  "
            f"{'serving on ' + t.listen if t.listen else 'not serving'}  "
            f"peer connections {t.serving}  leases held for peers {t.leases_served}",
            f"pulls {t.pulls} ({format_size(t.bytes_pulled)})  in flight {t.in_flight}  "
            f"failures {t.failures}  served {t.pins_served} pins "
            f"({format_size(t.bytes_served)})  refused {t.refused}",
        ]
        for p in t.peers:
            out.append(
                f"  peer {clean(p.address)} ({clean(p.node or '?')}): "
                f"{'connected' if p.connected else 'disconnected'}"
            )
        if t.last_failure:
            out.append(f"  last failure: {clean(t.last_failure)}")
    e = s.events
    if e is not None:
        out += [
            "",
            f"events: {e.endpoint} topic {e.topic} ({e.format})  sent "
            f"{e.events_published}  dropped {e.events_dropped}  queued {e.queued}  "
            f"next seq {e.next_seq}",
        ]
    d = s.disk
    if d is not None:
        why = clean(d.o_direct_problem or "o_direct = false")
        io = "O_DIRECT" if d.o_direct else f"buffered I/O ({why})"
        out += [
            "",
            f"disk tier: {format_size(d.used)} of {format_size(d.capacity)} used  "
            f"objects {d.objects} ({d.only_on_disk} on disk only, "
            f"{format_size(d.bytes)})  policy {d.policy}  {io}",
            f"  written {d.writes} ({format_size(d.written_bytes)}; write-back "
            f"{d.written_back}, demoted {d.demoted})  promoted {d.promoted} "
            f"({format_size(d.promoted_bytes)})  writing {format_size(d.writing_bytes)}  "
            f"evicted {d.evicted}  skipped {d.skipped}  damaged {d.dropped_damaged}  "
            f"errors {d.errors}",
            f"  {', '.join(clean(x) for x in d.directories)}  (recovered at start "
            f"{d.recovered}, dropped {d.recovered_dropped})",
        ]
    return out
