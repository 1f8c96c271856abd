"""The GPU data path of a client: registered pools, one DMA per buffer, stream-ordered.

Who owns and frees what
-----------------------

- The daemon owns the pools; :class:`~kvbroker.Client` maps each pool once per process.
  :class:`GpuClient` pins each of those mappings with ``cudaHostRegister`` ONCE per process
  (a process-wide registry, refcounted per segment: registration costs ~50 ms per GiB, so it
  is paid at attach, never per transfer) and unregisters when the last :class:`GpuClient` of
  that segment is closed. Close the :class:`GpuClient` before its :class:`Client` (the
  ``with`` block does both in that order when it made the client): unmapping a registered
  range leaves it pinned in the driver.
- :meth:`GpuClient.publish` copies each CUDA tensor into its leased slice with ONE device→host
  copy on a side stream that first waits on an event recorded on the caller's stream (so it
  never reads KV the forward pass has not written yet), waits for the copies, then seals.
  The source tensors are the caller's; they are marked used on the side stream so the
  caching allocator does not recycle them early.
- :meth:`GpuClient.claim` copies each buffer with ONE host→device copy into the caller's
  tensors on the side stream, makes the caller's stream wait on the copy's event (the engine
  cannot read KV before it has landed), waits for the copies (the lease must outlive them),
  then releases the lease.
- :func:`host_tensors` gives torch CPU tensors over a lease's slices (zero-copy, valid only
  while the lease is); they are writable even for read leases: do not write through them.

Torch is imported inside functions only: ``import kvbroker`` never imports torch. On a host
without CUDA every entry point that needs it raises :class:`~kvbroker.errors.KVBrokerError`
saying so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from ._client import Client, _Lease
from ._shared import PerProcess
from .errors import Exists, KVBrokerError

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


def _address(mm) -> int:
    """Base address of an mmap without keeping a buffer export on it (it may close later)."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


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


def _bytes_of(tensor):
    """A flat uint8 view of a contiguous tensor (bit-exact: no dtype conversion)."""
    import torch

    if not tensor.is_contiguous():
        raise KVBrokerError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: one DMA needs one run "
            "(gather it first, e.g. with kvbroker._kernels.gather)"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


class GpuClient:
    """A :class:`Client` whose pool mappings are CUDA-registered, with DMA publish/claim.

    ``client``: an existing client (closed by :meth:`close` only if ``own_client``), or None
    to connect one with ``**client_kw``. ``device``: the CUDA device of the side stream.
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
        try:
            for pool in self.client.pools:
                m = self.client._mapping(pool["index"])
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
    ) -> bool:
        """Publish contiguous CUDA tensors, one device→host DMA each; returns once sealed.

        ``stream``: the stream that produces the tensors (default: the current stream); the
        copies start after everything already queued on it. Returns False, copying nothing,
        when the key exists and ``replace`` is False.
        """
        torch = self._torch
        flat = {name: _bytes_of(t) for name, t in tensors.items()}
        try:
            lease = self.client.reserve(
                key, {n: f.numel() for n, f in flat.items()}, namespace=namespace, meta=meta,
                replace=replace, ttl=ttl, consumers=consumers,
            )  # fmt: skip
        except Exists:
            if replace:
                raise
            return False
        with lease:
            ready = torch.cuda.Event()
            ready.record(self._caller_stream(stream))
            dsts = host_tensors(lease)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                for name, src in flat.items():
                    if src.numel():
                        dsts[name].copy_(src, non_blocking=True)
                        src.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()  # the bytes are in the pool before the seal publishes them
            del dsts
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
        flat = {name: _bytes_of(t) for name, t in out.items()}
        caller = self._caller_stream(stream)
        with self.client.claim(key, namespace=namespace, select=select, consume=consume,
                               wait=wait) as lease:  # fmt: skip
            missing = [n for n in out if n not in lease]
            if missing:
                raise KVBrokerError(f"object {namespace}/{key} has no buffer(s) {missing}")
            srcs = host_tensors(lease)
            for name, dst in flat.items():
                if srcs[name].numel() != dst.numel():
                    raise KVBrokerError(
                        f"buffer {name!r} holds {srcs[name].numel()} bytes, "
                        f"the destination {dst.numel()}"
                    )
            ready = torch.cuda.Event()
            ready.record(caller)
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                for name, dst in flat.items():
                    if dst.numel():
                        dst.copy_(srcs[name], non_blocking=True)
                        dst.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
            caller.wait_event(done)  # the engine reads nothing before the copy is done
            done.synchronize()  # the lease must outlive the copies out of its slices
            del srcs
        return dict(out)
