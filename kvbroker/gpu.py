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
  Copies that continue each other on both sides (buffers that are views of one tensor) are
  merged into one DMA, issued through the CUDA driver (:func:`copy_runs`). The source tensors
  are the caller's; the call returns only after the copies have read them.
- :meth:`GpuClient.claim` copies each buffer with ONE host→device copy into the caller's
  tensors on the side stream, makes the caller's stream wait on the copy's event (the engine
  cannot read KV before it has landed), waits for the copies (the lease must outlive them),
  then releases the lease.
- :func:`host_tensors` gives torch CPU tensors over a lease's slices (zero-copy, valid only
  while the lease is); they are writable even for read leases: do not write through them.
- GPU staging rings (``kvbroker serve --gpu-ring SIZE``, :mod:`kvbroker._server.rings`): the
  daemon owns the device memory; a process maps each ring once (``cuIpcOpenMemHandle`` in the
  ring GPU's context; unmapped when its last GpuClient closes). :class:`RingRegion` is a region
  under a ring lease: scratch (staging for a gather or a scatter, given back on release),
  write (a ring-located object, :meth:`GpuClient.ring_publish`, owned by the daemon once
  sealed) or read (:meth:`GpuClient.ring_claim`: one copy per buffer, a peer copy over NVLink
  when the ring is on another GPU; a consume-claim frees the object on release).
- :func:`publish_shard_cuda` / :func:`claim_shards_cuda`: :mod:`kvbroker.kv`'s sharded objects
  from/to a paged CUDA cache, through a ring scratch region (or torch memory without a ring),
  one Triton gather/scatter per shard and one bulk DMA per shard.

Torch is imported inside functions only: ``import kvbroker`` never imports torch. On a host
without CUDA every entry point that needs it raises :class:`~kvbroker.errors.KVBrokerError`
saying so.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from ._client.client import Client, _Lease
from ._client.shared import PerProcess
from ._wire.objects import aligned
from .errors import Exists, KVBrokerError

__all__ = ["GpuClient", "RingRegion", "host_tensors", "cuda_available", "registered_segments",
           "publish_shard_cuda", "claim_shards_cuda", "copy_runs", "coalesce"]

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


def _span(tensor) -> tuple[int, int]:
    """``(device address, nbytes)`` of a contiguous tensor: what one DMA reads or writes.
    Attribute reads only (no view ops: at 128 buffers, views cost more than the DMA setup)."""
    if not tensor.is_contiguous():
        raise KVBrokerError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: one DMA needs one run "
            "(gather it first, e.g. with kvbroker._client.kernels.gather)"
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


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
        self._rings: list[dict] | None = None  # the daemon's `rings` reply, asked once
        self._ring_held: dict[int, _RingMapping] = {}
        self._side: dict[int, Any] = {}  # side streams on other GPUs (ring publish)
        self.last_copies = 0  # copy operations the last publish/claim issued (after merging)
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


    # -- GPU rings (kvbroker._server.rings): staging and GPU-to-GPU handoff -------------------
    def rings(self) -> list[dict]:
        """The daemon's GPU rings (index, PCI bus id, name, capacity); [] without rings."""
        if self._rings is None:
            from .errors import BadRequest

            try:
                self._rings = self.client._call("rings")["rings"]
            except BadRequest:
                self._rings = []
        return [{k: v for k, v in r.items() if k != "handle"} for r in self._rings]

    def _ring_mapping(self, index: int) -> _RingMapping:
        if index in self._ring_held:
            return self._ring_held[index]
        self.rings()
        infos = [r for r in self._rings if r["index"] == index]
        if not infos:
            raise KVBrokerError(f"the daemon has no GPU ring {index} (serve --gpu-ring SIZE)")
        info = infos[0]
        m = _ring_maps.acquire(bytes(info["handle"]), lambda: _RingMapping(self._torch, info))
        self._ring_held[index] = m
        return m

    def local_ring(self, device: Any = None) -> int:
        """The index of the ring on ``device`` (default: this client's device)."""
        from ._cuda import device_identity

        dev = self.device if device is None else self._torch.device(device)
        bus = device_identity(_driver(), dev.index)[0]
        for r in self.rings():
            if r["device"] == bus:
                return r["index"]
        raise KVBrokerError(f"the daemon has no GPU ring on {dev} (PCI {bus})")

    def ring_reserve(self, nbytes: int, *, key: str | None = None, ring: int | None = None,
                     namespace: str = "default", meta: dict | None = None,
                     ttl: float | None = None, wait: float = 5.0) -> RingRegion:  # fmt: skip
        """A ring region of ``nbytes``: scratch, or (``key``) a ring object to seal.

        A full ring is retried, with short sleeps, for at most ``wait`` seconds (regions free
        in FIFO order as their holders release them), then :class:`PoolFull`; a request larger
        than the ring fails at once."""
        import time

        from .errors import PoolFull

        index = self.local_ring() if ring is None else ring
        deadline = time.monotonic() + wait
        pause = 0.0005
        while True:
            try:
                reply = self.client._call("ring_reserve", device=index, nbytes=nbytes,
                                          namespace=namespace, key=key, meta=meta, ttl=ttl)
                break
            except PoolFull as exc:
                if "never fits" in str(exc) or time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        return self._region(reply, reply["kind"], key)

    def _region(self, reply: dict, kind: str, key: str | None) -> RingRegion:
        try:
            region = RingRegion(self, reply, kind, key)
            if region.device != self.device:
                _enable_peer(self._torch, self.device, region.device)
            return region
        except BaseException:
            self.client._call("ring_release", lease=reply["lease"])
            raise

    def ring_publish(self, key: str, tensors: Mapping[str, Any], *, ring: int | None = None,
                     stream: Any = None, namespace: str = "default", meta: dict | None = None,
                     ttl: float | None = None, wait: float = 5.0) -> dict:  # fmt: skip
        """Publish contiguous CUDA tensors into a GPU ring (the ring of this client's GPU by
        default): one device-to-device copy per tensor (merged when adjacent), no host round
        trip. A claimer on any GPU of the ring's NVLink domain reads it with
        :meth:`ring_claim`. Returns the ring object's directory (``name -> [offset, nbytes,
        dtype, shape]``, also in its meta)."""
        torch = self._torch
        flat = {name: _span(t) for name, t in tensors.items()}
        layout, at = {}, 0
        for name, (_, n) in flat.items():
            layout[name] = [at, n, str(tensors[name].dtype).removeprefix("torch."),
                            list(tensors[name].shape)]  # fmt: skip
            at += aligned(n)
        full_meta = {"kvbroker.ring": 1, "buffers": layout, "user": meta}
        region = self.ring_reserve(max(at, 1), key=key, ring=ring, namespace=namespace,
                                   meta=full_meta, ttl=ttl, wait=wait)  # fmt: skip
        try:
            ready = torch.cuda.Event()
            ready.record(self._caller_stream(stream))
            side = self._stream_on(region.device)
            side.wait_event(ready)
            base = region.tensor.data_ptr()
            self.last_copies = copy_runs(
                [(base + layout[k][0], ptr, n) for k, (ptr, n) in flat.items()], side
            )
            side.synchronize()  # the bytes are in the ring before the seal shows them
            region.seal()
        except BaseException:
            region.release()
            raise
        return layout

    def ring_claim(self, key: str, out: Mapping[str, Any], *, stream: Any = None,
                   namespace: str = "default", consume: bool = True,
                   wait: float | None = None) -> dict[str, Any]:  # fmt: skip
        """Copy each buffer named in ``out`` from a ring object into its CUDA tensor: one copy
        each (a peer copy over NVLink when the ring is on another GPU), ordered like
        :meth:`claim`. Returns ``out``."""
        torch = self._torch
        reply = self.client._call("ring_claim", namespace=namespace, key=key, consume=consume,
                                  wait=wait)  # fmt: skip
        with self._region(reply, "read", key) as region:
            layout = (region.meta or {}).get("buffers", {})
            missing = [n for n in out if n not in layout]
            if missing:
                raise KVBrokerError(f"ring object {namespace}/{key} has no buffer(s) {missing}")
            flat = {name: _span(t) for name, t in out.items()}
            for name, (_, n) in flat.items():
                if layout[name][1] != n:
                    raise KVBrokerError(f"buffer {name!r} holds {layout[name][1]} bytes, the "
                                        f"destination {n}")  # fmt: skip
            caller = self._caller_stream(stream)
            ready = torch.cuda.Event()
            ready.record(caller)
            side = self.stream
            side.wait_event(ready)
            base = region.tensor.data_ptr()
            self.last_copies = copy_runs(
                [(ptr, base + layout[k][0], n) for k, (ptr, n) in flat.items()], side
            )
            done = torch.cuda.Event()
            done.record(side)
            caller.wait_event(done)  # the engine reads nothing before the copy is done
            done.synchronize()  # the read lease must outlive the copy out of the ring
        return dict(out)

    def _stream_on(self, device):
        if device == self.device:
            return self.stream
        s = self._side.get(device.index)
        if s is None:
            with self._torch.cuda.device(device):
                s = self._side[device.index] = self._torch.cuda.Stream(device)
        return s

# ----------------------------------------------------------------------------- copy engine
def _driver():
    """The CUDA driver library (ctypes), loaded once; copies go through it, not through
    torch's per-call dispatch (which costs more than an 8 MiB DMA's setup at 128 buffers)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        from ._cuda import load_libcuda

        lib = load_libcuda()
        lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t,
                                      ctypes.c_void_p]  # fmt: skip
        _LIBCUDA = lib
    return _LIBCUDA


_LIBCUDA = None


def coalesce(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(dst, src, nbytes)`` copies that continue each other on both sides, in order."""
    out: list[list[int]] = []
    for dst, src, n in runs:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][2] == dst and out[-1][1] + out[-1][2] == src:
            out[-1][2] += n
        else:
            out.append([dst, src, n])
    return [tuple(r) for r in out]  # type: ignore[misc]


def copy_runs(runs: list[tuple[int, int, int]], stream) -> int:
    """Queue each ``(dst address, src address, nbytes)`` copy on ``stream`` (unified addressing:
    host, registered host and device memory alike), adjacent runs merged first. Returns the
    number of copies issued. The caller keeps both sides alive until the stream has run them."""
    import torch

    lib = _driver()
    # disjoint copies may run in any order: by destination, neighbours get merged
    merged = coalesce(sorted(runs))
    handle = ctypes.c_void_p(stream.cuda_stream)
    with torch.cuda.device(stream.device):  # the stream's context is the current one
        for dst, src, n in merged:
            code = lib.cuMemcpyAsync(dst, src, n, handle)
            if code:
                from ._cuda import _check

                _check(lib, code, f"cuMemcpyAsync of {n} bytes")
    return len(merged)


# ------------------------------------------------------------------------------ GPU rings
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704
_peers_enabled: set[tuple[int, int]] = set()


def _enable_peer(torch, device, peer) -> None:
    """Let ``device`` read and write ``peer``'s memory directly (NVLink/PCIe P2P), once per
    process and direction; without it a copy between them is staged through the host."""
    for a, b in ((device.index, peer.index), (peer.index, device.index)):
        if (a, b) in _peers_enabled or not torch.cuda.can_device_access_peer(a, b):
            continue
        lib = _driver()
        with torch.cuda.device(b):
            torch.empty(1, device=torch.device("cuda", b))  # b's primary context exists
        with torch.cuda.device(a):
            torch.empty(1, device=torch.device("cuda", a))
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            lib.cuDeviceGet(ctypes.byref(dev), b)
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # held for the process
            code = lib.cuCtxEnablePeerAccess(ctx, 0)
            if code not in (0, _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                from ._cuda import _check

                _check(lib, code, f"cuCtxEnablePeerAccess cuda:{a} -> cuda:{b}")
        _peers_enabled.add((a, b))


class _DeviceSpan:
    """``__cuda_array_interface__`` over raw device memory, so torch can view it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }  # fmt: skip


class _RingMapping:
    """One daemon ring mapped into this process (``cuIpcOpenMemHandle``, in the context of the
    ring's own GPU), with a uint8 tensor over all of it. Unmapped by the last holder."""

    def __init__(self, torch, info: dict) -> None:
        from ._cuda import IpcHandle, _check, device_identity

        lib = _driver()
        self.index, self.capacity = info["index"], info["capacity"]
        self.bus_id = info["device"]
        n = torch.cuda.device_count()
        ordinals = [i for i in range(n) if device_identity(lib, i)[0] == self.bus_id]
        if not ordinals:
            raise KVBrokerError(
                f"GPU ring {self.index} lives on the GPU at PCI {self.bus_id}, which this process "
                "does not see (check CUDA_VISIBLE_DEVICES): claim through a host pool instead"
            )
        self.ordinal = ordinals[0]
        self.device = torch.device("cuda", self.ordinal)
        with torch.cuda.device(self.device):
            torch.cuda.init()
            torch.empty(1, device=self.device)  # the primary context exists and is current
            ptr = ctypes.c_uint64()
            if len(info["handle"]) != ctypes.sizeof(IpcHandle):
                raise KVBrokerError(f"GPU ring {self.index}: the daemon sent a "
                                    f"{len(info['handle'])}-byte IPC handle, not 64")
            handle = IpcHandle.from_buffer_copy(bytes(info["handle"]))
            _check(lib, lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1),
                   f"cuIpcOpenMemHandle of GPU ring {self.index}")  # fmt: skip
        self.ptr = ptr.value
        self.tensor = torch.as_tensor(_DeviceSpan(self.ptr, self.capacity), device=self.device)
        self._torch = torch

    def close(self) -> None:
        torch = self._torch
        self.tensor = None
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            _driver().cuIpcCloseMemHandle(ctypes.c_uint64(self.ptr))


# handle bytes -> this process's one mapping of that ring
_ring_maps: PerProcess[_RingMapping] = PerProcess(lambda m: m.close())


class RingRegion:
    """A region of a daemon GPU ring under a ring lease of ``owner`` (a GpuClient).

    ``tensor``: uint8 CUDA tensor over the region, valid until the lease ends. ``kind``:
    "scratch" or "write" (keyed, :meth:`seal` publishes it) or "read" (a claim). Ends with
    :meth:`release` (a write lease: the object is discarded), or on ``with`` exit.
    """

    def __init__(self, owner: GpuClient, reply: dict, kind: str, key: str | None = None) -> None:
        self.owner = owner
        self.lease = reply["lease"]
        self.ring = reply["device"]
        self.offset = reply["offset"]
        self.nbytes = reply["nbytes"]
        self.kind = kind
        self.key = key
        self.meta = reply.get("meta")
        self.mapping = owner._ring_mapping(self.ring)
        self.tensor = self.mapping.tensor[self.offset : self.offset + self.nbytes]
        self.ended = False

    @property
    def device(self):
        return self.mapping.device

    def seal(self) -> None:
        """Publish a written region (its writes must be complete: synchronize first)."""
        if self.kind != "write":
            raise KVBrokerError(f"only a keyed ring region can be sealed, this one is {self.kind}")
        self.owner.client._call("ring_seal", lease=self.lease)
        self.ended = True
        self.tensor = None

    def release(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.tensor = None
        self.owner.client._call("ring_release", lease=self.lease)

    def __enter__(self) -> RingRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ------------------------------------------------------- sharded KV from/to a paged CUDA cache
_AXES6 = ("layer", "kv", "block", "token", "head", "head_dim")


def _paged_facts(cache, total_kv_heads):
    """(components, heads total or None) of a 6-axis paged CUDA cache (see kvbroker._client.kernels)."""
    from .errors import BadRequest

    if not getattr(cache, "is_cuda", False) or cache.dim() != 6:
        raise BadRequest("the CUDA shard path takes one CUDA tensor with axes (layer, kv, block, "
                         "token, head, head_dim); a host cache goes through kvbroker.kv")  # fmt: skip
    kv = cache.shape[1]
    if kv == 2:
        if total_kv_heads is None:
            raise BadRequest("total_kv_heads (from the model config) is required for a "
                             "per-head cache")  # fmt: skip
        return ("key", "value"), total_kv_heads
    if kv == 1 and cache.shape[4] == 1:
        return ("latent",), None
    raise BadRequest(f"the kv axis must be 2 (K, V) or 1 (an MLA latent with one head), "
                     f"got shape {tuple(cache.shape)}")  # fmt: skip


class _Staging:
    """A device staging region: a scratch region of the daemon's ring on the cache's GPU when
    there is one with room, else a tensor from torch's caching allocator. Freed on exit."""

    def __init__(self, g: GpuClient, nbytes: int, device) -> None:
        self.region = None
        self.in_ring = False
        try:
            if g.rings():
                self.region = g.ring_reserve(nbytes, ring=g.local_ring(device), wait=0.0)
                self.in_ring = True
        except KVBrokerError:  # no ring on that GPU, or full: do not wait, use torch memory
            self.region = None
        self.tensor = (self.region.tensor if self.region is not None
                       else g._torch.empty(nbytes, dtype=g._torch.uint8, device=device))

    def close(self) -> None:
        self.tensor = None
        if self.region is not None:
            self.region.release()


def _uniform_spacing(addrs: list[int], nbytes: int, itemsize: int) -> int | None:
    """The constant distance between consecutive buffers, when there is one (then one DMA
    moves them all, gaps included); None otherwise."""
    if len(addrs) == 1:
        return nbytes
    d = addrs[1] - addrs[0]
    if d < nbytes or d % itemsize or any(b - a != d for a, b in zip(addrs, addrs[1:])):
        return None
    return d


def publish_shard_cuda(
    g: GpuClient,
    request: str,
    cache: Any,
    block_table: Any,
    num_tokens: int,
    *,
    tp_rank: int,
    tp_size: int,
    total_kv_heads: int | None,
    decode_tp_size: int | None = None,
    namespace: str = "default",
    infix: str | None = None,
    ttl: float | None = None,
    replace: bool = False,
    stream: Any = None,
    checksum: bool = False,
):
    """:func:`kvbroker.kv.publish_shard` for a paged CUDA cache: the same object (key, buffer
    names, storage layout, meta), so a decode rank on the host path or on a GPU claims it.

    One Triton gather of all layers and K/V into a device staging region laid out like the
    lease's buffers (a ring scratch region when the daemon has a ring on this GPU), then ONE
    device-to-host DMA into the registered pool when the buffers are evenly spaced in it (one
    per buffer otherwise), then seal. ``cache``: ``(layer, kv, block, token, head, head_dim)``
    holding this rank's heads; ``block_table``: the request's blocks, in order.
    """
    import time

    from ._client import kernels as _kernels
    from . import kv as _kv
    from ._client.tp import readers_of, shard_heads
    from .errors import BadRequest, LayoutMismatch
    from .layout import Layout, dtype_name, shard_storage

    torch = g._torch
    started = time.perf_counter()
    components, heads = _paged_facts(cache, total_kv_heads)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise BadRequest(f"num_tokens must be a positive int, not {num_tokens!r}")
    L, C, _blocks, _page, local_heads, dim = cache.shape
    mine = shard_heads(tp_rank, tp_size, heads)
    if local_heads != len(mine):
        raise LayoutMismatch(f"layout mismatch on KV heads: TP rank {tp_rank} of {tp_size} holds "
                             f"{len(mine)} of {heads} heads, but its cache has {local_heads}")
    key = _kv.shard_key(request, tp_rank, tp_size)
    if decode_tp_size is None:
        consumers = _kv.UNKNOWN_CONSUMERS
    else:
        consumers = readers_of(tp_rank, heads, tp_size, decode_tp_size)
        if consumers == 0:
            return _kv.PublishResult(key, False, 0, seconds=time.perf_counter() - started)
    storage = shard_storage(dtype_name(cache), L, C, len(mine), num_tokens, dim)
    buffer_layout = storage.select("layer", 0).select("kv", 0)
    names = [_kv.kv_buffer_name(kind, i, infix) for i in range(L) for kind in components]
    B = buffer_layout.nbytes
    engine = Layout.from_tensor(cache, _AXES6, iterated=_AXES6[:-1]).select("layer", 0)
    meta = {
        _kv.META_TAG: 1, "request": request, "tp_rank": tp_rank, "tp_size": tp_size,
        "total_kv_heads": heads, "heads": [mine.start, mine.stop], "num_tokens": num_tokens,
        "num_layers": L, "components": list(components), "infix": infix,
        "layout": buffer_layout.to_dict(), "engine_layout": engine.to_dict(),
        "decode_tp_size": decode_tp_size,
    }  # fmt: skip
    item = cache.element_size()
    table = torch.as_tensor(block_table, device=cache.device)
    lease = g.client.reserve(key, dict.fromkeys(names, B), namespace=namespace, meta=meta,
                             ttl=ttl, replace=replace, consumers=consumers)  # fmt: skip
    lease.checksum = checksum  # see GpuClient.publish
    with lease:
        addrs = _host_addresses(lease)
        order = [addrs[n] for n in names]
        spacing = _uniform_spacing(order, B, item)
        slot = spacing if spacing is not None else B
        span = (len(names) - 1) * slot + B
        staging = _Staging(g, span, cache.device)
        try:
            st = staging.tensor[:span].view(cache.dtype)
            st = st.as_strided((L, C, len(mine), num_tokens, dim),
                               (C * slot // item, slot // item, num_tokens * dim, dim, 1))
            ready = torch.cuda.Event()
            ready.record(g._caller_stream(stream))
            g.stream.wait_event(ready)
            with torch.cuda.stream(g.stream):
                _kernels.gather(cache, table, num_tokens, st)
            base = staging.tensor.data_ptr()
            if spacing is not None:
                runs = [(order[0], base, span)]
            else:
                runs = [(a, base + i * slot, B) for i, a in enumerate(order)]
            copies = copy_runs(runs, g.stream)
            g.stream.synchronize()  # in the pool before the seal; the staging may go now
        finally:
            staging.close()
    return _kv.PublishResult(key, True, consumers, 1 + copies, B * len(names),
                             time.perf_counter() - started)  # fmt: skip


def claim_shards_cuda(
    g: GpuClient,
    request: str,
    cache: Any,
    block_table: Any,
    *,
    tp_rank: int,
    tp_size: int,
    prefill_tp_size: int,
    total_kv_heads: int | None,
    num_tokens: int | None = None,
    namespace: str = "default",
    infix: str | None = None,
    wait: float | None = None,
    consume: bool = True,
    stream: Any = None,
):
    """:func:`kvbroker.kv.claim_shards` into a paged CUDA cache (heterogeneous TP included).

    Per contributing shard: its head range of every (layer, K/V) is one run in the pool;
    those runs go host→device into a staging region (a ring scratch region when there is one)
    laid out like the pool, merged into ONE DMA when the whole shard is read, then ONE Triton
    scatter writes them into this rank's heads of the request's blocks. So
    ``copy_ops <= shards × (layers × components + 1)``, independent of the token count.
    ``stream`` (default: current) waits for the copies. Same errors and consume rule as
    :func:`kvbroker.kv.claim_shards`.
    """
    import time
    from types import SimpleNamespace

    from ._client import kernels as _kernels
    from . import kv as _kv
    from ._client.tp import claim_plan, shard_heads
    from .errors import LayoutMismatch
    from .layout import Layout

    torch = g._torch
    started = time.perf_counter()
    components, heads = _paged_facts(cache, total_kv_heads)
    L, C, _blocks, _page, local_heads, dim = cache.shape
    mine = shard_heads(tp_rank, tp_size, heads)
    if local_heads != len(mine):
        raise LayoutMismatch(f"layout mismatch on KV heads: decode TP rank {tp_rank} of {tp_size} "
                             f"needs {len(mine)} of {heads} heads, but its cache has "
                             f"{local_heads}")  # fmt: skip
    plan = claim_plan(heads, prefill_tp_size, tp_size, tp_rank)
    keys = list(dict.fromkeys(_kv.shard_key(request, p.prefill_rank, prefill_tp_size)
                              for p in plan))  # fmt: skip
    # Consume claims when consuming: counted only once every copy landed (see kv.claim_shards).
    pins = _kv._pin_shards(g.client, request, keys, namespace, wait, consume)
    claimed = False
    result = _kv.ClaimResult(keys, pieces=plan, wait_seconds=time.perf_counter() - started)
    local = SimpleNamespace(
        components=components, num_layers=L,
        layouts=[Layout.from_tensor(cache, _AXES6, iterated=_AXES6[:-1]).select("layer", 0)],
    )  # fmt: skip
    stagings: list[_Staging] = []
    try:
        tokens = {k: _kv._check_shard(pins[k].meta, k, local, heads, prefill_tp_size, infix)
                  for k in keys}  # fmt: skip
        if len(set(tokens.values())) != 1:
            raise LayoutMismatch(f"layout mismatch on num_tokens across shards: {tokens}")
        total = next(iter(tokens.values()))
        if num_tokens is not None and num_tokens != total:
            raise LayoutMismatch(f"layout mismatch on num_tokens: published {total}, "
                                 f"local {num_tokens}")  # fmt: skip
        names = [_kv.kv_buffer_name(kind, i, infix) for i in range(L) for kind in components]
        table = torch.as_tensor(block_table, device=cache.device)
        item = cache.element_size()
        ready = torch.cuda.Event()
        ready.record(g._caller_stream(stream))
        g.stream.wait_event(ready)
        for piece in plan:
            key = _kv.shard_key(request, piece.prefill_rank, prefill_tp_size)
            lease = pins[key]
            missing = [n for n in names if n not in lease]
            if missing:
                raise LayoutMismatch(f"layout mismatch on buffers: {key} has no {missing[0]}")
            stored = Layout.from_dict(lease.meta["layout"])
            (run_off, run_len), = stored.narrow("head", piece.src_head, piece.count).descriptors()
            addrs = _host_addresses(lease)
            order = [addrs[n] for n in names]
            spacing = _uniform_spacing(order, stored.nbytes, item)
            slot = spacing if spacing is not None else run_len
            span = (len(names) - 1) * slot + run_len
            staging = _Staging(g, span, cache.device)
            stagings.append(staging)
            base = staging.tensor.data_ptr()
            result.copy_ops += copy_runs(
                [(base + i * slot, a + run_off, run_len) for i, a in enumerate(order)], g.stream
            )
            result.source_runs += len(order)
            result.nbytes += run_len * len(order)
            st = staging.tensor[:span].view(cache.dtype).as_strided(
                (L, C, piece.count, total, dim),
                (C * slot // item, slot // item, total * dim, dim, 1))  # fmt: skip
            with torch.cuda.stream(g.stream):
                _kernels.scatter(st, cache, table, total, head_start=piece.dst_head)
            result.copy_ops += 1
        done = torch.cuda.Event()
        done.record(g.stream)
        g._caller_stream(stream).wait_event(done)  # the engine reads nothing before this
        done.synchronize()  # the pins and stagings outlive the copies
        result.num_tokens = total
        claimed = True
    finally:
        g.stream.synchronize()
        for s in stagings:
            s.close()
        _kv._release_all(pins.values(), counted=claimed)
    result.seconds = time.perf_counter() - started
    return result
