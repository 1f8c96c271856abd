"""The CUDA copy engine of the client's GPU path: DMA through the CUDA driver, peer access.

Copies go through ``cuMemcpyAsync`` (ctypes, :mod:`kvbroker._cuda`), not torch's per-call
dispatch, which costs more than an 8 MiB DMA's setup at 128 buffers. Used by
:class:`kvbroker.gpu.GpuClient`, its rings and the CUDA shard paths. Torch is imported inside
functions only. See ``docs/design.md``.
"""

from __future__ import annotations

import ctypes

from ..errors import KVBrokerError

__all__ = ["coalesce", "copy_runs"]


def _address(mm) -> int:
    """Base address of an mmap without keeping a buffer export on it (it may close later)."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _span(tensor) -> tuple[int, int]:
    """``(device address, nbytes)`` of a contiguous tensor: what one DMA reads or writes.
    Attribute reads only (no view ops: at 128 buffers, views cost more than the DMA setup)."""
    if not tensor.is_contiguous():
        raise KVBrokerError(
            f"tensor of shape {tuple(tensor.shape)} is not contiguous: one DMA needs one run "
            "(gather it first, e.g. with kvbroker._client.kernels.gather)"
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def _driver():
    """The CUDA driver library (ctypes), loaded once; copies go through it, not through
    torch's per-call dispatch (which costs more than an 8 MiB DMA's setup at 128 buffers)."""
    global _LIBCUDA
    if _LIBCUDA is None:
        from .._cuda import load_libcuda

        lib = load_libcuda()
        lib.cuMemcpyAsync.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
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
                from .._cuda import _check

                _check(lib, code, f"cuMemcpyAsync of {n} bytes")
    return len(merged)


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
                from .._cuda import _check

                _check(lib, code, f"cuCtxEnablePeerAccess cuda:{a} -> cuda:{b}")
        _peers_enabled.add((a, b))


class _DeviceSpan:
    """``__cuda_array_interface__`` over raw device memory, so torch can view it."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
