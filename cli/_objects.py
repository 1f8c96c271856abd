"""``kvbroker ls``, ``show`` and ``evict``: the objects of the running daemon."""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import itertools
import sys
import time

import typer

from kvbroker._wire.paths import format_size, parse_duration

from ._common import (
    EXIT_ERROR,
    EXIT_USAGE,
    JsonOpt,
    SocketOpt,
    clean,
    fail,
    fit,
    namespace_opt,
    output_width,
    run,
    to_json,
    usage_error,
)

DEFAULT_LIMIT = 1000
TIERS = ("all", "dram", "disk")  # what --tier picks: ls and evict alike
# What each --sort orders by, and whether larger comes first by default.
SORTS = {
    "namespace": (lambda o: (o.namespace, o.key), False),
    "key": (lambda o: (o.key, o.namespace), False),
    "size": (lambda o: o.nbytes, True),
    "age": (lambda o: -o.created_at, True),  # oldest first
    "readers": (lambda o: o.readers, True),
    "buffers": (lambda o: o.buffers, True),
    "pool": (lambda o: o.pool, False),
    "tier": (lambda o: o.tier or "", False),
}


SortBy = enum.Enum("SortBy", {name: name for name in SORTS}, type=str)


def age(t: float, now: float | None = None) -> str:
    d = max(0.0, (time.time() if now is None else now) - t)
    for unit, secs in (("d", 86400), ("h", 3600), ("m", 60)):
        if d >= secs:
            return f"{d / secs:.0f}{unit}"
    return f"{d:.0f}s"


def object_table(
    rows: list[tuple[str, str, list[str]]],
    tail_headers: list[tuple[str, int]],
    *,
    header: bool = True,
    wide: bool = False,
) -> list[str]:
    """Lines of a NAMESPACE KEY ... table. ``rows``: (namespace, key, right-aligned cells);
    ``tail_headers``: (header, width) of those cells. Names are shown whole unless stdout is a
    terminal too narrow for them (then cut with "…"; ``wide`` never cuts)."""
    names = [(clean(ns), clean(key), cells) for ns, key, cells in rows]
    ns_w = max([9] + [len(ns) for ns, _, _ in names]) + 2
    key_w = max([3] + [len(k) for _, k, _ in names]) + 2
    tail_w = sum(w for _, w in tail_headers)
    width = None if wide else output_width()
    if width is not None and ns_w + key_w + tail_w > width:
        spare = max(0, width - tail_w)
        ns_w = min(ns_w, max(12, spare // 3))
        key_w = max(22, spare - ns_w)
    lines = []
    if header:
        lines.append(
            f"{'NAMESPACE':<{ns_w}}{'KEY':<{key_w}}" + "".join(f"{h:>{w}}" for h, w in tail_headers)
        )
    for ns, key, cells in names:
        lines.append(
            f"{fit(ns, ns_w - 2):<{ns_w}}{fit(key, key_w - 2):<{key_w}}"
            + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, tail_headers, strict=True))
        )
    return lines


def _first_sorted(pages, order: str | None, reverse: bool, limit: int) -> tuple[list, bool]:
    """The first ``limit`` (0: all) objects of every page in ``order`` (a SORTS name; None:
    the order they were sealed in, which ``reverse`` makes newest first), and whether more
    matched: the whole listing is ordered, not the first ``limit`` sealed. Only ``limit`` of
    them are held at a time; ties keep the order they were sealed in."""
    seen = 0

    def counted(page):
        nonlocal seen
        seen += len(page)
        return page

    if order is None:  # reverse: the last `limit` sealed, newest first
        last = collections.deque((o for page in pages for o in counted(page)), maxlen=limit or None)
        return list(reversed(last)), bool(limit) and seen > limit
    key, largest_first = SORTS[order]
    descending = largest_first != reverse
    if not limit:
        return sorted((o for page in pages for o in page), key=key, reverse=descending), False
    first = heapq.nlargest if descending else heapq.nsmallest
    top: list = []
    for page in pages:
        top = first(limit, itertools.chain(top, counted(page)), key=key)
    return top, seen > limit


def ls_(
    match: str | None = typer.Option(
        None, "--match", "-m", metavar="REGEX", help="Only keys this regex (RE2) matches."
    ),
    namespace: str | None = namespace_opt("Only objects of this namespace."),
    limit: int = typer.Option(
        DEFAULT_LIMIT,
        min=0,
        metavar="N",
        help="At most N objects; 0: every one.",
    ),
    sort: SortBy | None = typer.Option(
        None,
        "--sort",
        help="Order every matching object, then list the first N (size, age, readers, "
        "buffers: largest/oldest first).",
        show_default="the order they were sealed in",
    ),
    reverse: bool = typer.Option(
        False,
        "--reverse",
        "-r",
        help="Reverse the --sort order (without --sort: the newest sealed first).",
    ),
    no_header: bool = typer.Option(False, "--no-header", help="No header line (for scripts)."),
    wide: bool = typer.Option(
        False, "--wide", "-w", help="Never cut namespaces and keys to fit the terminal."
    ),
    tier: str = typer.Option(
        "all",
        "--tier",
        metavar="all|dram|disk",
        help="all: every object; dram: those in the pools; disk: those with a copy on the "
        "disk tier (as evict --tier picks them).",
    ),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List sealed objects, in the pools and on the disk tier.

    TIER: dram (in a pool), disk (on the disk tier only: a claim brings it back first) or
    dram+disk (in a pool, with a copy on disk). On a terminal, names too long for it end in
    "…" (use --wide or --json for whole names); a pipe gets them whole. When more objects
    match than were listed, a note on stderr says so.
    """
    if tier not in TIERS:
        raise usage_error(f"--tier must be all, dram or disk, not {tier!r}", "kvbroker ls")
    if sort is None and not reverse:  # the first `limit` sealed
        listing = run(
            socket,
            lambda c: c.list(match, namespace=namespace, limit=limit or None, tier=tier),
        )
        objs, truncated = list(listing), listing.truncated
    else:  # every match ordered, then the first `limit` of them
        order = None if sort is None else sort.value
        objs, truncated = run(
            socket,
            lambda c: _first_sorted(
                c.list_pages(match, namespace=namespace, tier=tier), order, reverse, limit
            ),
        )
    if as_json:
        out = []
        for o in objs:
            d = o.to_dict()
            for only_show in _LOOKUP_ONLY:  # `list` does not carry them: `kvbroker show` does
                del d[only_show]
            out.append(d)
        typer.echo(to_json(out, indent=2))
    else:
        now = time.time()
        lines = object_table(
            [
                (
                    o.namespace,
                    o.key,
                    [
                        format_size(o.nbytes),
                        str(o.buffers),
                        str(o.readers),
                        age(o.created_at, now),
                        o.tier or "dram",
                    ],
                )
                for o in objs
            ],
            [("SIZE", 11), ("BUFS", 6), ("READERS", 8), ("AGE", 6), ("TIER", 11)],
            header=not no_header,
            wide=wide,
        )
        if lines:
            typer.echo("\n".join(lines))
    if truncated:
        typer.echo(
            f"kvbroker: listed the first {len(objs)} objects; more match (--limit "
            f"{limit} reached; --limit 0 lists every one, or narrow with --match or "
            "--namespace)",
            err=True,
        )


# ObjectInfo fields only `lookup` fills (`kvbroker show`); `list` leaves them None.
_LOOKUP_ONLY = ("checksums", "buffer_sizes", "consumers")


def show(
    key: str = typer.Argument(..., help="The object's key."),
    namespace: str | None = namespace_opt(
        "The object's namespace (default: look in every namespace)."
    ),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One object in full: size, buffers and their sizes, pool, readers, consumers left, age,
    meta, checksums and leases.

    Exit status 1 when no namespace holds KEY.
    """

    def fetch(c):
        snap = c.stat()
        if namespace is not None:
            spaces = [namespace]
        else:
            exact = _exact_regex(key)
            if len(exact) <= 1024:  # the daemon's bound on a regex
                spaces = sorted({o.namespace for o in c.list(exact)})
            else:  # a very long key: the namespaces stat names (the 1000 largest)
                spaces = sorted({n.namespace for n in snap.namespaces} | {"default"})
        found = [i for i in (c.lookup(key, namespace=ns) for ns in spaces) if i is not None]
        return found, snap

    found, snap = run(socket, fetch)
    where = f"{namespace}/{key}" if namespace is not None else key
    if not found:
        if as_json:
            typer.echo("[]")
        raise fail(f"no object {clean(where)!r}")
    views = []
    for info in found:
        leases = [ls for ls in snap.leases if (ls.namespace, ls.key) == (info.namespace, key)]
        views.append((info, leases))
    if as_json:
        out = []
        for info, leases in views:
            d = info.to_dict()
            d["leases"] = [dataclasses.asdict(ls) for ls in leases]
            out.append(d)
        typer.echo(to_json(out, indent=2))
        return
    now = time.time()
    blocks = []
    for info, leases in views:
        lines = [
            f"{clean(info.namespace)}/{clean(info.key)}",
            f"  size        {format_size(info.nbytes)} ({info.nbytes} bytes) in "
            f"{info.buffers} buffer(s), pool {info.pool}",
            f"  created     {age(info.created_at, now)} ago, last read {age(info.last_access, now)}"
            f" ago",
            f"  readers     {info.readers}",
        ]
        if info.consumers is not None:
            lines.append(f"  consumers   {info.consumers} consume-claim(s) left before it is freed")
        if info.meta:
            # JSON escapes control characters inside strings: each line is safe to print.
            meta = to_json(info.meta, indent=2, sort_keys=True).splitlines()
            lines.append("  meta        " + meta[0])
            lines += ["              " + line for line in meta[1:]]
        else:
            lines.append("  meta        -")
        from kvbroker._wire.checksum import KINDS, parse

        def checksum_text(recorded) -> str:
            try:
                kind, value = parse(recorded)
                return f"{KINDS[kind]}:{value:016x}"
            except (ValueError, KeyError):
                return f"unreadable {clean(repr(recorded))}"

        sums = info.checksums or {}
        sizes = info.buffer_sizes or {name: None for name in sums}
        names = [clean(n) for n in sizes]
        width = max([4] + [len(n) for n in names])
        lines.append(f"  buffers     {'NAME':<{width}}  {'BYTES':>12}  CHECKSUM")
        for shown, (name, nbytes) in zip(names, sizes.items(), strict=True):
            digest = checksum_text(sums[name]) if name in sums else "-"
            lines.append(
                f"              {shown:<{width}}  {'?' if nbytes is None else nbytes:>12}  {digest}"
            )
        lines.append(
            "  checksums   "
            + (
                "recorded at seal (xxh3: of the whole buffer, xxh3c: per 1 MiB chunk)"
                if sums
                else "none (sealed without)"
            )
        )
        if leases:
            lines.append(f"  leases      {len(leases)}:")
            lines += [
                f"    #{ls.lease} {ls.kind} by session {ls.session}, "
                f"expires in {ls.expires_in:.1f}s"
                for ls in leases
            ]
        else:
            lines.append("  leases      none")
        if info.readers > len(leases):  # prefix matches lease under their first block's key
            lines.append(
                f"              ({info.readers - len(leases)} more read lease(s) not "
                "listed: stat names the latest 256, a prefix match by its first "
                "block)"
            )
        blocks.append("\n".join(lines))
    typer.echo("\n\n".join(blocks))


def _copies_dropped(n: int, dry_run: bool) -> str:
    copies = f"{n} disk cop{'y' if n == 1 else 'ies'}"
    return f"; would drop {copies}" if dry_run else f"; {copies} dropped"


def _exact_regex(text: str) -> str:
    """An RE2 pattern matching exactly ``text`` (every character not a letter or digit
    written as an escape, so no key is read as regex syntax)."""
    return "^" + "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text) + "$"


def _confirm_on_terminal() -> bool:
    """Whether to ask before ``evict --all`` (both ends are a terminal)."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def evict(
    key: str | None = typer.Argument(
        None, help="Evict this key (from every namespace unless --namespace)."
    ),
    match: str | None = typer.Option(
        None, "--match", "-m", metavar="REGEX", help="Keys this regex (RE2) matches."
    ),
    namespace: str | None = namespace_opt("Only objects of this namespace."),
    match_buffers: str | None = typer.Option(
        None, metavar="REGEX", help="Objects with a buffer name this regex matches."
    ),
    older_than: str | None = typer.Option(None, metavar="AGE", help="Age, e.g. 10m, 2h."),
    all_: bool = typer.Option(False, "--all", help="Every unleased object (nothing else)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would go; free nothing."),
    tier: str = typer.Option(
        "all",
        "--tier",
        metavar="all|dram|disk",
        help="all: from the pools and the disk tier; dram: from the "
        "pools only (kept on disk); disk: the disk copies only.",
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before --all."),
    socket: str | None = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Free sealed objects matching every filter given (leased ones are never evicted).

    Exit status 1 when KEY names no object (with --tier disk: no disk copy), with or without
    --json. --all takes no other selector, and asks first on a terminal (--yes does not ask).
    """
    cmd = "kvbroker evict"
    filters = {
        "KEY": key,
        "--match": match,
        "--namespace": namespace,
        "--match-buffers": match_buffers,
        "--older-than": older_than,
    }
    given = [name for name, value in filters.items() if value is not None]
    if not (given or all_):
        raise usage_error(
            "say what to evict: KEY, --match, --namespace, --match-buffers, --older-than or --all",
            cmd,
        )
    if all_ and given:
        raise usage_error(f"--all evicts every object; it takes no {' or '.join(given)}", cmd)
    if key is not None and match is not None:
        raise usage_error("give KEY or --match, not both", cmd)
    if tier not in TIERS:
        raise usage_error(f"--tier must be all, dram or disk, not {tier!r}", cmd)
    age_s = None
    if older_than is not None:
        try:
            age_s = parse_duration(older_than)
        except ValueError as exc:
            raise usage_error(f"--older-than: {exc}", cmd) from None
    if all_ and not dry_run and not yes and _confirm_on_terminal():
        if not typer.confirm("Evict every unleased object?", default=False, err=True):
            raise fail("nothing evicted", EXIT_ERROR)
    res = run(
        socket,
        lambda c: c.evict(
            key,
            match=match,
            namespace=namespace,
            match_buffers=match_buffers,
            older_than=age_s,
            all=all_,
            dry_run=dry_run,
            tier=tier,
        ),
        regex_option="--match or --match-buffers",
    )
    if as_json:
        typer.echo(
            to_json(
                {
                    "count": res.count,
                    "bytes": res.bytes,
                    "skipped_leased": res.skipped_leased,
                    "dry_run": res.dry_run,
                    "on_disk": res.on_disk,
                    "objects": [o.to_dict() for o in res.objects],
                },
                indent=2,
            )
        )
    else:
        verb = "would evict" if dry_run else "evicted"
        for o in res.objects:
            typer.echo(f"{verb} {clean(o.namespace)}/{clean(o.key)} ({format_size(o.nbytes)})")
        typer.echo(
            f"{verb} {res.count} object(s), {format_size(res.bytes)}"
            + (f"; {res.skipped_leased} leased object(s) kept" if res.skipped_leased else "")
            + (_copies_dropped(res.on_disk, dry_run) if res.on_disk else "")
        )
    # --tier disk frees no object a pool still holds: dropping its disk copy (on_disk) is
    # what it was asked to do, not "no object".
    if key is not None and res.count == 0 and not res.skipped_leased and not res.on_disk:
        where = "no disk copy of" if tier == "disk" else "no object"
        raise fail(f"{where} {clean(key)!r}")


__all__ = ["ls_", "show", "evict", "object_table", "age", "EXIT_USAGE"]
