"""The checksum of a buffer, as clients compute it and the daemon records it.

Defined once, here; computed by clients only (the daemon never maps the pools: it checks that a
seal names one well-formed checksum per buffer, :func:`validate`, and keeps them with the
object). Two kinds exist on the wire:

``xxh3c`` (kind 1, what every client seals with today), wire form ``[1, value]``
    The buffer is cut into chunks of :data:`CHUNK` (1 MiB) bytes from its first byte, the
    last chunk holding the rest (a buffer of 0 bytes has no chunk). Each chunk is hashed with
    xxh3_64 (seed 0, the default secret), and ::

        value = xxh3_64(le64(nbytes) || le64(d_0) || le64(d_1) || ... || le64(d_{k-1}))

    where ``d_i`` is the xxh3_64 of chunk ``i`` and ``le64`` the 8-byte little-endian
    encoding. :func:`digest` is the reference implementation, on one thread.

``xxh3`` (kind 0, legacy), wire form: a bare unsigned 64-bit integer
    xxh3_64 of the whole buffer: what clients sealed with before kind 1. Objects sealed that
    way (still in a pool, or brought back by a warm restart's journal) verify as before:
    :func:`matches` recomputes whichever kind was recorded.

Why this design
---------------
- **Parallel on both sides.** Whole-buffer xxh3 is a chain: each 1 KiB block's
  accumulators are scrambled before the next block is added, so one buffer is hashed by one
  core (7 GB/s for a 2 GiB GPU publish against a 55 GB/s DMA). Independent chunks are hashed
  by as many CPU threads (:mod:`kvbroker._client.engine`) or GPU programs
  (:mod:`kvbroker._client.gpu_checksum`) as there are, and the combining hash reads 8 bytes
  per MiB.
- **xxh3_64 per chunk, not a new hash.** On the CPU, python-xxhash >= 4.1 picks the
  widest SIMD path the CPU has at run time (AVX2, AVX-512): 28.6 us per MiB in cache on an
  H100 host's Xeon cores, where its 4.0.x wheels, built for SSE2 only, take 79 us, more than
  the copy beside it (``benchmarks/results/xxhash-ab/``; :func:`simd_dispatch`; ``kvbroker
  doctor`` warns). It releases the GIL for
  inputs of 64 KiB or more (``_GIL_MINSIZE``), so chunk hashing runs in threads beside
  numpy's copies (which release it too). On the GPU, xxh3's
  long-input loop is 32x32->64-bit multiplies and 64-bit adds over 8 independent lanes,
  additive within each 1 KiB block: a Triton program reduces 4 blocks' stripes at a time in
  registers, then scrambles (one multiply per lane per KiB). Measured on an H100: 2 GiB in
  0.73 ms, 0.97x the time of a read-only pass (an int64 sum, 0.70 ms) and half a
  device-to-device copy. A GPU-friendlier hash (NH, CRC) would need its own GIL-free CPU
  implementation at several GB/s per core, which numpy cannot give (every vector op is a
  separate pass over memory).
- **1 MiB chunks.** The size is a compromise measured on an H100 host (16 cores):
  - the host copy engine hands the GIL back and forth twice per chunk (copy, then hash);
    with 256 KiB chunks those hand-offs cap a fused copy+hash of 32 MiB at 16 GB/s
    whatever the thread count (4 threads; 9 GB/s at 8-16), with 1 MiB at 24 GB/s
    (8 threads), with 4 MiB at 31 GB/s;
  - the GPU kernel runs one program per chunk, each walking its chunk in order: 2 GiB hashed
    in 0.725 ms with 256 KiB chunks, 0.733 ms with 1 MiB, 1.11 ms with 4 MiB (too few
    programs in flight);
  - a chunk is still hashed right after its copy, mostly from L2 (1-2 MiB per core) or L3.
  Only a buffer's last chunk can be shorter; if it is 240 bytes or less, xxh3 takes its
  short-input paths, which GPU code leaves to the CPU (those bytes copied to the host).
- **A real integrity check.** A flipped bit changes its chunk's xxh3_64 (a 64-bit hash
  with full avalanche) and so the combined value; swapped or duplicated chunks change the
  order of the ``d_i``; truncation or extension changes ``nbytes`` and the chunk count.
  It is not a MAC: it catches corruption, not an adversary who can write the pool.
- **Tagged on the wire.** A bare integer stays kind 0, so daemons and journals from before
  keep their meaning; kind 1 travels as ``[1, value]``. The daemon lists the kinds it
  accepts in its hello reply (``checksum_kinds``); a client seals kind 1 where it is listed
  and falls back to kind 0 against a daemon that does not list it (older daemons refuse the
  list form), :func:`seal_kind`. Clients older than this module would report kind-1 objects
  as mismatched if asked to verify them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import xxhash

__all__ = [
    "CHUNK",
    "KIND_XXH3",
    "KIND_XXH3C",
    "KINDS",
    "SHORT_MAX",
    "chunk_count",
    "chunk_digest",
    "chunk_digests",
    "combine",
    "digest",
    "legacy_digest",
    "encode",
    "parse",
    "matches",
    "validate",
    "seal_kind",
    "simd_dispatch",
]

# Bytes per chunk of the kind-1 checksum. Part of the definition: changing it is a new kind.
CHUNK = 1024 * 1024

# xxh3_64 hashes inputs of up to this many bytes with its short-input paths (not the striped
# loop a GPU kernel implements); only a buffer's last chunk can be that short.
SHORT_MAX = 240

KIND_XXH3 = 0  # legacy: xxh3_64 of the whole buffer, a bare integer on the wire
KIND_XXH3C = 1  # xxh3_64 per CHUNK bytes, combined; [1, value] on the wire
KINDS = {KIND_XXH3: "xxh3", KIND_XXH3C: "xxh3c"}

_MAX_U64 = (1 << 64) - 1


def simd_dispatch() -> bool | None:
    """Whether the installed python-xxhash picks AVX2 / AVX-512 at run time (its build exports
    xxHash's ``XXH3_64bits_dispatch``; wheels from 4.1 on do), on x86-64; None on other
    CPUs, whose SIMD path is fixed when the wheel is built, or when its library cannot be
    opened to look."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    import ctypes

    try:
        from xxhash import _xxhash

        library = ctypes.CDLL(_xxhash.__file__)
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    return hasattr(library, "XXH3_64bits_dispatch")


def chunk_count(nbytes: int) -> int:
    """How many chunks a buffer of ``nbytes`` bytes has (0 for an empty buffer)."""
    return -(-nbytes // CHUNK)


def chunk_digest(chunk: Any) -> int:
    """xxh3_64 of one chunk (a C-contiguous buffer of at most CHUNK bytes)."""
    return xxhash.xxh3_64_intdigest(chunk)


def chunk_digests(view: Any) -> list[int]:
    """The xxh3_64 of each chunk of ``view``, in order (one thread)."""
    mv = memoryview(view).cast("B")
    return [xxhash.xxh3_64_intdigest(mv[at : at + CHUNK]) for at in range(0, mv.nbytes, CHUNK)]


def combine(nbytes: int, digests: Any) -> int:
    """The kind-1 value of a buffer of ``nbytes`` bytes from its chunk digests: a sequence of
    ints, or their little-endian uint64 bytes (a numpy ``<u8`` array, bytes)."""
    if isinstance(digests, (list, tuple)):
        if len(digests) != -(-nbytes // CHUNK):
            raise ValueError(
                f"{len(digests)} chunk digests for {nbytes} bytes; expected {chunk_count(nbytes)}"
            )
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{1 + len(digests)}Q", nbytes, *digests))
    if getattr(digests, "dtype", None) is not None and digests.dtype.byteorder == ">":
        raise ValueError("chunk digests must be little-endian")
    raw = memoryview(digests).cast("B")
    if raw.nbytes != 8 * chunk_count(nbytes):
        raise ValueError(
            f"{raw.nbytes // 8} chunk digests for {nbytes} bytes; expected {chunk_count(nbytes)}"
        )
    h = xxhash.xxh3_64(struct.pack("<Q", nbytes))
    h.update(raw)
    return h.intdigest()


def digest(view: Any) -> int:
    """The kind-1 value of a C-contiguous buffer (numpy uint8 view, bytes, memoryview):
    the reference definition, on one thread."""
    mv = memoryview(view).cast("B")
    return combine(mv.nbytes, chunk_digests(mv))


def legacy_digest(view: Any) -> int:
    """The kind-0 value: xxh3_64 of the whole buffer."""
    return xxhash.xxh3_64_intdigest(view)


def seal_kind(accepted: Any) -> int:
    """The kind a client seals with against a daemon whose hello listed ``accepted`` (None: a
    daemon from before the field, which takes kind 0 only): kind 1 where accepted, else 0."""
    return KIND_XXH3C if accepted and KIND_XXH3C in accepted else KIND_XXH3


def encode(value: int, kind: int = KIND_XXH3C) -> int | list[int]:
    """The wire form of a checksum value of ``kind``."""
    if kind == KIND_XXH3:
        return value
    if kind in KINDS:
        return [kind, value]
    raise ValueError(f"unknown checksum kind {kind!r}")


def _u64(value: Any) -> bool:
    return value.__class__ is int and 0 <= value <= _MAX_U64


def parse(recorded: Any) -> tuple[int, int]:
    """``(kind, value)`` of a checksum in its wire form; ValueError if malformed."""
    if _u64(recorded):
        return KIND_XXH3, recorded
    if isinstance(recorded, (list, tuple)) and len(recorded) == 2:
        kind, value = recorded
        if kind.__class__ is int and kind in KINDS and kind != KIND_XXH3 and _u64(value):
            return kind, value
        if kind.__class__ is int and kind not in KINDS:
            raise ValueError(f"unknown checksum kind {kind!r} (known: {sorted(KINDS)})")
    raise ValueError(
        "a checksum must be an unsigned 64-bit integer (xxh3 of the whole buffer) or "
        "[kind, unsigned 64-bit integer]"
    )


def matches(view: Any, recorded: Any) -> bool:
    """Whether the bytes of ``view`` hash to ``recorded`` (wire form, either kind), on one
    thread. :mod:`kvbroker._client.integrity` does the same over threads."""
    kind, value = parse(recorded)
    if kind == KIND_XXH3:
        return legacy_digest(view) == value
    return digest(view) == value


def validate(checksums: Any, buffers: Mapping[str, Any]) -> dict[str, Any]:
    """The daemon's check of a seal's ``{buffer: checksum}``: one well-formed checksum (see
    :func:`parse`) for every buffer of the object, nothing else. Raises ValueError saying what
    is wrong."""
    if not isinstance(checksums, dict):
        raise ValueError("checksums must be a map {buffer name: checksum}")
    if checksums.keys() != buffers.keys():
        missing = sorted(set(buffers) - set(checksums))[:3]
        extra = sorted(set(checksums) - set(buffers), key=str)[:3]
        raise ValueError(
            "checksums must name every buffer of the object and nothing else"
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {extra}" if extra else "")
        )
    for name, value in checksums.items():
        try:
            parse(value)
        except ValueError as exc:
            raise ValueError(f"checksum of {name!r}: {exc}") from None
    return checksums
