"""Moving bytes between a caller's arrays and leased pool views, one pass over memory.

Sources and destinations are numpy arrays, torch CPU tensors or bytes-like objects; numpy and
torch are imported only when a caller already uses them (``import kvbroker`` stays light).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["copy_into", "nbytes_of"]


def _np():
    import numpy

    return numpy


def _torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def nbytes_of(obj: Any) -> int:
    """Size in bytes of a numpy array, torch tensor or bytes-like object."""
    if _torch_tensor(obj):
        return obj.numel() * obj.element_size()
    n = getattr(obj, "nbytes", None)
    if isinstance(n, int):
        return n
    return memoryview(obj).nbytes


def copy_into(dst, src: Any) -> None:
    """Copy ``src`` into the uint8 view ``dst`` with one pass over memory, bit for bit."""
    np = _np()
    if _torch_tensor(src):
        torch = sys.modules["torch"]
        if src.numel():
            target = torch.from_numpy(dst).view(src.dtype).view(src.shape)
            target.copy_(src.detach())
        return
    if isinstance(src, np.ndarray):
        if src.flags.c_contiguous:
            np.copyto(dst, src.reshape(-1).view(np.uint8))
        else:  # strided: let numpy walk the strides while writing, still one pass
            np.copyto(dst.view(src.dtype).reshape(src.shape), src)
        return
    np.copyto(dst, np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8))
