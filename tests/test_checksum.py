"""The checksum definition (kvbroker._wire.checksum): chunked xxh3_64, its wire forms, and the
daemon's check of what a seal carries.

The reference here is written out from the definition (xxh3_64 per CHUNK bytes, then xxh3_64 of
the little-endian length and digests), not read back from the module under test.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, strategies as st

from kvbroker._wire import checksum as cs


def reference(data: bytes, chunk: int = cs.CHUNK) -> int:
    digests = [xxhash.xxh3_64_intdigest(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<Q{len(digests)}Q", len(data), *digests))


def test_chunk_is_one_mib():
    assert cs.CHUNK == 1 << 20  # part of the definition: a change is a new kind


@pytest.mark.parametrize(
    "n",
    [0, 1, 240, 241, cs.CHUNK - 1, cs.CHUNK, cs.CHUNK + 1, 2 * cs.CHUNK + 240, 3 * cs.CHUNK + 4097],
)
def test_digest_is_the_written_out_definition(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert cs.digest(data) == reference(data)
    assert cs.digest(np.frombuffer(data, np.uint8)) == reference(data)
    assert cs.digest(memoryview(data)) == reference(data)


@given(st.binary(max_size=20_000), st.sampled_from([1, 7, 64, 241, 1024, 4096]))
def test_digest_follows_chunk_size_and_combine(data, chunk):
    # the module reads CHUNK at call time, so a small chunk exercises many chunks cheaply
    old = cs.CHUNK
    cs.CHUNK = chunk
    try:
        assert cs.digest(data) == reference(data, chunk)
        assert cs.chunk_count(len(data)) == -(-len(data) // chunk)
        assert cs.combine(len(data), cs.chunk_digests(data)) == reference(data, chunk)
        raw = np.array(cs.chunk_digests(data), dtype="<u8")
        assert cs.combine(len(data), raw) == reference(data, chunk)
        assert cs.combine(len(data), raw.tobytes()) == reference(data, chunk)
    finally:
        cs.CHUNK = old


def test_combine_refuses_a_wrong_digest_count():
    with pytest.raises(ValueError, match="chunk digests"):
        cs.combine(cs.CHUNK + 1, [1])
    with pytest.raises(ValueError, match="little-endian"):
        cs.combine(1, np.array([5], dtype=">u8"))


def test_it_catches_flips_swaps_truncation_and_extension():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, 3 * cs.CHUNK + 100, dtype=np.uint8)
    base = cs.digest(a)
    seen = {base}
    for at in (0, cs.CHUNK - 1, cs.CHUNK, 2 * cs.CHUNK + 7, a.nbytes - 1):
        for bit in (0, 7):
            b = a.copy()
            b[at] ^= 1 << bit
            seen.add(cs.digest(b))
    swapped = np.concatenate([a[cs.CHUNK : 2 * cs.CHUNK], a[: cs.CHUNK], a[2 * cs.CHUNK :]])
    seen.add(cs.digest(swapped))
    seen.add(cs.digest(a[:-1]))  # truncated by a byte
    seen.add(cs.digest(a[: 3 * cs.CHUNK]))  # truncated at a chunk boundary
    seen.add(cs.digest(np.concatenate([a, np.zeros(1, np.uint8)])))  # extended by a zero
    seen.add(cs.digest(np.zeros_like(a)))
    assert len(seen) == 1 + 10 + 1 + 2 + 1 + 1  # every change gave a new value
    # and duplicate chunks in different orders
    z = np.concatenate([np.zeros(cs.CHUNK, np.uint8), np.ones(cs.CHUNK, np.uint8)])
    assert cs.digest(z) != cs.digest(z[::-1].copy())


def test_legacy_kind_is_whole_buffer_xxh3():
    data = b"kv" * 100_000
    assert cs.legacy_digest(data) == xxhash.xxh3_64_intdigest(data)
    assert cs.digest(data) != cs.legacy_digest(
        data
    )  # the two kinds never compare equal by accident
    assert cs.matches(data, xxhash.xxh3_64_intdigest(data))
    assert cs.matches(data, [1, cs.digest(data)])
    assert not cs.matches(data, xxhash.xxh3_64_intdigest(data) ^ 1)
    assert not cs.matches(data, [1, cs.digest(data) ^ 1])
    assert not cs.matches(data, cs.digest(data))  # a kind-1 value without its tag is kind 0


def test_wire_forms():
    assert cs.encode(5) == [cs.KIND_XXH3C, 5]
    assert cs.encode(5, cs.KIND_XXH3) == 5
    assert cs.parse(5) == (cs.KIND_XXH3, 5)
    assert cs.parse([1, 5]) == (cs.KIND_XXH3C, 5)
    assert cs.parse((1, 5)) == (cs.KIND_XXH3C, 5)
    with pytest.raises(ValueError):
        cs.encode(5, 9)
    for bad in (
        -1,
        1 << 64,
        True,
        2.0,
        "5",
        None,
        [],
        [1],
        [0, 5],
        [1, -1],
        [1, 1 << 64],
        [True, 5],
        [1, 5, 6],
        {"1": 5},
    ):
        with pytest.raises(ValueError):
            cs.parse(bad)
    with pytest.raises(ValueError, match="unknown checksum kind 9"):
        cs.parse([9, 5])


def test_validate():
    buffers = {"a": (0, 4), "b": (4, 4)}
    ok = {"a": 7, "b": [1, 8]}
    assert cs.validate(ok, buffers) is ok
    with pytest.raises(ValueError, match="missing"):
        cs.validate({"a": 7}, buffers)
    with pytest.raises(ValueError, match="unknown"):
        cs.validate({"a": 7, "b": 1, "c": 2}, buffers)
    with pytest.raises(ValueError, match="checksum of 'b'.*64-bit"):
        cs.validate({"a": 7, "b": [1, -3]}, buffers)
    with pytest.raises(ValueError, match="map"):
        cs.validate([7, 8], buffers)
