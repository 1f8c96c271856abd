"""The daemon's KV event feed (``[events]``): which of the broker's prefix blocks go into the
:class:`~kvbroker._server.events.EventPublisher`, and when.

:class:`EventFeed` is owned by the daemon's :class:`~kvbroker._server.fleet.Fleet` (made at
its start, closed before the pools) and fed by the broker's ``on_block`` hook, on the event
loop: ``BlockStored`` when a prefix block with token ids is sealed (published here or
pulled), ``BlockRemoved`` when it is unlinked (evicted, consumed, replaced),
``AllBlocksCleared`` at start and after ``evict --all``; after a queue overflow (from the
publisher's thread, through the loop) every block is announced again.

The disk tier ([tier.disk]): a block is announced in the medium the node serves it from, as
vLLM's offloading tiers announce theirs: ``CPU`` while it is in a pool, ``STORAGE`` while it is
on disk only. A demotion is ``BlockRemoved(CPU)`` then ``BlockStored(STORAGE)`` (in that
order, in one batch: a router that ignores the medium ends with the block stored too), a
promotion ``BlockRemoved(STORAGE)`` then ``BlockStored(CPU)``; the block leaves the stream
for good only with the node's last copy (dropped from disk, or evicted with no room on
disk). The disk copy of a block still in a pool is not announced: the pool serves it, and
each block is in one medium at a time, so a router that counts the stores and removals of a
medium always gets them in pairs.

Which blocks: every one when the policy is open or the stream is authenticated (``[events]
curve_key``: only subscribers holding a listed key complete the handshake,
:mod:`kvbroker._server.event_auth`). Under ``isolation.mode = "tenant"`` without it, only
those of namespaces every user may read
(:meth:`~kvbroker._server.policy.Policy.readable_by_everyone`): anyone can subscribe to a
bind-form endpoint (or bind a connect-form port first), and a ``BlockStored`` carries a
prompt's token ids, its block hash a name another tenant could test a guess against. A
reload that changes the policy clears the stream and announces again what it may carry.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import xxhash

from .._wire.stats import EventStatistics
from ..errors import KVBrokerError

if TYPE_CHECKING:
    from .hosting import DaemonView
    from .state import StoredObject

__all__ = ["EventFeed", "announced", "block_event_hash"]

log = logging.getLogger("kvbroker.fleet")


def block_event_hash(key: str) -> int:
    """The 64-bit block hash a KV event carries for a prefix block's key: the last 8 bytes of
    its hex digest (:func:`kvbroker._server.events.external_hash`), or xxh3_64 of a key that
    is not a hex digest."""
    from .events import external_hash

    try:
        return external_hash(key)
    except ValueError:
        return xxhash.xxh3_64_intdigest(key.encode())


def announced(obj: StoredObject) -> bool:
    """Whether a block's seal and removal are announced: blocks with token ids, and of a TP
    sharded prefix cache only the shard of TP rank 0 (every shard names the same tokens)."""
    return _announced_key(obj.key, obj.tokens)


def _announced_key(key: str, tokens: Any) -> bool:
    if tokens is None:
        return False
    _, sep, shard = key.partition("/")
    return not sep or ".tp0of" in shard


class EventFeed:
    """The publisher of one daemon and what feeds it (see the module doc). Raises
    KVBrokerError for settings it cannot use (pyzmq missing, CURVE files)."""

    def __init__(self, daemon: DaemonView, node: str) -> None:
        from .events import AllBlocksCleared, CurveKeys, EventPublisher, topic_for

        cfg = daemon.config
        self.daemon = daemon
        self.broker = daemon.broker
        self.closed = False
        self._policy: Any = None  # the policy _memo was worked out under
        self._memo: dict[str, bool] = {}
        curve = None
        if cfg.events_curve_key or cfg.events_curve_clients:
            if not (cfg.events_curve_key and cfg.events_curve_clients):
                raise KVBrokerError(
                    "[events] curve_key and curve_clients go together: the "
                    "daemon's secret certificate and its subscribers' keys"
                )
            try:
                curve = CurveKeys(cfg.events_curve_key, cfg.events_curve_clients)
            except ValueError as exc:
                raise KVBrokerError(f"[events] {exc}") from None
            except ImportError as exc:
                raise KVBrokerError(str(exc)) from None
        try:
            self.publisher = EventPublisher(
                cfg.events_publish,
                topic=topic_for(node, cfg.events_model),
                replay_endpoint=cfg.events_replay,
                fmt=cfg.events_format,
                buffer_bytes=cfg.events_replay_buffer,
                curve=curve,
                on_overflow=self._announce_all_threadsafe,
            )
        except ImportError as exc:
            raise KVBrokerError(str(exc)) from None
        if curve is None and not self.broker.policy.open:
            log.warning(
                "KV events without [events] curve_key under tenant isolation: only "
                "namespaces every user may read are published"
            )
        # A router forgets what it knew of this node, then learns what is here (a warm
        # restart keeps blocks, with their token ids).
        self.publisher.publish([AllBlocksCleared()])
        self._announce_all()
        self.broker.on_block = self._on_block
        if self._disk is not None:
            self._disk.on_dropped = self._on_disk_dropped
        log.info(
            "KV events on %s (topic %s, %s%s)",
            self.publisher.endpoint,
            self.publisher.topic,
            cfg.events_format,
            f", CURVE: {curve.clients} subscriber keys" if curve else "",
        )

    def in_stream(self, namespace: str) -> bool:
        """Whether the events of ``namespace`` may go to every subscriber of the stream."""
        policy = self.broker.policy
        if self.publisher.authenticated or policy.open:
            return True
        if self._policy is not policy or len(self._memo) > 4096:
            self._policy, self._memo = policy, {}
        ok = self._memo.get(namespace)
        if ok is None:
            ok = self._memo[namespace] = policy.readable_by_everyone(namespace)
        return ok

    def policy_changed(self) -> None:
        """A reload set a new policy: what an unauthenticated stream may carry may differ,
        so the routers forget this node and learn it again under the new rule."""
        from .events import AllBlocksCleared

        if not self.publisher.authenticated:
            self.publisher.forget_history()  # replays too: nothing of the old rule
            self.publisher.publish([AllBlocksCleared()])
            self._announce_all()

    @property
    def _disk(self) -> Any:
        return self.broker.pages.tier  # [tier.disk] (kvbroker._server.disk_tier), or None

    def _announce_all(self) -> None:
        objs = [
            (o.serial, self._stored(o))
            for o in self.broker.objects.values()
            if announced(o) and self.in_stream(o.namespace)
        ]
        disk = self._disk
        for e in () if disk is None else list(disk.entries.values()):
            # Blocks on disk only, as STORAGE: every entry is marked again (the stream was
            # cleared, so only what is announced now needs its removal announced later).
            e.announced = self._on_disk_only(e) and self.in_stream(e.ident[0])
            if e.announced:
                objs.append((e.serial, self._stored_on_disk(e)))
        objs.sort(key=lambda row: row[0])  # parents were sealed before their children
        self.publisher.publish([event for _, event in objs])

    def _announce_all_threadsafe(self) -> None:
        loop = self.daemon.loop
        if loop is not None and not self.closed:
            loop.call_soon_threadsafe(self._announce_all)

    @staticmethod
    def _stored(obj: StoredObject) -> Any:
        from .events import BlockStored

        parent = block_event_hash(obj.parent_key) if obj.parent_key is not None else None
        return BlockStored([block_event_hash(obj.key)], parent, obj.tokens, len(obj.tokens))

    @staticmethod
    def _stored_on_disk(e: Any) -> Any:
        from .events import MEDIUM_STORAGE, BlockStored

        rec = e.record
        parent = rec.get("parent_key")
        tokens = rec["tokens"]
        return BlockStored(
            [block_event_hash(e.ident[1])],
            None if parent is None else block_event_hash(parent),
            tokens,
            len(tokens),
            medium=MEDIUM_STORAGE,
        )

    def _on_disk_only(self, e: Any) -> bool:
        """Whether disk entry ``e`` is a block this node serves from disk alone."""
        return (
            e.obj is None
            and not e.gone
            and _announced_key(e.ident[1], e.record.get("tokens"))
            and e.ident not in self.broker.directory
        )

    def _on_block(self, what: str, obj: StoredObject | None) -> None:
        from .events import MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved

        if what == "cleared":
            self.publisher.publish([AllBlocksCleared()])
            if self._disk is not None:  # the router forgot them all
                for e in self._disk.entries.values():
                    e.announced = False
        elif obj is not None and announced(obj) and self.in_stream(obj.namespace):
            disk = self._disk
            e = None if disk is None else disk.entries.get((obj.namespace, obj.key))
            if what == "stored":
                events = [self._stored(obj)]
                if e is not None and e.announced:  # promoted (or replaced): no longer STORAGE
                    e.announced = False
                    events.insert(0, BlockRemoved([block_event_hash(obj.key)], MEDIUM_STORAGE))
                self.publisher.publish(events)
                return
            events = [BlockRemoved([block_event_hash(obj.key)])]
            if (
                e is not None
                and e.serial == obj.serial
                and not e.announced
                and e.obj is None
                and disk.live(e)
            ):  # demoted: served from disk from now on
                e.announced = True
                events.append(self._stored_on_disk(e))
            self.publisher.publish(events)

    def _on_disk_dropped(self, e: Any) -> None:
        """A block announced as on disk left it: the node can no longer serve it."""
        from .events import MEDIUM_STORAGE, BlockRemoved

        if not self.closed:
            self.publisher.publish([BlockRemoved([block_event_hash(e.ident[1])], MEDIUM_STORAGE)])

    async def close(self) -> None:
        self.closed = True
        self.broker.on_block = None
        if self._disk is not None:
            self._disk.on_dropped = None
        await asyncio.get_running_loop().run_in_executor(None, self.publisher.close)

    def statistics(self) -> EventStatistics:
        p = self.publisher
        return EventStatistics(
            endpoint=p.endpoint,
            replay_endpoint=p.replay_endpoint or "",
            topic=p.topic,
            format=p.fmt,
            next_seq=p.next_seq,
            events_published=p.events_published,
            events_dropped=p.events_dropped,
            overflows=p.overflows,
            replay_requests=p.replay_requests,
            queued=p.queued,
            replay_refused=p.replay_refused,
            buffered_bytes=p.buffered_bytes,
            authenticated=p.authenticated,
        )
