"""The checksum of a buffer, as clients compute it and the daemon records it.

The checksum of a buffer is xxh3_64 of its bytes (an unsigned 64-bit integer on the wire),
hashed over chunks of :data:`CHUNK` bytes by clients while they copy
(:mod:`kvbroker._client.integrity`); the daemon never maps the pools, it only checks that a
seal names one digest per buffer (:func:`validate`) and keeps them with the object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import xxhash

__all__ = ["CHUNK", "digest", "validate"]

# Big enough that the per-call overhead vanishes, small enough that source and destination
# chunks stay in L2 between the copy and the hash (measured on a 1 MiB-L2 core: 256 KiB
# chunks hash for free, 1 MiB chunks cost ~12%; see benchmarks/bench_integrity.py).
CHUNK = 256 * 1024

_MAX_U64 = (1 << 64) - 1


def digest(view: Any) -> int:
    """xxh3_64 of a C-contiguous buffer (numpy uint8 view, bytes, memoryview)."""
    return xxhash.xxh3_64_intdigest(view)


def validate(checksums: Any, buffers: Mapping[str, Any]) -> dict[str, int]:
    """The daemon's check of a seal's ``{buffer: digest}``: one unsigned 64-bit digest for
    every buffer of the object, nothing else. Raises ValueError saying what is wrong."""
    if not isinstance(checksums, dict):
        raise ValueError("checksums must be a map {buffer name: digest}")
    if checksums.keys() != buffers.keys():
        missing = sorted(set(buffers) - set(checksums))[:3]
        extra = sorted(set(checksums) - set(buffers), key=str)[:3]
        raise ValueError(
            "checksums must name every buffer of the object and nothing else"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else "")
        )
    for name, value in checksums.items():
        if value.__class__ is not int or not 0 <= value <= _MAX_U64:
            raise ValueError(f"checksum of {name!r} must be an unsigned 64-bit integer")
    return checksums
