"""Disaggregated prefill -> decode through a running kvbroker daemon, with a transformers model.

Nothing is downloaded: the model is built from a config with seeded random weights
(examples/models.py), so the prefill and decode processes hold bit-identical weights.

    python examples/disaggregated.py                  # demo: all variants, checked end to end
    python examples/disaggregated.py prefill ...      # one role (see --help of each)
    python examples/disaggregated.py decode ...

The demo uses the daemon on $KVBROKER_SOCKET (else the default socket) and starts a private
one if none is running. It runs two processes side by side:

- **prefill** computes the KV cache of ``system + user_a`` in one forward and publishes it
  three ways: under the request key (``plain``), as P head shards (``tp``: emulated prefill
  TP ranks, kvbroker.kv), and as prefix blocks (``prefix``: it is DP rank A).
- **decode** waits for the request, claims it and generates greedily (``plain``); claims the
  heads of each of D emulated decode TP ranks and reassembles them (``tp``); and, as DP rank
  B with prompt ``system + user_b``, reuses rank A's published system-prompt blocks and
  prefills only the rest (``prefix``).

Then the demo generates the same requests in one process without the broker and checks that
the tokens and the first decode step's logits are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VARIANTS = ("plain", "tp", "prefix")


def _prompts(args) -> tuple[list[int], list[int]]:
    """(rank A's prompt, rank B's prompt): a shared system prompt and two user turns."""
    from models import prompt

    system = prompt(args.system_len, seed=args.seed + 100)
    return (
        system + prompt(args.user_len, seed=args.seed + 101),
        system + prompt(args.user_len + 3, seed=args.seed + 102),
    )


def _setup(args):
    import torch
    from models import build

    torch.set_num_threads(args.threads)  # same kernels in every process: bit-exact comparisons
    return build(args.arch, args.dtype, seed=args.seed)


def _prefix_cache(client, args):
    from kvbroker.prefix import PrefixCache

    # The namespace names the model: blocks of another model never match.
    return PrefixCache(
        client, namespace=f"ex-{args.arch}-{args.dtype}-s{args.seed}", block_size=args.block_size
    )


def role_prefill(args) -> dict:
    import numpy as np
    from models import prefill

    from kvbroker import Client
    from kvbroker.integrations import transformers as kvt

    model = _setup(args)
    prompt_a, _ = _prompts(args)
    started = time.perf_counter()
    cache, last_logits = prefill(model, prompt_a)
    first = int(last_logits.argmax())
    compute = time.perf_counter() - started
    report = {
        "role": "prefill",
        "prompt_tokens": len(prompt_a),
        "first_token": first,
        "prefill_s": round(compute, 4),
    }
    heads = kvt.KVSpec.from_model(model).num_kv_heads
    with Client(args.socket, name="example-prefill") as client:
        # The decode side waits on the plain request, so it is published last.
        if "prefix" in args.variants:
            pc = _prefix_cache(client, args)
            report["prefix_blocks_new"] = kvt.publish_prefix(
                pc, prompt_a, cache, config=model.config
            )
        if "tp" in args.variants:
            for rank in range(args.prefill_tp):  # each emulated prefill TP rank holds its heads
                shard = kvt.head_shard(cache, rank, args.prefill_tp, config=model.config)
                kvt.publish_tp_shard(
                    client,
                    args.request,
                    shard,
                    tp_rank=rank,
                    tp_size=args.prefill_tp,
                    total_kv_heads=heads,
                    decode_tp_size=args.decode_tp,
                )
            # The sampled token travels next to the KV (an engine's router would carry it).
            client.put(f"{args.request}/first", {"token": np.array([first], dtype=np.int64)})
        if "plain" in args.variants:
            published = kvt.publish_cache(
                client, args.request, cache, config=model.config, extra={"next_token": first}
            )
            report["plain_bytes"] = published.nbytes
            report["publish_s"] = round(published.seconds, 4)
    return report


def _save(out_dir: Path, variant: str, tokens, logits, **facts) -> dict:
    import torch

    torch.save({"tokens": tokens, "logits": logits.cpu()}, out_dir / f"{variant}.pt")
    return {"tokens": tokens, **facts}


def role_decode(args) -> dict:
    import numpy as np
    from models import greedy, prefill

    from kvbroker import Client
    from kvbroker.integrations import transformers as kvt

    model = _setup(args)
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvb-decode-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    _, prompt_b = _prompts(args)
    report: dict = {"role": "decode", "out": str(out_dir)}
    heads = kvt.KVSpec.from_model(model).num_kv_heads
    with Client(args.socket, name="example-decode") as client:
        if "plain" in args.variants:
            started = time.perf_counter()
            claimed = kvt.claim_cache(client, args.request, model=model, wait=args.wait)
            claim_s = time.perf_counter() - started
            tokens, logits = greedy(model, claimed.cache, claimed.meta["next_token"], args.steps)
            report["plain"] = _save(
                out_dir,
                "plain",
                tokens,
                logits,
                claimed_tokens=claimed.seq_len,
                claim_s=round(claim_s, 4),
                bytes=claimed.nbytes,
            )
        if "tp" in args.variants:
            first = client.get(f"{args.request}/first", consume=True, wait=args.wait)["token"]
            first = int(np.frombuffer(first, dtype=np.int64)[0])
            shards = [
                kvt.claim_tp_shard(
                    client,
                    args.request,
                    tp_rank=rank,
                    tp_size=args.decode_tp,
                    prefill_tp_size=args.prefill_tp,
                    model=model,
                    wait=args.wait,
                )
                for rank in range(args.decode_tp)
            ]  # each emulated decode TP rank
            cache = kvt.merge_head_shards(
                [s.cache for s in shards], total_kv_heads=heads, config=model.config
            )
            tokens, logits = greedy(model, cache, first, args.steps)
            report["tp"] = _save(
                out_dir,
                "tp",
                tokens,
                logits,
                shards_read=[s.result.keys for s in shards],
                local_heads=[s.cache.layers[0].keys.shape[1] for s in shards],
            )
        if "prefix" in args.variants:
            claimed = kvt.claim_prefix(_prefix_cache(client, args), prompt_b, model=model)
            cache, last_logits = prefill(model, prompt_b[claimed.seq_len :], claimed.cache)
            tokens, logits = greedy(model, cache, int(last_logits.argmax()), args.steps)
            report["prefix"] = _save(
                out_dir,
                "prefix",
                tokens,
                logits,
                reused_tokens=claimed.seq_len,
                prefilled_tokens=len(prompt_b) - claimed.seq_len,
            )
            import torch

            torch.save(last_logits.cpu(), out_dir / "prefix-last.pt")
    return report


def _daemon(socket_path: str | None):
    """The running daemon's socket, or a private daemon started for the demo (and its process)."""
    from kvbroker import BrokerUnavailable, Client
    from kvbroker._wire.paths import default_socket_path

    path = socket_path or default_socket_path()
    try:
        Client(path, map_pools=False).close()
        return path, None
    except BrokerUnavailable:
        pass
    path = os.path.join(tempfile.mkdtemp(prefix="kvb-demo-"), "kvb.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbroker", "serve", "--socket", path, "--pool-size", "256M"]
    )
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            Client(path, map_pools=False).close()
            print(f"started a private daemon on {path}")
            return path, proc
        except BrokerUnavailable:
            time.sleep(0.05)
    proc.terminate()
    raise SystemExit("could not start a daemon")


def _role_command(role: str, args, extra: list[str]) -> list[str]:
    common = [
        "--arch",
        args.arch,
        "--dtype",
        args.dtype,
        "--seed",
        str(args.seed),
        "--system-len",
        str(args.system_len),
        "--user-len",
        str(args.user_len),
        "--block-size",
        str(args.block_size),
        "--prefill-tp",
        str(args.prefill_tp),
        "--decode-tp",
        str(args.decode_tp),
        "--steps",
        str(args.steps),
        "--request",
        args.request,
        "--variants",
        ",".join(args.variants),
        "--socket",
        args.socket,
    ]
    return [sys.executable, __file__, role, *common, *extra]


def role_demo(args) -> dict:
    import torch
    from models import reference

    socket_path, daemon = _daemon(args.socket)
    args.socket = socket_path
    args.request = args.request or f"demo-{uuid.uuid4().hex[:8]}"
    out_dir = tempfile.mkdtemp(prefix="kvb-demo-out-")
    try:
        # Decode starts first and waits for the request to be published.
        decode = subprocess.Popen(
            _role_command("decode", args, ["--out", out_dir]), stdout=subprocess.PIPE, text=True
        )
        prefill = subprocess.run(
            _role_command("prefill", args, []), stdout=subprocess.PIPE, text=True, check=True
        )
        decoded, _ = decode.communicate(timeout=300)
        if decode.returncode:
            raise SystemExit(f"decode failed ({decode.returncode})")
        print("prefill:", prefill.stdout.strip())
        print("decode: ", decoded.strip())
        model = _setup(args)
        prompt_a, prompt_b = _prompts(args)
        ok = True
        for variant in args.variants:
            got = torch.load(Path(out_dir) / f"{variant}.pt")
            tokens, logits = reference(
                model, prompt_b if variant == "prefix" else prompt_a, args.steps
            )
            same = got["tokens"] == tokens and torch.equal(got["logits"], logits)
            ok &= same
            verdict = (
                "== single-process generation, first-step logits bit-identical"
                if same
                else "DIFFER from the single-process generation"
            )
            print(f"{variant:>6}: tokens {got['tokens']} {verdict}")
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(15)
    if not ok:
        raise SystemExit(1)
    return {"ok": ok}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", nargs="?", default="demo", choices=("demo", "prefill", "decode"))
    parser.add_argument("--arch", default="llama", help="llama, gpt_neox, qwen2 or mistral")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--system-len", type=int, default=40, help="shared system prompt tokens")
    parser.add_argument("--user-len", type=int, default=9)
    parser.add_argument("--block-size", type=int, default=16, help="prefix block tokens")
    parser.add_argument("--prefill-tp", type=int, default=2, help="P: emulated prefill TP ranks")
    parser.add_argument("--decode-tp", type=int, default=1, help="D: emulated decode TP ranks")
    parser.add_argument("--steps", type=int, default=8, help="tokens to decode")
    parser.add_argument("--request", default="")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--socket", default=os.environ.get("KVBROKER_SOCKET"))
    parser.add_argument("--wait", type=float, default=120.0, help="decode: seconds to wait")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (same everywhere)")
    parser.add_argument("--out", default="", help="decode: folder for the results")
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    if args.role != "demo" and not args.request:
        parser.error(f"{args.role} needs --request")
    report = {"demo": role_demo, "prefill": role_prefill, "decode": role_decode}[args.role](args)
    if args.role != "demo":
        print(json.dumps(report))


if __name__ == "__main__":
    main()
