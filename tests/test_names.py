"""KV buffer names with an engine infix: validated by the daemon at reserve, selected by regex."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvbroker import BadRequest
from kvbroker._wire.names import check_buffer_name, check_infix, kv_buffer_name, kv_select_regex


@pytest.mark.parametrize("infix", ["P", "prefill0", "A1b2"])
def test_valid_infixes_build_names_the_regex_selects(infix):
    names = [kv_buffer_name(k, i, infix) for i in (0, 7, 31) for k in ("key", "value")]
    assert names[0] == f"past_key.0_{infix}"
    pattern = re.compile(kv_select_regex(infix))
    assert all(pattern.fullmatch(n) for n in names)
    for n in names:
        check_buffer_name(n)


@pytest.mark.parametrize("infix", ["", "a_b", "a.b", "a b", "p-1", "é"])
def test_invalid_infixes_are_refused_clearly(infix):
    with pytest.raises(BadRequest, match="infix"):
        check_infix(infix)
    with pytest.raises(BadRequest, match="infix"):
        kv_buffer_name("key", 0, infix)


@pytest.mark.parametrize(
    "name",
    [
        "past_key.0_",
        "past_key.1_a_b",
        "past_value.2_x.y",
        "past_key.x",
        "past_key.01",
        "past_value.3_has space",
        "past_latent.",
    ],
)
def test_malformed_kv_names_are_refused(name):
    with pytest.raises(BadRequest, match="KV buffer"):
        check_buffer_name(name)


@pytest.mark.parametrize("name", ["vision_embeds", "past_keys", "logits", "past_key"])
def test_non_kv_names_pass_untouched(name):
    check_buffer_name(name)
    assert not re.fullmatch(kv_select_regex(), name)
    assert not re.fullmatch(kv_select_regex("P"), name)


def test_regex_without_infix_does_not_select_infixed_buffers():
    assert re.fullmatch(kv_select_regex(), "past_key.3")
    assert not re.fullmatch(kv_select_regex(), "past_key.3_P")
    assert not re.fullmatch(kv_select_regex("P"), "past_key.3_Q")
    assert not re.fullmatch(kv_select_regex("P"), "past_key.3_PP")


def test_daemon_refuses_a_bad_infix_at_reserve(client):
    with pytest.raises(BadRequest, match="past_key.0_a_b"):
        client.put("bad", {"past_key.0_a_b": b"x" * 8})
    assert not client.exists("bad")


def test_claim_by_kv_regex_leaves_other_buffers_alone(client):
    kv = {
        kv_buffer_name(k, i, "P1"): np.full(16, i, np.int16)
        for i in range(3)
        for k in ("key", "value")
    }
    other = {"vision_embeds": np.arange(32, dtype=np.float32), "past_key.0": b"unrelated"}
    assert client.put("req", {**kv, **other})
    with client.claim("req", select=kv_select_regex("P1")) as lease:
        assert sorted(lease) == sorted(kv)
    with client.claim("req", select="vision_embeds") as lease:
        assert np.array_equal(lease["vision_embeds"].view(np.float32), other["vision_embeds"])
