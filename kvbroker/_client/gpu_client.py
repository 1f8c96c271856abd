"""GpuClient: a client's pool mappings registered with CUDA, one DMA per buffer.

Public as :class:`kvbroker.gpu.GpuClient`; who owns and frees what is :mod:`kvbroker.gpu`'s
module doc. The GPU staging rings' methods come from :class:`kvbroker._client.gpu_rings.RingClient`,
the copies from :mod:`kvbroker._client.gpu_copy`. Torch is imported inside functions only.
See ``docs/design.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .client import Client
from .gpu_copy import _address, _span, copy_runs
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

    _cuda_check(torch, torch.cuda.cudart().cudaHostUnregister(addr),
                f"cudaHostUnregister of {size} bytes at {addr:#x}")  # fmt: skip


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
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)  # fmt: skip
        self._own = client is None if own_client is None else own_client
        self.client = client if client is not None else Client(**client_kw)
        self._names: list[str] = []
        self._rings: list[dict] | None = None  # the daemon's `rings` reply, asked once
        self._ring_held: dict[int, _RingMapping] = {}
        self._side: dict[int, Any] = {}  # side streams on other GPUs (ring publish)
        self.last_copies = 0  # copy operations the last publish/claim issued (after merging)
        try:
            for pool in self.client.pools:
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
        self._closed = False

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unregister this client's hold on each pool, then close the client if we own it."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if hasattr(self, "stream"):
            self.stream.synchronize()
        for s in getattr(self, "_side", {}).values():
            s.synchronize()
        for m in getattr(self, "_ring_held", {}).values():
            _ring_maps.release(bytes(next(r["handle"] for r in self._rings
                                          if r["index"] == m.index)))  # fmt: skip
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
        checksum: bool = False,
    ) -> bool:
        """Publish contiguous CUDA tensors, one device→host DMA each; returns once sealed.

        ``stream``: the stream that produces the tensors (default: the current stream); the
        copies start after everything already queued on it. Returns False, copying nothing,
        when the key exists and ``replace`` is False. ``checksum``: hash the buffers at seal
        (on the CPU: one more read of every byte; off by default on this DMA path).
        """
        torch = self._torch
        flat = {name: _span(t) for name, t in tensors.items()}
        try:
            lease = self.client.reserve(
                key, {n: f[1] for n, f in flat.items()}, namespace=namespace, meta=meta,
                replace=replace, ttl=ttl, consumers=consumers,
            )  # fmt: skip
        except Exists:
            if replace:
                raise
            return False
        # A seal-time checksum hashes every byte on the CPU: one more read of the whole
        # object (about 7 GB/s against 55 for the DMA on an H200), so it is asked for.
        lease.checksum = checksum
        with lease:
            ready = torch.cuda.Event()
            ready.record(self._caller_stream(stream))
            dsts = _host_addresses(lease)
            self.stream.wait_event(ready)
            # one DMA per buffer, merged where buffers continue each other on both sides
            self.last_copies = copy_runs(
                [(dsts[name], ptr, n) for name, (ptr, n) in flat.items()],
                self.stream,
            )
            # the bytes are in the pool before the seal publishes them (and the sources,
            # the caller's, are not released before the copies have read them)
            self.stream.synchronize()
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
    ) -> dict[str, Any]:
        """Copy each buffer named in ``out`` into its contiguous CUDA tensor, one DMA each.

        Only the buffers in ``out`` are claimed. ``stream`` (default: current) is made to wait
        for the copies, and they start after what is already queued on it (the engine may
        still be reading the blocks being overwritten). Returns ``out``.
        """
        torch = self._torch
        import re

        select: str | None = "|".join(re.escape(n) for n in out) or "(?!)"
        if len(select) > 1000:  # the daemon caps regexes: claim all, copy only those in out
            select = None
        flat = {name: _span(t) for name, t in out.items()}
        caller = self._caller_stream(stream)
        with self.client.claim(key, namespace=namespace, select=select, consume=consume,
                               wait=wait) as lease:  # fmt: skip
            missing = [n for n in out if n not in lease]
            if missing:
                raise KVBrokerError(f"object {namespace}/{key} has no buffer(s) {missing}")
            extents = lease.extents()
            for name, (_, n) in flat.items():
                if extents[name][2] != n:
                    raise KVBrokerError(
                        f"buffer {name!r} holds {extents[name][2]} bytes, the destination {n}"
                    )
            srcs = _host_addresses(lease)
            ready = torch.cuda.Event()
            ready.record(caller)
            self.stream.wait_event(ready)
            self.last_copies = copy_runs(
                [(ptr, srcs[name], n) for name, (ptr, n) in flat.items()],
                self.stream,
            )
            done = torch.cuda.Event()
            done.record(self.stream)
            caller.wait_event(done)  # the engine reads nothing before the copy is done
            done.synchronize()  # the lease must outlive the copies out of its slices
        return dict(out)
