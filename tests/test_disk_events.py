"""KV events beside the disk tier ([tier.disk] and [events], issue 42): a block is announced
in the medium the node serves it from, in vLLM's terms (``CPU`` in a pool, ``STORAGE`` on
disk only). A demotion is BlockRemoved(CPU) then BlockStored(STORAGE), a promotion the
reverse; a block leaves the stream only with the node's last copy. Checked with a real
subscriber (a SUB socket the daemon connects to, as tests/test_events.py's), by replaying
what it received into two routers — one that keeps each medium apart (llm-d's index), one
that ignores the medium — which must both hold exactly the blocks the node can serve."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq not installed (pip install 'kvbroker[events]')")

from kvbroker._server import events as ev  # noqa: E402
from kvbroker.prefix import PrefixCache  # noqa: E402
from test_disk_daemon import daemons, pattern, tier_env  # noqa: E402, F401 (a fixture)

NS = "prefix"
BS = 4


def _read(sock, got: list, done, timeout: float = 60.0) -> None:
    """Append decoded events (positional format) from ``sock`` to ``got`` until ``done()``."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"stream ended early: {got[-6:]}"
        if sock.poll(200):
            got += msgpack.unpackb(sock.recv_multipart()[-1])[1]


class Routers:
    """Two routers fed the same events: ``media`` keeps each block's media apart (a
    BlockRemoved takes its own medium away), ``plain`` ignores the medium."""

    def __init__(self, hashes: set[int]) -> None:
        self.hashes = hashes  # the blocks this test looks at
        self.media: dict[int, set[str]] = {}
        self.plain: set[int] = set()
        self.seen: list = []

    def feed(self, events: list) -> None:
        for e in events:
            if e[0] == "AllBlocksCleared":
                self.media.clear()
                self.plain.clear()
                continue
            for h in e[1]:
                if h not in self.hashes:
                    continue
                medium = e[6] if e[0] == "BlockStored" else e[2]
                self.seen.append((e[0], h, medium))
                if e[0] == "BlockStored":
                    self.media.setdefault(h, set()).add(medium)
                    self.plain.add(h)
                else:
                    self.media.get(h, set()).discard(medium)
                    self.plain.discard(h)


def test_demotion_and_promotion_are_announced_by_medium(daemons, tmp_path):  # noqa: F811
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.bind("tcp://127.0.0.1:*")
    sub.setsockopt_string(zmq.SUBSCRIBE, "")
    port = sub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    cfg = tmp_path / "kvb.toml"
    cfg.write_text(f'[events]\nmodel = "m"\npublish = "tcp://127.0.0.1:{port}"\n')
    env = {**tier_env(tmp_path / "disk"), "KVBROKER_TRANSFER_NODE": "n1"}
    d = daemons(env, "--config", str(cfg))
    got: list = []
    try:
        with d.client() as c:
            warm = PrefixCache(c, namespace="warm", block_size=BS, checksum=False)
            for r in range(300):  # PUB drops until the subscription is through
                warm.publish(
                    list(range(r * BS, (r + 1) * BS)),
                    lambda i: {"kv": b"\0" * 64},
                    block_sizes={"kv": 64},
                )
                if sub.poll(300):
                    break
            cache = PrefixCache(c, namespace=NS, block_size=BS)
            tokens = list(range(10_000, 10_000 + 4 * BS))
            blocks = [{"past_key.0": pattern(f"blk{i}", 64 << 10)} for i in range(4)]
            assert cache.publish(tokens, blocks) == 4
            keys = cache.keys(cache.hashes(tokens))
            hashes = [ev.external_hash(k) for k in keys]
            routers = Routers(set(hashes))

            def step(*expected: tuple[str, int, str]) -> None:
                """Read until the step's events arrived; they are exactly ``expected``, and
                both routers hold what the node serves, in the medium it serves it from."""
                start = len(routers.seen)
                at = len(got)
                _read(sub, got, lambda: len(_ours(got[at:], routers.hashes)) >= len(expected))
                routers.feed(got[at:])
                assert routers.seen[start:] == list(expected)
                listed = {o.key: o.tier for o in c.list(namespace=NS)}
                served = {ev.external_hash(k) for k in keys if c.exists(k, namespace=NS)}
                assert routers.plain == served
                assert {h: m for h, m in routers.media.items() if m} == {
                    ev.external_hash(k): {"STORAGE" if t == "disk" else "CPU"}
                    for k, t in listed.items()
                }

            step(*[("BlockStored", h, "CPU") for h in hashes])
            # Demoted (leaves first): served from disk from now on, said in that order.
            for k in reversed(keys[2:]):
                assert c.evict(k, namespace=NS, tier="dram").count == 1
            step(
                ("BlockRemoved", hashes[3], "CPU"),
                ("BlockStored", hashes[3], "STORAGE"),
                ("BlockRemoved", hashes[2], "CPU"),
                ("BlockStored", hashes[2], "STORAGE"),
            )
            stored = [e for e in got if e[0] == "BlockStored" and e[1] == [hashes[3]]][-1]
            assert stored[2] == hashes[2] and stored[3] == tokens[3 * BS :]  # parent, tokens
            # A held match promotes them: back in a pool.
            with cache.match(tokens + [0]) as m:
                assert m.num_blocks == 4
                for i, blk in enumerate(m.blocks):
                    assert np.array_equal(blk["past_key.0"], blocks[i]["past_key.0"]), i
            step(
                ("BlockRemoved", hashes[2], "STORAGE"),
                ("BlockStored", hashes[2], "CPU"),
                ("BlockRemoved", hashes[3], "STORAGE"),
                ("BlockStored", hashes[3], "CPU"),
            )
            # Demoted again (their disk copies stayed): STORAGE again, once.
            assert c.evict(keys[3], namespace=NS, tier="dram").count == 1
            step(("BlockRemoved", hashes[3], "CPU"), ("BlockStored", hashes[3], "STORAGE"))
            # Dropped from disk: the node can no longer serve it.
            assert c.evict(keys[3], namespace=NS, tier="disk").on_disk == 1
            step(("BlockRemoved", hashes[3], "STORAGE"))
            # Evicted from everywhere while in a pool: removed from CPU, the only medium
            # announced (its disk copy, if any, was never a medium of its own).
            assert c.evict(keys[2], namespace=NS).count == 1
            step(("BlockRemoved", hashes[2], "CPU"))
    finally:
        sub.close(linger=0)


def _ours(events: list, hashes: set[int]) -> list:
    return [e for e in events if e[0] != "AllBlocksCleared" and set(e[1]) & hashes]


def test_storage_is_vllms_medium_name():
    try:
        from vllm.distributed import kv_events
    except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
        pytest.skip(f"vLLM not importable here ({type(e).__name__}: {e})")
    assert (ev.MEDIUM_CPU, ev.MEDIUM_STORAGE) == (kv_events.MEDIUM_CPU, kv_events.MEDIUM_STORAGE)
