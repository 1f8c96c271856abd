"""Real vLLM engines serving a multi-turn, shared-prefix trace: TTFT and throughput with and
without kvbroker, and P/D.

Two vLLM CPU engines (each its own process, in-process engine core, ``OMP_NUM_THREADS=1``) run
a Llama-shaped model with seeded random weights built here (no download; ``--layers``,
``--hidden``: large enough that the prefill dominates a request). A router in this process
replays the trace against them in three modes, each mode with its own engines (started once,
idle while another mode runs) and, for the connector's modes, its own private daemon:

``plain``     two data-parallel engines, each with its own vLLM prefix cache; request i of the
              trace goes to engine i mod 2 (round-robin);
``kvbroker``  the same two engines with ``KVBrokerConnector`` (``kv_both``) on one private
              daemon: a prefix one engine computed is loaded by the other;
``pd``        a ``kv_producer`` engine runs every prompt with ``max_tokens=1`` and a
              ``kv_consumer`` engine then loads its KV and decodes.

The trace: ``--conversations`` users (an odd number, so round-robin moves each conversation
from one engine to the other every turn) sharing a ``--system-tokens`` system prompt, each
with ``--turns`` turns of ``--user-tokens`` new tokens; every turn's prompt is the whole
conversation so far, the assistant's replies being the trace's recorded ``--output-tokens``
tokens (the trace is a recording: every mode gets the same prompts). Users are closed-loop: a
user's next turn is sent when its previous answer is complete, all users at once.

``--rounds`` rounds, each a fresh trace (new token ids: nothing any cache holds matches it)
replayed in every mode, the order of the modes rotating from round to round, so the machine's
other work falls on every mode alike.

Measured per mode, on the router's clock (the engines share the machine's clock):

- TTFT: a request's arrival at the router to its first output token at the engine that answers
  the user (P/D: the consumer's first token, so the producer's prefill and the handoff count);
- throughput: output tokens (and requests) per second over the whole replay;
- recomputed tokens: the prompt tokens the engines computed (prompt length less vLLM's
  ``num_cached_tokens``: its own prefix cache plus what the connector loaded); P/D counts the
  producer's and the consumer's;
- the generated tokens, compared with plain vLLM's (greedy, fp32: loading KV must not change
  them).

The table pools every request of every round (p50, p99 over them; throughput over the
replays' summed wall time); each ratio (``/ plain``) is the quotient of the two figures of that
table, from the same rounds, and the per-round table gives each round's own. The machine
is shared: the results record the load average and the CPU pressure (PSI) before and after
each mode.

    .venv/bin/python benchmarks/bench_serving.py --out benchmarks/results/serving-cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from kvbroker._bench._common import pct

RESULT_TAG = "SERVING-RESULT "  # a worker's reply lines; vLLM's own logs go around them
MODES = ("plain", "kvbroker", "pd")
VOCAB = 2048
READY_TIMEOUT = 600.0


# ------------------------------------------------------------------------------ the model
def make_model(path: str, layers: int, hidden: int, seed: int = 0) -> dict:
    """A Llama-shaped model with seeded random weights saved to ``path``; its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads = hidden // 64
    cfg = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path)
    cfg["parameters"] = sum(p.numel() for p in model.parameters())
    return cfg


# ------------------------------------------------------------------------------ an engine
def worker(spec: dict) -> None:
    """One engine: requests as JSON lines on stdin, replies as tagged JSON lines on stdout."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints; the router reads only the tagged lines

    def reply(obj: dict) -> None:
        out.write(RESULT_TAG + json.dumps(obj) + "\n")
        out.flush()

    kw = {}
    if spec.get("role"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVBrokerConnector",
            kv_role=spec["role"],
            kv_connector_module_path="kvbroker.integrations.vllm",
            kv_connector_extra_config={"socket": spec["socket"]},
        )
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=16,
        seed=0,
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_prefix_caching=True,
        distributed_executor_backend="uni",
        **kw,
    )
    engine = llm.llm_engine
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            inbox.put(json.loads(line))
        inbox.put({"stop": True})

    threading.Thread(target=read, daemon=True).start()
    reply({"ready": True})
    first: dict[str, float] = {}
    stopping = False
    while True:
        while True:  # take what arrived; block only when there is nothing to step
            try:
                msg = inbox.get(block=not engine.has_unfinished_requests() and not stopping)
            except queue.Empty:
                break
            if msg.get("stop"):
                stopping = True
                break
            params = SamplingParams(
                max_tokens=msg["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
            )
            engine.add_request(msg["id"], {"prompt_token_ids": msg["prompt"]}, params)
        if stopping and not engine.has_unfinished_requests():
            break
        if not engine.has_unfinished_requests():
            continue
        outputs = engine.step()
        now = time.time()
        for o in outputs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = now
            if o.finished:
                reply(
                    {
                        "id": o.request_id,
                        "first_token_at": first.pop(o.request_id, now),
                        "finished_at": now,
                        "cached": o.num_cached_tokens or 0,
                        "prompt_tokens": len(o.prompt_token_ids or ()),
                        "output": list(o.outputs[0].token_ids),
                    }
                )
    totals = None
    if spec.get("role"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        w = get_kv_transfer_group()._worker
        w.take_stats()
        totals = dict(w.totals)
    reply({"stopped": True, "connector": totals})
    out.flush()
    os._exit(0)  # vLLM's teardown takes seconds here and measures nothing


class Engine:
    """An engine process and the thread that reads its replies."""

    def __init__(self, name: str, spec: dict, log_path: str, replies: queue.Queue):
        self.name = name
        self.log_path = log_path
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
        }
        self.log = open(self.log_path, "wb")  # noqa: SIM115  (the process's, until stop())
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            cwd=ROOT,
            text=True,
            bufsize=1,
        )
        self.replies = replies
        self.ready = threading.Event()
        self.stopped: dict | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith(RESULT_TAG):
                continue
            msg = json.loads(line[len(RESULT_TAG) :])
            if msg.get("ready"):
                self.ready.set()
            elif msg.get("stopped"):
                self.stopped = msg
            else:
                self.replies.put((self.name, msg))
        self.replies.put((self.name, {"exited": self.proc.wait()}))

    def send(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.proc.stdin.write(
            json.dumps({"id": rid, "prompt": prompt, "max_tokens": max_tokens}) + "\n"
        )
        self.proc.stdin.flush()

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not self.ready.wait(1.0):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"engine {self.name} did not start:\n{self.tail()}")

    def stop(self) -> dict | None:
        """Close its input; the connector's totals it reported on the way out."""
        if self.log.closed:
            return self.stopped
        try:
            self.proc.stdin.close()
            self.proc.wait(120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.stopped

    def tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]


# ------------------------------------------------------------------------------ the trace
def make_trace(
    conversations: int, turns: int, system: int, user: int, output: int, seed: int = 1
) -> list[list[dict]]:
    """Per conversation, its turns: {"prompt": ids, "reply": the recorded answer's ids}."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    shared = ids(system)
    trace = []
    for _ in range(conversations):
        history, conv = list(shared), []
        for _ in range(turns):
            history += ids(user)
            reply = ids(output)
            conv.append({"prompt": list(history), "reply": reply})
            history += reply
        trace.append(conv)
    return trace


def replay(
    mode: str,
    engines: dict[str, Engine],
    replies: queue.Queue,
    trace: list[list[dict]],
    output: int,
    timeout: float,
) -> list[dict]:
    """Replay ``trace`` closed-loop; one record per request, in trace order."""
    conversations, turns = len(trace), len(trace[0])
    names = sorted(engines)
    records: dict[str, dict] = {}

    def submit(c: int, t: int) -> None:
        index = t * conversations + c  # the trace's order: turn by turn, user by user
        rid = f"c{c}t{t}"
        rec = {
            "id": rid,
            "conversation": c,
            "turn": t,
            "index": index,
            "prompt_tokens": len(trace[c][t]["prompt"]),
            "arrived": time.time(),
        }
        records[rid] = rec
        if mode == "pd":
            rec["engine"] = "producer"
            engines["producer"].send(rid, trace[c][t]["prompt"], 1)
        else:
            rec["engine"] = names[index % len(names)]
            engines[rec["engine"]].send(rid, trace[c][t]["prompt"], output)

    started = time.time()
    for c in range(conversations):
        submit(c, 0)
    left = conversations * turns
    deadline = time.monotonic() + timeout
    while left:
        try:
            name, msg = replies.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise RuntimeError(
                f"{mode}: {left} requests unanswered after {timeout:.0f} s"
            ) from None
        if "exited" in msg:
            raise RuntimeError(
                f"{mode}: engine {name} exited ({msg['exited']}):\n{engines[name].tail()}"
            )
        rec = records[msg["id"]]
        c, t = rec["conversation"], rec["turn"]
        if mode == "pd" and name == "producer":
            rec.update(
                producer_first_token=msg["first_token_at"] - rec["arrived"],
                producer_cached=msg["cached"],
                handed_off=time.time(),
            )
            engines["consumer"].send(rec["id"], trace[c][t]["prompt"], output)
            continue
        rec.update(
            ttft=msg["first_token_at"] - rec["arrived"],
            latency=msg["finished_at"] - rec["arrived"],
            cached=msg["cached"],
            output=msg["output"],
            answered_by=name,
        )
        recomputed = rec["prompt_tokens"] - msg["cached"]
        if mode == "pd":
            recomputed += rec["prompt_tokens"] - rec["producer_cached"]
        rec["recomputed"] = recomputed
        left -= 1
        if t + 1 < turns:
            submit(c, t + 1)
    wall = time.time() - started
    out = sorted(records.values(), key=lambda r: r["index"])
    for r in out:
        r["wall_s"] = wall
    return out


def summarize(
    mode: str, recs: list[dict], walls: list[float], reference: list[dict] | None
) -> dict:
    """One mode's figures over ``recs`` (every request of the rounds given) and the replays'
    wall times; ``reference``: plain vLLM's records of the same rounds, in the same order."""
    ttft = [r["ttft"] for r in recs]
    wall = sum(walls)
    outputs = sum(len(r["output"]) for r in recs)
    row = {
        "mode": mode,
        "requests": len(recs),
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft),
        "output_tokens_per_s": outputs / wall,
        "requests_per_s": len(recs) / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
        "recomputed_tokens": sum(r["recomputed"] for r in recs),
    }
    if reference is not None:
        row["outputs_equal_plain"] = sum(
            a["output"] == b["output"] for a, b in zip(recs, reference, strict=True)
        )
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's ``ttft_p50_vs_plain`` and ``throughput_vs_plain``: quotients of that row's
    figures and plain vLLM's row beside it (the same rounds)."""
    base = next((r for r in rows if r["mode"] == "plain"), None)
    for r in rows:
        if base is not None:
            r["ttft_p50_vs_plain"] = r["ttft_p50_s"] / base["ttft_p50_s"]
            r["throughput_vs_plain"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    return rows


ROLES = {
    "plain": {"engine0": None, "engine1": None},
    "kvbroker": {"engine0": "kv_both", "engine1": "kv_both"},
    "pd": {"producer": "kv_producer", "consumer": "kv_consumer"},
}


def start_mode(mode: str, a, model: str, socket: str | None, workdir: str) -> dict:
    spec = {
        "model": model,
        "block_size": a.block_size,
        "kv_cache_bytes": a.kv_cache_mib << 20,
        "max_model_len": a.max_model_len,
        "max_num_batched_tokens": a.batched_tokens,
        "socket": socket,
    }
    replies: queue.Queue = queue.Queue()
    engines = {
        n: Engine(n, {**spec, "role": r}, os.path.join(workdir, f"{mode}-{n}.log"), replies)
        for n, r in ROLES[mode].items()
    }
    return {"engines": engines, "replies": replies}


def warm_up(mode: str, group: dict, a) -> None:
    """Wait for the engines; one untimed request each, sharing nothing with any trace."""
    engines, replies = group["engines"], group["replies"]
    for e in engines.values():
        e.wait_ready(READY_TIMEOUT)
    warm = make_trace(1, 1, 0, a.user_tokens, a.output_tokens, seed=10_000)[0][0]["prompt"]
    for n, e in engines.items():
        e.send(f"warmup-{n}", warm, a.output_tokens)
    for _ in engines:
        name, msg = replies.get(timeout=READY_TIMEOUT)
        if "exited" in msg:
            raise RuntimeError(
                f"{mode}: engine {name} exited while warming up:\n{engines[name].tail()}"
            )


def markdown(res: dict) -> str:
    from kvbroker._bench._common import format_value

    p = res["params"]
    lines = [
        "# Serving benchmark: vLLM CPU engines, multi-turn shared-prefix trace",
        "",
        f"Commit `{res['commit']}`, `{res['command']}`.",
        "",
        (
            f"Model: Llama-shaped, {p['layers']} layers, hidden {p['hidden']}, "
            f"{res['model']['parameters'] / 1e6:.0f} M parameters, fp32, random weights. "
            f"Trace: {p['conversations']} users x {p['turns']} turns, {p['system_tokens']}-token "
            f"shared system prompt, {p['user_tokens']} new tokens a turn, "
            f"{p['output_tokens']} output tokens a request; {p['rounds']} rounds, each a fresh "
            "trace replayed in every mode. Over every request of every round:"
        ),
        "",
        (
            "| mode | TTFT p50 | TTFT p99 | TTFT p50 / plain | output tok/s | / plain | "
            "recomputed / prompt tokens | outputs = plain |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['mode']} | {r['ttft_p50_s'] * 1e3:.0f} ms | {r['ttft_p99_s'] * 1e3:.0f} ms | "
            f"{format_value(r['ttft_p50_vs_plain'], 'ratio')} | {r['output_tokens_per_s']:.2f} | "
            f"{format_value(r['throughput_vs_plain'], 'ratio')} | "
            f"{r['recomputed_tokens']:,} / {r['prompt_tokens']:,} | "
            f"{r.get('outputs_equal_plain', r['requests'])}/{r['requests']} |"
        )
    lines += [
        "",
        "Per round (the order of the modes rotates from round to round):",
        "",
        (
            "| round | mode | TTFT p50 | TTFT p50 / plain | output tok/s | / plain | load | "
            "CPU pressure (some avg60) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for rnd in res["rounds"]:
        for r in rnd["rows"]:
            c = rnd["conditions"][r["mode"]]
            lines.append(
                f"| {rnd['round']} | {r['mode']} | {r['ttft_p50_s'] * 1e3:.0f} ms | "
                f"{format_value(r['ttft_p50_vs_plain'], 'ratio')} | "
                f"{r['output_tokens_per_s']:.2f} | {format_value(r['throughput_vs_plain'], 'ratio')}"
                f" | {c['before']['loadavg_1min']:.1f} → {c['after']['loadavg_1min']:.1f} | "
                f"{psi_avg60(c['before'])} → {psi_avg60(c['after'])} % |"
            )
    return "\n".join(lines) + "\n"


def psi_avg60(cond: dict) -> str:
    """The 60-second average of the CPU pressure line a run_conditions() recorded."""
    for part in (cond.get("cpu_pressure") or "").split():
        if part.startswith("avg60="):
            return part[6:]
    return "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--conversations", type=int, default=5)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=160)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-mib", type=int, default=384)
    ap.add_argument("--pool-size", default="2G")
    ap.add_argument("--replay-timeout", type=float, default=900.0)
    ap.add_argument("--model-dir", help="reuse (or build) the random-weight model here")
    ap.add_argument("--out", help="write PREFIX.json and PREFIX.md")
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0
    from kvbroker._bench._common import (
        invocation,
        machine_info,
        measured_commit,
        run_conditions,
        spawned_daemon,
        write_results,
    )

    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if set(modes) - set(MODES) or a.conversations % 2 == 0 or "plain" not in modes:
        ap.error(f"modes are {', '.join(MODES)}, plain among them; --conversations must be odd")
    workdir = tempfile.mkdtemp(prefix="kvb-serving-")
    model = a.model_dir or os.path.join(workdir, "model")
    cfg_path = os.path.join(model, "bench_model.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            model_cfg = json.load(f)
    else:
        model_cfg = make_model(model, a.layers, a.hidden)
        with open(cfg_path, "w") as f:
            json.dump(model_cfg, f)
    traces = [
        make_trace(
            a.conversations, a.turns, a.system_tokens, a.user_tokens, a.output_tokens, seed=1 + r
        )
        for r in range(a.rounds)
    ]
    if max(len(t["prompt"]) for c in traces[0] for t in c) + a.output_tokens > a.max_model_len:
        ap.error("the trace's longest prompt does not fit --max-model-len")
    result = {
        "benchmark": "serving",
        "commit": measured_commit(),
        "command": invocation(),
        "machine": machine_info(),
        "conditions_start": run_conditions(),
        "params": {k: v for k, v in vars(a).items() if k != "worker"},
        "model": model_cfg,
        "rounds": [],
        "requests": {m: [] for m in modes},
    }

    def note(text):
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    # Every mode's engines live through the whole run, each mode with its own daemon; a round
    # replays a fresh trace (new tokens: no cache holds any of it) in every mode in turn.
    with contextlib.ExitStack() as stack:
        groups = {}
        for mode in modes:
            sock = stack.enter_context(spawned_daemon(a.pool_size)) if mode != "plain" else None
            groups[mode] = start_mode(mode, a, model, sock, workdir)
            stack.callback(lambda g=groups[mode]: [e.stop() for e in g["engines"].values()])
        for mode in modes:
            warm_up(mode, groups[mode], a)
        note("engines ready")
        all_recs = {m: [] for m in modes}
        walls = {m: [] for m in modes}
        for r, trace in enumerate(traces):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            recs, conds = {}, {}
            for mode in order:
                note(f"round {r + 1}: {mode}")
                g = groups[mode]
                before = run_conditions()
                recs[mode] = replay(
                    mode, g["engines"], g["replies"], trace, a.output_tokens, a.replay_timeout
                )
                conds[mode] = {"before": before, "after": run_conditions()}
            rows = with_ratios(
                [
                    summarize(
                        m, recs[m], [recs[m][0]["wall_s"]], None if m == "plain" else recs["plain"]
                    )
                    for m in modes
                ]
            )
            result["rounds"].append(
                {"round": r + 1, "order": order, "rows": rows, "conditions": conds}
            )
            for m in modes:
                all_recs[m] += recs[m]
                walls[m].append(recs[m][0]["wall_s"])
                result["requests"][m] += [
                    {k: v for k, v in x.items() if k != "output"} for x in recs[m]
                ]
            note(json.dumps(rows))
        result["rows"] = with_ratios(
            [
                summarize(m, all_recs[m], walls[m], None if m == "plain" else all_recs["plain"])
                for m in modes
            ]
        )
        result["connector"] = {}
        for mode in modes:  # the engines' connector totals, reported as they stop
            result["connector"][mode] = {
                n: (e.stop() or {}).get("connector") for n, e in groups[mode]["engines"].items()
            }
    result["conditions_end"] = run_conditions()
    write_results(a.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
