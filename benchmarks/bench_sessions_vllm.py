"""Sessions against plain LRU through a real vLLM CPU engine (the small form of
``bench_sessions.py``).

One vLLM engine (in this process, ``KVBrokerConnector`` as ``kv_both``, its own prefix cache
off so that every reuse goes through the broker) on a private daemon with a small pool, a
Llama-shaped model with seeded random weights (``bench_serving.make_model``: no download).
The trace: conversations whose every turn is the whole conversation so far, one-shot prompts
between the turns, more of them than the pool holds. It is replayed twice on the same engine
and daemon, the daemon emptied in between: once with no session named (plain LRU), once with
each conversation's requests naming theirs in ``kv_transfer_params``
(``{"kvbroker": {"session": ...}}``). Recomputed tokens are the prompt tokens the engine
computed (a prompt's length less vLLM's ``num_cached_tokens``: what the connector loaded).

    .venv/bin/python benchmarks/bench_sessions_vllm.py --out benchmarks/results/sessions-vllm-cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvbroker._bench._common import (  # noqa: E402
    format_table,
    invocation,
    machine_info,
    measured_commit,
    run_conditions,
    spawned_daemon,
    write_results,
)


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(ROOT, "benchmarks", f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def replay(llm, client, trace, retain: bool) -> dict:
    from vllm import SamplingParams

    out = {
        "turns": 0,
        "turn_tokens": 0,
        "turn_cached": 0,
        "recomputed_tokens": 0,
        "prompt_tokens": 0,
        "requests": 0,
    }
    seen: set[str] = set()
    t0 = time.perf_counter()
    for _i, (name, tokens) in enumerate(trace):
        extra = {}
        if retain and name is not None:
            extra = {"kv_transfer_params": {"kvbroker": {"session": name}}}
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            extra_args=extra or None,
        )
        (res,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
        cached = res.num_cached_tokens or 0
        out["requests"] += 1
        out["prompt_tokens"] += len(tokens)
        out["recomputed_tokens"] += len(tokens) - cached
        if name is not None and name in seen:
            out["turns"] += 1
            out["turn_tokens"] += len(tokens)
            out["turn_cached"] += cached
        if name is not None:
            seen.add(name)
    out["seconds"] = time.perf_counter() - t0
    out["turn_hit_rate"] = out["turn_cached"] / max(1, out["turn_tokens"])
    snap = client.stat()
    out["evictions"] = snap.counters.evictions
    out["retained_evicted"] = dict(snap.retention.evicted) if snap.retention else {}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--oneshots", type=int, default=24, help="one-shot prompts per round")
    ap.add_argument("--first", type=int, default=256)
    ap.add_argument("--per-turn", type=int, default=64)
    ap.add_argument("--oneshot-tokens", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--pool", default="16M")
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--out", default=None, help="PREFIX: write PREFIX.json and PREFIX.md")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serving, sessions = _sibling("bench_serving"), _sibling("bench_sessions")
    vocab = serving.VOCAB
    trace = [
        (n, [t % (vocab - 2) + 1 for t in toks])
        for n, toks in sessions.make_trace(
            a.sessions, a.turns, a.oneshots, a.first, a.per_turn, a.oneshot_tokens, a.seed
        )
    ]
    work = tempfile.mkdtemp(prefix="kvb-sessions-vllm-")
    model_dir = os.path.join(work, "model")
    cfg = serving.make_model(model_dir, a.layers, a.hidden)
    before = run_conditions()
    with spawned_daemon(a.pool, "--page-size", "4K", env={"KVBROKER_READ_REPLICAS": "0"}) as socket:
        from vllm import LLM
        from vllm.config import KVTransferConfig

        from kvbroker import Client

        longest = max(len(t) for _, t in trace) + 32
        llm = LLM(
            model=model_dir,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            kv_cache_memory_bytes=64 << 20,
            block_size=32,
            max_model_len=longest,
            max_num_seqs=4,
            seed=0,
            max_num_batched_tokens=longest,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVBrokerConnector",
                kv_role="kv_both",
                kv_connector_module_path="kvbroker.integrations.vllm",
                kv_connector_extra_config={"socket": socket},
            ),
        )
        modes = {}
        with Client(socket, name="bench-sessions-vllm", map_pools=False) as c:
            for mode, retain in (("plain LRU", False), ("sessions", True)):
                c.evict(all=True)  # the same empty pool for both
                for s in c.ops.sessions()["sessions"]:
                    c.ops.unretain(s["name"], namespace=s["namespace"])
                modes[mode] = replay(llm, c, trace, retain)
    after = run_conditions()
    rows = [
        {
            "mode": m,
            "hit_rate": r["turn_hit_rate"],
            "cached": r["turn_cached"],
            "asked": r["turn_tokens"],
            "recomputed": r["recomputed_tokens"],
            "seconds": r["seconds"],
        }
        for m, r in modes.items()
    ]
    result = {
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "conditions_before": before,
        "conditions_after": after,
        "model": cfg,
        "trace": {
            "sessions": a.sessions,
            "turns": a.turns,
            "oneshots_per_round": a.oneshots,
            "first_tokens": a.first,
            "tokens_per_turn": a.per_turn,
            "oneshot_tokens": a.oneshot_tokens,
            "requests": len(trace),
            "pool": a.pool,
            "seed": a.seed,
        },
        "modes": modes,
        "rows": rows,
    }
    md = [
        f"Sessions against plain LRU through a vLLM CPU engine at commit `{result['commit']}`: "
        f"{a.sessions} conversations x {a.turns} turns, {a.oneshots} one-shot prompts of "
        f"{a.oneshot_tokens} tokens a round, pool {a.pool}, vLLM's own prefix cache off.",
        "",
        format_table(
            rows,
            [
                ("mode", "mode", "s"),
                ("hit_rate", "turn hit rate", ".1%"),
                ("cached", "loaded tokens", ","),
                ("asked", "turn tokens", ","),
                ("recomputed", "recomputed tokens", ","),
                ("seconds", "seconds", ".1f"),
            ],
        ),
        "",
        f"Load before/after: {before['loadavg_1min']}/{after['loadavg_1min']}; CPU pressure "
        f"after: {after['cpu_pressure']}. Command: `{result['command']}`.",
    ]
    write_results(a.out, result, "\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
