"""``kvbroker bench prefix``: match_prefix latency against prefix length, and a hit-rate
workload.

Latency: one prompt of ``max(lengths)`` tokens is published once in ``block``-token blocks;
then prompts that share its first L tokens are matched, for each L. Each match is one round
trip and one lease for every matched block; it is compared with a put+claim of one small
object. Both are timed alike, on a quiet pool: each operation after an untimed round trip
that flushes pipelined releases, the two alternating in runs of 20. A match timed right after the previous
one's multi-MiB load runs with both processes' caches emptied by the copy, and is up to twice
as slow on the 2-core VM: that figure is its own labelled column ("match p50 after a load",
from a third loop that matches, then loads every block). Block hashes are computed once
per prompt (an engine does that at admission) and timed on their own.

Hit rate: ``prompts`` requests, each a random one of ``systems`` shared system prompts
followed by unique user tokens, served in order the way an engine does (match, then publish
the full blocks it lacks). The measured hit rate (tokens matched / prompt tokens) is set
beside the rate the workload allows, computed from its definition alone.
"""

from __future__ import annotations

import time

from ._common import Result, Target, median, pct, save_figure, timed

DEFAULT_LENGTHS = (64, 256, 1024, 4096, 8192)
_RUN = 20  # timed operations of one kind in a row (latency_rows)
COLUMNS = [
    ("tokens", "tokens", "d"),
    ("blocks", "blocks", "d"),
    ("put_claim_p50_us", "put+claim p50 us", ".1f"),
    ("match_p50_us", "match p50 us", ".1f"),
    ("match_p99_us", "match p99 us", ".1f"),
    ("match_vs_put_claim", "x put+claim", "ratio"),
    ("loaded_match_p50_us", "match p50 after a load", ".1f"),
    ("hash_p50_us", "hash p50 us", ".1f"),
    ("load_gbps", "load GB/s", ".2f"),
]
HIT_COLUMNS = [
    ("requests", "requests", "d"),
    ("prompt_tokens", "prompt tokens", "d"),
    ("hit_rate", "hit rate", ".3f"),
    ("expected_hit_rate", "workload allows", ".3f"),
    ("hit_match_p50_us", "hit match p50 us", ".1f"),
    ("miss_match_p50_us", "miss match p50 us", ".1f"),
    ("publish_p50_us", "publish p50 us", ".1f"),
]


def latency_rows(c, lengths, block: int, reps: int, layers: int, block_bytes: int) -> list[dict]:
    import numpy as np

    from ..prefix import PrefixCache

    ns = "bench-prefix"
    c.evict(namespace=ns)
    rng = np.random.default_rng(0)
    longest = max(lengths)
    toks = rng.integers(0, 32000, longest + 1).tolist()
    nblocks = longest // block
    data = rng.integers(0, 256, (nblocks, layers, block_bytes), dtype=np.uint8)
    sink = np.empty_like(data)
    pc = PrefixCache(c, namespace=ns, block_size=block)
    t = time.perf_counter()
    pc.publish(
        toks[: nblocks * block],
        [{f"past_key.{j}": data[b, j] for j in range(layers)} for b in range(nblocks)],
    )
    publish_s = time.perf_counter() - t
    small = b"x" * 4096
    rows = []
    for length in sorted(lengths):
        prompt = toks[:length] + [toks[length]]  # one token more: the engine prefills it
        want = length // block
        hash_t = timed(lambda: pc.hashes(prompt), 20)  # noqa: B023
        hs = pc.hashes(prompt)
        base, match_t, loaded_t, load_t = [], [], [], []
        # Each timed operation on a quiet pool: after an untimed round trip that flushes the
        # previous one's pipelined release. The two alternate in runs of _RUN, so that a slow
        # spell of a shared machine falls on both; not one by one, where the put+claim would
        # follow a many-block match and its release, and be slower for it.
        for start in range(0, reps, _RUN):
            for i in range(start, min(reps, start + _RUN)):
                c.ops.ping()
                t0 = time.perf_counter()
                c.put(f"rt-{i}", {"x": small}, namespace=ns)
                with c.claim(f"rt-{i}", namespace=ns, consume=True):
                    pass
                base.append(time.perf_counter() - t0)
            for _ in range(start, min(reps, start + _RUN)):
                c.ops.ping()
                t0 = time.perf_counter()
                with pc.match(prompt, hashes=hs) as m:
                    match_t.append(time.perf_counter() - t0)
                if m.num_blocks != want:
                    raise AssertionError(f"matched {m.num_blocks} blocks of {want}")
        for _ in range(reps):  # an engine's use: match, then load every block
            c.ops.ping()
            t1m = time.perf_counter()
            with pc.match(prompt, hashes=hs) as m:
                t2 = time.perf_counter()
                for b, blk in enumerate(m.blocks):
                    for j in range(layers):
                        np.copyto(sink[b, j], blk[f"past_key.{j}"])
                t3 = time.perf_counter()
            loaded_t.append(t2 - t1m)
            load_t.append(t3 - t2)
        if not np.array_equal(sink[:want], data[:want]):
            raise AssertionError("loaded prefix differs from the published one")
        mb, mm, ml = (median(x) for x in (base, match_t, load_t))
        rows.append(
            {
                "tokens": length,
                "blocks": want,
                "block_tokens": block,
                "prefix_bytes": int(data[:want].nbytes),
                "put_claim_p50_us": mb * 1e6,
                "match_p50_us": mm * 1e6,
                "match_p99_us": pct(match_t, 0.99) * 1e6,
                "match_vs_put_claim": mm / mb,
                "loaded_match_p50_us": median(loaded_t) * 1e6,
                "hash_p50_us": median(hash_t) * 1e6,
                "load_gbps": data[:want].nbytes / ml / 1e9,
                "publish_all_ms": publish_s * 1e3,
            }
        )
    c.evict(namespace=ns)
    return rows


def hit_rate_row(
    c,
    systems: int,
    system_tokens: int,
    user_tokens: int,
    prompts: int,
    block: int,
    block_bytes: int,
) -> dict:
    import numpy as np

    from ..prefix import PrefixCache

    ns = "bench-prefix-hits"
    c.evict(namespace=ns)
    rng = np.random.default_rng(1)
    sys_prompts = [rng.integers(0, 32000, system_tokens).tolist() for _ in range(systems)]
    pc = PrefixCache(c, namespace=ns, block_size=block)
    payload = np.zeros(block_bytes, dtype=np.uint8)
    seen: set[int] = set()
    hit_t, miss_t, pub_t = [], [], []
    matched = allowed = total = 0
    for _ in range(prompts):
        s = int(rng.integers(systems))
        prompt = sys_prompts[s] + rng.integers(0, 32000, user_tokens).tolist()
        total += len(prompt)
        # What the workload allows: the full blocks inside a system prompt seen before, never
        # more than len - 1 tokens (one token is always prefilled).
        if s in seen:
            allowed += min(system_tokens // block, (len(prompt) - 1) // block) * block
        seen.add(s)
        hs = pc.hashes(prompt)
        t0 = time.perf_counter()
        with pc.match(prompt, hashes=hs) as m:
            t1 = time.perf_counter()
            matched += m.num_tokens
        (hit_t if m.num_blocks else miss_t).append(t1 - t0)
        t0 = time.perf_counter()
        pc.publish(
            prompt, lambda i: {"past_key.0": payload}, block_sizes={"past_key.0": block_bytes}
        )
        pub_t.append(time.perf_counter() - t0)
    c.evict(namespace=ns)
    return {
        "requests": prompts,
        "systems": systems,
        "system_tokens": system_tokens,
        "user_tokens": user_tokens,
        "block_tokens": block,
        "prompt_tokens": total,
        "matched_tokens": matched,
        "hit_rate": matched / total,
        "expected_hit_rate": allowed / total,
        "hit_match_p50_us": median(hit_t) * 1e6 if hit_t else None,
        "miss_match_p50_us": median(miss_t) * 1e6 if miss_t else None,
        "publish_p50_us": median(pub_t) * 1e6,
    }


def run(
    socket_path: str,
    lengths=DEFAULT_LENGTHS,
    block: int = 16,
    reps: int = 200,
    layers: int = 2,
    block_bytes: int = 16 * 1024,
    systems: int = 8,
    system_tokens: int = 1024,
    user_tokens: int = 256,
    prompts: int = 200,
) -> Result:
    from .. import Client

    with Client(socket_path, name="bench-prefix", role="bench") as c:
        rows = latency_rows(c, lengths, block, reps, layers, block_bytes)
        hits = hit_rate_row(c, systems, system_tokens, user_tokens, prompts, block, 4096)
    longest = rows[-1]
    targets = [
        Target(
            f"match_prefix of {longest['tokens']} tokens vs a 4 KiB put+claim",
            longest["match_vs_put_claim"],
            2.0,
            "<=",
        ),
        Target(
            "hit rate vs what the workload allows",
            hits["hit_rate"] / hits["expected_hit_rate"] if hits["expected_hit_rate"] else 1.0,
            1.0,
        ),
    ]
    return Result(
        "prefix",
        rows,
        COLUMNS,
        params={
            "lengths": list(lengths),
            "block_tokens": block,
            "reps": reps,
            "layers": layers,
            "block_bytes": block_bytes,
        },
        targets=targets,
        tables={"hit_rate": ([hits], HIT_COLUMNS)},
    )


def plot(result: dict, plt, out_dir: str) -> list[str]:
    rows = result["rows"]
    t = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(t, [r["match_p50_us"] for r in rows], marker="o", label="match_prefix p50")
    ax.plot(t, [r["match_p99_us"] for r in rows], marker="x", ls="--", label="match_prefix p99")
    ax.plot(t, [r["put_claim_p50_us"] for r in rows], marker="s", label="4 KiB put+claim p50")
    ax.plot(t, [r["hash_p50_us"] for r in rows], ls=":", label="block hashing p50")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("µs")
    hit = result.get("hit_rate", [{}])[0]
    if hit:
        ax.set_title(
            f"prefix match; hit rate {hit['hit_rate']:.2f} "
            f"(workload allows {hit['expected_hit_rate']:.2f})"
        )
    ax.legend(fontsize=8)
    return [save_figure(fig, plt, out_dir, "prefix.png")]
