"""One handler per op row the broker serves (``Service.BROKER`` in ``kvbroker._wire.protocol``).

:class:`Handlers` holds them (the publishing ops in :mod:`~kvbroker._server.publish_ops`,
the sessions' in :mod:`~kvbroker._server.session_ops`) and dispatches a request to its own: ``op_<name>(session, **args)`` checks what the request asks
(arguments already validated against the table; the rest in :mod:`kvbroker._server.checks`),
makes one transition of the broker's (:class:`~kvbroker._server.transitions.Transitions`)
and shapes the reply the table declares. Who owns and frees what: see
:mod:`kvbroker._server.state`.
"""

from __future__ import annotations

import os
from typing import Any

from .._version import __version__
from .._wire import checksum as _checksum
from .._wire import replies as R
from .._wire.protocol import (
    MAX_BUFFERS,
    MAX_NAME,
    MAX_REPORTED,
    OPS,
    PROTOCOL_VERSION,
    Service,
    validate_args,
)
from ..errors import BadRequest, NotFound, ProtocolError
from .checks import (
    MAX_TOKENS,
    extents,
    leases_named,
)
from .disk_tier import on_disk_only
from .evicting import (
    SCAN_TIMEOUT,
    check_tier,
    disk_candidates,
    disk_filter,
    on_disk,
    select,
    tiered,
    victims,
)
from .listing import list_objects
from .patterns import client_regex as _regex
from .prefix_leases import count_query, matched_run
from .publish_ops import PublishOps
from .session_ops import SessionOps
from .state import Deferred, Session, StoredObject, WouldWait
from .transitions import Transitions

__all__ = ["HANDLERS", "Handlers"]


class Handlers:
    """The broker's op handlers, by op name, and the dispatch of a request to one."""

    def __init__(self, broker: Transitions) -> None:
        self.b = broker
        self.sessions = SessionOps(broker.retention)  # the sessions' ops (retention)
        self.publishing = PublishOps(broker, self.sessions)  # reserve, seal, publish...
        # The broker's own rows of the op table, each with its handler: a row without one
        # fails here.
        self._table = {
            name: next(
                getattr(part, f"op_{name}")
                for part in (self, self.publishing, self.sessions)
                if hasattr(part, f"op_{name}")
            )
            for name, op in OPS.items()
            if op.service is Service.BROKER
        }

    def handle(self, session: Session, op: str, raw_args: Any, daemon: Any = None) -> Any:
        """Run one request; returns its result or raises a KVBrokerError (or WouldWait).
        ``daemon``: what answers the ops the table gives the daemon (the connection)."""
        b = self.b
        b.counters["requests"] += 1
        args = validate_args(op, raw_args, b)  # (its max_lease_ttl: the TTL rule)
        row = OPS[op]
        if row.needs_hello and not session.greeted:
            raise ProtocolError("the first request on a connection must be hello")
        handler = self._table.get(op)
        if handler is not None:
            journal = b.journal
            # One write for every record of this request (none when the connection holds a
            # batch for its whole slice of requests: it writes them before the replies).
            if journal is None or not journal.begin():
                return handler(session, **args)
            try:
                return handler(session, **args)
            finally:
                journal.flush()
        if row.service is Service.RINGS:
            if b.rings is None:
                raise BadRequest(f"{op}: this daemon has no GPU rings (serve --gpu-ring SIZE)")
            return b.rings.handle(session, op, args)
        if daemon is None:
            raise BadRequest(f"{op}: only a daemon's connection answers it")
        return daemon.handle(session, op, args)

    # -------------------------------------------------------------------------- session
    def op_hello(self, session: Session, version: int, name: str, role: str) -> R.Hello:
        b = self.b
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (daemon speaks {PROTOCOL_VERSION})"
            )
        session.name, session.role = name[:MAX_NAME], role[:MAX_NAME]
        session.greeted = True
        # Another tenant's pool keeps its index (extents name pools by index), not its segment.
        pools = [
            p.describe() if b.pages.named_to(p, session) else {"index": p.index, "hidden": True}
            for p in b.pools
        ]
        return {
            "version": PROTOCOL_VERSION,
            "server_version": __version__,
            "server_pid": os.getpid(),
            "session": session.id,
            "lease_ttl": b.leases.lease_ttl,
            "pools": pools,
            "epoch": b.registry.epoch,
            "checksum_kinds": sorted(_checksum.KINDS),
            **({"replicas": list(b.replica_paths)} if b.replica_paths else {}),
        }

    # -------------------------------------------------------------------------- claim
    def op_claim(self, session, namespace, key, select, consume, wait, ttl, peer=None) -> R.Claimed:
        b = self.b
        # A consume-claim frees the object when released: as much a write as evict is.
        session.access.check(namespace, bool(consume), "consume-claim" if consume else "claim")
        ident = (namespace, key)
        obj = b.directory.get(ident)
        if obj is None and on_disk_only(b.pages.tier, ident):  # promote it, then claim it
            raise b.pages.tier.promotion(
                [ident],
                b.directory.__contains__,
                lambda: self.op_claim(session, namespace, key, select, consume, None, ttl),
            )
        if obj is None and peer is not None:  # pull it from the peer, then claim it here
            session.access.check(namespace, True, "claim from a peer")  # it writes our pools
            fleet = self._fleet("claim")
            raise Deferred(
                lambda: fleet.fetch(peer, namespace, key, consume, session),
                lambda _: self.op_claim(session, namespace, key, select, consume, None, ttl),
                fleet.timeout,
            )
        if obj is None:
            if wait is not None and wait > 0:
                raise WouldWait(ident, float(wait))
            b.counters["misses"] += 1
            raise NotFound(f"{namespace}/{key} is not published")
        if select is None:
            chosen = obj.buffers
        else:
            pattern = _regex(select)
            chosen = {n: e for n, e in obj.buffers.items() if pattern.fullmatch(n)}
        ttl = b.leases.ttl(ttl)
        nbytes = sum(n for _, n in chosen.values())
        lease = b.claim(session, obj, ttl, consume, nbytes)
        sums = obj.checksums
        return {
            "lease": lease.id,
            "ttl": ttl,
            "meta": obj.meta,
            "buffers": extents(obj, chosen),
            "checksums": None if sums is None else {n: sums[n] for n in chosen},
        }

    def op_release(self, session, lease, consume=True) -> R.Empty:
        ls = self.b.leases.of(session, lease, "read")
        self.b.end_read(ls, "it was released", consume=ls.consume and consume)
        return {}

    def op_release_many(self, session, leases) -> R.Empty:
        held = leases_named(self.b.leases, session, "release_many", leases, "read")
        for ls in held:  # all checked first
            self.b.end_read(ls, "it was released", consume=ls.consume)
        return {}

    def op_match_prefix(
        self,
        session,
        namespace,
        keys,
        block_tokens,
        ttl,
        peer=None,
        hold=True,
        retain=None,
    ) -> R.PrefixMatch:
        b = self.b
        ttl = b.leases.ttl(ttl)
        if len(keys) > MAX_BUFFERS:
            raise BadRequest(f"match_prefix: at most {MAX_BUFFERS} keys per request")
        if not 0 <= block_tokens <= MAX_TOKENS:  # it is added into counters every stat packs
            raise BadRequest(f"match_prefix: block_tokens must be in [0, {MAX_TOKENS}]")
        if peer is not None and not hold:
            raise BadRequest("match_prefix: a pull from a peer needs hold (it holds what it pulls)")
        if not session.access.can(namespace):  # another tenant's prefixes: invisible
            keys = ()
        found = matched_run(b.directory, namespace, keys)
        on_disk = (
            0
            if b.pages.tier is None
            else b.pages.tier.run_after(  # [tier.disk]
                namespace,
                keys,
                len(found),
                b.directory.__contains__,
                hold,
                lambda: self.op_match_prefix(
                    session, namespace, keys, block_tokens, ttl, peer, hold, retain
                ),
            )
        )
        if peer is not None and len(found) < len(keys):
            # Pull the blocks after the local run that the peer holds, then match here.
            session.access.check(namespace, True, "match_prefix from a peer")
            rest = keys[len(found) :]
            if all(k.__class__ is str for k in rest):
                fleet = self._fleet("match_prefix")
                raise Deferred(
                    lambda: fleet.fetch_prefix(peer, namespace, list(rest), session),
                    lambda _: self.op_match_prefix(
                        session, namespace, keys, block_tokens, ttl, retain=retain
                    ),
                    fleet.timeout,
                )
        count_query(b.counters, len(keys), len(found) + on_disk, block_tokens)
        kept = self.sessions.session_of_request(session, namespace, retain, "match_prefix")
        if kept is not None:  # each request renews its session; what it matched is retained
            b.retention.retain(kept, found)
        if not found or not hold:
            b.directory.touch(found)
            return {
                "ttl": ttl,
                "matched": len(found) + on_disk,
                "lease": None,
                "names": [],
                "blocks": [],
            }
        lease, names, packed, _ = b.match(session, found, ttl)
        # One meta for the run when every block shares it (the usual case), else one per
        # block: a reader checks each block's layout before copying it.
        first = found[0].meta
        same = all(obj.meta is first or obj.meta == first for obj in found)
        reply: R.PrefixMatch = {
            "ttl": ttl,
            "matched": len(found),
            "lease": lease.id,
            "names": list(names),
            "metas": [first] if same else [obj.meta for obj in found],
            "blocks": [],
        }
        # Compact reply: when every block has the same buffer names (the usual case), one
        # bytes string `packed` of little-endian int64 rows, a row per block; else a map per
        # block.
        if packed is not None:
            reply["packed"] = packed
        else:
            reply["blocks"] = [extents(obj, obj.buffers) for obj in found]
        return reply

    def op_renew(self, session, leases, ttl) -> R.Renewed:
        table = self.b.leases
        ttl = table.ttl(ttl) if ttl is not None else None
        # all checked first
        held = leases_named(table, session, "renew", leases, None, repeats=True)
        for ls in {ls.id: ls for ls in held}.values():  # a lease named twice is renewed once
            table.renew(ls, ls.ttl if ttl is None else ttl)
        return {"expires_in": [(ls.id, ls.ttl) for ls in held]}

    # -------------------------------------------------------------------------- directory
    def op_lookup(self, session, namespace, key, peer=None) -> dict | None:
        b = self.b
        obj = b.directory.get((namespace, key))
        if obj is None and peer is not None and session.access.can(namespace):
            fleet = self._fleet("lookup")
            raise Deferred(
                lambda: fleet.lookup(peer, namespace, key),
                lambda info: info,
                fleet.timeout,
            )
        if obj is None and on_disk_only(b.pages.tier, (namespace, key)):
            return b.pages.tier.lookup((namespace, key)) if session.access.can(namespace) else None
        if obj is None or not session.access.can(namespace):
            return None
        info = b.lookup(obj)  # its readers reported
        info["checksums"] = obj.checksums
        info["buffer_sizes"] = {name: n for name, (_, n) in obj.buffers.items()}
        info["consumers"] = obj.consumers
        return info

    def op_exists(self, session, namespace, key) -> bool:
        here = (namespace, key) in self.b.directory or on_disk_only(
            self.b.pages.tier, (namespace, key)
        )
        return here and session.access.can(namespace)

    def op_list(self, session, namespace, match, limit, after, tier) -> R.Listed:
        b = self.b
        return list_objects(
            b.directory,
            b.pages.tier,
            b.lazy_readers(),  # readers reported, nothing changed
            session,
            namespace,
            match,
            limit,
            after,
            tier,
        )

    def op_evict(
        self, session, namespace, key, match, match_buffers, older_than, all, dry_run, tier
    ) -> R.Evicted:
        b = self.b
        cleared = bool(all and not (namespace or key or match or match_buffers or older_than))
        disk = check_tier(b.pages.tier, tier)
        filters = (namespace, key, match, match_buffers, older_than, all)

        def evict_now(found: list[StoredObject], on_disk_found: list) -> R.Evicted:
            reply, chosen = victims([] if tier == "disk" else found, b.lazy_readers(), dry_run)
            tiered(disk, tier, chosen, reply, dry_run)  # demoted (dram), or their copies counted
            if not dry_run:
                b.evict_all(chosen, cleared and tier == "all")  # (a router forgets the node)
            if disk is not None and tier != "dram":
                on_disk(disk, b.directory, on_disk_found, tier, reply, dry_run)
            return reply

        def finish(found: list[StoredObject]) -> R.Evicted:
            if disk is None or tier == "dram":
                return evict_now(found, [])
            picked = disk_filter(session, *filters[:5])
            on_disk_found = disk_candidates(disk, picked, match_buffers is not None)
            if isinstance(on_disk_found, list):
                return evict_now(found, on_disk_found)
            scan = on_disk_found  # the disk's names, read in slices of the loop first
            raise Deferred(
                scan,
                lambda entries: b.in_batch(lambda: evict_now(found, entries)),
                SCAN_TIMEOUT,
            )

        def finish_later(found: list[StoredObject]) -> R.Evicted:
            # Outside handle's batch: one journal write for the unlinks, as it would be.
            return b.in_batch(lambda: finish(found))

        return select(b.directory, session, *filters, finish, finish_later)

    def op_fetch(self, session, namespace, key, peer) -> R.Fetched:
        session.access.check(namespace, True, "fetch")
        obj = self.b.directory.get((namespace, key))
        if obj is not None:  # here already: never fetched twice
            return {
                "namespace": namespace,
                "key": key,
                "nbytes": obj.nbytes,
                "fetched": False,
                "peer": peer,
            }
        fleet = self._fleet("fetch")

        def then(pulled: bool) -> R.Fetched:
            obj = self.b.directory.get((namespace, key))
            if obj is None:
                raise NotFound(
                    f"{namespace}/{key} was pulled from {peer} but is gone again "
                    "(consumed or evicted)"
                )
            return {
                "namespace": namespace,
                "key": key,
                "nbytes": obj.nbytes,
                "fetched": bool(pulled),
                "peer": peer,
            }

        raise Deferred(
            lambda: fleet.fetch(peer, namespace, key, False, session),
            then,
            fleet.timeout,
        )

    def op_stat(self, session) -> dict[str, Any]:
        return self.b.statistics_for(session).to_dict()

    def op_ping(self, session) -> R.Pong:
        b = self.b
        return {
            "server_version": __version__,
            "server_pid": os.getpid(),
            "started_at": b.started_at,
            "epoch": b.registry.epoch,
        }

    def op_report(self, session, counters) -> R.Reported:
        if len(counters) > MAX_REPORTED:
            raise BadRequest(f"report: at most {MAX_REPORTED} counters")
        for name, value in counters.items():
            if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
                raise BadRequest(
                    "report: counter names must be printable strings of 1-64 characters"
                )
            if value.__class__ is not int or not 0 <= value < 1 << 63:
                raise BadRequest(f"report: counter {name!r} must be a non-negative int")
        session.reported = dict(counters)
        return {"counters": len(counters)}

    # -------------------------------------------------------------------------- checks
    def _fleet(self, op: str) -> Any:
        if self.b.fleet is None:
            raise BadRequest(
                f"{op} with a peer: this daemon pulls from no peer (set [transfer] peers, "
                "cert_file, key_file and ca_file, and install kvbroker[transfer])"
            )
        return self.b.fleet


# op name -> its handler (unbound: ``(handlers, session, **args)``)
HANDLERS = {
    name[3:]: fn
    for cls in (Handlers, PublishOps, SessionOps)
    for name, fn in vars(cls).items()
    if name.startswith("op_")
}
