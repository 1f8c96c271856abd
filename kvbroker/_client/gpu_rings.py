"""The GPU staging rings from the client's side: mapping a daemon ring, ring leases.

The daemon owns the device memory (``kvbroker serve --gpu-ring SIZE``,
:mod:`kvbroker._server.rings`); a process maps each ring once (``cuIpcOpenMemHandle`` in the
ring GPU's context; unmapped when its last GpuClient closes). :class:`RingRegion` is a region
under a ring lease: scratch, write (a ring-located object, sealed by the daemon's rules) or
read. :class:`RingClient` holds :class:`~kvbroker.gpu.GpuClient`'s ring methods. See
:mod:`kvbroker.gpu` for who owns what, and ``docs/design.md``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .gpu_copy import _DeviceSpan, _driver, _enable_peer, _span, copy_runs
from .shared import PerProcess
from .._wire.objects import aligned
from ..errors import KVBrokerError

if TYPE_CHECKING:
    from .gpu_client import GpuClient

__all__ = ["RingClient", "RingRegion"]


class RingClient:
    """:class:`~kvbroker.gpu.GpuClient`'s GPU ring methods (a mixin: it uses the GpuClient's
    ``client``, ``device``, ``stream``, ``_torch``, ``_rings``, ``_ring_held``, ``_side``,
    ``last_copies`` and ``_caller_stream``)."""

    def rings(self) -> list[dict]:
        """The daemon's GPU rings (index, PCI bus id, name, capacity); [] without rings."""
        if self._rings is None:
            from ..errors import BadRequest

            try:
                self._rings = self.client.ops.rings()["rings"]
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
        from .._cuda import device_identity

        dev = self.device if device is None else self._torch.device(device)
        bus = device_identity(_driver(), dev.index)[0]
        for r in self.rings():
            if r["device"] == bus:
                return r["index"]
        raise KVBrokerError(f"the daemon has no GPU ring on {dev} (PCI {bus})")

    def ring_reserve(
        self,
        nbytes: int,
        *,
        key: str | None = None,
        ring: int | None = None,
        namespace: str = "default",
        meta: dict | None = None,
        ttl: float | None = None,
        wait: float = 5.0,
    ) -> RingRegion:
        """A ring region of ``nbytes``: scratch, or (``key``) a ring object to seal.

        A full ring is retried, with short sleeps, for at most ``wait`` seconds (regions free
        in FIFO order as their holders release them), then :class:`PoolFull`; a request larger
        than the ring fails at once."""
        import time

        from ..errors import PoolFull

        index = self.local_ring() if ring is None else ring
        deadline = time.monotonic() + wait
        pause = 0.0005
        while True:
            try:
                reply = self.client.ops.ring_reserve(
                    index, nbytes, namespace=namespace, key=key, meta=meta, ttl=ttl
                )
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
            self.client.ops.ring_release(reply["lease"])
            raise

    def ring_publish(
        self,
        key: str,
        tensors: Mapping[str, Any],
        *,
        ring: int | None = None,
        stream: Any = None,
        namespace: str = "default",
        meta: dict | None = None,
        ttl: float | None = None,
        wait: float = 5.0,
    ) -> dict:
        """Publish contiguous CUDA tensors into a GPU ring (the ring of this client's GPU by
        default): one device-to-device copy per tensor (merged when adjacent), no host round
        trip. A claimer on any GPU of the ring's NVLink domain reads it with
        :meth:`ring_claim`. Returns the ring object's directory (``name -> [offset, nbytes,
        dtype, shape]``, also in its meta)."""
        torch = self._torch
        flat = {name: _span(t) for name, t in tensors.items()}
        layout, at = {}, 0
        for name, (_, n) in flat.items():
            layout[name] = [
                at,
                n,
                str(tensors[name].dtype).removeprefix("torch."),
                list(tensors[name].shape),
            ]
            at += aligned(n)
        full_meta = {"kvbroker.ring": 1, "buffers": layout, "user": meta}
        region = self.ring_reserve(
            max(at, 1), key=key, ring=ring, namespace=namespace, meta=full_meta, ttl=ttl, wait=wait
        )
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

    def ring_read(
        self,
        key: str,
        *,
        namespace: str = "default",
        consume: bool = True,
        wait: float | None = None,
    ) -> RingRegion:
        """A read lease on a sealed ring object, its bytes lent as ``region.tensor`` (uint8,
        on the ring's GPU, mapped over CUDA IPC) for the caller's own kernels to read (a
        scatter into a paged cache): no copy is made here. The caller releases it (``with``)
        once every kernel reading it has run; ``consume``: the object is freed then, and no
        one else may claim it meanwhile. Not found (and no ``wait``): NotFound."""
        reply = self.client.ops.ring_claim(key, namespace=namespace, consume=consume, wait=wait)
        return self._region(reply, "read", key)

    def ring_claim(
        self,
        key: str,
        out: Mapping[str, Any],
        *,
        stream: Any = None,
        namespace: str = "default",
        consume: bool = True,
        wait: float | None = None,
    ) -> dict[str, Any]:
        """Copy each buffer named in ``out`` from a ring object into its CUDA tensor: one copy
        each (a peer copy over NVLink when the ring is on another GPU), ordered like
        :meth:`claim`. Returns ``out``."""
        torch = self._torch
        reply = self.client.ops.ring_claim(key, namespace=namespace, consume=consume, wait=wait)
        with self._region(reply, "read", key) as region:
            layout = (region.meta or {}).get("buffers", {})
            missing = [n for n in out if n not in layout]
            if missing:
                raise KVBrokerError(f"ring object {namespace}/{key} has no buffer(s) {missing}")
            flat = {name: _span(t) for name, t in out.items()}
            for name, (_, n) in flat.items():
                if layout[name][1] != n:
                    raise KVBrokerError(
                        f"buffer {name!r} holds {layout[name][1]} bytes, the destination {n}"
                    )
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


class _RingMapping:
    """One daemon ring mapped into this process (``cuIpcOpenMemHandle``, in the context of the
    ring's own GPU), with a uint8 tensor over all of it. Unmapped by the last holder."""

    def __init__(self, torch, info: dict) -> None:
        from .._cuda import IpcHandle, _check, device_identity

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
                raise KVBrokerError(
                    f"GPU ring {self.index}: the daemon sent a "
                    f"{len(info['handle'])}-byte IPC handle, not 64"
                )
            handle = IpcHandle.from_buffer_copy(bytes(info["handle"]))
            _check(
                lib,
                lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, 1),
                f"cuIpcOpenMemHandle of GPU ring {self.index}",
            )
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
        self.owner.client.ops.ring_seal(self.lease)
        self.ended = True
        self.tensor = None

    def release(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.tensor = None
        self.owner.client.ops.ring_release(self.lease)

    def __enter__(self) -> RingRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
