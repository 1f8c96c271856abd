"""``kvbroker bench SCENARIO``: one subcommand per scenario of :mod:`kvbroker._bench`.

Each prints a table and the targets it checks, writes JSON with ``--json-out`` and PNG charts
with ``--plot DIR`` (matplotlib, from the ``bench`` extra). Without ``--socket`` (or
``$KVBROKER_SOCKET``) a scenario starts a private daemon sized for it and stops it afterwards.

Exit codes as for every command (0 ok, 1 error, 2 usage, 3 daemon not running), and 4 when
the scenario needs hardware or software this machine lacks (``gpu`` without CUDA, ``tp``
without torch).
A missed target does not fail the command: the figures are the output.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json

import typer

from kvbroker._wire.paths import parse_size

from ._common import EXIT_ERROR, EXIT_UNAVAILABLE, EXIT_UNSUPPORTED, fail

bench_app = typer.Typer(
    rich_markup_mode=None,
    help="Measure kvbroker against this machine's limits and a peer (ratios from one run).\n\n"
    "Exit codes: 0 ok (a missed target is reported, not failed), 1 error, 2 usage error, "
    "3 daemon not running, 4 this machine lacks what the scenario needs (CUDA, torch).",
    no_args_is_help=True,
)

SocketOpt = typer.Option(
    None,
    "--socket",
    "-s",
    envvar="KVBROKER_SOCKET",
    metavar="PATH",
    help="Benchmark this daemon (it is left as found).",
    show_default="start a private daemon",
)
JsonOutOpt = typer.Option(
    None, "--json-out", metavar="FILE", help="Write the results here as JSON."
)
PlotOpt = typer.Option(
    None, "--plot", metavar="DIR", help="Write PNG charts into this folder (matplotlib)."
)


def _peer_python_opt(help: str, show_default: str):
    """``--X-python``: the interpreter of the environment that has peer X installed."""
    return typer.Option(None, metavar="PYTHON", help=help, show_default=show_default)


def _peer_driver_opt(peer: str, python_flag: str, driver: str, **option):
    """``--X-script``: peer X's driver, run under ``python_flag``; by default ``driver`` in
    the source tree's benchmarks/."""
    return typer.Option(
        None,
        metavar="FILE",
        help=f"{peer}'s driver (it runs under {python_flag}).",
        show_default=f"benchmarks/{driver} of the source tree",
        **option,
    )


def _sizes(text: str, what: str = "--sizes") -> tuple[int, ...]:
    try:
        out = tuple(parse_size(s.strip()) for s in text.split(",") if s.strip())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=what) from None
    if not out or any(n <= 0 for n in out):
        raise typer.BadParameter("give one or more sizes above 0, e.g. 256K,4M", param_hint=what)
    return out


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(float(s)) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(
            f"expected numbers like 1,4,16 or 1e3, got {text!r}", param_hint=what
        ) from None
    if not out or any(n <= 0 for n in out):
        raise typer.BadParameter("give one or more numbers above 0", param_hint=what)
    return out


def _execute(
    socket, json_out, plot, run, pool_size="1G", daemon_args=(), daemon=True, daemon_env=None
) -> None:
    """Run one scenario (``run(socket_path) -> Result``), print, write JSON and charts.

    ``daemon`` False: the scenario starts what it needs itself (``run`` gets None)."""
    from kvbroker import _bench
    from kvbroker.errors import BrokerUnavailable

    if plot and importlib.util.find_spec("matplotlib") is None:  # fail before measuring
        typer.echo("kvbroker: --plot needs matplotlib: pip install 'kvbroker[bench]'", err=True)
        raise typer.Exit(1)
    if socket or not daemon:
        context = contextlib.nullcontext(socket)
    else:
        context = _bench.spawned_daemon(pool_size, *daemon_args, env=daemon_env)
    from kvbroker._bench._common import run_conditions

    before = run_conditions()  # the load and CPU pressure the figures were measured under
    try:
        with context as path:
            result = run(path)
    except BrokerUnavailable as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    result.extra.setdefault("conditions", {"before": before, "after": run_conditions()})
    typer.echo(result.text())
    data = result.as_dict()
    if json_out:
        with open(json_out, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        typer.echo(f"wrote {json_out}")
    if plot:
        for path in _bench.plot_result(data, plot):
            typer.echo(f"wrote {path}")


@bench_app.command()
def transfer(
    socket: str | None = SocketOpt,
    sizes: str = typer.Option(
        "4K,16K,64K,256K,1M,4M,16M,32M,64M,256M",
        metavar="SIZE,SIZE,...",
        help="Object sizes, comma-separated.",
    ),
    budget: str = typer.Option("2G", metavar="SIZE", help="About this many bytes moved per size."),
    pool_size: str = typer.Option("1G", metavar="SIZE", help="Pool of the private daemon."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """Publish+claim GB/s and p50/p99 latency per object size, memcpy in the same loop."""
    from kvbroker._bench import transfer as t

    size_list, budget_bytes = _sizes(sizes), _sizes(budget, "--budget")[0]
    _execute(socket, json_out, plot, lambda p: t.run(p, size_list, budget_bytes), pool_size)


@bench_app.command()
def rpc(
    socket: str | None = SocketOpt,
    clients: str = typer.Option(
        "1,4,16", metavar="N,N,...", help="Concurrent client processes, per run."
    ),
    seconds: float = typer.Option(2.0, min=0.05, help="Measuring window per run."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """Control-plane operations/s and latency with N concurrent client processes."""
    from kvbroker._bench import rpc as r

    n = _ints(clients, "--clients")
    _execute(socket, json_out, plot, lambda p: r.run(p, n, seconds), "64M")


@bench_app.command()
def scale(
    socket: str | None = SocketOpt,
    counts: str = typer.Option(
        "1e3,1e4,1e5,1e6", metavar="N,N,...", help="Directory sizes, filled in turn."
    ),
    ops: int = typer.Option(2000, min=10, help="Operations timed at each size."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """Lookup/claim latency and daemon memory with 10^3..10^6 objects in the directory."""
    from kvbroker._bench import scale as s

    n = _ints(counts, "--counts")
    _execute(
        socket,
        json_out,
        plot,
        lambda p: s.run(p, n, ops),
        s.pool_size_for(n),
        ("--page-size", str(s.PAGE)),
        daemon_env=s.DAEMON_ENV,
    )


@bench_app.command()
def prefix(
    socket: str | None = SocketOpt,
    lengths: str = typer.Option(
        "64,256,1024,4096,8192", metavar="N,N,...", help="Prefix lengths in tokens."
    ),
    reps: int = typer.Option(200, min=1, help="Matches timed per length."),
    prompts: int = typer.Option(200, min=2, help="Requests of the hit-rate workload."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """match_prefix latency against prefix length, and a hit-rate workload."""
    from kvbroker._bench import prefix as px

    n = _ints(lengths, "--lengths")
    _execute(socket, json_out, plot, lambda p: px.run(p, n, reps=reps, prompts=prompts))


@bench_app.command()
def tp(
    socket: str | None = SocketOpt,
    repeats: int = typer.Option(5, min=1, help="Requests timed per configuration."),
    layout: list[str] | None = typer.Option(None, help="Decode cache layout(s); default all."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """Heterogeneous vs homogeneous TP claims: copies per claim, GB/s (needs torch)."""
    from kvbroker._bench import tp as t

    try:
        t.load_bench_tp()
    except t.NoTorch as exc:
        raise fail(str(exc), EXIT_UNSUPPORTED) from None
    _execute(socket, json_out, plot, lambda p: t.run(p, repeats, layout), "2G")


@bench_app.command()
def gpu(
    reps: int = typer.Option(10, min=1, help="Repetitions per figure."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """CUDA only: D2H/H2D vs pinned, gather/scatter vs D2D, GPU-to-GPU through the rings.

    Starts its own daemon (sized for its 1 GiB transfers).
    """
    from kvbroker._bench import gpu as g

    try:
        g.cuda_device()
    except g.NoCuda as exc:
        raise fail(str(exc), EXIT_UNSUPPORTED) from None
    _execute(None, json_out, plot, lambda _: g.run(None, reps), daemon=False)


@bench_app.command()
def peer(
    mooncake_python: str | None = _peer_python_opt(
        "Python of the environment with Mooncake installed, e.g. /tmp/mc/bin/python.",
        "Mooncake not run: kvbroker against memcpy only",
    ),
    peer_script: str | None = _peer_driver_opt(
        "The peer", "--mooncake-python", "mooncake_peer.py", envvar="KVBROKER_PEER_SCRIPT"
    ),
    lmcache_python: str | None = _peer_python_opt(
        "Python of the environment with the lmcache wheel, e.g. /tmp/lmc/bin/python.",
        "LMCache not run",
    ),
    lmcache_script: str | None = _peer_driver_opt("LMCache", "--lmcache-python", "lmcache_peer.py"),
    kvcr_python: str | None = _peer_python_opt(
        "Python of the environment with the kvcr wheel and NIXL.", "KVCR not run"
    ),
    kvcr_script: str | None = _peer_driver_opt("KVCR", "--kvcr-python", "kvcr_peer.py"),
    socket: str | None = SocketOpt,
    sizes: str = typer.Option(
        "256K,4M,32M", metavar="SIZE,SIZE,...", help="Object sizes (the peer's defaults)."
    ),
    modes: str = typer.Option(
        "dummy,embedded", metavar="MODE,...", help="Mooncake modes to run (with --mooncake-python)."
    ),
    ops: int = typer.Option(50, min=3, help="Timed operations per size, both sides."),
    rounds: int = typer.Option(1, min=1, help="Peer-then-kvbroker rounds (ranges reported)."),
    json_out: str | None = JsonOutOpt,
    plot: str | None = PlotOpt,
) -> None:
    """kvbroker, Mooncake Store, LMCache and KVCR side by side in one session, with ratios;
    and against memcpy, on one thread and on the copy engine's threads (without peers too)."""
    from kvbroker._bench import peer as pr

    size_list = _sizes(sizes)
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = set(mode_list) - {"dummy", "embedded", "tcp"}
    if not mode_list or bad:
        raise typer.BadParameter(
            f"modes are dummy, embedded, tcp; got {modes!r}", param_hint="--modes"
        )
    script = None
    try:
        if mooncake_python is not None:
            script = peer_script or pr.default_peer_script()
        if lmcache_python is not None:
            lmcache_script = lmcache_script or pr.default_peer_script(pr.LMCACHE_SCRIPT)
        if kvcr_python is not None:
            kvcr_script = kvcr_script or pr.default_peer_script(pr.KVCR_SCRIPT)
    except pr.PeerFailed as exc:
        raise fail(str(exc), EXIT_ERROR) from None

    def run(path):
        try:
            return pr.run(
                path,
                mooncake_python,
                script,
                size_list,
                mode_list,
                ops,
                rounds,
                lmcache_python=lmcache_python,
                lmcache_script=lmcache_script,
                kvcr_python=kvcr_python,
                kvcr_script=kvcr_script,
            )
        except pr.PeerFailed as exc:  # not fail(): the peer's stderr tail keeps its lines
            typer.echo(f"kvbroker: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None

    _execute(socket, json_out, plot, run, "1G")
