"""Buffer checksums on the client side: hashed while copying, checked on claim.

The checksum itself is defined once, in :mod:`kvbroker._wire.checksum` (kind 1: xxh3_64 per
1 MiB chunk, combined; kind 0, the whole-buffer xxh3_64 of older clients, is still checked).
The daemon never maps the pools, so clients compute every checksum, through the host copy
engine (:mod:`kvbroker._client.engine`: chunks over a few threads, bit for bit the
single-threaded definition):

- ``put`` copies each buffer a chunk at a time and hashes each chunk right after copying it,
  while it is still in cache: the bytes cross memory once, as without checksums.
- a :class:`~kvbroker.WriteLease` the caller filled itself is hashed at ``seal``: one extra
  read of the written bytes, over the engine's threads. ``reserve(..., checksum=False)``
  skips it.
- ``claim(..., verify=True)`` re-hashes the leased buffers; ``get(..., verify=True)`` hashes
  each chunk it copies out, so again one pass. A mismatch raises
  :class:`~kvbroker.errors.ChecksumMismatch`; corrupted bytes are never returned.
- CUDA tensors are hashed on their GPU by :mod:`kvbroker._client.gpu_checksum`, to the same
  values.

This module owns no state; every function borrows the views it is given.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .._wire import checksum as _cs
from .._wire.checksum import CHUNK
from ..errors import ChecksumMismatch, NotFound
from .copy import flat_bytes
from .engine import default_engine

__all__ = [
    "CHUNK",
    "digest",
    "matches",
    "copy_hashed",
    "copy_out_hashed",
    "copy_out_checked",
    "Computed",
    "mismatched",
    "check",
    "ObjectCheck",
    "verify_objects",
]


def _u8(view: Any):
    flat = flat_bytes(view)
    if flat is None:
        raise ValueError("checksum of a buffer that is not one contiguous run of bytes")
    return flat


def digest(view: Any) -> list[int]:
    """The checksum to record for the bytes of ``view`` (a contiguous buffer), in its wire
    form: ``[1, value]``, hashed over the engine's threads (small bytes-like objects on this
    one, without importing numpy: the CLI's fast paths stay light)."""
    if isinstance(view, (bytes, bytearray, memoryview)) and memoryview(view).nbytes < 2 * _cs.CHUNK:
        return _cs.encode(_cs.digest(view))
    return _cs.encode(default_engine().hash(_u8(view)))


def matches(view: Any, recorded: Any) -> bool:
    """Whether the bytes of ``view`` hash to ``recorded`` (wire form, either kind)."""
    kind, value = _cs.parse(recorded)
    if kind == _cs.KIND_XXH3:
        return _cs.legacy_digest(_u8(view)) == value
    return default_engine().hash(_u8(view)) == value


def copy_hashed(dst, src: Any, copy_into) -> list[int]:
    """Copy ``src`` into the uint8 view ``dst``; return the checksum (wire form) of the bytes
    copied, hashed in ``dst``.

    Contiguous sources are copied and hashed a chunk at a time by the engine's threads; other
    sources (strided, on a GPU) are copied by ``copy_into`` in one go, then hashed.
    """
    flat = flat_bytes(src)
    engine = default_engine()
    if flat is None:
        copy_into(dst, src)
        return _cs.encode(engine.hash(dst))
    return _cs.encode(engine.copy_hashed(dst, flat))


class Computed:
    """The checksum of bytes just copied out, compared with ``==``/``!=`` against a recorded
    checksum of either kind (a kind-0 one is recomputed over the copied bytes: one more read,
    for objects sealed by older clients only)."""

    __slots__ = ("value", "_view")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: int, view) -> None:
        self.value = value
        self._view = view

    def matches(self, recorded: Any) -> bool:
        kind, want = _cs.parse(recorded)
        if kind == _cs.KIND_XXH3:
            return _cs.legacy_digest(self._view) == want
        return self.value == want

    def __eq__(self, other: Any) -> bool:
        return self.matches(other)

    def __ne__(self, other: Any) -> bool:
        return not self.matches(other)

    def __repr__(self) -> str:
        return f"Computed({_cs.encode(self.value)!r})"


def copy_out_hashed(dst, src) -> Computed:
    """Copy the uint8 view ``src`` (a leased buffer) into the uint8 array ``dst`` a chunk at a
    time over the engine's threads, hashing each copied chunk while it is in cache; returns
    the checksum, to compare with the one recorded (``!=``)."""
    return Computed(default_engine().copy_hashed(dst, src), dst)


def copy_out_checked(dst, src, recorded: Any) -> bool:
    """Copy ``src`` into ``dst`` as :func:`copy_out_hashed` does and say whether the bytes
    copied match ``recorded`` (wire form, either kind); still one pass for either."""
    kind, want = _cs.parse(recorded)
    if kind == _cs.KIND_XXH3C:
        return default_engine().copy_hashed(dst, src) == want
    import numpy as np

    h = xxhash.xxh3_64()  # kind 0: one chain over the whole buffer, on this thread
    for at in range(0, src.nbytes, CHUNK):
        piece = dst[at : at + CHUNK]
        np.copyto(piece, src[at : at + CHUNK])
        h.update(piece)
    return h.intdigest() == want


def mismatched(views: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Names of the buffers whose bytes do not match their checksum in ``expected`` (wire
    form, either kind; buffers with no recorded checksum are not checked)."""
    bad = []
    for name, view in views.items():
        want = expected.get(name)
        if want is not None and not matches(view, want):
            bad.append(name)
    return bad


def check(namespace: str, key: str, bad: list[str]) -> None:
    """Raise :class:`ChecksumMismatch` naming ``bad`` buffers of ``namespace/key``, if any."""
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise ChecksumMismatch(
            f"{namespace}/{key}: {len(bad)} buffer(s) do not match the checksum recorded at "
            f"seal: {shown}",
            buffers=tuple(bad),
        )


@dataclass(frozen=True)
class ObjectCheck:
    """The outcome of verifying one object: ``status`` is ``ok``, ``mismatch``,
    ``unchecked`` (sealed without checksums) or ``gone`` (freed before it could be read)."""

    namespace: str
    key: str
    nbytes: int
    buffers: int
    status: str
    bad: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "key": self.key, "nbytes": self.nbytes,
                "buffers": self.buffers, "status": self.status, "bad": list(self.bad)}  # fmt: skip


def verify_objects(
    client, *, match: str | None = None, namespace: str | None = None
) -> Iterator[ObjectCheck]:
    """Claim every sealed object (or those selected), re-hash its buffers, release it.

    Each object is read under a read lease, so its bytes cannot be reused while they are
    hashed. Claiming refreshes the object's place in the LRU order, as any reader would.
    Either kind of checksum is checked (:func:`matches`).
    """
    for info in client.list(match, namespace=namespace):
        try:
            lease = client.claim(info.key, namespace=info.namespace)
        except NotFound:
            yield ObjectCheck(info.namespace, info.key, info.nbytes, info.buffers, "gone")
            continue
        with lease:
            if not lease.checksums:
                status, bad = "unchecked", []
            else:
                bad = mismatched({n: lease[n] for n in lease}, lease.checksums)
                status = "mismatch" if bad else "ok"
        yield ObjectCheck(info.namespace, info.key, lease.nbytes, len(lease), status, tuple(bad))
