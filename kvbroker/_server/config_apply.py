"""How a setting reaches the code that uses it: each ``Key`` of
:data:`~kvbroker._server.config.SETTINGS` declares it (``reload=``), and both the start and
every SIGHUP reload follow that declaration, so no consumer is wired by hand.

A declaration names the daemon's owners (:data:`OWNERS`), not code of its own: a setting is
read where it is needed (:data:`LIVE`: ``config.<field>`` each time), copied into attributes
of owners (:class:`Into`: ``"broker.lease_ttl"``, ``"rings.object_ttl"``), or passed to
methods of owners (:class:`Call`: ``"broker.set_policy"`` with the running ``isolation`` and
``quotas``). The running daemon resolves the names (``Daemon.owners()``: name -> the object,
None for a part it does not run), and each declaration applies itself to what that resolves
(``apply(config, field, owners)``): :func:`apply_owned` sets every :class:`Into` copy at the
start, once the owners are built; ``config.reload_into`` applies every declaration after a
reload.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

# The running kvbroker._server.config.DaemonConfig (which imports this module: named, not
# imported, so that the two make no circle).
DaemonConfig = Any
# What the daemon's Daemon.owners() gives: an OWNERS name -> the object (None: not running).
Owners = Mapping[str, Any]

__all__ = ["LIVE", "OWNERS", "TO_BROKER", "Apply", "Call", "Into", "Live", "Owners", "apply_owned"]

# The names a declaration may use, and what the daemon resolves each to (Daemon.owners()).
OWNERS: dict[str, str] = {
    "daemon": "the daemon itself: its open connections, the process's logging",
    "broker": "the broker (kvbroker._server.broker.Broker)",
    "retention": "the broker's sessions' retention (kvbroker._server.retention.Retention)",
    "rings": "the GPU staging rings (kvbroker._server.rings.RingService), with gpu_ring",
    "disk": "the disk tier (kvbroker._server.disk_tier.DiskTier), with [tier.disk]",
    "events": "the KV event feed (kvbroker._server.fleet_events.EventFeed), with [events]",
}


def _target(kind: str, target: str, what: str) -> tuple[str, str]:
    owner, _, name = target.partition(".")
    if owner not in OWNERS or not name:
        raise ValueError(f"{kind}({target!r}): not OWNER.{what} of {sorted(OWNERS)}")
    return owner, name


class Live:
    """Nothing to push: the daemon reads ``config.<field>`` each time it needs it."""

    def once(self, field: str) -> Any:
        return self

    def apply(self, cfg: DaemonConfig, field: str, owners: Owners) -> None:
        pass


LIVE = Live()


class Into:
    """The setting's value, copied into ``owner.attribute`` of each target (``{}``: the
    setting's own field name), at the start and at every reload. An owner the daemon does
    not run (no GPU rings) is passed over."""

    def __init__(self, *targets: str) -> None:
        self.targets = tuple(_target("Into", t, "attribute") for t in targets)

    def places(self, field: str) -> list[tuple[str, str]]:
        """``(owner, attribute)`` of every copy of ``field``."""
        return [(owner, attr.format(field)) for owner, attr in self.targets]

    def once(self, field: str) -> Any:
        """Shared by several settings (TO_BROKER), it copies each one."""
        return (self, field)

    def apply(self, cfg: DaemonConfig, field: str, owners: Owners) -> None:
        value = getattr(cfg, field)
        for owner, attr in self.places(field):
            obj = owners[owner]
            if obj is not None:
                setattr(obj, attr, value)


# The broker keeps its own copy, under the setting's name.
TO_BROKER = Into("broker.{}")


class Call:
    """``owner.method(*values)`` with values of the running configuration: each argument
    names a field (``"isolation"``) or a method without arguments (``"retention_settings"``)
    of it. :meth:`then` adds another owner's method to the same call. Several settings may
    share one (``[isolation]`` and ``[quotas]``): a reload makes it once. An owner the daemon
    does not run is passed over."""

    def __init__(self, target: str, *args: str) -> None:
        owner, method = _target("Call", target, "method")
        self.steps: tuple[tuple[str, str, tuple[str, ...]], ...] = ((owner, method, args),)

    def then(self, target: str, *args: str) -> Call:
        more = Call(target, *args)
        more.steps = self.steps + more.steps
        return more

    def calls(self) -> list[tuple[str, str]]:
        """``(owner, method)`` of every method it calls, in order."""
        return [(owner, method) for owner, method, _ in self.steps]

    @staticmethod
    def values(cfg: DaemonConfig, args: tuple[str, ...]) -> list[Any]:
        out = [getattr(cfg, name) for name in args]
        return [v() if inspect.ismethod(v) else v for v in out]

    def once(self, field: str) -> Any:
        return self

    def apply(self, cfg: DaemonConfig, field: str, owners: Owners) -> None:
        for owner, method, args in self.steps:
            obj = owners[owner]
            if obj is not None:
                getattr(obj, method)(*self.values(cfg, args))


# How SIGHUP applies a setting (a Key's ``reload``).
Apply = Live | Into | Call


def apply_owned(settings: Any, cfg: DaemonConfig, owners: Owners) -> None:
    """Every :class:`Into` copy of ``settings`` (the Keys) from ``cfg``, into ``owners``."""
    for key in settings:
        if isinstance(key.reload, Into):
            key.reload.apply(cfg, key.attr, owners)
