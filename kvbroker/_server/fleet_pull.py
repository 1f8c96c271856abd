"""The steps of one pull from a peer broker, as :class:`Fleet` takes them: describe what the
peer holds, reserve room here for it, read it over NIXL and verify it, or discard it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..errors import (
    BadRequest,
    ChecksumMismatch,
    KVBrokerError,
    TransferFailed,
)
from . import transfer
from .disk_store import PoolUnusable
from .pin_reply import Described


if TYPE_CHECKING:
    from .state import Lease


class _Peer:
    """Our connection to one peer broker, and its NIXL agent."""

    def __init__(self, client: transfer.PeerClient, agent: str) -> None:
        self.client = client
        self.agent = agent


class PullSteps:
    """A pull's steps (a part of :class:`Fleet`)."""

    def _described(
        self, pinned: Any, address: str, namespace: str, how: str, keys: list[str]
    ) -> list[Described]:
        """The objects of a pin reply, each checked as a local seal is checked; exactly the
        one key asked (``pin``), or a leading run of the keys asked (``pin_prefix``)."""
        objects = pinned.get("objects") if isinstance(pinned, dict) else None
        if not isinstance(objects, list) or not objects:
            raise TransferFailed(f"peer {address} described no object; nothing was sealed")
        if len(objects) > (1 if how == "pin" else len(keys)):
            raise TransferFailed(
                f"peer {address} described {len(objects)} objects for "
                f"{len(keys) if how != 'pin' else 1} asked; nothing was "
                "sealed"
            )
        out = []
        for i, desc in enumerate(objects):
            try:
                d = Described.check(desc, namespace, self.broker.require_checksums)
            except (BadRequest, ValueError, TypeError) as exc:
                msg = exc.message if isinstance(exc, KVBrokerError) else str(exc)
                raise TransferFailed(
                    f"peer {address} described a bad object: {msg}; nothing was sealed"
                ) from None
            if d.key != keys[i]:
                raise TransferFailed(
                    f"peer {address} described {namespace}/{d.key[:80]} "
                    f"where {namespace}/{keys[i][:80]} was asked; nothing "
                    "was sealed"
                )
            out.append(d)
        return out

    def _reserve(self, d: Described, tenants: tuple) -> Lease:
        """A write lease here for one described object, charged to the tenants of the
        session that asked for the pull (not to the daemon's own)."""
        # Outlives the pull: each of pin, READ and release is bounded by the timeout.
        ttl = 3 * self.timeout + self.pin_ttl
        return self.broker.reserve_extent(
            self.session,
            (d.namespace, d.key),
            d.layout,
            d.span,
            d.meta,
            ttl,
            d.tokens,
            tenants=tenants,
        )

    def _read_and_verify(self, peer: _Peer, address: str, plans, phases: dict[str, float]) -> None:
        """In a worker thread: one NIXL READ, then every buffer's checksum."""
        remote, local = [], []
        for lease, d in plans:
            try:  # NIXL writes through the mapping: not into a pool a client truncated
                self.pages[lease.obj.pool.index].check()
            except PoolUnusable as exc:
                raise TransferFailed(
                    f"pull from peer {address}: {exc}; nothing was sealed"
                ) from None
            base = self.bases[lease.obj.pool.index]
            remote += d.extents
            local += [(base + off, n) for off, n in lease.obj.buffers.values() if n]
        res = self.endpoint.read(peer.agent, remote, local, timeout=self.timeout)
        self._read_seconds = phases["read"] = res.seconds
        t = time.perf_counter()
        for lease, d in plans:
            sums = d.checksums
            if sums is None:
                continue  # sealed there without checksums: the fenced release still guards
            obj = lease.obj
            pages = self.pages[obj.pool.index]
            try:  # read from the segment, not the mapping: see PoolPages
                bad = [
                    name
                    for name, (off, n) in obj.buffers.items()
                    if name not in sums or not pages.matches(off, n, sums[name])
                ]
            except PoolUnusable as exc:
                raise TransferFailed(
                    f"{obj.namespace}/{obj.key} pulled from peer {address}: {exc}; "
                    "nothing was sealed"
                ) from None
            if bad:
                raise ChecksumMismatch(
                    f"{obj.namespace}/{obj.key} pulled from peer {address}: buffer(s) "
                    f"{', '.join(bad[:5])} do not match the checksums sealed there; "
                    "nothing was sealed",
                    buffers=tuple(bad),
                )
        phases["verify"] = time.perf_counter() - t

    def _discard(self, lease: Lease, quarantine: bool) -> None:
        b = self.broker
        if quarantine:  # a READ that may still land: the pages wait out the quarantine
            b.abort_held(lease, "its pull failed")
        else:
            b.abort(lease, "its pull failed")
        b.counters["aborts"] += 1
