"""An op's arguments as the op table declares them: types, defaults, value rules, and which
requests a read replica answers.

A value rule (:class:`Rule`) is declared on the argument it governs, in a row of
:data:`~kvbroker._wire.protocol.OPS` (or of :data:`~kvbroker._wire.peer.PEER_OPS`), and
applied by :func:`check_args` on every path a request takes: the daemon, its read replicas,
the peer channel. A rule may depend on the serving side's settings (``limits``: an object
with the attributes the rule names, e.g. the broker's ``max_lease_ttl``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest

__all__ = ["LEASE_TTL", "Arg", "Replica", "Rule", "check_args", "check_rules"]


@dataclass(frozen=True)
class Rule:
    """What an argument's value must be beyond its type. ``problem(value, limits)`` says why
    ``value`` is refused (with the serving side's ``limits``), or None."""

    name: str  # what the op table says of it
    problem: Callable[[Any, Any], str | None]


def _lease_ttl_problem(ttl: Any, limits: Any) -> str | None:
    if ttl is None:
        return None  # the serving side's default
    most = limits.max_lease_ttl
    # (NaN compares false both ways and inf exceeds any bound: both refused here.)
    if not 0 < ttl <= most or not math.isfinite(ttl):
        return f"ttl must be in (0, {most:g}] seconds, not {ttl!r}"
    return None


# A lease or object TTL: a finite number of seconds in (0, max_lease_ttl] (a NaN would never
# be due in the expiry heap; issue 38), or None for the serving side's default.
LEASE_TTL = Rule("in (0, max_lease_ttl] s", _lease_ttl_problem)


@dataclass(frozen=True)
class Arg:
    types: tuple[type, ...]
    required: bool = False
    default: Any = None
    rule: Rule | None = None


@dataclass(frozen=True)
class Replica:
    """The op table's ``replica`` column: a read replica (:mod:`kvbroker._server.replica`)
    answers the op, when its arguments have the values ``when`` names (a replica holds the
    journal's names only: no pages, no leases, no peers). ``routed``: a client sends it there
    rather than to the daemon; ``hello`` and ``ping`` are answered on a replica's own
    connection, not routed."""

    when: tuple[tuple[str, Any], ...] = ()
    routed: bool = True


def replica_answers(replica: Replica | None, declared: dict[str, Arg], args: Mapping) -> bool:
    """Whether a replica answers a request of an op whose row says ``replica`` (its
    arguments ``declared``) with ``args`` (an argument left out has its default)."""
    if replica is None:
        return False
    for name, value in replica.when:
        if args.get(name, declared[name].default) != value:
            return False
    return True


_MISSING = object()


def check_args(op_name: str, declared: dict[str, Arg], raw: Any, limits: Any) -> dict[str, Any]:
    """``raw`` checked against ``declared`` (one op's arguments, of the op table or of the
    peer channel's table): the arguments with their defaults filled in, or
    :class:`~kvbroker.errors.BadRequest` naming the offending one. ``limits``: the serving
    side's, for the arguments' rules."""
    if raw is None:
        raw = {}
    elif not isinstance(raw, dict):
        raise BadRequest(f"{op_name}: args must be a map, not {type(raw).__name__}")
    out: dict[str, Any] = {}
    seen = 0
    for name, arg in declared.items():
        value = raw.get(name, _MISSING)
        if value is _MISSING:
            if arg.required:
                raise BadRequest(f"{op_name}: missing argument {name!r}")
            out[name] = arg.default
            continue
        seen += 1
        # bool is an int subclass: never accept True where a count is meant.
        if not isinstance(value, arg.types) or (value.__class__ is bool and bool not in arg.types):
            raise BadRequest(
                f"{op_name}: {name} must be {_type_names(arg)}, not {type(value).__name__}"
            )
        out[name] = value
    if seen != len(raw):
        extra = next(k for k in raw if k not in declared)
        raise BadRequest(f"{op_name}: unexpected argument {extra!r}")
    check_rules(op_name, ruled(declared), out, limits)
    return out


def ruled(declared: dict[str, Arg]) -> tuple[tuple[str, Rule], ...]:
    """The arguments of ``declared`` that have a rule, with it."""
    return tuple((name, arg.rule) for name, arg in declared.items() if arg.rule is not None)


def check_rules(
    op_name: str, rules: tuple[tuple[str, Rule], ...], args: dict[str, Any], limits: Any
) -> None:
    """BadRequest when an argument of ``args`` (type-checked already) breaks its rule."""
    for name, rule in rules:
        problem = rule.problem(args.get(name), limits)
        if problem is not None:
            raise BadRequest(f"{op_name}: {problem}")


def _type_names(arg: Arg) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in arg.types)
