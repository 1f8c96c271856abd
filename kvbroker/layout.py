"""Layout descriptors: where every element of a KV cache lives, as msgpack-able data.

A :class:`Layout` is a meta-tensor in the spirit of vLLM's NIXL ``CacheLayout`` (see
``docs/design.md``): a dtype name, a shape and strides in *elements*, a storage offset in
elements, one name per axis, the axes a transfer walks (``iterated``, outer to inner) and the
axis tensor parallelism shards (``sharded``, normally ``head``). The axes that are not
iterated form the *leaf*: each leaf is one contiguous run of bytes, so they must be
C-contiguous among themselves. That is checked at construction and therefore after every
:meth:`narrow`, :meth:`select` and :meth:`sub_block`, which all return new layouts.

It describes an engine's paged cache, e.g. per layer

- blocks-first NHD ``[block, kv, token, head, head_dim]`` (FlashInfer),
- K/V-first HND ``[kv, block, head, token, head_dim]``,
- an MLA latent cache ``[block, token, head_dim]`` (no ``head`` axis, nothing sharded),

and the broker's storage of a published shard, ``[layer][kv][head][token][head_dim]``
(:func:`shard_storage`): heads outermost within one (layer, kv), so any head range is one
contiguous run per (layer, kv).

A layout owns no memory. :meth:`descriptors` turns it into (byte offset, length) runs relative
to a base address the caller supplies; the caller owns that memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import BadRequest, LayoutMismatch

__all__ = ["Layout", "check_compatible", "dtype_name", "itemsize_of", "shard_storage"]

_ITEMSIZE = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}

# What a mismatch on an axis is called in an error message.
_FIELD_NAMES = {
    "layer": "layers",
    "kv": "K/V components",
    "block": "blocks",
    "token": "block size",
    "head": "KV heads",
    "head_dim": "head_dim",
}


def itemsize_of(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        raise BadRequest(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_ITEMSIZE))}")
    return size


def dtype_name(array: Any) -> str:
    """The dtype of a torch tensor or numpy array as a plain name (``bfloat16``, ``float16``)."""
    name = str(array.dtype)
    return name[len("torch.") :] if name.startswith("torch.") else name


def _is_torch(obj: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # never imported here: a tensor implies torch is loaded
    return torch is not None and isinstance(obj, torch.Tensor)


@dataclass(frozen=True)
class Layout:
    """Shape, strides (elements), offset (elements), named axes, iterated and sharded axes."""

    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    axes: tuple[str, ...]
    iterated: tuple[str, ...] = ()
    sharded: str | None = None
    offset: int = 0
    itemsize: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("shape", "strides", "axes", "iterated"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "itemsize", itemsize_of(self.dtype))
        if not len(self.shape) == len(self.strides) == len(self.axes):
            raise BadRequest(
                f"layout: shape {self.shape}, strides {self.strides} and axes {self.axes} "
                "must have the same length"
            )
        if len(set(self.axes)) != len(self.axes):
            raise BadRequest(f"layout: axis names must be unique, got {self.axes}")
        if any(n < 0 for n in self.shape) or self.offset < 0:
            raise BadRequest(f"layout: negative size or offset in {self}")
        for name in self.iterated:
            if name not in self.axes:
                raise BadRequest(f"layout: iterated axis {name!r} is not one of {self.axes}")
        if len(set(self.iterated)) != len(self.iterated):
            raise BadRequest(f"layout: iterated axes repeat: {self.iterated}")
        if self.sharded is not None and self.sharded not in self.axes:
            raise BadRequest(f"layout: sharded axis {self.sharded!r} is not one of {self.axes}")
        self._check_leaf_contiguous()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def contiguous(
        cls,
        dtype: str,
        shape: Sequence[int],
        axes: Sequence[str],
        iterated: Sequence[str] = (),
        sharded: str | None = None,
        offset: int = 0,
    ) -> Layout:
        """The C-contiguous layout of ``shape``."""
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        return cls(
            dtype,
            tuple(shape),
            tuple(reversed(strides)),
            tuple(axes),
            tuple(iterated),
            sharded,
            offset,
        )

    @classmethod
    def from_tensor(
        cls,
        array: Any,
        axes: Sequence[str],
        iterated: Sequence[str] | None = None,
        sharded: str | None = "head",
    ) -> Layout:
        """The layout of a torch tensor or numpy array, offsets relative to its data pointer.

        ``iterated`` defaults to every axis but the last; ``sharded`` is dropped when the
        tensor has no such axis (a latent cache has no ``head``).
        """
        axes = tuple(axes)
        if len(axes) != array.ndim:
            raise BadRequest(f"layout: {array.ndim}-d array but {len(axes)} axis names {axes}")
        if _is_torch(array):
            strides = tuple(array.stride())
        else:
            itemsize = array.dtype.itemsize
            if any(s % itemsize for s in array.strides):
                raise BadRequest("layout: array strides are not a multiple of its itemsize")
            strides = tuple(s // itemsize for s in array.strides)
        if any(s < 0 for s in strides):
            raise BadRequest("layout: negative strides are not supported")
        return cls(
            dtype_name(array),
            tuple(array.shape),
            strides,
            axes,
            tuple(axes[:-1] if iterated is None else iterated),
            sharded if sharded in axes else None,
            0,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "axes": list(self.axes),
            "iterated": list(self.iterated),
            "sharded": self.sharded,
            "offset": self.offset,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        try:
            return cls(
                d["dtype"],
                tuple(d["shape"]),
                tuple(d["strides"]),
                tuple(d["axes"]),
                tuple(d.get("iterated", ())),
                d.get("sharded"),
                d.get("offset", 0),
            )
        except (KeyError, TypeError) as exc:
            raise BadRequest(f"layout: malformed layout dict {d!r}: {exc}") from None

    # -- queries ------------------------------------------------------------------------------
    def axis(self, name: str) -> int:
        try:
            return self.axes.index(name)
        except ValueError:
            raise BadRequest(f"layout has no axis {name!r}; its axes are {self.axes}") from None

    def size(self, name: str) -> int:
        return self.shape[self.axis(name)]

    def stride(self, name: str) -> int:
        return self.strides[self.axis(name)]

    @property
    def leaf_axes(self) -> tuple[str, ...]:
        """The axes inside one contiguous run, outer to inner."""
        return tuple(a for a in self.axes if a not in self.iterated)

    @property
    def leaf_nbytes(self) -> int:
        return math.prod(self.size(a) for a in self.leaf_axes) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    # -- transformations ----------------------------------------------------------------------
    def narrow(self, axis: str, start: int, length: int) -> Layout:
        """Keep ``[start, start + length)`` of ``axis``: start × stride moves into the offset."""
        i = self.axis(axis)
        if start < 0 or length < 0 or start + length > self.shape[i]:
            raise BadRequest(
                f"layout: narrow({axis!r}, {start}, {length}) is outside its size {self.shape[i]}"
            )
        shape = list(self.shape)
        shape[i] = length
        return replace(self, shape=tuple(shape), offset=self.offset + start * self.strides[i])

    def select(self, axis: str, index: int) -> Layout:
        """Fix ``axis`` at ``index`` and drop it (its offset moves into the storage offset)."""
        i = self.axis(axis)
        if not 0 <= index < self.shape[i]:
            raise BadRequest(f"layout: select({axis!r}, {index}) outside size {self.shape[i]}")
        return Layout(
            self.dtype,
            self.shape[:i] + self.shape[i + 1 :],
            self.strides[:i] + self.strides[i + 1 :],
            self.axes[:i] + self.axes[i + 1 :],
            tuple(a for a in self.iterated if a != axis),
            None if self.sharded == axis else self.sharded,
            self.offset + index * self.strides[i],
        )

    def sub_block(self, r: int, block: str = "block", token: str = "token") -> Layout:
        """Re-tile each page of ``token`` slots into ``r`` sub-pages.

        The token axis of size S becomes a ``sub_block`` axis of size r (stride S/r × token
        stride) right after ``block``, and a token axis of size S/r. ``sub_block`` is iterated
        right after ``block`` when ``block`` is iterated.
        """
        slots = self.size(token)
        if r < 1 or slots % r:
            raise BadRequest(f"layout: sub_block({r}) must divide the block size {slots}")
        if "sub_block" in self.axes:
            raise BadRequest("layout: already sub-blocked")
        ti, bi = self.axis(token), self.axis(block)
        shape, strides, axes = list(self.shape), list(self.strides), list(self.axes)
        shape[ti] = slots // r
        shape.insert(bi + 1, r)
        strides.insert(bi + 1, strides[ti] * (slots // r))
        axes.insert(bi + 1, "sub_block")
        iterated = list(self.iterated)
        if block in iterated:
            iterated.insert(iterated.index(block) + 1, "sub_block")
        return Layout(
            self.dtype,
            tuple(shape),
            tuple(strides),
            tuple(axes),
            tuple(iterated),
            self.sharded,
            self.offset,
        )

    # -- transfer descriptors -----------------------------------------------------------------
    def descriptors(self, base: int = 0) -> list[tuple[int, int]]:
        """Contiguous ``(byte address, nbytes)`` runs in iteration order, adjacent ones merged.

        One run per combination of iterated indices before coalescing; ``base`` is the byte
        address of element 0 of the underlying storage.
        """
        import numpy as np

        if 0 in self.shape:
            return []
        starts = np.array([self.offset], dtype=np.int64)
        for name in self.iterated:  # outer -> inner: the last one varies fastest
            steps = np.arange(self.size(name), dtype=np.int64) * self.stride(name)
            starts = (starts[:, None] + steps[None, :]).reshape(-1)
        starts = base + starts * self.itemsize
        leaf = self.leaf_nbytes
        # A run continues while the next leaf starts exactly where this one ends.
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + leaf) + 1
        firsts = np.concatenate(([0], breaks))
        lasts = np.concatenate((breaks, [len(starts)]))
        return [(int(starts[a]), int(b - a) * leaf) for a, b in zip(firsts, lasts, strict=True)]

    def _check_leaf_contiguous(self) -> None:
        expected = 1
        for name in reversed(self.leaf_axes):
            i = self.axes.index(name)
            if self.shape[i] != 1 and self.strides[i] != expected:
                raise BadRequest(
                    f"layout: the non-iterated axes {self.leaf_axes} must be C-contiguous, but "
                    f"axis {name!r} has stride {self.strides[i]} where {expected} is needed; "
                    f"iterate over {name!r} (or an axis inside it) instead"
                )
            expected *= self.shape[i]


def shard_storage(
    dtype: str, num_layers: int, components: int, heads: int, tokens: int, head_dim: int
) -> Layout:
    """The broker's layout of one published shard: ``[layer][kv][head][token][head_dim]``.

    Iterating ``layer, kv, head`` with ``[token][head_dim]`` leaves, any head range of one
    (layer, kv) coalesces into one run.
    """
    return Layout.contiguous(
        dtype,
        (num_layers, components, heads, tokens, head_dim),
        ("layer", "kv", "head", "token", "head_dim"),
        iterated=("layer", "kv", "head"),
        sharded="head",
    )


def check_compatible(
    published: Layout, local: Layout, axes: Iterable[str] = ("head_dim",), *, what: str = ""
) -> None:
    """Raise LayoutMismatch naming the first field that differs: dtype, then each axis size.

    An axis only one side has is a mismatch too (e.g. a latent cache against a per-head one).
    """
    where = f" ({what})" if what else ""
    if published.dtype != local.dtype:
        raise LayoutMismatch(
            f"layout mismatch on dtype{where}: published {published.dtype}, local {local.dtype}"
        )
    for name in axes:
        label = _FIELD_NAMES.get(name, name)
        mine, theirs = name in local.axes, name in published.axes
        if mine != theirs:
            raise LayoutMismatch(
                f"layout mismatch on {label}{where}: axis {name!r} is "
                f"{'only local' if mine else 'only published'} (published axes "
                f"{published.axes}, local axes {local.axes})"
            )
        if mine and published.size(name) != local.size(name):
            raise LayoutMismatch(
                f"layout mismatch on {label}{where}: published {published.size(name)}, "
                f"local {local.size(name)}"
            )
