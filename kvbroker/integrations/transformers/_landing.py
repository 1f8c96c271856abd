"""Cache layers whose tensors are still landing: a read waits for the layer's own copies.

:func:`claim_cache` on a CUDA device through a GpuClient returns before the copies are done
(:meth:`kvbroker.gpu.GpuClient.land`), so the first decode step runs while they land. Each
layer of the rebuilt ``DynamicCache`` is switched to a subclass of its own type whose
``keys`` and ``values`` make the reader's current CUDA stream wait for that layer's event
before handing the tensor out: the attention of layer 0 starts when layer 0 has landed,
while layer 31 is still on its way, and no kernel can read a byte before it is there. The
wait is queued on the GPU; the CPU goes on launching. Once the claim has landed, the first
read turns the layer back into its own type (:func:`settle` does it at once, waiting on the
CPU), so nothing of this stays: it pickles, publishes and compares like any layer.
"""

from __future__ import annotations

from typing import Any

__all__ = ["guard_layers", "settle"]

_classes: dict[type, type] = {}


class _LandingLayer:
    """What the subclass of a transformers cache layer type adds (see the module doc). Its
    members are copied into that subclass, whose only base is the layer type: ``__class__``
    can only change between types of one layout, and a second base would change it."""

    # (Landing, group) until the layer's copies are known to be done
    _kvb_pending: tuple[Any, int] | None = None

    def _kvb_await(self, tensor: Any) -> None:
        landing, group = self.__dict__["_kvb_pending"]
        if landing.landed:
            _restore(self)
        elif tensor is not None:
            landing.wait_for(group, device=tensor.device)

    @property
    def keys(self) -> Any:
        t = self.__dict__.get("_kvb_keys")
        self._kvb_await(t)
        return t

    @keys.setter
    def keys(self, value: Any) -> None:
        self._kvb_keys = value

    @property
    def values(self) -> Any:
        t = self.__dict__.get("_kvb_values")
        self._kvb_await(t)
        return t

    @values.setter
    def values(self, value: Any) -> None:
        self._kvb_values = value

    def __reduce_ex__(self, protocol: int) -> Any:
        # copy.deepcopy / pickle / torch.save: the copies land first (the CPU waits), then
        # the layer is reduced as its own type
        settle(self)
        return self.__reduce_ex__(protocol)


def _landing_class(kind: type) -> type:
    cls = _classes.get(kind)
    if cls is None:
        members = {k: v for k, v in vars(_LandingLayer).items()
                   if k not in ("__dict__", "__weakref__", "__doc__")}  # fmt: skip
        members.update(__module__=__name__, __qualname__=kind.__qualname__)
        cls = _classes[kind] = type(kind.__name__, (kind,), members)
    return cls


def _is_landing(layer: Any) -> bool:
    return type(layer) in _classes.values()


def _restore(layer: Any) -> None:
    """``layer`` back to its own type, its tensors as plain attributes."""
    state = layer.__dict__
    keys, values = state.pop("_kvb_keys", None), state.pop("_kvb_values", None)
    state.pop("_kvb_pending", None)
    layer.__class__ = type(layer).__bases__[0]
    layer.keys, layer.values = keys, values


def guard_layers(cache: Any, landing: Any) -> None:
    """Make layer ``i`` of ``cache`` wait for group ``i`` of ``landing`` before any read."""
    for i, layer in enumerate(cache.layers):
        if not _is_landing(layer):
            keys, values = layer.__dict__.pop("keys"), layer.__dict__.pop("values")
            layer.__class__ = _landing_class(type(layer))
            layer.keys, layer.values = keys, values
        layer._kvb_pending = (landing, i)


def settle(layer: Any) -> None:
    """Wait on the CPU until ``layer``'s copies are done and turn it back into its own type;
    nothing for a layer that is not landing."""
    if _is_landing(layer):
        layer.__dict__["_kvb_pending"][0].done.synchronize()
        _restore(layer)
