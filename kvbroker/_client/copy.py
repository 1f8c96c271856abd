"""Moving bytes between a caller's arrays and leased pool views, one pass over memory.

Sources and destinations are numpy arrays, torch CPU tensors or bytes-like objects; numpy and
torch are imported only when a caller already uses them (``import kvbroker`` stays light).
Contiguous sources of :data:`kvbroker._client.engine.SPLIT_MIN` bytes or more per thread are
copied by the host copy engine (:mod:`kvbroker._client.engine`), over several threads where
the machine has the CPUs.
"""

from __future__ import annotations

from itertools import pairwise
import sys
from typing import Any

__all__ = ["copy_into", "nbytes_of", "flat_bytes", "destination", "get_destinations"]


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


def flat_bytes(src: Any):
    """``src`` as a flat uint8 numpy array over the same memory, or None when that would need
    a copy (strided arrays, tensors not in CPU memory)."""
    np = _np()
    if _torch_tensor(src):
        if src.device.type != "cpu" or not src.is_contiguous():
            return None
        torch = sys.modules["torch"]
        return src.detach().reshape(-1).view(torch.uint8).numpy()
    if isinstance(src, np.ndarray):
        if not src.flags.c_contiguous:
            return None
        return src.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(src).cast("B"), dtype=np.uint8)


def destination(dst: Any, nbytes: int, what: str, name: str | None = None):
    """``dst`` as a writable flat uint8 numpy array over its own memory, for copying
    ``nbytes`` into; raises BadRequest (naming ``what``, or ``what[name]`` when a buffer's
    ``name`` is given: formatted only then) when the bytes would not land in it:
    a strided array or a GPU tensor (a flat view of either is a copy, filled then thrown
    away), a read-only buffer, another size, or no plain bytes (an object array, a tensor
    whose raw bytes torch refuses, something that is no buffer)."""
    np = sys.modules.get("numpy")
    if np is not None and dst.__class__ is np.ndarray and dst.nbytes == nbytes:
        # the common case, answered without the questions below (the same view they give)
        flags = dst.flags
        if flags.c_contiguous and flags.writeable and not dst.dtype.hasobject:
            return dst.reshape(-1).view(np.uint8)
    from ..errors import BadRequest

    if name is not None:
        what = f"{what}[{name!r}]"
    kinds = "a numpy array, a torch tensor or a writable bytes-like object"
    if _torch_tensor(dst):
        torch = sys.modules["torch"]
        # torch refuses the raw bytes of these (a RuntimeError), or they are no such bytes
        if dst.layout is not torch.strided or dst.is_conj() or dst.is_neg():
            raise BadRequest(
                f"{what} must be a plain strided tensor (not sparse, MKL-DNN, "
                "or a conjugate or negative view)"
            )
    elif getattr(getattr(dst, "dtype", None), "hasobject", False):  # elements are pointers
        raise BadRequest(f"{what} must be {kinds}, not an array of Python objects")
    try:
        target = flat_bytes(dst)
    except TypeError:  # no buffer, or one memoryview cannot cast to bytes (strided)
        if not _has_buffer(dst):
            raise BadRequest(f"{what} must be {kinds}, not {type(dst).__name__}") from None
        target = None
    except ValueError:  # a released memoryview
        target = None
    if target is None:
        raise BadRequest(
            f"{what} must be contiguous and in CPU memory (a strided array or a "
            "GPU tensor would receive a copy, and the bytes would be lost; "
            "GpuClient.claim copies into CUDA tensors)"
        )
    if not target.flags.writeable:
        raise BadRequest(f"{what} is read-only")
    if target.nbytes != nbytes:
        raise BadRequest(f"{what} holds {target.nbytes} bytes, the buffer {nbytes}")
    return target


def refuse_overlaps(targets: dict[str, Any], what: str) -> None:
    """Raise BadRequest (naming ``what`` and both buffers) when two of ``targets`` (flat
    uint8 arrays, by buffer name, in the order they are copied) share a byte: the second
    copy would overwrite the first. Sorted by address, an overlap shows between neighbours."""
    if len(targets) < 2:
        return
    from ctypes import addressof, c_char  # (not at import: ``import kvbroker`` stays light)

    spans = []
    for i, (name, t) in enumerate(targets.items()):
        if t.nbytes:  # (nothing is copied into an empty one)
            # (a quarter of the time of t.ctypes.data: the targets are writable buffers)
            start = addressof(c_char.from_buffer(t))
            spans.append((start, start + t.nbytes, i, name))
    spans.sort()
    for (_, end, i, name), (start, _, j, other) in pairwise(spans):
        if start < end:
            from ..errors import BadRequest

            first, second = (name, other) if i < j else (other, name)
            raise BadRequest(
                f"{what}: out[{first!r}] and out[{second!r}] share memory (the "
                "second copy would overwrite the first): give each buffer its own"
            )


def get_destinations(
    lease: Any, out: Any, namespace: str, key: str, select: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Where ``get`` copies each buffer its read ``lease`` of ``namespace/key`` holds, and
    what it returns: ``(targets, returned)``, by buffer name in the lease's order. A target
    is the flat uint8 view of ``out[name]`` (returned as ``out[name]`` itself), or a fresh
    array (returned as it is) where ``out`` is None or names none. Everything ``out`` is
    asked happens here, before any byte is copied: a name in ``out`` that the claim does not
    return, a destination of the wrong kind or size, two destinations sharing memory, or an
    ``out`` that answers none of it raise (BadRequest for the first three) and lose nothing."""
    np = _np()
    if out is None:
        targets = {name: np.empty(lease[name].nbytes, dtype=np.uint8) for name in lease}
        return targets, targets
    # (set(out): any Mapping's names, whatever its keys() returns)
    unknown = set(out) - lease.keys() if out else None
    if unknown:
        from ..errors import BadRequest

        raise BadRequest(
            f"get: out names buffer(s) {sorted(unknown)} that this claim of "
            f"{namespace}/{key} does not return (it has {sorted(lease)}"
            f"{'' if select is None else f', select={select!r}'})"
        )
    targets, returned, named = {}, {}, []
    for name in lease:
        nbytes = lease[name].nbytes
        given = out.get(name)
        if given is None:
            targets[name] = returned[name] = np.empty(nbytes, dtype=np.uint8)
        else:
            targets[name] = destination(given, nbytes, "get: out", name)
            returned[name] = out[name]
            named.append(name)
    if len(named) > 1:  # (the fresh arrays share nothing)
        refuse_overlaps({name: targets[name] for name in named}, "get")
    return targets, returned


def _has_buffer(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def copy_into(dst, src: Any) -> None:
    """Copy ``src`` into the uint8 view ``dst`` with one pass over memory, bit for bit."""
    np = _np()
    flat = flat_bytes(src)
    if flat is not None:
        if flat.nbytes:
            from .engine import default_engine

            default_engine().copy(dst, flat)
        return
    if _torch_tensor(src):  # strided, or on a GPU: torch walks the strides / runs the DMA
        torch = sys.modules["torch"]
        if src.numel():
            target = torch.from_numpy(dst).view(src.dtype).view(src.shape)
            target.copy_(src.detach())
        return
    # a strided numpy array: let numpy walk the strides while writing, still one pass
    np.copyto(dst.view(src.dtype).reshape(src.shape), src)
