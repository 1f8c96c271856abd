"""Run one vLLM engine over token-id prompts and write its greedy outputs as JSON.

A helper of tests/test_vllm_e2e.py (run as a separate process, as a deployment would):

    python -m tests.vllm_helpers.engine SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[ids...]...], "max_tokens": n, "role": null |
"kv_producer" | "kv_consumer" | "kv_both", "socket": path, "extra": {...},
"block_size": 32, "in_process": true, "vllm_log_level": "DEBUG"}. OUT: {"outputs": [[ids...]...], "seconds": s}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_model(path: str, *, arch: str = "llama", seed: int = 0) -> None:
    """A tiny model with seeded random weights, saved to ``path`` (no download)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=2048, torch_dtype="float32")
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path)


def run(spec: dict) -> dict:
    begun = time.perf_counter()
    if spec.get("vllm_log_level"):  # before vLLM is imported; its engine core inherits it
        os.environ["VLLM_LOGGING_LEVEL"] = spec["vllm_log_level"]
    if spec.get("in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("role"):
        extra = {"socket": spec["socket"], **spec.get("extra", {})}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVBrokerConnector",
            kv_connector_module_path="kvbroker.integrations.vllm",
            kv_role=spec["role"], kv_connector_extra_config=extra,
        )
    if spec.get("in_process", True):
        kw["distributed_executor_backend"] = "uni"
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              block_size=spec.get("block_size", 32), kv_cache_memory_bytes=64 << 20,
              max_model_len=2048, max_num_seqs=8, seed=0,
              enable_prefix_caching=spec.get("prefix_caching", True), **kw)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False,
                            ignore_eos=True)
    started = time.perf_counter()
    print(f"engine ready in {started - begun:.1f} s", file=sys.stderr, flush=True)
    outputs = []
    for batch in spec.get("batches") or [spec["prompts"]]:
        got = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        outputs += [list(o.outputs[0].token_ids) for o in got]
    # An engine core in its own process (in_process False) is shut down here: os._exit below
    # would leave it running.
    llm.llm_engine.engine_core.shutdown()
    return {"outputs": outputs, "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's teardown takes seconds on this machine and proves nothing here; the kernel
    # closes the broker connections (the daemon frees whatever they held).
    os._exit(0)
