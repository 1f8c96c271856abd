"""Who may use which namespace, and how many bytes a namespace may hold.

The daemon learns each client's uid and gid from SO_PEERCRED when it connects (supplementary
groups come from the group database for that uid's user). The :class:`Policy` then decides,
per namespace, whether that client may *read* it (claim, match_prefix, lookup, list, stat) and
*write* it (reserve, publish, seal, evict):

- ``open`` (the default): every client may do everything, as a single-user daemon wants;
  the socket's mode (0600, or 0660 with a group) is then the only gate.
- ``tenant``: a client owns the namespaces named after its user, ``alice`` and
  ``alice/<anything>`` (a uid with no user name owns ``<uid>`` and ``<uid>/...``);
  ``[isolation.shared."<namespace or glob>"]`` grants groups (or users) read or read-write
  access to other namespaces; administrators (root, the daemon's own user, ``admins`` and
  members of ``admin_groups``) may do everything. A namespace a client may not read is
  invisible to it: list, lookup, match_prefix, evict and stat skip it. Taking a lease on
  it raises :class:`~kvbroker.errors.Forbidden` naming the uid, the namespace and the rule.

The policy guards the directory (names, leases, eviction). The bytes live in pools every
connected client maps; a client that can map a pool can read any byte in it. So clients of
different uids share a daemon through ``group`` (socket and pools mode 0660, group-owned):
members of that group are trusted with the pool memory, and the namespace policy keeps their
names, prefixes and leases apart. Tenants that must not see each other's bytes need separate
daemons (each with its own socket, group and pools).

Quotas: ``[quotas]`` maps a namespace (exact name, or a glob such as ``"team-a/*"`` or
``"*"``) to a byte limit; every namespace matching a glob gets that limit for itself. An
exact name beats a glob, a longer glob beats a shorter one. A *tenant* quota caps what one
user (``"user:alice"``; ``"user:*"``: each user) or one group (``"group:team"``, its members
together) holds across every namespace it writes, write arenas included: a namespace glob
cannot, since ``alice/sub0``, ``alice/sub1``, ... each get its limit. The broker charges the
pages an object occupies from its reservation (or its arena) until its pages are freed.

Owned by the daemon: built from the configuration at start and on SIGHUP, read by the
broker on every request. Immutable, so a reload swaps it whole.
"""

from __future__ import annotations

import fnmatch
import grp
import os
import pwd
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..errors import Forbidden

__all__ = [
    "Policy",
    "Access",
    "Quotas",
    "forget_accounts",
    "parse_isolation",
    "parse_quotas",
    "user_name",
]

MODES = ("open", "tenant")


@lru_cache(maxsize=4096)
def user_name(uid: int) -> str:
    """The user name of ``uid``, or the uid in decimal when the host does not know it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


@lru_cache(maxsize=4096)
def _groups_of(uid: int, gid: int) -> frozenset[int]:
    gids = {gid}
    try:
        gids.update(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OverflowError, OSError):
        pass
    return frozenset(g for g in gids if g >= 0)


def forget_accounts() -> None:
    """Drop the cached user names and group memberships (SIGHUP: the group database may
    have changed since)."""
    user_name.cache_clear()
    _groups_of.cache_clear()


@dataclass(frozen=True)
class Grant:
    """Access to the namespaces matching ``pattern`` (an exact name or a glob)."""

    pattern: str
    read_gids: frozenset[int] = frozenset()
    write_gids: frozenset[int] = frozenset()
    read_uids: frozenset[int] = frozenset()
    write_uids: frozenset[int] = frozenset()
    everyone: str = ""  # "", "read" or "write": "*" in the lists

    def matches(self, namespace: str) -> bool:
        return namespace == self.pattern or fnmatch.fnmatchcase(namespace, self.pattern)

    def allows(self, uid: int, gids: frozenset[int], write: bool) -> bool:
        if self.everyone == "write" or (self.everyone == "read" and not write):
            return True
        if uid in self.write_uids or gids & self.write_gids:
            return True
        return not write and (uid in self.read_uids or bool(gids & self.read_gids))


@dataclass(frozen=True)
class Policy:
    mode: str = "open"
    admin_uids: frozenset[int] = frozenset()
    admin_gids: frozenset[int] = frozenset()
    shared: tuple[Grant, ...] = ()

    @property
    def open(self) -> bool:
        return self.mode == "open"

    def readable_by_everyone(self, namespace: str) -> bool:
        """Whether every user may read ``namespace``: open mode, or a shared grant to "*"
        (what a KV event stream anyone can subscribe to may carry)."""
        return self.open or any(g.everyone and g.matches(namespace) for g in self.shared)

    def access(self, uid: int, gid: int) -> Access:
        """What a client with these credentials may do (cache it per connection)."""
        gids = _groups_of(uid, gid) if uid >= 0 else frozenset()
        admin = (
            self.open
            or uid in (0, os.getuid())
            or uid in self.admin_uids
            or bool(gids & self.admin_gids)
        )
        return Access(self, uid, gids, admin)


@dataclass
class Access:
    """One connection's rights under a policy, with a per-namespace memo."""

    policy: Policy
    uid: int
    gids: frozenset[int]
    admin: bool
    _memo: dict[tuple[str, bool], bool] = field(default_factory=dict, repr=False)

    @property
    def user(self) -> str:
        return user_name(self.uid)

    def can(self, namespace: str, write: bool = False) -> bool:
        if self.admin:
            return True
        key = (namespace, write)
        ok = self._memo.get(key)
        if ok is None:
            ok = self._decide(namespace, write)
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = ok
        return ok

    def _decide(self, namespace: str, write: bool) -> bool:
        user = self.user
        if namespace == user or namespace.startswith(user + "/"):
            return True
        return any(
            g.allows(self.uid, self.gids, write) for g in self.policy.shared if g.matches(namespace)
        )

    def check(self, namespace: str, write: bool, op: str) -> None:
        """Raise Forbidden unless this client may read (or write) ``namespace``."""
        if self.can(namespace, write):
            return
        user = self.user
        grants = [g.pattern for g in self.policy.shared if g.matches(namespace)]
        rule = (
            f"shared grant(s) {', '.join(map(repr, grants))} give uid {self.uid} no "
            f"{'write' if write else 'read'} access"
            if grants
            else "no [isolation.shared] grant names it"
        )
        raise Forbidden(
            f"{op}: uid {self.uid} ({user}) may not {'write' if write else 'read'} namespace "
            f"{namespace!r}: tenant policy gives a user its own namespaces ({user!r}, "
            f"'{user}/...') and what [isolation.shared] grants; {rule}"
        )


@dataclass(frozen=True)
class Quotas:
    """Byte limits per namespace (see the module doc for how patterns match), and per
    tenant: a user (``"user:alice"``, ``"user:*"`` for every user) or a group
    (``"group:team"``, shared by its members), across every namespace it writes."""

    exact: tuple[tuple[str, int], ...] = ()
    globs: tuple[tuple[str, int], ...] = ()  # longest pattern first
    users: tuple[tuple[int, int], ...] = ()  # (uid, bytes)
    every_user: int | None = None  # "user:*": each user without its own line
    groups: tuple[tuple[int, int], ...] = ()  # (gid, bytes)

    def __bool__(self) -> bool:
        return bool(self.exact or self.globs or self.tenanted)

    @property
    def tenanted(self) -> bool:
        return bool(self.users or self.groups or self.every_user is not None)

    def tenants(self, uid: int, gids: frozenset[int]) -> tuple[tuple[str, int], ...]:
        """The tenant accounts a client's writes are charged to: ("user", uid), and
        ("group", gid) for each of its groups with a quota."""
        if not self.tenanted:
            return ()
        out: list[tuple[str, int]] = [("user", uid)]
        out += [("group", g) for g, _ in self.groups if g in gids]
        return tuple(out)

    def tenant_limit(self, account: tuple[str, int]) -> int | None:
        kind, ident = account
        if kind == "user":
            return next((n for u, n in self.users if u == ident), self.every_user)
        return next((n for g, n in self.groups if g == ident), None)

    def limit(self, namespace: str) -> int | None:
        for name, n in self.exact:
            if name == namespace:
                return n
        for pattern, n in self.globs:
            if fnmatch.fnmatchcase(namespace, pattern):
                return n
        return None


@dataclass(frozen=True)
class TenantPool:
    """A pool of one tenant's own (``[tenant_pools.NAME]``): created owned by ``uid`` (mode
    0600) or group-owned by ``gid`` (mode 0660), so the kernel lets only that tenant's
    processes map it; objects of ``namespaces`` (names or globs) live only there."""

    name: str
    size: int
    uid: int | None
    gid: int | None
    namespaces: tuple[str, ...]

    def holds(self, namespace: str) -> bool:
        return any(namespace == p or fnmatch.fnmatchcase(namespace, p) for p in self.namespaces)

    def admits(self, uid: int, gids: frozenset[int]) -> bool:
        """Whether a client with these credentials can map the pool (its arena goes here)."""
        return uid == self.uid if self.uid is not None else self.gid in gids


def parse_tenant_pools(table: Any, parse_size, where: str = "tenant_pools") -> tuple:
    """``[tenant_pools.NAME]`` tables (size, user or group, namespaces) -> TenantPools."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected tables like [tenant_pools.alice]")
    out = []
    for name, spec in table.items():
        at = _at(where, repr(name))
        if not isinstance(spec, dict) or not set(spec) <= {"size", "user", "group", "namespaces"}:
            raise ValueError(f"{at}: expected size, user or group, and namespaces")
        if ("user" in spec) == ("group" in spec):
            raise ValueError(f"{at}: name exactly one owner, user or group")
        try:
            size = parse_size(spec.get("size"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{at}.size: {exc}") from None
        uid = _uid(spec["user"], f"{at}.user") if "user" in spec else None
        gid = _gid(spec["group"], f"{at}.group") if "group" in spec else None
        spaces = _list(spec.get("namespaces"), f"{at}.namespaces")
        if not spaces or not all(isinstance(n, str) and n for n in spaces):
            raise ValueError(f"{at}.namespaces: expected a list of namespaces or globs")
        out.append(TenantPool(str(name), size, uid, gid, tuple(spaces)))
    return tuple(out)


# -- configuration --------------------------------------------------------------------------
def _numeric_id(value: Any, where: str, kind: str, lookup) -> int:
    """A uid/gid from an int, a string of digits, or a name ``lookup`` resolves."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, str):
        try:
            return lookup(value)
        except KeyError:
            raise ValueError(f"{where}: no {kind} {value!r} on this host") from None
    raise ValueError(f"{where}: expected a {kind} name or {kind[0]}id, got {value!r}")


def _uid(value: Any, where: str) -> int:
    return _numeric_id(value, where, "user", lambda name: pwd.getpwnam(name).pw_uid)


def _gid(value: Any, where: str) -> int:
    return _numeric_id(value, where, "group", lambda name: grp.getgrnam(name).gr_gid)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list, got {value!r}")
    return value


def _principals(value: Any, where: str) -> tuple[frozenset[int], frozenset[int], bool]:
    """["group", "user:alice", "*"] -> (gids, uids, everyone)."""
    gids, uids, everyone = set(), set(), False
    for item in _list(value, where):
        if item == "*":
            everyone = True
        elif isinstance(item, str) and item.startswith("user:"):
            uids.add(_uid(item[5:], where))
        else:
            gids.add(_gid(item, where))
    return frozenset(gids), frozenset(uids), everyone


def _at(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def parse_isolation(table: Any, where: str = "isolation") -> Policy:
    """The ``[isolation]`` table of the configuration file -> :class:`Policy`.

    Raises ValueError naming the offending key (``where`` prefixes it)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table ([isolation]), got {table!r}")
    known = {"mode", "admins", "admin_groups", "shared"}
    for key in table:
        if key not in known:
            raise ValueError(f"{_at(where, key)}: unknown key (expected one of {sorted(known)})")
    mode = table.get("mode", "open")
    if mode not in MODES:
        raise ValueError(f"{_at(where, 'mode')}: expected one of {', '.join(MODES)}, got {mode!r}")
    at = _at(where, "admins")
    admins = frozenset(_uid(u, at) for u in _list(table.get("admins", []), at))
    at = _at(where, "admin_groups")
    admin_gids = frozenset(_gid(g, at) for g in _list(table.get("admin_groups", []), at))
    shared_table = table.get("shared", {})
    if not isinstance(shared_table, dict):
        raise ValueError(f'{_at(where, "shared")}: expected tables like [isolation.shared."name"]')
    grants = []
    for pattern, spec in shared_table.items():
        at = f"{_at(where, 'shared')}.{pattern!r}"
        if not pattern:
            raise ValueError(f"{at}: the namespace (or glob) must not be empty")
        if not isinstance(spec, dict) or not set(spec) <= {"read", "write"}:
            raise ValueError(f"{at}: expected read = [groups] and/or write = [groups]")
        rg, ru, r_all = _principals(spec.get("read", []), f"{at}.read")
        wg, wu, w_all = _principals(spec.get("write", []), f"{at}.write")
        everyone = "write" if w_all else ("read" if r_all else "")
        grants.append(Grant(pattern, rg, wg, ru, wu, everyone))
    # admins and grants matter only in tenant mode, but are checked in both
    return Policy(mode, admins, admin_gids, tuple(grants))


def parse_quotas(table: Any, parse_size, where: str = "quotas") -> Quotas:
    """The ``[quotas]`` table -> :class:`Quotas`; ``parse_size`` turns "8G" into bytes."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table of namespace = size, got {table!r}")
    exact, globs, users, groups = [], [], [], []
    every_user = None
    for pattern, size in table.items():
        if isinstance(size, dict):
            raise ValueError(
                f'{_at(where, repr(pattern))}: expected a size like "8G"; '
                "quote names that contain dots or slashes"
            )
        try:
            n = parse_size(size)
        except ValueError as exc:
            raise ValueError(f"{_at(where, repr(pattern))}: {exc}") from None
        at = _at(where, repr(pattern))
        if pattern == "user:*":
            every_user = n
        elif pattern.startswith("user:"):
            users.append((_uid(pattern[5:], at), n))
        elif pattern.startswith("group:"):
            groups.append((_gid(pattern[6:], at), n))
        else:
            (globs if any(c in pattern for c in "*?[") else exact).append((pattern, n))
    globs.sort(key=lambda pn: -len(pn[0]))
    return Quotas(tuple(exact), tuple(globs), tuple(users), every_user, tuple(groups))
