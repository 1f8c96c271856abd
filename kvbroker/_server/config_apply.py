"""How a setting reaches the code that uses it: each ``Key`` of
:data:`~kvbroker._server.config.SETTINGS` declares it (``reload=``), and both the start and
every SIGHUP reload follow that declaration, so no consumer is wired by hand.

A setting is read where it is needed (:data:`LIVE`: ``daemon.config.<field>``), copied into
attributes of the daemon's owners (:class:`Into`: ``"broker.lease_ttl"``,
``"rings.object_ttl"``; :data:`OWNERS` says how each owner is reached), or applied by a
function of its own (a policy recomputed, a log level set). :func:`apply_owned` sets every
:class:`Into` target from the running configuration: the start calls it once the owners are
built, and the reload after each one (``reload_into``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

# The running kvbroker._server.config.DaemonConfig (which imports this module: named, not
# imported, so that the two make no circle).
DaemonConfig = Any


class Daemon(Protocol):
    """The running daemon as a setting reaches it (:class:`~kvbroker._server.daemon.Daemon`;
    declared here: the configuration, which the daemon imports, imports no daemon)."""

    config: DaemonConfig
    broker: Any
    fleet: Any
    connections: set[Any]


__all__ = [
    "LIVE",
    "OWNERS",
    "TO_BROKER",
    "Apply",
    "Into",
    "apply_owned",
    "set_log_level",
    "set_policy",
    "set_retention",
    "set_write_buffers",
]

# f(daemon, running configuration, field): how SIGHUP applies a setting.
Apply = Callable[["Daemon", "DaemonConfig", str], None]

# The daemon's owners an Into may name, and how each is reached (None: not running here).
OWNERS: dict[str, Callable[[Daemon], Any]] = {
    "broker": lambda d: d.broker,
    "rings": lambda d: d.broker.rings if d.broker is not None else None,
    "disk": lambda d: d.broker.pages.tier if d.broker is not None else None,  # [tier.disk]
}


def LIVE(daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
    """Nothing to push: the daemon reads ``daemon.config.<field>`` each time it needs it."""


class Into:
    """The setting's value, copied into ``owner.attribute`` of each target (``{}``: the
    setting's own field name), at the start and at every reload. An owner the daemon does
    not run (no GPU rings) is passed over."""

    def __init__(self, *targets: str) -> None:
        self.targets: tuple[tuple[str, str], ...] = ()
        for target in targets:
            owner, _, attr = target.partition(".")
            if owner not in OWNERS or not attr:
                raise ValueError(f"Into({target!r}): not OWNER.attribute of {sorted(OWNERS)}")
            self.targets += ((owner, attr),)

    def places(self, field: str) -> list[tuple[str, str]]:
        """``(owner, attribute)`` of every copy of ``field``."""
        return [(owner, attr.format(field)) for owner, attr in self.targets]

    def __call__(self, daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
        value = getattr(cfg, field)
        for owner, attr in self.places(field):
            obj = OWNERS[owner](daemon)
            if obj is not None:
                setattr(obj, attr, value)


# The broker keeps its own copy, under the setting's name.
TO_BROKER = Into("broker.{}")


def apply_owned(daemon: Daemon, settings: Any) -> None:
    """Every :class:`Into` copy of ``settings`` (the Keys) from ``daemon.config``."""
    for key in settings:
        if isinstance(key.reload, Into):
            key.reload(daemon, daemon.config, key.attr)


def set_policy(daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
    # One call for both tables (the reload calls each function once): every connection's
    # access is recomputed from its next request on.
    if daemon.broker is not None:
        daemon.broker.set_policy(cfg.isolation, cfg.quotas)
    events = getattr(daemon.fleet, "events", None)
    if events is not None:  # which namespaces an unauthenticated event stream carries
        events.policy_changed()


def set_write_buffers(daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
    if daemon.broker is None:
        return
    for conn in daemon.connections:  # the new bound applies to every open connection
        if conn.transport is not None and not conn.closed:
            conn.transport.set_write_buffer_limits(high=cfg.max_write_buffer)


def set_retention(daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
    # One call for the whole [sessions] table: lowered bounds are enforced at once.
    if daemon.broker is not None:
        daemon.broker.retention.configure(cfg.retention_settings())


def set_log_level(daemon: Daemon, cfg: DaemonConfig, field: str) -> None:
    logging.getLogger().setLevel(cfg.log_level.upper())
