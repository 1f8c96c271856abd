"""Does an overlapped claim ever give the decode step other bytes than a serial one? (CUDA)

One published prompt cache, claimed over and over through a GpuClient, alternating
``claim_cache(overlap=True)`` (the default on CUDA: the step runs while the copies land) and
``overlap=False`` (every copy, then the step); every other overlapped claim starts behind a
GPU sleep on the copy stream, so its step reaches most layers before their copies have
landed. Each step's logits are compared bit for bit with the first serial claim's, and so
is each serial claim's: a serial mismatch is the GPU's own non-determinism, an overlapped
mismatch beyond that rate a read before a layer landed.

    python benchmarks/check_overlap.py [--size bench|8b] [--prompt-len 8192] [--rounds 40]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import models  # noqa: E402
from bench_ttft import decode_step, start_daemon  # noqa: E402

from kvbroker import Client  # noqa: E402
from kvbroker._bench._common import measured_commit  # noqa: E402
from kvbroker.gpu import GpuClient  # noqa: E402
from kvbroker.integrations import transformers as kvt  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", choices=("bench", "8b"))
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--pool-size", default="4G")
    p.add_argument("--commit", default=None)
    p.add_argument("--out", default=None, help="results stem (.json and .md)")
    args = p.parse_args(argv)
    model = models.build(size=args.size, dtype="bf16", seed=0, device="cuda",
                         max_positions=args.prompt_len + 8)  # fmt: skip
    prompt = models.prompt(args.prompt_len, seed=1, vocab=model.config.vocab_size)
    cache, last = models.prefill(model, prompt)
    first = int(last.argmax())
    daemon, sock = start_daemon(tempfile.mkdtemp(prefix="kvb-overlap-"), args.pool_size)
    counts = {"overlap": 0, "overlap_delayed": 0, "serial": 0}
    mismatches = {k: 0 for k in counts}
    try:
        with Client(sock, name="check-overlap") as plain, GpuClient(plain, device="cuda") as g:
            kvt.publish_cache(g, "req", cache, config=model.config)
            claimed = kvt.claim_cache(g, "req", model=model, device="cuda", consume=False,
                                      overlap=False)  # fmt: skip
            _, reference = decode_step(model, claimed.cache, first)
            for r in range(args.rounds):
                for kind in ("overlap", "serial"):
                    if kind == "overlap" and r % 2:
                        kind = "overlap_delayed"
                        with torch.cuda.stream(g.stream):
                            torch.cuda._sleep(int(2e7))  # ~10 ms of GPU clock on the copy stream
                    claimed = kvt.claim_cache(g, "req", model=model, device="cuda",
                                              consume=False, overlap=kind != "serial")  # fmt: skip
                    _, logits = decode_step(model, claimed.cache, first)
                    if claimed.landing is not None:
                        claimed.landing.finish()
                    counts[kind] += 1
                    mismatches[kind] += not torch.equal(logits, reference)
    finally:
        daemon.terminate()
        daemon.wait(30)
    result = {
        "benchmark": "check_overlap", "commit": args.commit or measured_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "model": args.size, "prompt_tokens": args.prompt_len,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "claims": counts, "logits_differing_from_the_first_serial_claim": mismatches,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(
            f"# Overlapped vs serial claims, first-step logits ({result['gpu']})\n\n"
            f"Command: `{result['command']}` at commit {result['commit']}, {result['when']}; "
            f"torch {result['torch']}, model {args.size}, {args.prompt_len} prompt tokens.\n\n"
            "| claims | count | logits differing from the first serial claim's |\n|---|---|---|\n"
            + "".join(f"| {k} | {counts[k]} | {mismatches[k]} |\n" for k in counts)
        )  # fmt: skip
    if os.environ.get("CHECK_OVERLAP_STRICT") and any(mismatches.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
