"""The CUDA driver through ctypes: shared by the daemon's GPU rings and :class:`~kvbroker.gpu.GpuClient`.

Loaded only where asked for (``serve --gpu-ring``, a GpuClient): no torch, no CUDA runtime.
"""

from __future__ import annotations

import ctypes

from .errors import KVBrokerError

__all__ = ["CudaError", "IPC_HANDLE_BYTES", "IpcHandle", "device_identity", "load_libcuda"]

IPC_HANDLE_BYTES = 64


class CudaError(KVBrokerError):
    """A CUDA driver call failed."""


def load_libcuda():
    """The CUDA driver library (ctypes), initialised; raises KVBrokerError where there is none."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise KVBrokerError(f"GPU rings need the CUDA driver (libcuda.so.1): {exc}") from None
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib, code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaError(f"{what} failed: {(name.value or b'?').decode()} ({code})")


class IpcHandle(ctypes.Structure):
    # bytes, not c_char: a c_char array field reads back cut at its first NUL byte
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]


def device_identity(lib, ordinal: int) -> tuple[str, str]:
    """(PCI bus id, name) of device ``ordinal``: the bus id matches devices across processes
    whose CUDA_VISIBLE_DEVICES differ."""
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
    bus = ctypes.create_string_buffer(64)
    _check(lib, lib.cuDeviceGetPCIBusId(bus, 64, dev), "cuDeviceGetPCIBusId")
    name = ctypes.create_string_buffer(256)
    _check(lib, lib.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
    return bus.value.decode().lower(), name.value.decode()
