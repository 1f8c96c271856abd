"""What a 16k-token KV load costs the other requests' steps: synchronous against load_async.

The vLLM connector's worker (``kvbroker.integrations.vllm._worker.WorkerSide``, driven as
vLLM drives it, without vLLM) on one GPU, with a daemon of its own. An engine step is
``--step-ms`` of GPU work on the engine's stream (bf16 matmuls, calibrated first) followed
by a host sync, as vLLM's sampler waits for its tokens. At step ``--arrive`` a request whose
KV the broker holds is planned: a Llama-3-8B-shaped KV of 16k tokens (32 layers, 8 KV heads,
head_dim 128, bf16: 2 GiB) in a vLLM 0.32 CUDA cache (NHD; block size 16).

- **sync** (the connector's default): ``start_load`` before the step's forward, as vLLM calls
  it when a step has synchronous loads; that step waits for the whole load, and the request
  runs in it.
- **load_async**: the load is marked ``background``; ``start_load`` after the forward is
  launched (vLLM's order for such loads); every step ends by asking ``finished_loads`` (vLLM's
  ``get_finished``), and the request runs in the step after the one that reports it.

Per mode, medians over ``--reps`` scenarios: the step time with no load running, the longest
step from the arrival until the load is over, and the time from the arrival to the end of the
step the request first runs in. Every load is checked bit-exact against the published blocks
(a sample of them). Writes ``DIR/NAME.json`` and ``DIR/NAME.md`` with the commit, machine and
command line.

Usage: ``python benchmarks/bench_vllm_async_load.py --out DIR [--reps 3] [--step-ms 10]``;
``--report-only JSON`` rewrites the markdown of an earlier run from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vllm_gpu import start_daemon, vllm_cache  # noqa: E402

from kvbroker._bench import checkout_commit  # noqa: E402
from kvbroker._bench._common import ratio as _ratio  # noqa: E402
from kvbroker.integrations._link import BrokerLink, Warnings  # noqa: E402
from kvbroker.integrations.vllm._paged import cuda_cache  # noqa: E402
from kvbroker.integrations.vllm._scheduler import LoadSpec, SaveSpec, StepPlan  # noqa: E402
from kvbroker.integrations.vllm._worker import WorkerSide  # noqa: E402

NS = "vllm/bench-async"


def worker(sock: str, a, caches) -> WorkerSide:
    w = WorkerSide(
        link=BrokerLink(
            sock,
            name="bench-async",
            role="kv_both",
            map_pools=True,
            timeout=60.0,
            warnings=Warnings(),
        ),
        namespace=NS,
        block_size=a.block_size,
        total_kv_heads=a.heads,
        latent=False,
        tp_rank=0,
        tp_size=1,
        warnings=Warnings(),
    )
    w.register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)}, "FLASH_ATTN")
    return w


class Forward:
    """``step_ms`` of GPU work on the current stream: bf16 matmuls, their count calibrated."""

    def __init__(self, step_ms: float, device) -> None:
        self.a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        for _ in range(3):
            torch.matmul(self.a, self.a, out=self.out)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            torch.matmul(self.a, self.a, out=self.out)
        torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / 50
        self.count = max(1, round(step_ms / 1e3 / per))

    def launch(self) -> None:
        for _ in range(self.count):
            torch.matmul(self.a, self.a, out=self.out)


def scenario(a, consumer: WorkerSide, forward: Forward, hashes, dst_ids, background: bool) -> dict:
    """One run of ``a.steps`` steps, the request arriving at ``a.arrive``."""
    steps, arrive_t, reported, ran_end = [], None, None, None
    spec = LoadSpec("r", hashes, dst_ids, background=background)
    for i in range(a.steps):
        plan = StepPlan(loads=[spec] if i == a.arrive else [])
        t0 = time.perf_counter()
        if i == a.arrive:
            arrive_t = t0
        consumer.bind(plan)
        if not background:
            consumer.start_load()  # before the forward: vLLM's order with synchronous loads
        forward.launch()
        if background:
            consumer.start_load()  # after the forward's launch: vLLM's order for async loads
        torch.cuda.current_stream().synchronize()  # the sampler's tokens
        done = consumer.finished_loads()
        consumer.unbind()
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        if i == a.arrive and not background:
            reported, ran_end = i, t1  # loaded before the forward: it ran in this step
        elif background and done and "r" in done:
            reported = i
        elif background and reported is not None and ran_end is None:
            ran_end = t1  # the step after the report: the request's first
    assert reported is not None and ran_end is not None, "the load did not finish in time"
    errors = consumer.load_errors()
    assert not errors, f"blocks not loaded: {sorted(errors)[:5]}"
    quiet = steps[: a.arrive]
    during = steps[a.arrive : reported + 1]
    return {
        "steps_s": steps,
        "quiet_step_s": statistics.median(quiet),
        "longest_step_during_load_s": max(during),
        "arrival_to_first_run_s": ran_end - arrive_t,
        "reported_at_step": reported,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--name", default="vllm-async-load")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--arrive", type=int, default=8)
    ap.add_argument("--commit", help="the commit measured, where the checkout has no usable git")
    ap.add_argument("--report-only", metavar="JSON", help="rewrite JSON's markdown beside it")
    a = ap.parse_args()
    if a.report_only:
        with open(a.report_only) as f:
            md = markdown(json.load(f))
        with open(os.path.splitext(a.report_only)[0] + ".md", "w") as f:
            f.write(md)
        print(md)
        return
    os.makedirs(a.out, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    nblk = a.tokens // a.block_size
    L, H, D, page = a.layers, a.heads, a.head_dim, a.block_size
    r: dict = {
        "commit": a.commit or checkout_commit(ROOT),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(shlex.quote(x) for x in ["python", *sys.argv]),
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(0),
        },
        "params": {
            k: getattr(a, k)
            for k in (
                "reps",
                "tokens",
                "layers",
                "heads",
                "head_dim",
                "block_size",
                "step_ms",
                "steps",
                "arrive",
            )
        },
    }
    src = vllm_cache(L, nblk + 8, H, page, D, device, "NHD")
    dst = vllm_cache(L, nblk + 8, H, page, D, device, "NHD", seed=1)
    d = tempfile.mkdtemp(prefix="kvb")
    sock = os.path.join(d, "kvb.sock")
    kv_bytes = nblk * L * 2 * H * page * D * 2
    proc = start_daemon(sock, (kv_bytes >> 20) + 512)
    try:
        producer, consumer = worker(sock, a, src), worker(sock, a, dst)
        hashes = [f"{i:032x}" for i in range(1, nblk + 1)]
        src_ids, dst_ids = list(range(8, nblk + 8)), list(range(nblk))[::-1]
        producer.bind(
            StepPlan(
                saves=[
                    SaveSpec(
                        "p",
                        [
                            (h, hashes[i - 1] if i else None, b)
                            for i, (h, b) in enumerate(zip(hashes, src_ids, strict=True))
                        ],
                    )
                ]
            )
        )
        producer.wait_for_save()
        producer.unbind()
        assert producer.take_stats()["saved_blocks"] == nblk, "the KV was not published whole"
        forward = Forward(a.step_ms, device)
        r["forward_matmuls"] = forward.count
        s6, d6 = cuda_cache(src, "packed"), cuda_cache(dst, "packed")
        runs: dict[str, list[dict]] = {"sync": [], "load_async": []}
        for rep in range(a.reps + 1):  # the first round warms up both
            for mode in ("sync", "load_async"):  # alternated
                for t in dst:
                    t.zero_()
                torch.cuda.synchronize()
                got = scenario(a, consumer, forward, hashes, dst_ids, mode == "load_async")
                sample = list(zip(src_ids, dst_ids, strict=True))[:: max(1, nblk // 64)]
                assert all(
                    torch.equal(s6[:, :, x].view(torch.int16), d6[:, :, y].view(torch.int16))
                    for x, y in sample
                ), f"{mode}: the loaded blocks differ"
                if rep:
                    runs[mode].append(got)
                print(mode, {k: v for k, v in got.items() if k != "steps_s"}, flush=True)
        producer.close()
        consumer.close()
    finally:
        proc.terminate()
        proc.wait(30)
    r["kv_bytes"] = kv_bytes
    r["runs"] = runs
    r["summary"] = {
        mode: {
            key: statistics.median(x[key] for x in rs)
            for key in ("quiet_step_s", "longest_step_during_load_s", "arrival_to_first_run_s")
        }
        for mode, rs in runs.items()
    }
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(r, f, indent=2)
    md = markdown(r)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write(md)
    print(md)


def markdown(r: dict) -> str:
    p, s = r["params"], r["summary"]
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    lines = [
        f"# A 16k-token KV load beside the engine's steps ({r['machine']['device']})",
        "",
        f"commit {r['commit']}, {r['when']}; `{r['command']}`",
        "",
        f"{p['tokens']} tokens ({_ratio(r['kv_bytes'] / 2**30)} GiB, {p['layers']} layers, "
        f"{p['heads']} KV heads, head_dim {p['head_dim']}, bf16, NHD, block size "
        f"{p['block_size']}); a step: {r['forward_matmuls']} bf16 4096² matmuls (about "
        f"{p['step_ms']:g} ms) and a host sync; the request arrives at step {p['arrive']}. "
        f"Medians of {p['reps']} scenarios per mode, alternated.",
        "",
        "| mode | step, no load (ms) | longest step while loading (ms) | arrival to the end "
        "of the request's first step (ms) |",
        "|---|---|---|---|",
    ]
    for mode in ("sync", "load_async"):
        m = s[mode]
        lines.append(
            f"| {mode} | {ms(m['quiet_step_s'])} | {ms(m['longest_step_during_load_s'])} "
            f"| {ms(m['arrival_to_first_run_s'])} |"
        )
    lines += [
        "",
        "Each scenario (longest step while loading / arrival to the end of the "
        "request's first step, ms; the step whose end reported the load):",
    ]
    for mode in ("sync", "load_async"):
        each = "; ".join(
            f"{ms(x['longest_step_during_load_s'])} / "
            f"{ms(x['arrival_to_first_run_s'])} (step {x['reported_at_step']})"
            for x in r["runs"][mode]
        )
        lines.append(f"- {mode}: {each}")
    sync, asy = s["sync"], s["load_async"]
    lines += [
        "",
        f"Longest step while a load runs, load_async / sync: "
        f"{_ratio(asy['longest_step_during_load_s'] / sync['longest_step_during_load_s'])}; "
        f"the request's own wait, load_async / sync: "
        f"{_ratio(asy['arrival_to_first_run_s'] / sync['arrival_to_first_run_s'])}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
