"""What one setting declares (:class:`Key`): its name, parser, default, where it is read from
(file, variable, flag), who a reload reaches, how the docs show it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config_apply import Apply

ENV_PREFIX = "KVBROKER_"


@dataclass(frozen=True, eq=False)
class Key:
    """One setting: a TOML key, a ``KVBROKER_<NAME>`` variable, maybe a ``serve`` flag, and
    a :class:`DaemonConfig` field."""

    name: str  # the TOML key
    parse: Callable[[Any], Any]  # a TOML value (or text, or a flag's value) -> the setting
    # As written in TOML ("64K", "30s", 0.95): parsed by ``parse`` into DaemonConfig's default.
    # None stays None; a callable is a default factory; a table ({}) is parsed per instance.
    default: Any
    help: str
    # How SIGHUP applies a new value (LIVE, or the owners' attributes and methods it names:
    # Into, TO_BROKER, Call; kvbroker._server.config_apply); None: needs a restart.
    reload: Apply | None = None
    # ``serve``'s option declarations: () is --<name-with-dashes>; None: no flag (file and
    # environment only). A bool key with one declaration is a switch (--cold): absent means
    # "not given", never false.
    flag: tuple[str, ...] | None = None
    # The type of the value a flag gives (int, float, bool or str); a variable's text is
    # converted to int or float before ``parse`` when it is one of those.
    text: type = str
    # the default as help shows it, when the default does not say (a callable: worked out
    # when the help is shown, e.g. the socket path, which depends on who asks)
    shown: str | Callable[[], str] | None = None
    metavar: str | None = None  # what a flag's value is, in help (SIZE, DURATION, ...)
    field: str = ""  # the DaemonConfig attribute, when it is not ``name``
    example: Any = None  # a valid value other than the default, as TOML would hold it
    # A key of a TOML section: ``[transfer] listen`` is the key "transfer_listen" with section
    # "transfer" (variable KVBROKER_TRANSFER_LISTEN); "" for a top-level key.
    section: str = ""

    @property
    def toml_name(self) -> str:
        """Its name inside its section (``listen``), or its name at the top."""
        return self.name[len(self.section) + 1 :] if self.section else self.name

    @property
    def where(self) -> str:
        """How a file names it: ``[transfer] listen`` or ``lease_ttl``."""
        return f"[{self.section}] {self.toml_name}" if self.section else self.name

    @property
    def attr(self) -> str:
        return self.field or self.name

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def flags(self) -> tuple[str, ...]:
        """``serve``'s option declarations; () when the key has no flag."""
        if self.flag is None:
            return ()
        return self.flag or (flag_name(self.name),)

    @property
    def switch(self) -> bool:
        """A flag that can only say yes (--cold): absent is "not given", never false."""
        return self.text is bool and len(self.flags) == 1 and "/" not in self.flags[0]

    @property
    def reloadable(self) -> bool:
        return self.reload is not None

    @property
    def table(self) -> bool:
        return isinstance(self.default, dict)

    def parse_text(self, text: str) -> Any:
        """An environment variable's value: numbers arrive as text there, unlike in TOML."""
        if self.text in (int, float):
            try:
                return self.parse(self.text(text))
            except ValueError:
                pass  # let parse() word the error about the text itself
        return self.parse(text)

    def shown_default(self) -> str | None:
        if callable(self.shown):
            return self.shown()
        if self.shown is not None:
            return self.shown
        if self.default is None or callable(self.default) or self.table:
            return None
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)

    def dataclass_field(self) -> Any:
        if self.default is None:
            return dataclasses.field(default=None)
        if callable(self.default):
            return dataclasses.field(default_factory=self.default)
        if self.table:  # parsed when first needed: policy's imports stay off the CLI's path
            return dataclasses.field(default_factory=lambda: self.parse(dict(self.default)))
        return dataclasses.field(default=self.parse(self.default))


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")
