"""Sessions: the KV that agents and multi-turn chats come back to, kept past plain LRU.

A *session* is a name a request gives (``retain: {session, for, priority}`` on ``reserve``,
``publish``, ``reserve_blocks`` and ``match_prefix``), scoped by its namespace like every other name:
``(namespace, name)``, visible only to clients that may read that namespace. The blocks a
session publishes or matches are *retained* while the session lasts: eviction takes them only
after every unretained object, and among retained objects the lowest priority first (an
object's priority is the highest of the sessions retaining it), least recently used first
within a priority, a chain from its leaf. Each request naming the session renews it for its
``for`` (the ``[sessions] retain`` default), never past ``[sessions] max_retain``.

Retention is bounded, and what gives way is retention, never a request or its bytes:

- *tenant quota* (``[sessions] tenant_quota``): the bytes one uid's sessions retain together.
  Past it the tenant's own lowest priority, least recently used retained blocks lose their
  retention (they stay cached, as the oldest end of the plain LRU) until it fits again
  (docs/sessions.md says why it yields rather than refuses, and why its own).
- *pool share* (``[sessions] pool_share``): the part of each pool retained blocks may hold,
  all tenants together; past it, the pool's lowest priority, least recently used retained
  blocks lose their retention (whoever retains them), so plain traffic always keeps the rest.
  Either bound sheds a chain from its leaf (``children``): a block is kept by its retained
  children whatever its own retention says.
- *time* (``[sessions] max_retain``), and ``[sessions] max_per_uid`` sessions per uid
  (:class:`~kvbroker.errors.LimitExceeded` past it: a name costs the daemon memory).

A session expires when its time passes without a request (``expire``), or is released
(``release``); its blocks then fall back to the plain LRU. A block unlinked meanwhile (evicted
under pressure, by an operator, replaced) leaves every session that retained it; the
``why`` of such evictions is counted (``statistics``).

Owned by the broker (:class:`~kvbroker._server.broker.Broker` composes it and calls its hooks
where objects enter or leave the eviction order); its state is its own: sessions, which
session retains which object, retained bytes per pool and per tenant, and the order retained
objects are evicted in. What it journals (:mod:`~kvbroker._server.retention_records`) lets
a restart keep it, the bounds enforced again. No I/O.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._wire.stats import RetentionStatistics, SessionInfo
from ..errors import BadRequest, LimitExceeded
from .retention_records import ended_record, named_record, restorable, shed_record

if TYPE_CHECKING:
    from .state import StoredObject

__all__ = ["Retention", "RetentionSettings", "Retained"]


@dataclass(frozen=True)
class RetentionSettings:
    """The ``[sessions]`` settings (kvbroker._server.config), reloadable on SIGHUP."""

    retain: float = 600.0  # a request naming a session without ``for`` renews it this long
    max_retain: float = 3600.0
    pool_share: float = 0.5  # of each pool, all sessions together
    tenant_quota: int | None = None  # bytes one uid's sessions retain together
    max_per_uid: int = 4096


class Retained:
    """One session: its name, its owner's uid, its priority and expiry, what it retains."""

    __slots__ = (
        "namespace",
        "name",
        "uid",
        "priority",
        "expires_at",
        "last_use",
        "created_at",
        "objects",
        "nbytes",
    )

    def __init__(self, namespace: str, name: str, uid: int, now: float) -> None:
        self.namespace, self.name, self.uid = namespace, name, uid
        self.priority = 0
        self.expires_at = now
        self.last_use = self.created_at = now
        self.objects: dict[int, StoredObject] = {}  # serial -> object it retains
        self.nbytes = 0  # the pages of those objects

    def info(self, now: float) -> SessionInfo:
        return SessionInfo(
            namespace=self.namespace,
            name=self.name,
            uid=self.uid,
            priority=self.priority,
            blocks=len(self.objects),
            bytes=self.nbytes,
            last_use=self.last_use,
            expires_in=max(0.0, self.expires_at - now),
            created_at=self.created_at,
        )


def _size_then_use(entry: Retained) -> tuple[int, float]:
    return entry.nbytes, entry.last_use


def _footprint(obj: StoredObject) -> int:
    return obj.npages * obj.pool.page_size


class Retention:
    """The sessions, the objects they retain, and the order those objects are evicted in."""

    def __init__(
        self,
        capacities: list[int],
        lru: OrderedDict[int, StoredObject],
        settings: RetentionSettings | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings or RetentionSettings()
        self.clock = clock  # wall-clock: an expiry survives a restart in the journal
        self.capacities = capacities  # bytes per pool index
        self._lru = lru  # the broker's plain LRU: where an object goes when no session keeps it
        self.sessions: dict[tuple[str, str], Retained] = {}
        self.holders: dict[int, list[Retained]] = {}  # serial -> sessions retaining it
        # priority -> serial -> object, least recently used first: the eviction order
        self.tiers: dict[int, OrderedDict[int, StoredObject]] = {}
        # serial -> when it last went to the recent end of its tier: a tier's order, so one
        # tenant's own retained objects sort into it without a walk of everyone else's
        self.placed: dict[int, int] = {}
        self._placings = itertools.count()
        self.pool_bytes: Counter[int] = Counter()  # pool index -> bytes retained there
        self.tenant_bytes: Counter[int] = Counter()  # uid -> bytes its sessions retain
        self.per_uid: Counter[int] = Counter()  # uid -> sessions
        self.pending: dict[int, Retained] = {}  # serial of an unsealed block -> its session
        self._expiry: list[tuple[float, str, str]] = []
        self.evicted: Counter[str] = Counter()  # why retained objects were evicted
        self.dropped: Counter[str] = Counter()  # why objects lost their retention
        self._journal_file: Any = None  # kvbroker._server.journal.Journal, when kept
        # serial -> how many of its children (``obj.parent``) sessions retain: a block with
        # one is kept by it, so it loses retention only after them (a chain from its leaf)
        self.children: Counter[int] = Counter()

    # ------------------------------------------------------------------ requests
    @staticmethod
    def request(retain: dict) -> tuple[str, float | None, int | None]:
        """(session, for, priority) of a request's ``retain`` map (checked by the op table's
        rule, ``kvbroker._wire.protocol.retain_problem``)."""
        return retain["session"], retain.get("for"), retain.get("priority")

    def renew(
        self,
        namespace: str,
        name: str,
        uid: int,
        for_: float | None = None,
        priority: int | None = None,
        exactly: bool = False,
    ) -> Retained:
        """The session ``(namespace, name)``, created for ``uid`` if new, renewed from now for
        ``for_`` seconds (the default when None; never past ``max_retain``). A request only
        extends (a turn without ``for`` does not cut an hour an operator granted short);
        ``exactly`` (an operator's ``retain``) sets it."""
        now = self.clock()
        key = (namespace, name)
        entry = self.sessions.get(key)
        if entry is None:
            if self.per_uid[uid] >= self.settings.max_per_uid:
                raise LimitExceeded(
                    f"uid {uid} has {self.per_uid[uid]} sessions, the most one uid may have "
                    "([sessions] max_per_uid): release some (kvbroker release SESSION)"
                )
            entry = self.sessions[key] = Retained(namespace, name, uid, now)
            self.per_uid[uid] += 1
        s = self.settings
        until = now + min(s.retain if for_ is None else for_, s.max_retain)
        entry.expires_at = until if exactly else max(until, entry.expires_at)
        entry.last_use = now
        heapq.heappush(self._expiry, (entry.expires_at, namespace, name))
        if priority is not None and priority != entry.priority:
            entry.priority = priority
            for obj in entry.objects.values():
                self._place(obj)
        self._journal(entry, ())
        return entry

    def retain(self, entry: Retained, found: Iterable[StoredObject]) -> None:
        """``entry`` retains the sealed, linked objects ``found`` (a chain parents first) from
        now on, the most recently used of its priority; then the bounds are enforced."""
        added, pools = [], set()
        mine, holders, namespace = entry.objects, self.holders, entry.namespace
        own_tier = self.tiers.get(entry.priority)
        # Leaf first into the order: a chain loses retention (and is evicted) from its leaf.
        for obj in reversed(list(found)):
            if not obj.linked or obj.namespace != namespace:
                continue
            serial = obj.serial
            if serial not in mine:
                self._add(entry, obj)
                added.append(serial)
                own_tier = self.tiers.get(entry.priority)
            elif own_tier is not None and len(holders[serial]) == 1 and serial in own_tier:
                own_tier.move_to_end(serial)  # a renewal of its own block: the usual case
                self.placed[serial] = next(self._placings)
            else:
                self._place(obj)
            pools.add(obj.pool.index)
        if added:
            self._journal(entry, added)
        self.enforce(uids=(entry.uid,), pools=pools)

    def adopt(self, obj: StoredObject) -> None:
        """An object just sealed: retained by the session its reservation named (if that
        session still lasts), else the most recently used of the plain LRU."""
        entry = self.pending.pop(obj.serial, None)
        if entry is not None and self.sessions.get((entry.namespace, entry.name)) is entry:
            self.retain(entry, (obj,))
        if obj.serial not in self.holders:
            self._lru[obj.serial] = obj

    def keeps(self, obj: StoredObject) -> bool:
        """Whether a session retains ``obj`` (then it stays out of the plain LRU)."""
        return obj.serial in self.holders

    # ------------------------------------------------------------------ eviction order
    def victims(self, pool: int | None = None) -> Iterator[StoredObject]:
        """Retained objects eviction may take (no reader, no child, linked; of ``pool``
        when given), lowest priority first, least recently used first: what goes only
        after every unretained object. Do not change the order while iterating."""
        for prio in sorted(self.tiers):
            for obj in self.tiers[prio].values():
                if obj.readers or obj.children or not obj.linked:
                    continue
                if pool is None or obj.pool.index == pool:
                    yield obj

    def evicted_now(self, obj: StoredObject, why: str) -> None:
        """``obj`` is being evicted (``why``: pool_full, watermark, quota, operator)."""
        if obj.serial in self.holders:
            self.evicted[why] += 1

    def forget(self, obj: StoredObject) -> None:
        """``obj`` was unlinked: out of the plain LRU, and no session retains it any more."""
        self._lru.pop(obj.serial, None)
        self.pending.pop(obj.serial, None)
        for entry in self.holders.get(obj.serial, ())[:]:
            self._remove(entry, obj, back_to_lru=False)
        self.children.pop(obj.serial, None)

    # ------------------------------------------------------------------ operators
    def find(
        self, namespace: str | None, name: str, visible: Callable[[str], bool]
    ) -> Retained | None:
        """The session ``name`` (in ``namespace``, or in the one namespace among those
        ``visible`` that has it); None when there is none the caller may see."""
        if namespace is not None:
            entry = self.sessions.get((namespace, name))
            return entry if entry is not None and visible(namespace) else None
        found = [e for (ns, n), e in self.sessions.items() if n == name and visible(ns)]
        if len(found) > 1:
            raise BadRequest(
                f"session {name!r} exists in namespaces "
                f"{sorted(e.namespace for e in found)}: name one (--namespace)"
            )
        return found[0] if found else None

    def release(self, entry: Retained, why: str = "released") -> None:
        """End the session: its objects fall back to the plain LRU (oldest end)."""
        if self.sessions.get((entry.namespace, entry.name)) is not entry:
            return
        for obj in list(entry.objects.values()):
            self._remove(entry, obj, back_to_lru=True)
            self.dropped[why] += 1
        del self.sessions[(entry.namespace, entry.name)]
        self.per_uid[entry.uid] -= 1
        if self.per_uid[entry.uid] <= 0:
            del self.per_uid[entry.uid]
        if self.journal is not None:
            self.journal.retention(ended_record(entry))

    def expire(self, now: float | None = None) -> int:
        """Release the sessions whose time passed without a request; returns how many."""
        now = self.clock() if now is None else now
        ended = 0
        while self._expiry and self._expiry[0][0] <= now:
            at, ns, name = heapq.heappop(self._expiry)
            entry = self.sessions.get((ns, name))
            if entry is None or entry.expires_at != at:
                continue  # released, or renewed since (a later heap entry stands for it)
            self.release(entry, "expired")
            ended += 1
        if len(self._expiry) > 2 * len(self.sessions) + 1024:  # renewals leave stale entries
            self._expiry = [(e.expires_at, e.namespace, e.name) for e in self.sessions.values()]
            heapq.heapify(self._expiry)
        return ended

    def configure(self, settings: RetentionSettings) -> None:
        """New ``[sessions]`` settings (a reload): lowered bounds are enforced at once; a
        shorter ``max_retain`` shortens what was granted beyond it."""
        self.settings = settings
        now = self.clock()
        for entry in self.sessions.values():
            if entry.expires_at > now + settings.max_retain:
                entry.expires_at = now + settings.max_retain
                heapq.heappush(self._expiry, (entry.expires_at, entry.namespace, entry.name))
                self._journal(entry, ())  # a restart must not give the time back
        self.enforce()

    # ------------------------------------------------------------------ bounds
    def enforce(
        self, uids: Iterable[int] | None = None, pools: Iterable[int] | None = None
    ) -> None:
        """Drop retention (lowest priority, least recently used first) until every tenant in
        ``uids`` and every pool in ``pools`` (None: all) is within its bound."""
        lost: dict[Retained, list[int]] = {}  # what each session lost, for the journal
        quota = self.settings.tenant_quota
        if quota is not None:
            for uid in list(self.tenant_bytes) if uids is None else uids:
                if self.tenant_bytes[uid] > quota:
                    self._shed_tenant(uid, quota, lost)
        share = self.settings.pool_share
        for idx in range(len(self.capacities)) if pools is None else pools:
            cap = share * self.capacities[idx]
            if self.pool_bytes[idx] > cap:
                self._shed(
                    lambda o, i=idx: o.pool.index == i,
                    lambda i=idx, c=cap: self.pool_bytes[i] <= c,
                    "pool_share",
                    lost,
                )
        if lost and self.journal is not None:
            # A restart replays these: what a bound took stays taken (the bound may have
            # room again by then, and the live daemon would not have given it back).
            for entry, serials in lost.items():
                if self.sessions.get((entry.namespace, entry.name)) is entry:
                    self.journal.retention(shed_record(entry, serials))

    def _shed_tenant(self, uid: int, quota: int, lost: dict[Retained, list[int]]) -> None:
        # The tenant's own retained objects in eviction order (their tier, then when each
        # went to its tier's recent end): a request past its quota costs a sort of what its
        # tenant retains, never a walk of what every other tenant retains (a tenant at the
        # recent end of a big tier made each of its requests, and so every other client's
        # wait on the event loop, cost a scan of all of it).
        own = {
            serial: obj
            for e in self.sessions.values()
            if e.uid == uid
            for serial, obj in e.objects.items()
        }
        order = sorted(own.values(), key=lambda o: (self._priority(o), self.placed[o.serial]))
        drop = functools.partial(self._drop, why="tenant_quota", lost=lost, uid=uid)
        deferred: dict[int, StoredObject] = {}
        self._shed_leaves_first(order, lambda: self.tenant_bytes[uid] <= quota, drop, deferred)
        self._shed_rest(deferred, lambda: self.tenant_bytes[uid] <= quota, drop, uid)

    def _priority(self, obj: StoredObject) -> int:
        """The tier ``obj`` is in: the highest priority of the sessions retaining it."""
        holders = self.holders[obj.serial]
        return holders[0].priority if len(holders) == 1 else max(e.priority for e in holders)

    def _shed(
        self,
        chosen: Callable[[StoredObject], bool],
        done: Callable[[], bool],
        why: str,
        lost: dict[Retained, list[int]],
    ) -> None:
        # In batches from the front of the order: a request past a bound sheds a few blocks,
        # and must not cost a walk of everything retained (the tiers change as it sheds).
        drop = functools.partial(self._drop, why=why, lost=lost)
        deferred: dict[int, StoredObject] = {}
        while not done():
            batch = list(
                islice(
                    (
                        o
                        for prio in sorted(self.tiers)
                        for o in self.tiers[prio].values()
                        if o.serial not in deferred and chosen(o)
                    ),
                    64,
                )
            )
            if not batch:
                break
            self._shed_leaves_first(batch, done, drop, deferred)
        self._shed_rest(deferred, done, drop)

    def _drop(
        self, obj: StoredObject, why: str, lost: dict[Retained, list[int]], uid: int | None = None
    ) -> None:
        """``obj`` loses the retention of every session (of ``uid``'s, when given)."""
        for entry in self.holders.get(obj.serial, ())[:]:
            if uid is None or entry.uid == uid:
                self._remove(entry, obj, back_to_lru=True)
                lost.setdefault(entry, []).append(obj.serial)
        self.dropped[why] += 1

    def _shed_leaves_first(
        self,
        order: Iterable[StoredObject],
        done: Callable[[], bool],
        drop: Callable[[StoredObject], None],
        deferred: dict[int, StoredObject],
    ) -> None:
        """Drop retention in ``order``, a chain from its leaf: a block whose child is still
        retained is deferred (its child keeps it unevictable, so dropping its retention
        first would free nothing and let a bound be passed in fact), and dropped as soon as
        its last retained child was."""
        for obj in order:
            if done():
                return
            if obj.serial in deferred or not self.keeps(obj):
                continue  # dropped already, up a chain
            if self.children[obj.serial]:
                deferred[obj.serial] = obj
                continue
            drop(obj)
            up = obj.parent
            while (
                up is not None
                and up.serial in deferred
                and not self.children[up.serial]
                and not done()
            ):
                del deferred[up.serial]
                drop(up)
                up = up.parent

    def _shed_rest(
        self,
        deferred: dict[int, StoredObject],
        done: Callable[[], bool],
        drop: Callable[[StoredObject], None],
        uid: int | None = None,
    ) -> None:
        """Past what leaves could give (blocks kept by children beyond the bound's reach:
        another pool's, another tenant's), the bound still holds: the deferred go too."""
        for obj in deferred.values():
            if done():
                return
            holders = self.holders.get(obj.serial, ())
            if any(uid is None or e.uid == uid for e in holders):
                drop(obj)

    # ------------------------------------------------------------------ the tables
    def _add(self, entry: Retained, obj: StoredObject) -> None:
        size = _footprint(obj)
        holders = self.holders.get(obj.serial)
        if holders is None:
            holders = self.holders[obj.serial] = []
            self.pool_bytes[obj.pool.index] += size
            self._lru.pop(obj.serial, None)  # retained: out of the plain order
            if obj.parent is not None:
                self.children[obj.parent.serial] += 1
        if all(e.uid != entry.uid for e in holders):
            self.tenant_bytes[entry.uid] += size
        holders.append(entry)
        entry.objects[obj.serial] = obj
        entry.nbytes += size
        self._place(obj)

    def _remove(self, entry: Retained, obj: StoredObject, back_to_lru: bool) -> None:
        holders = self.holders.get(obj.serial)
        if holders is None or entry not in holders:
            return
        size = _footprint(obj)
        holders.remove(entry)
        del entry.objects[obj.serial]
        entry.nbytes -= size
        if all(e.uid != entry.uid for e in holders):
            self._uncount(self.tenant_bytes, entry.uid, size)
        if holders:
            self._place(obj)
            return
        del self.holders[obj.serial]
        self.placed.pop(obj.serial, None)
        if obj.parent is not None:
            self._uncount(self.children, obj.parent.serial, 1)
        self._uncount(self.pool_bytes, obj.pool.index, size)
        for tier in self.tiers.values():
            tier.pop(obj.serial, None)
        if back_to_lru and obj.linked and not obj.readers and not obj.children:
            self._lru[obj.serial] = obj  # the oldest end: the first to go under pressure
            self._lru.move_to_end(obj.serial, last=False)

    def _place(self, obj: StoredObject) -> None:
        """Put ``obj`` at the recent end of its priority's tier (its holders' highest)."""
        prio = self._priority(obj)
        self.placed[obj.serial] = next(self._placings)
        tier = self.tiers.get(prio)
        if tier is not None and obj.serial in tier:  # the usual case: a renewal
            tier.move_to_end(obj.serial)
            return
        for p, tier in self.tiers.items():
            if p != prio:
                tier.pop(obj.serial, None)
        tier = self.tiers.setdefault(prio, OrderedDict())
        tier.pop(obj.serial, None)
        tier[obj.serial] = obj
        for p in [p for p, t in self.tiers.items() if not t]:
            del self.tiers[p]

    @staticmethod
    def _uncount(counter: Counter, key: Any, n: int) -> None:
        counter[key] -= n
        if counter[key] <= 0:
            del counter[key]

    # ------------------------------------------------------------------ journal, restart
    def _journal(self, entry: Retained, added: Iterable[int]) -> None:
        if self.journal is not None:
            self.journal.retention(named_record(entry, list(added)))

    @property
    def journal(self) -> Any:
        return self._journal_file

    @journal.setter
    def journal(self, journal: Any) -> None:
        """Journal the sessions' changes from now on; a rewrite of the file (a compaction)
        carries every session (``records``)."""
        self._journal_file = journal
        if journal is not None:
            journal.sessions = self.records

    def records(self) -> list[dict[str, Any]]:
        """Every session as one journal record (a compaction's)."""
        return [named_record(e, list(e.objects)) for e in self.sessions.values()]

    def restore(self, sessions: Iterable[dict[str, Any]], objects: dict[int, StoredObject]) -> int:
        """Sessions of a previous daemon (``Recovered.sessions``) over its restored objects
        (``objects``: serial -> object): the ones not expired come back with the objects
        still there, and the bounds are enforced. Returns how many came back."""
        now = self.clock()
        n = 0
        for rec in sessions:
            fields = restorable(rec)
            if fields is None:
                continue  # a malformed record retains nothing; the others still come back
            ns, name, uid, expires, prio, created, serials = fields
            if expires <= now or (ns, name) in self.sessions:
                continue
            entry = self.sessions[(ns, name)] = Retained(ns, name, uid, now)
            self.per_uid[uid] += 1
            entry.priority = prio
            entry.expires_at = min(expires, now + self.settings.max_retain)
            entry.created_at = min(created, now) if created is not None else now
            heapq.heappush(self._expiry, (entry.expires_at, ns, name))
            for serial in sorted(serials):
                obj = objects.get(serial)
                if obj is not None and obj.linked and obj.namespace == ns:
                    self._add(entry, obj)
            n += 1
        self.enforce()
        return n

    # ------------------------------------------------------------------ statistics
    def largest(
        self, top: int = 64, visible: Callable[[str], bool] | None = None
    ) -> tuple[SessionInfo, ...]:
        """The ``top`` largest sessions (of the namespaces ``visible`` admits, when given)."""
        now, see = self.clock(), visible or (lambda ns: True)
        rows = (e for e in self.sessions.values() if see(e.namespace))
        return tuple(e.info(now) for e in heapq.nlargest(top, rows, key=_size_then_use))

    def statistics(self, top: int = 64) -> RetentionStatistics:
        """Frozen: the largest sessions, bytes retained per pool against its cap, why
        retention was dropped and why retained objects were evicted."""
        share = self.settings.pool_share
        return RetentionStatistics(
            sessions=len(self.sessions),
            retained_objects=len(self.holders),
            retained_bytes=tuple(self.pool_bytes.get(i, 0) for i in range(len(self.capacities))),
            retained_cap=tuple(int(share * c) for c in self.capacities),
            tenant_quota=self.settings.tenant_quota,
            largest=self.largest(top),
            evicted=dict(self.evicted),
            dropped=dict(self.dropped),
        )

    def listing(
        self, visible: Callable[[str], bool], namespace: str | None = None, limit: int = 1000
    ) -> tuple[list[SessionInfo], bool]:
        """The sessions a caller may see (largest first), at most ``limit``; and whether
        more were left out."""
        now = self.clock()
        rows = [
            e
            for e in self.sessions.values()
            if (namespace is None or e.namespace == namespace) and visible(e.namespace)
        ]
        rows.sort(key=lambda e: (-e.nbytes, e.namespace, e.name))
        return [e.info(now) for e in rows[:limit]], len(rows) > limit
