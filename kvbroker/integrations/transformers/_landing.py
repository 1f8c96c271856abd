"""Cache layers whose tensors are still landing: a read waits for the layer's own copies.

:func:`claim_cache` on a CUDA device through a GpuClient returns before the copies are done
(:meth:`kvbroker.gpu.GpuClient.land`), so the first decode step runs while they land. Each
layer of the rebuilt ``DynamicCache`` is switched to a subclass of its own type whose
``keys`` and ``values`` make the reader's current CUDA stream wait for that layer's event
before handing the tensor out: the attention of layer 0 starts when layer 0 has landed,
while layer 31 is still on its way, and no kernel can read a byte before it is there. The
wait is queued on the GPU; the CPU goes on launching. Once the claim has landed, the next
read turns the layer back into its own type (:func:`settle` does it at once, waiting on the
CPU; a copy, a pickle and a publish settle first), so nothing of this stays.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["LateLanding", "guard_layers", "settle"]

_classes: dict[type, type] = {}  # layer type -> its landing subclass
_bases: dict[type, type] = {}  # landing subclass -> the layer type
# One restore at a time: a settle on one thread and a read on another may both find the claim
# landed (the decode thread reads while a publish of the same cache settles it).
_restoring = threading.Lock()


class LateLanding:
    """The landing a cache is guarded with before its copies are queued (the guard cannot
    fail after the lease has passed to the copies); ``landing`` is set right after. Until
    then the cache is not handed out, so nothing reads it."""

    landing: Any = None

    @property
    def landed(self) -> bool:
        return self.landing.landed

    @property
    def done(self) -> Any:
        return self.landing.done

    def wait_for(self, group: int, stream: Any = None, *, device: Any = None) -> None:
        self.landing.wait_for(group, stream, device=device)


def _guarded(name: str) -> property:
    """The layer's ``name`` tensor, read after its reader's stream waits for the copies. The
    tensor is read before the wait: a restore on another thread moves it from ``_kvb_NAME``
    to ``NAME`` (in that order, so one of them always holds it)."""
    hidden = f"_kvb_{name}"

    def read(self: Any) -> Any:
        state = self.__dict__
        t = state.get(hidden, state.get(name))
        self._kvb_await(t)
        return t

    def write(self: Any, value: Any) -> None:
        self.__dict__[hidden] = value

    return property(read, write)


class _LandingLayer:
    """What the subclass of a transformers cache layer type adds (see the module doc). Its
    members are copied into that subclass, whose only base is the layer type: ``__class__``
    can only change between types of one layout, and a second base would change it."""

    def _kvb_await(self, tensor: Any) -> None:
        pending = self.__dict__.get("_kvb_pending")
        if pending is None:
            return  # restored meanwhile (another thread)
        landing, group = pending
        if landing.landed:
            _restore(self)
        elif tensor is not None:
            landing.wait_for(group, device=tensor.device)

    keys = _guarded("keys")
    values = _guarded("values")

    def __reduce_ex__(self, protocol: int) -> Any:
        # copy.deepcopy / pickle / torch.save: the copies land first (the CPU waits), then
        # the layer is reduced as its own type
        settle(self)
        _restore(self)  # (already done by settle, or by another thread)
        return self.__reduce_ex__(protocol)


def _landing_class(kind: type) -> type:
    cls = _classes.get(kind)
    if cls is None:
        members = {
            k: v
            for k, v in vars(_LandingLayer).items()
            if k not in ("__dict__", "__weakref__", "__doc__")
        }
        members.update(__module__=__name__, __qualname__=kind.__qualname__)
        cls = _classes[kind] = type(kind.__name__, (kind,), members)
        _bases[cls] = kind
    return cls


def _is_landing(layer: Any) -> bool:
    return type(layer) in _bases


def _restore(layer: Any) -> None:
    """``layer`` back to its own type, its tensors as plain attributes; once."""
    with _restoring:
        if not _is_landing(layer):
            return
        state = layer.__dict__
        # plain attributes first (the properties hide them until the type changes), then the
        # type, then the landing's own: a reader on another thread finds the tensors throughout
        state["keys"], state["values"] = state.get("_kvb_keys"), state.get("_kvb_values")
        layer.__class__ = _bases[type(layer)]
        for name in ("_kvb_keys", "_kvb_values", "_kvb_pending"):
            state.pop(name, None)


def guard_layers(cache: Any, landing: Any) -> None:
    """Make layer ``i`` of ``cache`` wait for group ``i`` of ``landing`` before any read."""
    for i, layer in enumerate(cache.layers):
        state = layer.__dict__
        state["_kvb_pending"] = (landing, i)  # before the type: a landing layer always has it
        if not _is_landing(layer):
            state["_kvb_keys"], state["_kvb_values"] = state.get("keys"), state.get("values")
            layer.__class__ = _landing_class(type(layer))
            state.pop("keys", None)
            state.pop("values", None)


def settle(layer: Any) -> None:
    """Wait on the CPU until ``layer``'s copies are done and turn it back into its own type;
    nothing for a layer that is not landing."""
    pending = layer.__dict__.get("_kvb_pending") if _is_landing(layer) else None
    if pending is not None:
        pending[0].done.synchronize()
        _restore(layer)
