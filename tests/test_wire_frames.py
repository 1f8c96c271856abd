"""The frame codec (kvbroker._wire.frames), sans I/O: whatever way a valid stream is cut into
reads, it decodes to the same messages; oversized or garbage input ends in the codec's one
error, never a hang, never more held than the limit."""

from __future__ import annotations

import itertools

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbroker._wire.frames import (
    FrameDecoder,
    FrameEncoder,
    FrameError,
    SharedUnpacker,
    as_request,
    error_of,
    result_of,
)
from kvbroker._wire.protocol import MAX_REQUEST
from kvbroker.errors import ERROR_CLASSES, BadRequest, InternalError, ProtocolError

_LIMIT = 4096  # small, so that the tests reach it

_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=40),
)
_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=10,
)
_messages = st.dictionaries(st.text(max_size=8), _values, max_size=6)


def _cuts(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def _decode(decoder: FrameDecoder, chunks: list[bytes]) -> list:
    out = []
    for chunk in chunks:
        out.extend(decoder.receive(memoryview(chunk)))
        assert decoder.buffered <= decoder.limit
    return out


@settings(max_examples=80, deadline=None)
@given(st.lists(_messages, max_size=8), st.lists(st.integers(0, 1 << 16), max_size=30))
def test_any_chunking_of_a_valid_stream_decodes_the_same(messages, points):
    data = b"".join(msgpack.packb(m) for m in messages)
    assert all(len(msgpack.packb(m)) <= (1 << 20) for m in messages)
    for decoder in (FrameDecoder(1 << 20), FrameDecoder(1 << 20, shared=SharedUnpacker(1 << 20))):
        assert _decode(decoder, _cuts(data, points)) == messages
        assert decoder.buffered == 0


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.lists(_messages, max_size=4), min_size=2, max_size=4),
    st.lists(st.integers(0, 1 << 12), max_size=20),
    st.randoms(use_true_random=False),
)
def test_decoders_sharing_an_unpacker_keep_their_streams_apart(streams, points, rnd):
    """Several connections' reads interleaved on one event loop: each decoder gets its own
    messages, a frame split across reads of one while the others read whole ones."""
    shared = SharedUnpacker(1 << 20)
    decoders = [FrameDecoder(1 << 20, shared=shared) for _ in streams]
    pending = [_cuts(b"".join(msgpack.packb(m) for m in s), points) for s in streams]
    got: list[list] = [[] for _ in streams]
    while any(pending):
        i = rnd.choice([i for i, p in enumerate(pending) if p])
        got[i].extend(decoders[i].receive(pending[i].pop(0)))
    assert got == streams


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=3 * _LIMIT), st.lists(st.integers(0, 1 << 14), max_size=20), st.booleans()
)
def test_garbage_ends_in_the_codecs_error_or_messages_never_more_than_the_limit(
    data, points, share
):
    decoder = FrameDecoder(_LIMIT, shared=SharedUnpacker(_LIMIT) if share else None)
    try:
        for chunk in _cuts(data, points):  # one call per chunk: nothing can loop on its own
            decoder.receive(chunk)
            assert decoder.buffered <= _LIMIT
    except FrameError as exc:
        assert isinstance(exc, ProtocolError)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize(
    "header",
    [
        b"\xdb" + (64 << 20).to_bytes(4, "big"),  # a str claiming 64 MiB
        b"\xdd" + (1 << 20).to_bytes(4, "big"),  # an array of a million items...
    ],
)
def test_a_frame_over_the_limit_is_refused_while_it_arrives(share, header):
    decoder = FrameDecoder(
        _LIMIT, sender="the peer", shared=SharedUnpacker(_LIMIT) if share else None
    )
    body = b"a" * 64 if header[0] == 0xDB else b"\x9f" + b"\x00" * 15  # ...of full arrays
    sent = 0
    with pytest.raises(
        FrameError, match=r"a frame from the peer exceeds the size limit \(4096 bytes\)"
    ):
        decoder.receive(header)
        while sent < 100 * _LIMIT:
            decoder.receive(body * 8)
            sent += len(body) * 8
            assert decoder.buffered <= _LIMIT
    assert sent <= 2 * _LIMIT


def test_malformed_bytes_are_the_codecs_error():
    with pytest.raises(FrameError, match="malformed frame from the daemon"):
        FrameDecoder(sender="the daemon").receive(b"\xc1")


def test_a_decoder_shares_an_unpacker_only_between_frames():
    shared = SharedUnpacker(1 << 20)
    a, b = FrameDecoder(1 << 20, shared=shared), FrameDecoder(1 << 20, shared=shared)
    frame = msgpack.packb({"id": 1, "op": "ping", "args": {}})
    assert a.receive(frame[:3]) == [] and a.buffered == 3
    assert b.receive(frame) == [{"id": 1, "op": "ping", "args": {}}]
    assert a.receive(frame[3:]) == [{"id": 1, "op": "ping", "args": {}}] and a.buffered == 0


def test_requests_replies_and_errors_round_trip():
    enc, dec = FrameEncoder(), FrameDecoder()
    (req,) = dec.receive(enc.request(7, "exists", {"key": "k"}))
    assert as_request(req) == (7, "exists", {"key": "k"})
    for bad in ([1, 2], {"id": "x", "op": "stat"}, {"id": True, "op": "stat"}, {"id": 1, "op": 2}):
        with pytest.raises(BadRequest):
            as_request(bad)
    (ok,) = dec.receive(enc.reply(7, {"a": 1}))
    assert result_of(ok) == {"a": 1}
    for cls in ERROR_CLASSES:
        (failed,) = dec.receive(enc.refusal(3, cls("why")))
        assert failed["id"] == 3
        err = error_of(failed)
        assert type(err) is cls and err.message == "why"


def test_a_request_over_the_daemons_limit_is_refused_before_it_is_sent():
    with pytest.raises(BadRequest, match="more than the"):
        FrameEncoder().request(1, "report", {"counters": {"x": "y" * MAX_REQUEST}})


def test_an_unpackable_reply_becomes_an_internal_error():
    told = []
    enc = FrameEncoder(on_unpackable=told.append)
    (msg,) = FrameDecoder().receive(enc.reply(5, {"x": object()}))
    assert msg["id"] == 5 and isinstance(error_of(msg), InternalError) and len(told) == 1
    (msg,) = FrameDecoder().receive(enc.reply(6, 1))  # the packer was left clean
    assert result_of(msg) == 1
