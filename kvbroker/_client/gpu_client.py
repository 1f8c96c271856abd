"""GpuClient: a client's pool mappings registered with CUDA, one DMA per buffer.

Public as :class:`kvbroker.gpu.GpuClient`; who owns and frees what is :mod:`kvbroker.gpu`'s
module doc. The GPU staging rings' methods come from :class:`kvbroker._client.gpu_rings.RingClient`,
the copies from :mod:`kvbroker._client.gpu_copy`. Torch is imported inside functions only.
See ``docs/design.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from . import gpu_integrity as _gi
from . import integrity as _integrity
from .client import Client
from .gpu_copy import _address, _span, copy_runs
from .gpu_landing import Finisher, Landing
from .gpu_rings import RingClient, _ring_maps
from .leases import _Lease
from .shared import PerProcess
from ..errors import Exists, Forbidden, KVBrokerError

if TYPE_CHECKING:
    from .gpu_rings import _RingMapping

__all__ = ["GpuClient", "host_tensors", "cuda_available", "registered_segments"]

_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current one

# segment name -> (address, size) of this process's one registration of its mapping
_registered: PerProcess[tuple[int, int]] = PerProcess(lambda reg: _unregister_address(*reg))


def cuda_available() -> bool:
    """True when torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _require_cuda():
    try:
        import torch
    except ImportError as exc:
        raise KVBrokerError("the GPU data path needs torch, which is not installed") from exc
    if not torch.cuda.is_available():
        raise KVBrokerError(
            "the GPU data path needs CUDA, and torch sees no CUDA device "
            f"(torch {torch.__version__}, built {'with' if torch.version.cuda else 'without'} "
            "CUDA): use Client.put/get or kvbroker.kv on the host path instead"
        )
    return torch


def _cuda_check(torch, code, what: str) -> None:
    code = int(getattr(code, "value", code))
    if code != 0:
        raise KVBrokerError(f"{what} failed: CUDA error {code}")


def _register(torch, name: str, mm, size: int) -> None:
    def register() -> tuple[int, int]:
        addr = _address(mm)
        err = torch.cuda.cudart().cudaHostRegister(addr, size, _CUDA_HOST_REGISTER_PORTABLE)
        _cuda_check(torch, err, f"cudaHostRegister of pool {name} ({size} bytes)")
        return addr, size

    _registered.acquire(name, register)


def _unregister_address(addr: int, size: int) -> None:
    import torch

    _cuda_check(
        torch,
        torch.cuda.cudart().cudaHostUnregister(addr),
        f"cudaHostUnregister of {size} bytes at {addr:#x}",
    )


def registered_segments() -> dict[str, int]:
    """``{segment name: number of GpuClients holding its registration}`` in this process."""
    return _registered.holders()


def host_tensors(lease: _Lease) -> dict[str, Any]:
    """uint8 torch CPU tensors over each of a lease's slices; valid while the lease is."""
    import torch

    out = {}
    for name, (pool, offset, nbytes) in lease.extents().items():
        if lease.ended:
            raise KVBrokerError(f"lease {lease.id} has ended; its views are gone")
        mm = lease.client._mapping(pool).mm
        if nbytes == 0:
            out[name] = torch.empty(0, dtype=torch.uint8)
        else:
            out[name] = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
    return out


# Bytes a claim(verify=True) copies before hashing them (the last group's hash is what the
# verify adds after the copies: 256 MiB is ~0.1 ms of an H100's HBM).
VERIFY_GROUP_BYTES = 256 << 20


def _verify_groups(flat: Mapping[str, tuple[int, int]]) -> list[list[str]]:
    """The names of ``flat`` (name -> (address, nbytes)) in order, cut into runs of about
    VERIFY_GROUP_BYTES."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, (_, n) in flat.items():
        if size >= VERIFY_GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def _check_destinations(lease: _Lease, flat: Mapping[str, tuple[int, int]]) -> None:
    """Every buffer named in ``flat`` (name -> (address, nbytes)) is in ``lease``, as big."""
    missing = [n for n in flat if n not in lease]
    if missing:
        raise KVBrokerError(f"object {lease.namespace}/{lease.key} has no buffer(s) {missing}")
    extents = lease.extents()
    for name, (_, n) in flat.items():
        if extents[name][2] != n:
            raise KVBrokerError(
                f"buffer {name!r} holds {extents[name][2]} bytes, the destination {n}"
            )


def _host_addresses(lease: _Lease) -> dict[str, int]:
    """The address of each of a lease's slices in this process's pool mappings."""
    if lease.ended:
        raise KVBrokerError(f"lease {lease.id} has ended; its slices are gone")
    bases: dict[int, int] = {}
    out = {}
    for name, (pool, offset, _nbytes) in lease.extents().items():
        if pool not in bases:
            bases[pool] = _address(lease.client._mapping(pool).mm)
        out[name] = bases[pool] + offset
    return out


class GpuClient(RingClient):
    """A :class:`Client` whose pool mappings are CUDA-registered, with DMA publish/claim.

    ``client``: an existing client (closed by :meth:`close` only if ``own_client``), or None
    to connect one with ``**client_kw``. ``device``: the CUDA device of the side stream. The
    GPU ring methods (``rings``, ``ring_reserve``, ``ring_publish``, ``ring_claim``...) are
    :class:`~kvbroker._client.gpu_rings.RingClient`'s.
    """

    def __init__(
        self,
        client: Client | None = None,
        *,
        device: Any = None,
        own_client: bool | None = None,
        **client_kw: Any,
    ) -> None:
        torch = _require_cuda()
        self._torch = torch
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        self._own = client is None if own_client is None else own_client
        self.client = client if client is not None else Client(**client_kw)
        self._names: list[str] = []
        self._rings: list[dict] | None = None  # the daemon's `rings` reply, asked once
        self._ring_held: dict[int, _RingMapping] = {}
        self._side: dict[int, Any] = {}  # side streams on other GPUs (ring publish)
        self._sum_streams: dict[int, Any] = {}  # per GPU: where checksums run beside a DMA
        self.last_copies = 0  # copy operations the last publish/claim issued (after merging)
        # seconds a claim(verify=True) spent after its copies were done: waiting for the GPU
        # checksums (and combining them); what verifying added to the claim
        self.last_verify_s = 0.0
        self._finisher: Finisher | None = None  # land()'s lease releases (below)
        try:
            for pool in self.client.pools:
                if pool.get("hidden"):
                    continue  # another tenant's own pool: the daemon does not name it
                try:
                    m = self.client._mapping(pool["index"])
                except Forbidden:
                    continue  # another tenant's own pool: the kernel keeps it from us
                _register(torch, m.name, m.mm, m.size)
                self._names.append(m.name)
        except BaseException:
            self.close()
            raise
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
        # its thread starts at the first land(); the stream's device has an index
        self._finisher = Finisher(self.stream.device)
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister this client's hold on each pool, then close the client if we own it."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if getattr(self, "_finisher", None) is not None:
            self._finisher.close()  # no copy of a landing reads the pools any more
        if hasattr(self, "stream"):
            self.stream.synchronize()
        for s in getattr(self, "_side", {}).values():
            s.synchronize()
        for s in getattr(self, "_sum_streams", {}).values():
            s.synchronize()
        for m in getattr(self, "_ring_held", {}).values():
            _ring_maps.release(
                bytes(next(r["handle"] for r in self._rings if r["index"] == m.index))
            )
        self._ring_held = {}
        names, self._names = self._names, []
        for name in names:
            _registered.release(name)
        if self._own:
            self.client.close()

    def __enter__(self) -> GpuClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- transfers --------------------------------------------------------------------------
    def _caller_stream(self, stream):
        return stream if stream is not None else self._torch.cuda.current_stream(self.device)

    def _sum_streams_after(self, event):
        """``stream_for(device)`` for :mod:`kvbroker._client.gpu_integrity`: this client's
        checksum stream on that GPU (made once), waiting for ``event`` first; None for a
        tensor not on a GPU."""
        torch = self._torch

        def stream_for(device):
            if device.type != "cuda":
                return None
            index = device.index if device.index is not None else torch.cuda.current_device()
            s = self._sum_streams.get(index)
            if s is None:
                with torch.cuda.device(index):
                    s = self._sum_streams[index] = torch.cuda.Stream(index)
            s.wait_event(event)
            return s

        return stream_for

    def start_checksums(self, tensors: Mapping[str, Any], *, stream: Any = None) -> _gi.Sums:
        """Start the checksums a seal of ``tensors`` (contiguous, as they will lie in their
        buffers) records, in the kind this client seals with: kind 1 on the tensors' GPU, on
        this client's checksum stream after what is queued on ``stream`` (default: current).

        For code that fills a :meth:`Client.reserve` lease itself (an integration copying
        with its own kernels or DMA): start this before or while copying, then, once the copy
        is done and before the seal, ``lease.checksums = sums.values(lease)`` (kind 0 is
        hashed there, from the pool). The tensors must not change until then.
        """
        ready = self._torch.cuda.Event()
        ready.record(self._caller_stream(stream))
        return _gi.start_seal(tensors, self.client.checksum_kind, self._sum_streams_after(ready))

    def publish(
        self,
        key: str,
        tensors: Mapping[str, Any],
        *,
        stream: Any = None,
        namespace: str = "default",
        meta: dict | None = None,
        replace: bool = False,
        ttl: float | None = None,
        consumers: int = 1,
        checksum: bool = True,
        session: str | None = None,
        retain: float | str | None = None,
        priority: int | None = None,
    ) -> bool:
        """Publish contiguous CUDA tensors, one device→host DMA each; returns once sealed.

        ``stream``: the stream that produces the tensors (default: the current stream); the
        copies start after everything already queued on it. Returns False, copying nothing,
        when the key exists and ``replace`` is False. ``checksum`` (on by default): record
        each buffer's checksum at seal, computed on the tensors' GPU by a kernel on another
        stream while the DMA runs (kind 1; ``benchmarks/bench_integrity_gpu.py`` measures
        what it costs). Against a daemon that accepts only kind 0 it is hashed on the CPU
        from the pool after the copy instead (one more read of every byte, on one core).
        ``session``, ``retain``, ``priority``: as :meth:`kvbroker.Client.reserve` takes them.
        """
        torch = self._torch
        flat = {name: _span(t) for name, t in tensors.items()}
        try:
            lease = self.client.reserve(
                key,
                {n: f[1] for n, f in flat.items()},
                namespace=namespace,
                meta=meta,
                replace=replace,
                ttl=ttl,
                consumers=consumers,
                session=session,
                retain=retain,
                priority=priority,
            )
        except Exists:
            if replace:
                raise
            return False
        # with checksum, lease.checksums is set below: the seal does not hash again
        lease.checksum = checksum
        with lease:
            ready = torch.cuda.Event()
            ready.record(self._caller_stream(stream))
            dsts = _host_addresses(lease)
            self.stream.wait_event(ready)
            sums = None
            try:
                # one DMA per buffer, merged where buffers continue each other on both sides
                self.last_copies = copy_runs(
                    [(dsts[name], ptr, n) for name, (ptr, n) in flat.items()],
                    self.stream,
                )
                if checksum:  # queued while the DMA runs, on their own stream: beside it
                    sums = _gi.start_seal(
                        tensors, self.client.checksum_kind, self._sum_streams_after(ready)
                    )
            finally:
                # the bytes are in the pool before the seal publishes them (and no copy
                # writes into the pages once an abort has given them back)
                self.stream.synchronize()
            if sums is not None:
                # waits for the kernels (they read the caller's tensors: not released before)
                lease.checksums = sums.values(lease)
        return True

    def claim(
        self,
        key: str,
        out: Mapping[str, Any],
        *,
        stream: Any = None,
        namespace: str = "default",
        consume: bool = False,
        wait: float | None = None,
        verify: bool = False,
    ) -> dict[str, Any]:
        """Copy each buffer named in ``out`` into its contiguous CUDA tensor, one DMA each.

        Only the buffers in ``out`` are claimed. ``stream`` (default: current) is made to wait
        for the copies, and they start after what is already queued on it (the engine may
        still be reading the blocks being overwritten). Returns ``out``.

        ``verify``: check each buffer against the checksum recorded at seal before returning:
        kind 1 recomputed on the claimer's GPU from the tensors in ``out``, each group of
        buffers (VERIFY_GROUP_BYTES) as soon as its copies landed, while the next ones copy
        (so a corruption in the pool or in transit is caught), kind 0 (objects sealed
        by older clients) hashed on the CPU from the pool while the copies run. A mismatch
        raises :class:`~kvbroker.errors.ChecksumMismatch` naming the buffers, the lease
        released: the tensors in ``out`` then hold the bad bytes, do not use them. Buffers
        sealed without a checksum are not checked.
        """
        torch = self._torch
        import re

        select: str | None = "|".join(re.escape(n) for n in out) or "(?!)"
        if len(select) > 1000:  # the daemon caps regexes: claim all, copy only those in out
            select = None
        flat = {name: _span(t) for name, t in out.items()}
        caller = self._caller_stream(stream)
        with self.client.claim(
            key, namespace=namespace, select=select, consume=consume, wait=wait
        ) as lease:
            _check_destinations(lease, flat)
            srcs = _host_addresses(lease)
            ready = torch.cuda.Event()
            ready.record(caller)
            self.stream.wait_event(ready)
            checking = bool(verify and lease.checksums)
            checks, computed = [], {}
            self.last_copies = 0
            try:
                # With verify, the copies go in groups and each group is hashed on the GPU
                # as soon as it landed, while the next ones copy: what is left after the
                # last byte is one group's hash, not the whole object's. Every copy is
                # queued first: the DMA engine never waits for the hashes' set-up.
                landed = []
                for group in _verify_groups(flat) if checking else [list(flat)]:
                    if checking:  # its chunk table goes to the GPU ahead of its copies
                        ready = _gi.prepare_verify(
                            {n: out[n] for n in group}, lease.checksums, self.stream
                        )
                    self.last_copies += copy_runs(
                        [(flat[name][0], srcs[name], flat[name][1]) for name in group],
                        self.stream,
                    )
                    if checking:
                        event = torch.cuda.Event()
                        event.record(self.stream)
                        landed.append((ready, event))
                for ready, event in landed:
                    check = ready.launch(self._sum_streams_after(event))
                    checks.append(check)
                    if check.on_host:  # kind 0: hashed on the CPU, from the pool, now
                        computed.update(check.host_values(lease))
            finally:
                done = torch.cuda.Event()
                done.record(self.stream)
                caller.wait_event(done)  # the engine reads nothing before the copy is done
                done.synchronize()  # the lease must outlive the copies out of its slices
            if checking:
                copied = time.perf_counter()
                for check in checks:  # the kind-1 values, each group's once it was hashed
                    computed.update(check.device_values())
                self.last_verify_s = time.perf_counter() - copied
                computed = {n: computed[n] for n in out if n in computed}
                _integrity.check(namespace, key, _gi.mismatched(computed, lease.checksums))
        return dict(out)

    def land(
        self,
        lease: _Lease,
        groups: Sequence[Mapping[str, Any]],
        *,
        stream: Any = None,
        after: Callable[[], None] | None = None,
    ) -> Landing:
        """Queue one host→device DMA per buffer of the read ``lease`` into contiguous CUDA
        tensors and return without waiting for them: the engine computes while they land.

        ``groups``: the destination tensors by buffer name, in the order they are to land;
        each group gets one CUDA event (:meth:`Landing.ready`), so a layer waits only for its
        own group. The copies start after what is already queued on ``stream`` (default:
        current); nothing makes ``stream`` wait for them: use :meth:`Landing.wait_for`.
        The lease passes to the returned :class:`~kvbroker._client.gpu_landing.Landing`
        (``kvbroker._client.gpu_landing`` says who frees what): this client's finisher thread
        releases it once the copies are done, then calls ``after`` (not after a failed
        copy). Bad destinations raise before anything is queued, the lease still the
        caller's.
        """
        torch = self._torch
        if self._closed:
            raise KVBrokerError("this GpuClient is closed")
        flats = [{name: _span(t) for name, t in group.items()} for group in groups]
        for flat in flats:
            _check_destinations(lease, flat)
        srcs = _host_addresses(lease)
        # After what is queued on the caller's stream, and on each destination GPU's current
        # stream (where their memory was allocated: it may be a block freed there and still
        # read by work queued before).
        waits = {
            s.cuda_stream: s
            for s in [self._caller_stream(stream)]
            + [torch.cuda.current_stream(d) for d in {t.device for g in groups for t in g.values()}]
        }
        for waited in waits.values():
            ready = torch.cuda.Event()
            ready.record(waited)
            self.stream.wait_event(ready)
        events = []
        self.last_copies = 0
        try:
            for group, flat in zip(groups, flats, strict=True):
                self.last_copies += copy_runs(
                    [(flat[name][0], srcs[name], flat[name][1]) for name in group],
                    self.stream,
                )
                for t in group.values():  # freed early, their memory waits for the copy
                    t.record_stream(self.stream)
                events.append(torch.cuda.Event())
                events[-1].record(self.stream)
        except BaseException:
            self.stream.synchronize()  # what was queued reads the lease's slices
            raise
        # timed against the caller's own events; blocking: the finisher sleeps, not spins
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        done.record(self.stream)
        landing = Landing(lease, events, done, after)
        try:
            self._finisher.submit(landing)
        except BaseException:
            self.stream.synchronize()
            raise
        return landing
