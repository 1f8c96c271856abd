"""Run one vLLM engine over token-id prompts and write its greedy outputs as JSON.

A helper of tests/test_vllm_e2e.py (run as a separate process, as a deployment would):

    python -m tests.vllm_helpers.engine SPEC.json OUT.json

SPEC: {"model": dir, "prompts": [[ids...]...], "max_tokens": n, "role": null |
"kv_producer" | "kv_consumer" | "kv_both", "socket": path, "extra": {...}, "plugin": false,
"block_size": 32 (null: vLLM's choice), "in_process": true, "vllm_log_level": "DEBUG",
"dtype": "float32", "logprobs": null | k, "max_num_batched_tokens": null | n,
"lora_adapters": {name: dir}, "prompt_loras": [name | null, one per prompt of every batch]}.
OUT: {"outputs": [[ids...]...], "seconds": s, "logprobs": [[[token, logprob]...]...] (with
"logprobs": the sampled token's logprob at each step), "connector": {"totals": {...},
"groups": [[kind, block_size, layers]...], "namespace": ...} (an engine in process with a
connector: its worker's counters and KV cache groups)}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def make_model(path: str, *, arch: str = "llama", seed: int = 0) -> None:
    """A tiny model with seeded random weights, saved to ``path`` (no download).

    Hybrid kinds (vLLM's hybrid KV cache manager makes several KV cache groups of them):
    ``gemma3`` (3 sliding-window layers, window 32, and 1 full one: 4 groups of one layer),
    ``gemma4`` (the same, window 48, its full layer's head size twice the sliding ones': vLLM
    gives the groups different block sizes),
    ``granite4`` (3 Mamba2 layers and 1 attention one, fp32),
    ``qwen3_next`` (3 gated-delta linear-attention layers and 1 full one, bf16: the CPU GDN
    kernel takes bf16 and a head dim of 64 or more),
    ``gpt_oss`` (2 sliding-window layers, window 32, and 2 full ones, alternating, with
    attention sinks and 4 experts; bf16, unquantized: vLLM makes 2 groups of 2 layers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
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
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **{**common, "num_hidden_layers": 4},
                sliding_window=32,
                query_pre_attn_scalar=32,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
            )
        )
    elif arch == "gemma4":
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        model = Gemma4ForCausalLM(
            Gemma4TextConfig(
                **{**common, "num_hidden_layers": 4},
                sliding_window=48,
                global_head_dim=64,
                hidden_size_per_layer_input=16,
                vocab_size_per_layer_input=512,
                layer_types=["sliding_attention"] * 3 + ["full_attention"],
            )
        )
    elif arch == "granite4":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        model = GraniteMoeHybridForCausalLM(
            GraniteMoeHybridConfig(
                **{**common, "num_hidden_layers": 4},
                num_local_experts=0,
                shared_intermediate_size=256,
                mamba_n_heads=4,
                mamba_n_groups=1,
                mamba_d_state=16,
                mamba_d_head=64,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_chunk_size=64,
                position_embedding_type="rope",
                layer_types=["mamba", "mamba", "mamba", "attention"],
            )
        )
    elif arch == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            **{**common, "num_hidden_layers": 4, "torch_dtype": "bfloat16"},
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )
        model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    elif arch == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = GptOssConfig(
            **{
                **common,
                "num_hidden_layers": 4,
                "intermediate_size": 128,
                "torch_dtype": "bfloat16",
            },
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=32,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
        GptOssForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
        # unquantized: vLLM reads a quantization_config key as MXFP4 weights' description
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        saved.pop("quantization_config", None)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(saved, f)
        return
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.save_pretrained(path)


def make_lora_adapter(path: str, base: str, *, seed: int, rank: int = 8) -> None:
    """A PEFT LoRA adapter of ``make_model``'s model (q_proj and v_proj of every layer) with
    seeded random weights, large enough to change the KV and the greedy tokens."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for proj, out in (("q_proj", 128), ("v_proj", 64)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, 128, generator=g) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "bias": "none",
                "target_modules": ["q_proj", "v_proj"],
                "base_model_name_or_path": base,
                "task_type": "CAUSAL_LM",
            },
            f,
        )


def run(spec: dict) -> dict:
    begun = time.perf_counter()
    if spec.get("vllm_log_level"):  # before vLLM is imported; its engine core inherits it
        os.environ["VLLM_LOGGING_LEVEL"] = spec["vllm_log_level"]
    if spec.get("in_process", True):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("tensor_parallel_size", 1) > 1:
        # vLLM's CPU workers bind their threads one NUMA node each unless told the cores:
        # this machine has one node, so one core per worker
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND",
            "|".join(str(i % (os.cpu_count() or 1)) for i in range(spec["tensor_parallel_size"])),
        )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("role"):
        extra = {"socket": spec["socket"], **spec.get("extra", {})}
        # "plugin": the name alone, resolved through kvbroker's vllm.general_plugins entry point
        where = (
            {} if spec.get("plugin") else {"kv_connector_module_path": "kvbroker.integrations.vllm"}
        )
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVBrokerConnector",
            kv_role=spec["role"],
            kv_connector_extra_config=extra,
            **where,
        )
    if spec.get("in_process", True):
        kw["distributed_executor_backend"] = "uni"
    if spec.get("tensor_parallel_size", 1) > 1:  # (its own processes: in_process False)
        kw.update(
            tensor_parallel_size=spec["tensor_parallel_size"], distributed_executor_backend="mp"
        )
    if spec.get("block_size", 32) is not None:
        kw["block_size"] = spec.get("block_size", 32)
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    adapters = spec.get("lora_adapters") or {}  # name -> adapter directory
    if adapters:
        kw.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=8)
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=2048,
        max_num_seqs=8,
        seed=0,
        enable_prefix_caching=spec.get("prefix_caching", True),
        **kw,
    )
    params = SamplingParams(
        max_tokens=spec["max_tokens"],
        temperature=0.0,
        detokenize=False,
        ignore_eos=True,
        logprobs=spec.get("logprobs"),
    )
    started = time.perf_counter()
    print(f"engine ready in {started - begun:.1f} s", file=sys.stderr, flush=True)
    outputs, logprobs = [], []
    loras = None
    if adapters:
        from vllm.lora.request import LoRARequest

        known = {
            name: LoRARequest(name, i + 1, path)
            for i, (name, path) in enumerate(sorted(adapters.items()))
        }
        loras = [known[n] if n else None for n in spec["prompt_loras"]]
    done = 0
    for batch in spec.get("batches") or [spec["prompts"]]:
        got = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            params,
            use_tqdm=False,
            lora_request=loras and loras[done : done + len(batch)],
        )
        done += len(batch)
        outputs += [list(o.outputs[0].token_ids) for o in got]
        if spec.get("logprobs") is not None:
            logprobs += [
                [
                    [t, step[t].logprob]
                    for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
                ]
                for o in got
            ]
    connector = _connector_facts() if spec.get("role") and spec.get("in_process", True) else None
    # An engine core in its own process (in_process False) is shut down here: os._exit below
    # would leave it running.
    llm.llm_engine.engine_core.shutdown()
    return {
        "outputs": outputs,
        "seconds": time.perf_counter() - started,
        "logprobs": logprobs,
        "connector": connector,
    }


def _connector_facts() -> dict:
    """The worker connector's totals (its stats counters) and KV cache groups, read in this
    process (an engine run in process has its worker here)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    worker = conn._worker
    worker.take_stats()
    groups = [[g.kind, g.block_size, len(g.layer_names)] for g in conn._groups or ()]
    return {"totals": dict(worker.totals), "groups": groups, "namespace": conn._namespace}


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
