"""Does an overlapped claim ever give the decode step other bytes than a serial one? (CUDA)

Two published prompt caches, claimed in turn over and over through a GpuClient, alternating
``claim_cache(overlap=True)`` (the default on CUDA: the step runs while the copies land) and
``overlap=False`` (every copy, then the step); every other overlapped claim starts behind a
GPU sleep on the copy stream, so its step reaches most layers before their copies have
landed, and a claim's tensors reuse the blocks the other prompt's claim freed (its bytes are
what an early read would see). Each step's logits are compared bit for bit with its prompt's
first serial claim's, and so is each serial claim's: a serial mismatch is the GPU's own
non-determinism, an overlapped mismatch beyond that rate (or far larger) a read before a
layer landed. The largest logit difference and the changed next tokens tell the two apart.

    python benchmarks/check_overlap.py [--size bench|8b] [--prompt-len 8192] [--rounds 40]
        [--control]

``--control`` adds claims whose layer guards are taken off at once: the detector's own check
(those steps must differ).
"""

from __future__ import annotations

import argparse
import json
import math
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
from kvbroker.integrations.transformers._landing import _restore  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="bench", choices=("bench", "8b"))
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--pool-size", default="4G")
    p.add_argument("--commit", default=None)
    p.add_argument("--out", default=None, help="results stem (.json and .md)")
    p.add_argument(
        "--control",
        action="store_true",
        help="also claim with the layer guards taken off (each layer turned back "
        "into its own type at once, behind the GPU sleep): the step then "
        "reads before the copies land, which this check must show",
    )
    args = p.parse_args(argv)
    model = models.build(
        size=args.size, dtype="bf16", seed=0, device="cuda", max_positions=args.prompt_len + 8
    )
    # Two prompts, claimed in turn: a claim's tensors come from the caching allocator's blocks
    # the other prompt's claim just freed, so a read before its layer landed would see the
    # other prompt's keys and values, not by chance the same ones.
    prompts = {}
    for name, seed in (("a", 1), ("b", 2)):
        prompt = models.prompt(args.prompt_len, seed=seed, vocab=model.config.vocab_size)
        cache, last = models.prefill(model, prompt)
        prompts[name] = (cache, int(last.argmax()))
    daemon, sock = start_daemon(tempfile.mkdtemp(prefix="kvb-overlap-"), args.pool_size)
    kinds = ("overlap", "serial") + (("unguarded_control",) if args.control else ())
    counts = {"overlap": 0, "overlap_delayed": 0, "serial": 0}
    counts.update({k: 0 for k in kinds[2:]})
    mismatches = {k: 0 for k in counts}
    # How far a differing step is from its reference: a read before landing takes the other
    # prompt's bytes for a whole layer, far beyond the GPU's own rounding.
    max_diff = {k: 0.0 for k in counts}
    argmax_changed = {k: 0 for k in counts}
    try:
        with Client(sock, name="check-overlap") as plain, GpuClient(plain, device="cuda") as g:
            references = {}
            for name, (cache, first) in prompts.items():
                kvt.publish_cache(g, name, cache, config=model.config)
                claimed = kvt.claim_cache(
                    g, name, model=model, device="cuda", consume=False, overlap=False
                )
                references[name] = decode_step(model, claimed.cache, first)[1]
            del cache, claimed
            prompts = {name: first for name, (_, first) in prompts.items()}  # (caches freed)
            for r in range(args.rounds):
                for name, first in prompts.items():
                    reference = references[name]
                    for kind in kinds:
                        if kind == "overlap" and r % 2:
                            kind = "overlap_delayed"
                        if kind in ("overlap_delayed", "unguarded_control"):
                            with torch.cuda.stream(g.stream):
                                torch.cuda._sleep(int(2e7))  # ~10 ms of GPU clock, copy stream
                        claimed = kvt.claim_cache(
                            g,
                            name,
                            model=model,
                            device="cuda",
                            consume=False,
                            overlap=kind != "serial",
                        )
                        if kind == "unguarded_control":
                            for layer in claimed.cache.layers:
                                _restore(layer)  # no wait: the step reads what is there
                        _, logits = decode_step(model, claimed.cache, first)
                        if claimed.landing is not None:
                            claimed.landing.finish()
                        del claimed
                        counts[kind] += 1
                        mismatches[kind] += not torch.equal(logits, reference)
                        diff = (logits.float() - reference.float()).abs().max().item()
                        diff = diff if math.isfinite(diff) else math.inf
                        max_diff[kind] = max(max_diff[kind], diff)
                        argmax_changed[kind] += int(logits.argmax() != reference.argmax())
    finally:
        daemon.terminate()
        daemon.wait(30)
    spans = [(float(x.float().min()), float(x.float().max())) for x in references.values()]
    result = {
        "benchmark": "check_overlap",
        "commit": args.commit or measured_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.size,
        "prompt_tokens": args.prompt_len,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "claims": counts,
        "logits_differing_from_the_first_serial_claim": mismatches,
        "max_abs_logit_difference": max_diff,
        "argmax_changed": argmax_changed,
        "reference_logit_range": [min(lo for lo, _ in spans), max(hi for _, hi in spans)],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(
            f"# Overlapped vs serial claims, first-step logits ({result['gpu']})\n\n"
            f"Command: `{result['command']}` at commit {result['commit']}, {result['when']}; "
            f"torch {result['torch']}, model {args.size}, {args.prompt_len} prompt tokens.\n\n"
            "| claims | count | logits differing from the first serial claim's | largest "
            "logit difference | next token changed |\n|---|---|---|---|---|\n"
            + "".join(
                f"| {k} | {counts[k]} | {mismatches[k]} | {max_diff[k]:.4g} | "
                f"{argmax_changed[k]} |\n"
                for k in counts
            )
            + "\nThe reference's logits span {:.4g} to {:.4g}.\n".format(
                *result["reference_logit_range"]
            )
        )
    if os.environ.get("CHECK_OVERLAP_STRICT") and any(mismatches.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
