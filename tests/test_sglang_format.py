"""The SGLang backend's SGLang-free parts: where a host pool's pages lie, the shard keys of
heterogeneous TP, the salted page keys. (The backend itself, through SGLang:
tests/test_sglang_storage.py; its public-API-only rule: tests/test_architecture.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvbroker.integrations.sglang._format import PageGeometry, Sharding
from kvbroker.integrations.sglang._pages import PageKeys

L, H, D, P, PAGES = 3, 4, 2, 4, 5


def mha_buffer(layout: str) -> tuple[np.ndarray, callable]:
    """An MHA host buffer as SGLang's init_kv_buffer shapes it (every byte distinct), and the
    page at a token as ``[K/V, layer, token, head, dim]``, read from the shape's definition."""
    size = PAGES * P
    shapes = {
        "layer_first": (2, L, size, H, D),
        "page_first": (2, size, L, H, D),
        "page_first_direct": (2, PAGES, L, P, H, D),
        "page_head": (2, PAGES, H, P, L, D),
    }
    buf = np.arange(np.prod(shapes[layout]), dtype=np.int32).reshape(shapes[layout])

    def page(t: int) -> np.ndarray:
        if layout == "layer_first":
            return buf[:, :, t : t + P]
        if layout == "page_first":
            return buf[:, t : t + P].transpose(0, 2, 1, 3, 4)
        if layout == "page_first_direct":
            return buf[:, t // P]
        return buf[:, t // P].transpose(0, 3, 2, 1, 4)

    return buf, page


def gathered(buf: np.ndarray, g: PageGeometry, t: int, split: int = 1, j: int = 0) -> np.ndarray:
    flat = buf.reshape(-1).view(np.uint8)
    piece = g.run // split
    runs = [flat[g.start(t) + r * g.outer_stride + j * piece :][:piece] for r in range(g.outer)]
    return np.concatenate(runs).view(np.int32)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_a_pages_runs_are_exactly_its_bytes_in_the_host_layouts_order(layout):
    buf, page = mha_buffer(layout)
    g = PageGeometry.of(layout, buf.shape, 4, P, PAGES * P, paired=True)
    assert g.outer * g.run == 2 * L * P * H * D * 4
    for t in (0, 2 * P, (PAGES - 1) * P):
        got = gathered(buf, g, t)
        # the runs hold every value of the page once, and nothing else
        assert sorted(got.tolist()) == sorted(page(t).reshape(-1).tolist())
        # in the layout's own order: what SGLang's get_data_page(flat=True) gives
        if layout == "layer_first":
            flat = buf[:, :, t : t + P].reshape(-1)
        elif layout == "page_first":
            flat = buf[:, t : t + P].reshape(-1)
        else:
            flat = buf[:, t // P].reshape(-1)
        assert np.array_equal(got, flat)


def test_page_head_shards_hold_one_head_range_each():
    buf, page = mha_buffer("page_head")
    g = PageGeometry.of("page_head", buf.shape, 4, P, PAGES * P, paired=True)
    for j in range(2):  # two shards of two heads
        got = gathered(buf, g, P, split=2, j=j)
        want = page(P)[:, :, :, 2 * j : 2 * j + 2]  # [K/V, layer, token, head, dim]
        assert sorted(got.tolist()) == sorted(want.reshape(-1).tolist())


def test_bad_layouts_and_indices_are_refused_clearly():
    with pytest.raises(ValueError, match="page_unified.*not supported"):
        PageGeometry.of("page_unified", (2, 4), 2, P, 4, paired=True)
    with pytest.raises(ValueError, match="does not match layout"):
        PageGeometry.of("page_first", (2, 7, L, H, D), 2, P, PAGES * P, paired=True)
    g = PageGeometry.of("page_first", (2, PAGES * P, L, H, D), 2, P, PAGES * P, paired=True)
    with pytest.raises(ValueError, match="not at a page boundary"):
        g.start(P + 1)


def config(tp_rank=0, tp_size=1, lcm=None, split=False, mla=False, pp=(0, 1)):
    return SimpleNamespace(
        tp_rank=tp_rank,
        tp_size=tp_size,
        tp_lcm_size=lcm,
        should_split_heads=split,
        is_mla_model=mla,
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        dcp_rank=0,
        dcp_size=1,
    )


def test_shard_suffixes_agree_across_tp_sizes_through_tp_lcm_size():
    one = Sharding.of(config(lcm=4, split=True), 8)
    two = [Sharding.of(config(r, 2, 4, True), 4) for r in (0, 1)]
    four = [Sharding.of(config(r, 4, 4, False), 2) for r in range(4)]
    assert one.suffixes() == [f"/h8.tp{j}of4" for j in range(4)]
    assert [s for sh in two for s in sh.suffixes()] == one.suffixes()
    assert [s for sh in four for s in sh.suffixes()] == one.suffixes()
    # Without tp_lcm_size each TP size has shards of its own
    assert Sharding.of(config(1, 2), 4).suffixes() == ["/h8.tp1of2"]
    assert Sharding.of(config(mla=True), None).suffixes() == ["/h0.tp0of1"]
    assert Sharding.of(config(pp=(1, 2)), 8).suffixes() == ["/h8.tp0of1.pp1of2"]
    with pytest.raises(ValueError, match="do not split"):
        Sharding.of(config(lcm=3, split=True), 4)


def test_page_keys_are_salted_by_namespace_and_cache_salt():
    h = "ab" * 32
    base = PageKeys("sglang/m-1", "", ["/h8.tp0of1"])
    assert base.blocks([h]) == PageKeys("sglang/m-1", "", ["/h8.tp0of1"]).blocks([h])
    assert base.page(h) != PageKeys("sglang/m-2", "", []).page(h)
    assert base.page(h) != PageKeys("sglang/m-1", "tenant", []).page(h)
    assert base.blocks([h, h + "x"]) == [
        base.page(h) + "/h8.tp0of1",
        base.page(h + "x") + "/h8.tp0of1",
    ]
    two = PageKeys("sglang/m-1", "", ["/a", "/b"]).blocks(["p", "q"])
    assert [k[-2:] for k in two] == ["/a", "/b", "/a", "/b"]  # block-major, shard-minor
