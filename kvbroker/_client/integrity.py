"""Buffer checksums on the client side: hashed while copying, checked on claim.

The checksum itself is defined once, in :mod:`kvbroker._wire.checksum` (kind 1: xxh3_64 per
1 MiB chunk, combined; kind 0, the whole-buffer xxh3_64 of older clients, is still checked).
The daemon never maps the pools, so clients compute every checksum, through the host copy
engine (:mod:`kvbroker._client.engine`: chunks over a few threads, bit for bit the
single-threaded definition):

- ``put`` copies each buffer a chunk at a time and hashes each chunk right after copying it,
  while it is still in cache: the bytes cross memory once, as without checksums.
- the kind sealed is the client's ``checksum_kind``: 1, or 0 against a daemon whose hello
  does not list kind 1 (:func:`kvbroker._wire.checksum.seal_kind`); kind 0 is one chain,
  hashed on the calling thread.
- a :class:`~kvbroker.WriteLease` the caller filled itself is hashed at ``seal``: one extra
  read of the written bytes, over the engine's threads. ``reserve(..., checksum=False)``
  skips it.
- ``claim(..., verify=True)`` re-hashes the leased buffers; ``get(..., verify=True)`` hashes
  each chunk it copies out (:func:`copy_out_checked`), so again one pass. A mismatch raises
  :class:`~kvbroker.errors.ChecksumMismatch`; corrupted bytes are never returned unflagged.
- CUDA tensors are hashed on their GPU by :mod:`kvbroker._client.gpu_checksum`, to the same
  values (:mod:`kvbroker._client.gpu_integrity`: GpuClient's publish and claim).

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
    "digest_here",
    "empty_digest",
    "matches",
    "copy_hashed",
    "copy_out_checked",
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


def digest(view: Any, kind: int = _cs.KIND_XXH3C) -> Any:
    """The checksum of ``kind`` to record for the bytes of ``view`` (a contiguous buffer), in
    its wire form: ``[1, value]`` hashed over the engine's threads (small bytes-like objects
    on this one, without importing numpy: the CLI's fast paths stay light), or for kind 0 (a
    daemon that accepts nothing else, :func:`kvbroker._wire.checksum.seal_kind`) the bare
    whole-buffer xxh3_64, on this thread."""
    small = isinstance(view, (bytes, bytearray, memoryview)) and memoryview(view).nbytes < 2 * CHUNK
    if kind == _cs.KIND_XXH3:
        return _cs.legacy_digest(view if small else _u8(view))
    if small:
        return _cs.encode(_cs.digest(view))
    return _cs.encode(default_engine().hash(_u8(view)))


def digest_here(view: Any, kind: int = _cs.KIND_XXH3C) -> Any:
    """:func:`digest` on the calling thread (for a job of the engine's
    :meth:`~kvbroker._client.engine.CopyEngine.run_jobs` hashing what it just wrote)."""
    if kind == _cs.KIND_XXH3:
        return _cs.legacy_digest(_u8(view))
    return _cs.encode(default_engine().hash_here(_u8(view)))


_EMPTY = {kind: digest(b"", kind) for kind in _cs.KINDS}


def empty_digest(kind: int = _cs.KIND_XXH3C) -> Any:
    """The checksum of ``kind`` of a buffer of 0 bytes, in its wire form."""
    return _EMPTY[kind]


def matches(view: Any, recorded: Any) -> bool:
    """Whether the bytes of ``view`` hash to ``recorded`` (wire form, either kind)."""
    kind, value = _cs.parse(recorded)
    if kind == _cs.KIND_XXH3:
        return _cs.legacy_digest(_u8(view)) == value
    return default_engine().hash(_u8(view)) == value


def _copy_legacy(dst, src) -> int:
    """Copy the uint8 view ``src`` into ``dst`` a chunk at a time, hashing the copied bytes
    as one whole-buffer xxh3_64 chain (kind 0: on this thread, still one pass)."""
    import numpy as np

    h = xxhash.xxh3_64()
    for at in range(0, src.nbytes, CHUNK):
        piece = dst[at : at + CHUNK]
        np.copyto(piece, src[at : at + CHUNK])
        h.update(piece)
    return h.intdigest()


def copy_hashed(dst, src: Any, copy_into, kind: int = _cs.KIND_XXH3C) -> Any:
    """Copy ``src`` into the uint8 view ``dst``; return the checksum of ``kind`` (wire form)
    of the bytes copied, hashed in ``dst`` (in ``src`` for a copy big enough to store
    non-temporally, :func:`kvbroker._client.engine.stream_min`: a source that changes during
    the copy then gives a checksum its stored bytes fail, which a later verify reports).

    Contiguous sources are copied and hashed a chunk at a time (kind 1 by the engine's
    threads, kind 0 on this one); other sources (strided, on a GPU) are copied by
    ``copy_into`` in one go, then hashed.
    """
    flat = flat_bytes(src)
    if kind == _cs.KIND_XXH3:
        if flat is None:
            copy_into(dst, src)
            return _cs.legacy_digest(dst)
        return _copy_legacy(dst, flat)
    engine = default_engine()
    if flat is None:
        copy_into(dst, src)
        return _cs.encode(engine.hash(dst))
    return _cs.encode(engine.copy_hashed(dst, flat))


def copy_out_checked(dst, src, recorded: Any) -> bool:
    """Copy the uint8 view ``src`` (a leased buffer) into the uint8 array ``dst`` a chunk at
    a time, hashing each copied chunk while it is in cache (kind 1 over the engine's threads,
    kind 0 as one chain on this thread), and say whether the bytes copied match ``recorded``
    (wire form, either kind; for a copy that stores non-temporally, the bytes read from
    ``src``, the same under the read lease): one pass for either."""
    kind, want = _cs.parse(recorded)
    if kind == _cs.KIND_XXH3C:
        return default_engine().copy_hashed(dst, src) == want
    return _copy_legacy(dst, src) == want


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
        return {
            "namespace": self.namespace,
            "key": self.key,
            "nbytes": self.nbytes,
            "buffers": self.buffers,
            "status": self.status,
            "bad": list(self.bad),
        }


def verify_objects(
    client, *, match: str | None = None, namespace: str | None = None
) -> Iterator[ObjectCheck]:
    """Claim every sealed object (or those selected), re-hash its buffers, release it.

    Each object is read under a read lease, so its bytes cannot be reused while they are
    hashed. Claiming refreshes the object's place in the LRU order, as any reader would.
    Either kind of checksum is checked (:func:`matches`).
    """
    # The pools' objects (a claim of one on disk only would promote it, and checks its
    # digest on the way in: the disk tier verifies its own reads).
    for info in client.list(match, namespace=namespace, tier="dram"):
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
