"""``kvbroker serve``'s setting options, generated from the declarations in
``kvbroker/_server/config.py`` (one option per :class:`Key` with a ``flag``); nothing here
names a setting.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import typer

from kvbroker._server.config import SETTINGS, Key

__all__ = ["with_setting_flags"]


def _parameter(key: Key) -> inspect.Parameter:
    if key.switch:  # --cold
        annotation: Any = bool
        option = typer.Option(False, *key.flags, help=key.help)
    else:
        annotation = key.text | None  # None: not given, the file or a variable decides
        shown = key.shown_default()
        option = typer.Option(
            None,
            *key.flags,
            help=key.help,
            metavar=key.metavar,
            show_default=shown if shown is not None else False,
        )
    return inspect.Parameter(
        key.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option, annotation=annotation
    )


def with_setting_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command(<its own options>, *, flags)`` -> a Typer command taking its own options plus
    one per setting with a flag; ``flags`` maps each such setting to its value, None when not
    given (what ``load_config(flags=...)`` takes)."""
    keys = [k for k in SETTINGS if k.flags]
    hints = typing.get_type_hints(command)
    own = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in inspect.signature(command).parameters.values()
        if p.name != "flags"
    ]
    params = own + [_parameter(k) for k in keys]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        flags = {k.name: kwargs.pop(k.name) for k in keys}
        for k in keys:
            if k.switch and not flags[k.name]:
                flags[k.name] = None
        return command(**kwargs, flags=flags)

    wrapper.__signature__ = inspect.Signature(params, return_annotation=hints.get("return"))
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper
