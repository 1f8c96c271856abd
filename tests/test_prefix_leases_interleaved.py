"""A prefix match over several chains interleaved block by block — what ``match_kv`` asks
for when a decode rank reads the shards of several prefill TP ranks: keys ``h0/s0, h0/s1,
h0/s2, h1/s0, ...``, each shard's blocks a chain of its own. Like one chain, such a lease
pins only its leaves (the last block of each chain); these tests attack the other blocks
through every path that frees or reports them, as tests/test_prefix_leases.py does for one
chain.
"""

import pytest
from test_prefix_leases import NS, PAGE, fill_pool, make_broker, put, read, session, used

from kvbroker.errors import QuotaExceeded

__all__ = ["make_broker"]  # the fixture, shared

CHAINS, ROWS = 3, 3


def key(row, chain):
    return f"h{row}/s{chain}"


def interleaved(rows=ROWS, chains=CHAINS):
    """The keys of ``rows`` blocks of ``chains`` chains, block-major, chain-minor."""
    return [key(r, c) for r in range(rows) for c in range(chains)]


def fill(k):
    """The byte block ``k`` is filled with: its place in the interleaved order, + 0x10."""
    row, chain = k[1:].split("/s")
    return 0x10 + int(row) * CHAINS + int(chain)


def publish_chains(b, s, rows=ROWS, chains=CHAINS):
    """``chains`` chains of ``rows`` one-page blocks, each block the child of the block
    before it in its chain, filled by :func:`fill`."""
    for c in range(chains):
        keys = [key(r, c) for r in range(rows)]
        r = b.handle(
            s,
            "reserve_blocks",
            {
                "namespace": NS,
                "blocks": [
                    {"key": k, "parent": keys[i - 1] if i else None} for i, k in enumerate(keys)
                ],
                "buffers": {"x": PAGE},
            },
        )
        for k, res in zip(keys, r["results"], strict=True):
            _, off, n = res["buffers"]["x"]
            b.test_mm[off : off + n] = bytes([fill(k)]) * n
        b.handle(
            s, "seal_many", {"leases": [res["lease"] for res in r["results"]], "checksums": None}
        )


def match(b, s, keys):
    reply = b.handle(s, "match_prefix", {"namespace": NS, "keys": keys})
    assert reply["matched"] == len(keys)
    return reply["lease"]


def intact(b, blocks):
    return all(read(b, obj) == bytes([fill(k)]) * PAGE for k, obj in blocks.items())


def settled(b):
    """No lease left, no reader counted, and every block without children in the LRU."""
    return (
        not b.leases
        and not b.lazy_leases
        and all(o.readers == 0 for o in b.objects.values())
        and all(b.directory.is_evictable(o) == (o.children == 0) for o in b.objects.values())
    )


@pytest.mark.parametrize(
    "keys", [interleaved(), interleaved()[:-1]], ids=["whole rows", "a partial last row"]
)
def test_a_match_over_interleaved_chains_pins_only_their_leaves(make_broker, keys):
    b = make_broker()
    s = session(b)
    publish_chains(b, s)
    lease = match(b, s, keys)
    assert b.lazy_leases[lease].lazy == CHAINS
    leaves = set(keys[-CHAINS:])
    assert {k: b.objects[NS, k].readers for k in keys} == {k: int(k in leaves) for k in keys}
    listed = b.handle(s, "list", {"namespace": NS})["objects"]
    assert {o["key"]: o["readers"] for o in listed} == {k: int(k in keys) for k in interleaved()}
    b.handle(s, "release", {"lease": lease})
    assert settled(b)


@pytest.mark.parametrize("victim", interleaved())
def test_a_republished_block_of_any_chain_is_kept_until_release(make_broker, victim):
    b = make_broker(npages=48)
    s = session(b)
    publish_chains(b, s)
    keys = interleaved()
    lease = match(b, s, keys)
    held = {k: b.objects[NS, k] for k in keys}
    put(b, s, victim, 0x77, replace=True)
    assert b.objects[NS, victim] is not held[victim]
    fill_pool(b)
    assert intact(b, held) and b.pages.owners[0][held[victim].start] is held[victim]
    before = used(b)
    b.handle(s, "release", {"lease": lease})
    assert used(b) == before - 1 and held[victim].start not in b.pages.owners[0]
    assert all(o.readers == 0 for (ns, _), o in b.objects.items() if ns == NS)


@pytest.mark.parametrize("victim", interleaved())
def test_a_consumed_block_of_any_chain_is_kept_until_release(make_broker, victim):
    b = make_broker(npages=48)
    s, consumer = session(b), session(b)
    publish_chains(b, s)
    keys = interleaved()
    lease = match(b, s, keys)
    held = {k: b.objects[NS, k] for k in keys}
    got = b.handle(consumer, "claim", {"namespace": NS, "key": victim, "consume": True})
    b.handle(consumer, "release", {"lease": got["lease"]})
    assert (NS, victim) not in b.objects
    fill_pool(b)
    assert intact(b, held)
    before = used(b)
    b.handle(s, "release", {"lease": lease})
    assert used(b) == before - 1


def test_pool_pressure_evict_and_quota_leave_every_matched_block(make_broker):
    b = make_broker(npages=24, quotas={NS: 9 * PAGE})
    s = session(b)
    publish_chains(b, s)
    keys = interleaved()
    lease = match(b, s, keys)
    held = {k: b.objects[NS, k] for k in keys}
    got = b.handle(s, "evict", {"namespace": NS})
    assert (got["count"], got["skipped_leased"]) == (0, 9)
    with pytest.raises(QuotaExceeded):  # full of matched blocks: none may go
        put(b, s, "more", 0x50)
    fill_pool(b)
    assert intact(b, held) and all((NS, k) in b.objects for k in keys)
    b.handle(s, "release", {"lease": lease})
    assert b.handle(s, "evict", {"namespace": NS})["count"] == 9


def test_two_matches_of_one_span_count_twice_nothing_materialized(make_broker):
    b = make_broker()
    s = session(b)
    publish_chains(b, s)
    keys = interleaved()
    leases = [match(b, s, keys), match(b, s, keys), match(b, s, keys[: CHAINS * 2])]
    listed = {o["key"]: o["readers"] for o in b.handle(s, "list", {"namespace": NS})["objects"]}
    assert listed == {k: 3 if i < CHAINS * 2 else 2 for i, k in enumerate(keys)}
    assert set(b.lazy_leases) == set(leases)  # reporting changed none of them
    pool = b.snapshot()["pools"][0]
    assert pool["leased_read"] == 9 * PAGE
    b.handle(s, "release_many", {"leases": leases})
    assert settled(b)


def test_an_expired_or_closed_match_unpins_every_chain(make_broker):
    b = make_broker()
    s, reader = session(b), session(b)
    publish_chains(b, s)
    b.handle(reader, "match_prefix", {"namespace": NS, "keys": interleaved(), "ttl": 1.0})
    b.clock.now += 2.0
    b.expire()
    assert settled(b)
    match(b, reader, interleaved())
    b.close_session(reader)
    assert settled(b)


def test_blocks_that_only_look_interleaved_are_pinned_each(make_broker):
    # The second row's first block is a child of the first, but the rest is no interleave:
    # every block counts the lease, as for blocks in no chain.
    b = make_broker()
    s = session(b)
    publish_chains(b, s, rows=2, chains=2)
    keys = [key(0, 0), key(0, 1), key(1, 0), "lone"]
    put(b, s, "lone", 0x50)
    lease = match(b, s, keys)
    assert lease not in b.lazy_leases
    assert all(b.objects[NS, k].readers == 1 for k in keys)
    b.handle(s, "release", {"lease": lease})
    assert settled(b)


def true_readers(b):
    """Every block's readers if every lease counted each of its places."""
    out = {}
    for ls in b.leases.values():
        for obj in ls.objects():
            out[obj.key] = out.get(obj.key, 0) + 1
    return out


@pytest.mark.parametrize(
    "two",
    [
        # two chains each, partial last rows: the same first and last block, another chain 1
        (
            [key(0, 0), key(0, 1), key(1, 0), key(1, 1), key(2, 0)],
            [key(0, 0), key(0, 2), key(1, 0), key(1, 2), key(2, 0)],
        ),
        # one chain twice over against two chains: the same first and last block
        ([key(0, 0), key(0, 1), key(1, 0)], [key(0, 0), key(0, 0), key(1, 0), key(1, 0)]),
    ],
    ids=["another middle chain", "a chain twice over"],
)
def test_list_and_evict_tell_apart_matches_that_share_their_ends(make_broker, two):
    # Reporting counts each lease's own blocks: two interleaved matches are one span only
    # when every chain of theirs is.
    b = make_broker()
    s = session(b)
    publish_chains(b, s)
    leases = [match(b, s, keys) for keys in two]
    assert all(b.lazy_leases[ls].lazy == 2 for ls in leases)
    want = true_readers(b)
    listed = {o["key"]: o["readers"] for o in b.handle(s, "list", {"namespace": NS})["objects"]}
    assert {k: n for k, n in listed.items() if n} == want
    got = b.handle(s, "evict", {"namespace": NS, "dry_run": True})
    assert got["skipped_leased"] == len(want)
    b.handle(s, "release_many", {"leases": leases})
    assert settled(b)
