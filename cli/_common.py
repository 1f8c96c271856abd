"""What every ``kvbroker`` command shares: exit codes, one-line errors, safe text, options.

Exit codes: 0 ok, 1 error, 2 usage error, 3 daemon not running, 4 the command needs hardware
or software this machine lacks (``bench gpu`` without CUDA, ``bench tp`` without torch).
This module must stay cheap to import: no torch, no numpy, no textual.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import typer
from typer.core import TyperGroup

from kvbroker.errors import BrokerUnavailable, KVBrokerError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_UNSUPPORTED = 0, 1, 2, 3, 4

# Click's exceptions as Typer raises them (recent Typer versions carry their own Click).
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
# A group run without a command (`kvbroker`, `kvbroker bench`): its help, which is not an
# error to fold into one line (Click 8.2 and later raise it; older ones print the help).
_NoArgsIsHelp = getattr(sys.modules[_UsageError.__module__], "NoArgsIsHelpError", ())


def to_json(value: Any, **kw: Any) -> str:
    """``value`` as valid JSON whatever clients put in their metas: bytes (and anything
    else JSON lacks) as their ``repr``, NaN and infinities as the strings ``"nan"``,
    ``"inf"``, ``"-inf"`` (JSON has no such numbers)."""
    import json

    def finite(v: Any) -> Any:
        if isinstance(v, float) and v != v or v in (float("inf"), float("-inf")):
            return repr(v)
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    return json.dumps(finite(value), default=repr, allow_nan=False, **kw)


def clean(text: object) -> str:
    """``text`` with every control or otherwise unprintable character escaped (``\\x1b``,
    ``\\n``, ``\\u2028``...), so a key cannot move the cursor, retitle the terminal or forge a
    row. Printable non-ASCII (``é``, ``中``) stays as it is."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in s)


def one_line(text: object) -> str:
    """An error message on one line, control characters escaped."""
    return clean(" ".join(str(text).split("\n")).strip())


def fail(message: str, code: int = EXIT_ERROR) -> typer.Exit:
    """Print ``kvbroker: message`` (one line) on stderr; raise what this returns."""
    typer.echo(f"kvbroker: {one_line(message)}", err=True)
    return typer.Exit(code)


def usage_error(message: str, command: str = "kvbroker") -> typer.Exit:
    """A usage error, printed like every other one (exit 2)."""
    typer.echo(f"{command}: {one_line(message)} (see '{command} --help')", err=True)
    return typer.Exit(EXIT_USAGE)


class OneLineGroup(TyperGroup):
    """Click's group with every error on one line of stderr: usage errors (exit 2) read
    ``kvbroker ls: Invalid value for '--limit': ... (see 'kvbroker ls --help')`` instead of a
    usage block (a group run without a command still prints its help), and an unexpected exception is one line too (``KVBROKER_DEBUG=1``: the
    traceback)."""

    def main(
        self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra: Any
    ):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as exc:
            exc.show()  # the group's whole help, as Click prints it
            sys.exit(exc.exit_code)
        except _UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else "kvbroker"
            typer.echo(
                f"{command}: {one_line(exc.format_message())} (see '{command} --help')", err=True
            )
            sys.exit(exc.exit_code)
        except _ClickException as exc:
            typer.echo(f"kvbroker: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("kvbroker: interrupted", err=True)
            sys.exit(130)
        except KVBrokerError as exc:  # a path that forgot to catch it: still one line
            code = EXIT_UNAVAILABLE if isinstance(exc, BrokerUnavailable) else EXIT_ERROR
            typer.echo(f"kvbroker: {one_line(exc)}", err=True)
            sys.exit(code)
        except Exception as exc:  # noqa: BLE001 - never a traceback for a user
            if os.environ.get("KVBROKER_DEBUG"):
                raise
            typer.echo(
                f"kvbroker: internal error: {type(exc).__name__}: {one_line(exc)} "
                "(KVBROKER_DEBUG=1 shows the traceback)",
                err=True,
            )
            sys.exit(EXIT_ERROR)
        sys.exit(rv if isinstance(rv, int) else EXIT_OK)


def user_default_socket() -> str:
    """The socket a command uses without ``--socket`` or ``$KVBROKER_SOCKET``, for this user
    (the same rule as :func:`kvbroker._wire.paths.default_socket_path`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvbroker.sock")
    if os.geteuid() == 0:
        return "/run/kvbroker/kvbroker.sock"
    return f"/tmp/kvbroker-{os.geteuid()}.sock"


SocketOpt = typer.Option(
    None,
    "--socket",
    "-s",
    envvar="KVBROKER_SOCKET",
    metavar="PATH",
    help="Daemon socket path.",
    show_default=user_default_socket(),
)
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")


def namespace_opt(what: str) -> Any:
    return typer.Option(None, "--namespace", "-n", metavar="NS", help=what)


def connect(socket: str | None, *, timeout: float = 10, name: str = "kvbroker-cli"):
    from kvbroker import Client

    try:
        return Client(socket, name=name, role="admin", map_pools=False, timeout=timeout)
    except BrokerUnavailable as exc:
        raise fail(f"{exc} (start it with 'kvbroker serve')", EXIT_UNAVAILABLE) from None
    except KVBrokerError as exc:  # refused: max_connections, a protocol mismatch...
        raise fail(f"{exc.code}: {exc}") from None


def run(socket: str | None, fn, *, regex_option: str = "--match", **connect_args):
    """``fn(client)`` on a fresh admin connection (``connect_args``: :func:`connect`'s);
    daemon errors become one-line exits. The daemon's "bad regex" is a usage error (exit 2),
    named after ``regex_option``."""
    from kvbroker.errors import BadRequest

    client = connect(socket, **connect_args)
    try:
        return fn(client)
    except BrokerUnavailable as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    except BadRequest as exc:
        if str(exc).startswith("bad regex"):
            raise fail(f"{regex_option}: {exc}", EXIT_USAGE) from None
        raise fail(f"{exc.code}: {exc}") from None
    except KVBrokerError as exc:
        raise fail(f"{exc.code}: {exc}") from None
    finally:
        client.close()


def output_width() -> int | None:
    """Columns to fit tables into: ``$COLUMNS``, else the terminal's; None when stdout is
    not a terminal (a pipe gets every key whole)."""
    env = os.environ.get("COLUMNS")
    if env and env.isdigit():
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns with an ellipsis when it is longer."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"
