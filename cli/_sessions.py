"""``kvbroker sessions``, ``retain`` and ``release``: the sessions of the running daemon, whose
blocks are kept past plain LRU (see docs/sessions.md)."""

from __future__ import annotations


import typer

from kvbroker._wire.paths import format_size, parse_duration

from ._common import JsonOpt, SocketOpt, clean, fit, namespace_opt, output_width, run, to_json


def _expires(seconds: float) -> str:
    for unit, secs in (("h", 3600), ("m", 60)):
        if seconds >= secs:
            return f"{seconds / secs:.0f}{unit}"
    return f"{seconds:.0f}s"


def sessions(
    socket: str | None = SocketOpt,
    namespace: str | None = namespace_opt("Only the sessions of this namespace."),
    limit: int = typer.Option(100, "--limit", min=1, max=1000, help="The largest N sessions."),
    as_json: bool = JsonOpt,
) -> None:
    """The sessions whose blocks are retained: tenant, blocks, bytes, last use, expiry."""
    from kvbroker._wire.stats import SessionInfo

    reply = run(socket, lambda c: c.ops.sessions(namespace=namespace, limit=limit))
    if as_json:
        typer.echo(to_json(reply, indent=2))
        return
    typer.echo(render(reply, [SessionInfo(**x) for x in reply["sessions"]]))


def render(reply: dict, rows: list) -> str:
    import time

    from kvbroker._server.policy import user_name

    now = time.time()
    lines = []
    for i, (used, cap) in enumerate(
        zip(reply["retained_bytes"], reply["retained_cap"], strict=True)
    ):
        share = used / cap if cap else 0.0
        lines.append(
            f"pool {i}: {format_size(used)} retained of a {format_size(cap)} cap ({share:.0%})"
        )
    if not rows:
        return "\n".join(lines + ["no sessions"])
    names = [(clean(r.namespace), clean(r.name)) for r in rows]
    ns_w = max([9] + [len(ns) for ns, _ in names]) + 2
    name_w = max([7] + [len(n) for _, n in names]) + 2
    width = output_width()
    if width is not None and ns_w + name_w + 56 > width:
        ns_w = min(ns_w, max(12, (width - 56) // 3))
        name_w = max(12, width - 56 - ns_w)
    lines += [
        "",
        f"{'NAMESPACE':<{ns_w}}{'SESSION':<{name_w}}{'TENANT':>10}{'PRIO':>5}"
        f"{'BLOCKS':>8}{'BYTES':>11}{'LAST USE':>11}{'EXPIRES':>10}",
    ]
    for (ns, name), r in zip(names, rows, strict=True):
        idle = _expires(max(0.0, now - r.last_use)) + " ago"
        lines.append(
            f"{fit(ns, ns_w - 2):<{ns_w}}{fit(name, name_w - 2):<{name_w}}"
            f"{fit(user_name(r.uid), 9):>10}{r.priority:>5}{r.blocks:>8}"
            f"{format_size(r.bytes):>11}{idle:>11}{_expires(r.expires_in):>10}"
        )
    if reply.get("truncated"):
        lines.append("(more sessions: --limit)")
    return "\n".join(lines)


def retain(
    session: str = typer.Argument(
        ..., metavar="SESSION", help="The session's name (as the engine gave it)."
    ),
    for_: str = typer.Option(
        ...,
        "--for",
        metavar="DURATION",
        help="Keep it retained this long from now (e.g. 1h; at most [sessions] max_retain).",
    ),
    priority: int | None = typer.Option(
        None,
        "--priority",
        min=0,
        max=100,
        metavar="N",
        help="0-100: evicted after sessions of lower priority.",
    ),
    namespace: str | None = namespace_opt("The session's namespace, when several have it."),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Keep a session's blocks retained for a while (each request renews it too)."""
    try:
        seconds = parse_duration(for_)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--for") from None
    info = run(
        socket, lambda c: c.ops.retain(session, seconds, namespace=namespace, priority=priority)
    )
    _said(info, as_json, f"retained for {_expires(info['expires_in'])}")


def release(
    session: str = typer.Argument(..., metavar="SESSION", help="The session's name."),
    namespace: str | None = namespace_opt("The session's namespace, when several have it."),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """End a session now: its blocks fall back to plain LRU (nothing is freed)."""
    info = run(socket, lambda c: c.ops.unretain(session, namespace=namespace))
    _said(info, as_json, "released")


def _said(info: dict, as_json: bool, what: str) -> None:
    if as_json:
        typer.echo(to_json(info, indent=2))
        return
    typer.echo(
        f"{clean(info['namespace'])}/{clean(info['name'])}: {what} "
        f"({info['blocks']} blocks, {format_size(info['bytes'])}, "
        f"priority {info['priority']})"
    )
