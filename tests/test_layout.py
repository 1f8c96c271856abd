"""Layout descriptors: runs match the real memory of strided arrays, coalescing, checks."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker import BadRequest, LayoutMismatch
from kvbroker.layout import Layout, check_compatible, shard_storage

NHD = ("block", "kv", "token", "head", "head_dim")  # blocks-first, heads inside a token
HND = ("kv", "block", "head", "token", "head_dim")  # K/V-first, tokens inside a head


def _gathered(array: np.ndarray, layout: Layout) -> bytes:
    """The bytes the layout's descriptors address inside ``array``'s buffer, in order."""
    raw = array.reshape(-1).view(np.uint8)
    return b"".join(raw[o : o + n].tobytes() for o, n in layout.descriptors())


def _covered(runs) -> list[tuple[int, int]]:
    """The byte intervals ``runs`` cover, merged: equal for two walks of the same memory."""
    merged: list[list[int]] = []
    for start, n in sorted(runs):
        if merged and merged[-1][1] == start:
            merged[-1][1] += n
        else:
            merged.append([start, start + n])
    return [tuple(m) for m in merged]


def _engine_cache(axes, blocks=5, slots=4, heads=6, dim=3):
    sizes = {"block": blocks, "kv": 2, "token": slots, "head": heads, "head_dim": dim}
    shape = tuple(sizes[a] for a in axes)
    return np.arange(np.prod(shape), dtype=np.int16).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(
    axes=st.sampled_from([NHD, HND]),
    head_start=st.integers(0, 5),
    head_len=st.integers(1, 6),
    block=st.integers(0, 4),
)
def test_narrowed_head_range_addresses_exactly_the_sliced_elements(
    axes, head_start, head_len, block
):
    head_len = min(head_len, 6 - head_start)
    cache = _engine_cache(axes)
    layout = Layout.from_tensor(cache, axes, iterated=[a for a in axes if a != "head_dim"])
    narrowed = layout.select("block", block).narrow("head", head_start, head_len)
    view = np.moveaxis(cache, axes.index("block"), 0)[block]
    rest = [a for a in axes if a != "block"]
    expected = np.take(view, range(head_start, head_start + head_len), axis=rest.index("head"))
    assert _gathered(cache, narrowed) == np.ascontiguousarray(expected).tobytes()


def test_storage_layout_any_head_range_is_one_run_per_layer_and_kv():
    layers, heads, tokens, dim = 3, 8, 5, 4
    storage = shard_storage("bfloat16", layers, 2, heads, tokens, dim)
    for start, length in [(0, 8), (2, 3), (7, 1), (0, 1)]:
        runs = storage.narrow("head", start, length).descriptors(base=4096)
        assert len(runs) == (1 if length == heads else layers * 2)
        assert all(n == length * tokens * dim * 2 for o, n in runs) or length == heads
        assert runs[0][0] == 4096 + start * tokens * dim * 2
    assert storage.descriptors() == [(0, storage.nbytes)]  # everything coalesces


def test_leaf_must_be_c_contiguous_and_narrow_rechecks():
    with pytest.raises(BadRequest, match="C-contiguous"):
        Layout("float16", (4, 8), (1, 4), ("token", "head_dim"))
    lay = Layout.contiguous(
        "float16", (4, 6, 8), ("token", "head", "head_dim"), iterated=("token",)
    )
    lay.narrow("head", 1, 2)  # an outer leaf axis may be narrowed
    with pytest.raises(BadRequest, match="head_dim"):
        lay.narrow("head_dim", 0, 4)
    with pytest.raises(BadRequest, match="outside"):
        lay.narrow("head", 5, 2)


def test_select_and_narrow_move_the_offset():
    lay = Layout.contiguous(
        "float32",
        (2, 3, 4),
        ("layer", "head", "head_dim"),
        iterated=("layer", "head"),
        sharded="head",
    )
    sel = lay.select("layer", 1)
    assert sel.offset == 12 and sel.axes == ("head", "head_dim") and sel.iterated == ("head",)
    assert sel.narrow("head", 2, 1).descriptors(base=100) == [(100 + (12 + 8) * 4, 16)]
    assert lay.select("head", 0).sharded is None


@pytest.mark.parametrize("axes", [NHD, HND])
@pytest.mark.parametrize("r", [1, 2, 4])
def test_sub_block_retiles_pages_without_moving_bytes(axes, r):
    cache = _engine_cache(axes, slots=4)
    layout = Layout.from_tensor(cache, axes, iterated=[a for a in axes if a != "head_dim"])
    sub = layout.sub_block(r)
    assert sub.size("sub_block") == r and sub.size("token") == 4 // r
    assert _covered(sub.descriptors()) == _covered(layout.descriptors())
    assert _gathered(cache, sub.select("block", 1).select("sub_block", r - 1)) == _gathered(
        cache, layout.select("block", 1).narrow("token", 4 - 4 // r, 4 // r)
    )
    with pytest.raises(BadRequest, match="divide"):
        layout.sub_block(3)


def test_round_trip_through_msgpack_and_from_torch():
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16)[:, 1:3]
    lay = Layout.from_tensor(t, ("kv", "block", "token", "head_dim"))
    assert lay.dtype == "bfloat16" and lay.itemsize == 2 and lay.strides == (96, 24, 8, 1)
    back = Layout.from_dict(msgpack.unpackb(msgpack.packb(lay.to_dict())))
    assert back == lay and back.descriptors() == lay.descriptors()


def test_compatibility_errors_name_the_field():
    a = shard_storage("bfloat16", 4, 2, 8, 16, 128)
    check_compatible(a, a, ("layer", "head_dim", "token"))
    cases = [
        (shard_storage("float16", 4, 2, 8, 16, 128), "dtype"),
        (shard_storage("bfloat16", 4, 2, 8, 16, 64), "head_dim"),
        (shard_storage("bfloat16", 5, 2, 8, 16, 128), "layers"),
        (shard_storage("bfloat16", 4, 2, 8, 32, 128), "block size"),
    ]
    for other, field in cases:
        with pytest.raises(LayoutMismatch, match=field):
            check_compatible(a, other, ("layer", "head_dim", "token"))
    latent = Layout.contiguous("bfloat16", (4, 16, 576), ("layer", "token", "head_dim"))
    with pytest.raises(LayoutMismatch, match="KV heads"):
        check_compatible(a, latent, ("head",))


def test_bad_descriptors_are_refused():
    with pytest.raises(BadRequest, match="unknown dtype"):
        Layout.contiguous("float13", (2,), ("head_dim",))
    with pytest.raises(BadRequest, match="unique"):
        Layout.contiguous("int8", (2, 2), ("head", "head"))
    with pytest.raises(BadRequest, match="no axis"):
        shard_storage("int8", 1, 1, 1, 1, 1).narrow("block", 0, 1)
