"""Daemon-owned GPU staging rings: device memory, CUDA IPC handles, ring leases.

``kvbroker serve --gpu-ring SIZE`` makes the daemon allocate one ring of SIZE bytes on each
visible GPU and share it with its clients through a CUDA IPC handle (op ``rings``). The
allocator of each ring (:class:`~kvbroker._server.ring_allocator.RingAllocator`: strict, FIFO
recycling, wrap, oversize fails at once, an empty ring restarts at 0) runs here, in the
daemon; clients only ever borrow a region through a *ring lease*. Who owns and frees what
(rings included) is the ownership contract in :mod:`kvbroker._server.state`; ring leases
take their ids from the broker's lease registry (:mod:`kvbroker._server.leases`), so they
are fenced and answered like pool leases.

The device memory is ``cuMemAlloc``'d through the CUDA driver API, loaded with ctypes only
when rings are asked for: the daemon never imports torch. A client maps each ring once per
process (``cuIpcOpenMemHandle``, see :mod:`kvbroker.gpu`).

Waiting for ring space is the client's, bounded by its ``wait`` (see
:meth:`kvbroker.gpu.GpuClient.ring_scratch`); waiting for a ring object to be sealed uses the
daemon's claim waiting (``ring_claim`` with ``wait``).

Backends: :class:`CudaDriverRings` (real GPUs) and :class:`FakeRings` (no device memory, for
tests of the plumbing on machines without a GPU; selected by ``KVBROKER_FAKE_GPUS=N``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .leases import LeaseRegistry
from .ring_allocator import Region, RingAllocator, RingOversize
from .state import WouldWait
from .._cuda import IpcHandle, _check, device_identity, load_libcuda
from .._wire import replies as R
from .._wire.protocol import meta_problem
from .._wire.stats import RingStatistics
from ..errors import BadRequest, Exists, KVBrokerError, NotFound, PoolFull

__all__ = ["RingService", "CudaDriverRings", "FakeRings", "open_backend"]

log = logging.getLogger("kvbroker.rings")

RING_ALIGN = 256  # regions start on this boundary (DMA engines, vector loads)
_MAX_KEY = 512
_MAX_LOOKUP = 4096  # keys per ring_lookup (a 16k-token prompt in 16-token blocks is 1024)
_OCCUPANCY_CELLS = 64


# ------------------------------------------------------------------------------- backends
class CudaDriverRings:
    """One ``cuMemAlloc`` per visible device, exported with ``cuIpcGetMemHandle``."""

    def __init__(self) -> None:
        self.lib = load_libcuda()
        n = ctypes.c_int()
        _check(self.lib, self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        self.count = n.value
        self._allocs: list[tuple[ctypes.c_void_p, int, int]] = []  # (context, device, ptr)

    def devices(self) -> list[tuple[str, str]]:
        return [device_identity(self.lib, i) for i in range(self.count)]

    def allocate(self, ordinal: int, size: int) -> bytes:
        lib = self.lib
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        _check(
            lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain"
        )
        _check(lib, lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            ptr = ctypes.c_uint64()
            _check(
                lib,
                lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(size)),
                f"cuMemAlloc of a {size}-byte ring on GPU {ordinal}",
            )
            handle = IpcHandle()
            try:
                _check(lib, lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr), "cuIpcGetMemHandle")
            except BaseException:
                lib.cuMemFree_v2(ptr)
                raise
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        self._allocs.append((ctx, dev.value, ptr.value))
        return bytes(handle.reserved)

    def close(self) -> None:
        lib = self.lib
        for ctx, dev, ptr in reversed(self._allocs):
            lib.cuCtxPushCurrent_v2(ctx)
            lib.cuMemFree_v2(ctypes.c_uint64(ptr))
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
            lib.cuDevicePrimaryCtxRelease_v2(dev)
        self._allocs.clear()


class FakeRings:
    """``n`` pretend GPUs with no memory behind them: the ring plumbing (leases, allocator,
    statistics, the wire) runs as on a GPU host, so tests need no GPU. Never for serving KV."""

    def __init__(self, n: int) -> None:
        self.count = n
        self.allocated: list[int] = []

    def devices(self) -> list[tuple[str, str]]:
        return [(f"fake:{i:02x}:00.0", "fake GPU (KVBROKER_FAKE_GPUS)") for i in range(self.count)]

    def allocate(self, ordinal: int, size: int) -> bytes:
        self.allocated.append(size)
        return hashlib.sha512(f"fake-ring-{os.getpid()}-{ordinal}".encode()).digest()

    def close(self) -> None:
        self.allocated.clear()


def open_backend():
    """The backend for this host: fake GPUs when KVBROKER_FAKE_GPUS is set, else the driver."""
    fake = os.environ.get("KVBROKER_FAKE_GPUS", "")
    if fake:
        try:
            n = int(fake)
        except ValueError:
            raise KVBrokerError(f"KVBROKER_FAKE_GPUS must be a count, not {fake!r}") from None
        return FakeRings(n)
    return CudaDriverRings()


# --------------------------------------------------------------------------- the service
@dataclass(eq=False)
class _Ring:
    index: int
    bus_id: str
    name: str
    allocator: RingAllocator
    handle: bytes


@dataclass(eq=False)
class _RingObject:
    namespace: str
    key: str
    ring: _Ring
    region: Region
    nbytes: int
    meta: dict | None
    ttl: float
    sealed: bool = False
    linked: bool = False  # reachable through RingService.objects
    readers: int = 0
    expires_at: float = 0.0


@dataclass(eq=False)
class _RingLease:
    id: int
    kind: str  # "scratch" | "write" | "read"
    session: int
    ring: _Ring
    region: Region
    obj: _RingObject | None = None
    consume: bool = False
    nbytes: int = 0
    done: bool = field(default=False, repr=False)


def _align(n: int) -> int:
    return -(-n // RING_ALIGN) * RING_ALIGN


class RingService:
    """The rings of one daemon and every ring lease: the service of the op table's
    ``Service.RINGS`` rows, one ``op_<name>`` handler each, driven by the broker's dispatch."""

    def __init__(
        self,
        backend: Any,
        size: int,
        *,
        object_ttl: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_sealed: Callable[[tuple[str, str]], None] | None = None,
        registry: LeaseRegistry | None = None,
    ) -> None:
        if size < RING_ALIGN:
            raise KVBrokerError(f"a GPU ring needs at least {RING_ALIGN} bytes, not {size}")
        self.backend = backend
        self.size = size - size % RING_ALIGN
        self.object_ttl = object_ttl  # (a TTL asked for is checked by the op table's rule)
        self.clock = clock
        self.on_sealed = on_sealed
        self.rings: list[_Ring] = []
        for i, (bus, name) in enumerate(backend.devices()):
            handle = backend.allocate(i, self.size)
            self.rings.append(_Ring(i, bus, name, RingAllocator(self.size), handle))
        self.objects: dict[tuple[str, str], _RingObject] = {}
        self.pending: dict[tuple[str, str], _RingObject] = {}
        self.leases: dict[int, _RingLease] = {}  # live ring leases; ids from the registry
        self._by_session: dict[int, dict[int, _RingLease]] = {}
        # The broker's, once attached to one (Broker.rings): one id space for every lease.
        self.registry = registry or LeaseRegistry()
        self.counters = dict.fromkeys(
            ("reserves", "seals", "claims", "releases", "aborts", "expired", "bytes"), 0
        )

    def close(self) -> None:
        self.backend.close()

    # ---------------------------------------------------------------- dispatch
    def handle(self, session: Any, op: str, args: dict) -> Any:
        self.expire()
        return getattr(self, "op_" + op)(session, **args)

    def op_rings(self, session) -> R.Rings:
        return {
            "rings": [
                {
                    "index": r.index,
                    "device": r.bus_id,
                    "name": r.name,
                    "capacity": self.size,
                    "align": RING_ALIGN,
                    "handle": r.handle,
                }
                for r in self.rings
            ]
        }

    def _ring(self, device: int) -> _Ring:
        if not 0 <= device < len(self.rings):
            raise BadRequest(f"no GPU ring {device}: this daemon has {len(self.rings)}")
        return self.rings[device]

    def op_ring_reserve(self, session, device, nbytes, namespace, key, meta, ttl) -> R.RingRegion:
        ring = self._ring(device)
        if nbytes <= 0:
            raise BadRequest(f"ring_reserve: nbytes must be positive, not {nbytes}")
        ident = None
        if key is not None:
            if not key or len(key) > _MAX_KEY or not namespace or len(namespace) > _MAX_KEY:
                raise BadRequest(f"ring_reserve: key and namespace must be 1..{_MAX_KEY} chars")
            # Before any lookup: an Exists answer would tell another tenant which keys exist.
            session.access.check(namespace, True, "ring_reserve")
            ident = (namespace, key)
            if ident in self.pending:
                raise Exists(f"{namespace}/{key} is being published into a ring by another writer")
            if ident in self.objects:
                raise Exists(f"{namespace}/{key} is already published in a ring")
        elif meta is not None or ttl is not None:
            raise BadRequest("ring_reserve: meta and ttl belong to a keyed (published) region")
        problem = meta_problem(meta)
        if problem is not None:
            raise BadRequest(f"ring_reserve: {problem}")
        ttl = self._ttl(ttl)
        try:
            region = ring.allocator.alloc(_align(nbytes), timeout=0)
        except RingOversize as exc:
            raise PoolFull(
                f"ring {device}: {exc} (never fits: publish through a host pool)"
            ) from None
        except KVBrokerError as exc:  # Timeout: no contiguous space now; the client may wait
            raise PoolFull(f"ring {device} is full for now: {exc}") from None
        lease = _RingLease(
            self.registry.next_id(),
            "scratch" if ident is None else "write",
            session.id,
            ring,
            region,
            nbytes=nbytes,
        )
        if ident is not None:
            lease.obj = _RingObject(namespace, key, ring, region, nbytes, meta, ttl)
            self.pending[ident] = lease.obj
        self._add(lease)
        self.counters["reserves"] += 1
        return {
            "lease": lease.id,
            "device": device,
            "offset": region.offset,
            "nbytes": nbytes,
            "kind": lease.kind,
        }

    def op_ring_seal(self, session, lease) -> R.Sealed:
        ls = self._lease(session, lease)
        if ls.kind != "write":
            raise BadRequest(f"ring lease {lease} is a {ls.kind} lease: only a write lease seals")
        obj = ls.obj
        ident = (obj.namespace, obj.key)
        self.pending.pop(ident, None)
        obj.sealed = obj.linked = True
        obj.expires_at = self.clock() + obj.ttl
        self.objects[ident] = obj
        self._end(ls, "it was sealed", free=False)
        self.counters["seals"] += 1
        self.counters["bytes"] += obj.nbytes
        if self.on_sealed is not None:
            self.on_sealed(ident)
        return {"namespace": obj.namespace, "key": obj.key, "nbytes": obj.nbytes}

    def op_ring_claim(self, session, namespace, key, consume, wait) -> R.RingClaimed:
        # As for host objects: reading needs read access, a consume-claim (it frees) write.
        session.access.check(
            namespace, bool(consume), "ring consume-claim" if consume else "ring_claim"
        )
        ident = (namespace, key)
        obj = self.objects.get(ident)
        if obj is None:
            if wait:
                raise WouldWait(ident, float(wait))
            raise NotFound(f"{namespace}/{key} is not published in a GPU ring")
        obj.readers += 1
        if consume:
            # one-shot handoff: nobody else may claim it; it goes once this reader is done
            self._unlink(obj)
        ls = _RingLease(
            self.registry.next_id(),
            "read",
            session.id,
            obj.ring,
            obj.region,
            obj,
            consume,
            obj.nbytes,
        )
        self._add(ls)
        self.counters["claims"] += 1
        return {
            "lease": ls.id,
            "device": obj.ring.index,
            "offset": obj.region.offset,
            "nbytes": obj.nbytes,
            "meta": obj.meta,
        }

    def op_ring_lookup(self, session, namespace, keys) -> R.RingFound:
        session.access.check(namespace, False, "ring_lookup")
        if len(keys) > _MAX_LOOKUP:
            raise BadRequest(f"ring_lookup: at most {_MAX_LOOKUP} keys at a time, not {len(keys)}")
        if not all(isinstance(k, str) for k in keys):
            raise BadRequest("ring_lookup: keys must be strings")
        found = []
        for key in keys:
            obj = self.objects.get((namespace, key))
            found.append(
                None
                if obj is None
                else {"device": obj.ring.index, "nbytes": obj.nbytes, "meta": obj.meta}
            )
        return {"objects": found}

    def op_ring_release(self, session, lease) -> R.Empty:
        ls = self._lease(session, lease)
        if ls.kind == "write":
            self.counters["aborts"] += 1
            self._end(ls, "it was aborted")
        else:
            self.counters["releases"] += 1
            self._end(ls, "it was released")
        return {}

    # ---------------------------------------------------------------- lifetimes
    def _ttl(self, ttl: float | None) -> float:
        """A TTL asked for (in range: the op table's rule checked it), or the default."""
        return self.object_ttl if ttl is None else float(ttl)

    def _add(self, ls: _RingLease) -> None:
        self.leases[ls.id] = ls
        self._by_session.setdefault(ls.session, {})[ls.id] = ls

    def _lease(self, session, lid: int) -> _RingLease:
        ls = self.leases.get(lid)
        if ls is None:
            raise self.registry.gone(lid, "ring lease")
        if ls.session != session.id:
            raise self.registry.foreign(lid, "ring lease")
        return ls

    def _end(
        self, ls: _RingLease, why: str, *, free: bool = True, consume: bool | None = None
    ) -> None:
        """End a lease; ``free``: give back what it holds (a discarded write, a scratch region,
        a read lease's share of its object)."""
        ls.done = True
        self.leases.pop(ls.id, None)
        held = self._by_session.get(ls.session)
        if held is not None:
            held.pop(ls.id, None)
            if not held:
                del self._by_session[ls.session]
        self.registry.ended(ls.id, why)
        if not free:
            return
        if ls.kind == "scratch":
            ls.ring.allocator.free(ls.region)
        elif ls.kind == "write":
            self.pending.pop((ls.obj.namespace, ls.obj.key), None)
            ls.ring.allocator.free(ls.region)
        else:
            obj = ls.obj
            obj.readers -= 1
            if consume is False and ls.consume and not obj.linked:
                # The reader went away before finishing: put the object back for a retry,
                # unless the key was published again or is being so (a writer reserved it
                # after the consume unlinked it): that writer's seal would replace the
                # re-linked object without freeing it, and its region would jam the ring.
                ident = (obj.namespace, obj.key)
                if ident not in self.objects and ident not in self.pending:
                    obj.linked = True
                    obj.expires_at = self.clock() + obj.ttl
                    self.objects[(obj.namespace, obj.key)] = obj
            if not obj.linked and obj.readers == 0:
                obj.ring.allocator.free(obj.region)

    def _unlink(self, obj: _RingObject) -> None:
        if obj.linked:
            obj.linked = False
            self.objects.pop((obj.namespace, obj.key), None)

    def close_session(self, session: Any) -> None:
        """A connection ended: every ring lease it held ends; nothing it held stays allocated
        (a read lease it held leaves the object for the next claimer)."""
        for ls in list(self._by_session.get(session.id, {}).values()):
            self._end(ls, "its connection closed", consume=False)

    def expire(self) -> None:
        now = self.clock()
        for obj in [o for o in self.objects.values() if o.readers == 0 and o.expires_at <= now]:
            self._unlink(obj)
            obj.ring.allocator.free(obj.region)
            self.counters["expired"] += 1
            log.info(
                "ring object %s/%s was not claimed within %g s: freed",
                obj.namespace,
                obj.key,
                obj.ttl,
            )

    # ---------------------------------------------------------------- statistics
    def snapshot(self, occupancy_cells: int = _OCCUPANCY_CELLS) -> list[dict[str, Any]]:
        """The statistics as sent on the wire."""
        return [dataclasses.asdict(r) for r in self.statistics(occupancy_cells)]

    def statistics(self, occupancy_cells: int = _OCCUPANCY_CELLS) -> tuple[RingStatistics, ...]:
        self.expire()
        out = []
        for ring in self.rings:
            states: dict[int, str] = {}  # region offset -> state letter
            read = write = objects = 0
            for ls in self.leases.values():
                if ls.ring is ring and ls.kind != "read":
                    write += ls.region.size
                    states[ls.region.offset] = "w"
            seen = set()
            for ls in self.leases.values():
                if ls.ring is ring and ls.kind == "read" and id(ls.obj) not in seen:
                    seen.add(id(ls.obj))
                    read += ls.region.size
                    states[ls.region.offset] = "r"
            for obj in self.objects.values():
                if obj.ring is ring:
                    objects += 1
                    states.setdefault(obj.region.offset, "s")
            a = ring.allocator
            used = a.used
            out.append(
                RingStatistics(
                    index=ring.index,
                    device=ring.bus_id,
                    name=ring.name,
                    capacity=self.size,
                    used=used,
                    free=self.size - used,
                    leased_read=read,
                    leased_write=write,
                    # freed regions the FIFO frontier has not passed yet: not reusable until it does
                    quarantined=used - sum(r.size for r in a.live()),
                    objects=objects,
                    largest_free=a.largest_free,
                    fragmentation=0.0
                    if used == self.size
                    else 1.0 - a.largest_free / (self.size - used),
                    high_watermark=1.0,
                    low_watermark=1.0,
                    occupancy=self._occupancy(a, states, occupancy_cells),
                )
            )
        return tuple(out)

    def _occupancy(self, a: RingAllocator, states: dict[int, str], cells: int) -> str:
        if cells <= 0:
            return ""
        rank = {".": 0, "q": 1, "s": 2, "r": 3, "w": 4}
        out = ["."] * cells
        for region in a.held():
            letter = "q" if region.freed else states.get(region.offset, "s")
            first = region.offset * cells // self.size
            last = max(first, (region.end - 1) * cells // self.size)
            for c in range(first, min(last, cells - 1) + 1):
                if rank[letter] > rank[out[c]]:
                    out[c] = letter
        return "".join(out)
