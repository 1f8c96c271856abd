"""Models for the examples, tests and benchmark: built from a config with seeded random
weights, so nothing is downloaded. Every process that builds the same (arch, size, dtype,
seed) gets bit-identical weights.

Also the greedy decode loop every role shares, so a reference generation and a disaggregated
one run exactly the same code after the KV cache is in place.
"""

from __future__ import annotations

import torch

# The architectures exercised: different head layouts (GQA, MHA, MQA) and block structures.
TINY = {
    # Llama: GQA, 4 query heads over 2 KV heads, RMSNorm, rotary on the whole head.
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
    ),
    # GPT-NeoX: MHA (4 KV heads), fused QKV, parallel residual, rotary on a quarter of the head.
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    ),
    # Qwen2: MQA here (1 KV head), QKV biases.
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
        ),
    ),
    # Mistral: GQA, sliding-window layers (DynamicSlidingWindowLayer).
    "mistral": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4096,
        ),
    ),
}

# ~110M parameters (Llama-style, GQA 12/4): a prefill of a few thousand tokens costs seconds
# on a CPU, so time to first token measures something.
BENCH = (
    "LlamaConfig",
    dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
)

# Llama-3-8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128): a 16k-token
# prompt's KV is 2 GiB in bf16. Only on a GPU host (16 GB of weights, built on the device).
LLAMA_8B = (
    "LlamaConfig",
    dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VOCAB = 256


def build(
    arch: str = "llama",
    dtype: str = "fp32",
    *,
    seed: int = 0,
    size: str = "tiny",
    max_positions: int = 8192,
    device: str = "cpu",
    **overrides,
):
    """A causal LM from a config, weights drawn from ``torch.manual_seed(seed)``, eval mode.

    ``overrides``: config fields to change (e.g. ``sliding_window=8``)."""
    import transformers

    if size == "bench":
        config_name, kw = BENCH
    elif size == "8b":
        config_name, kw = LLAMA_8B
    else:
        config_name, kw = TINY[arch]
        kw = {**kw, "vocab_size": VOCAB}
    kw = {**kw, **overrides}
    config = getattr(transformers, config_name)(max_position_embeddings=max_positions, **kw)
    torch.manual_seed(seed)
    if size == "8b":  # initialised where it will run: 8B random weights on a CPU take minutes
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        return model.eval()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    return model.to(device).eval()


def prompt(length: int, *, seed: int, vocab: int = VOCAB) -> list[int]:
    """A reproducible prompt of ``length`` token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@torch.no_grad()
def prefill(model, token_ids: list[int], cache=None):
    """Run the prompt (or the part of it not in ``cache``) through the model.

    Returns ``(cache, last_logits)``: the cache now holds every prompt position; the logits
    are those of the last prompt token (they give the first generated token).
    """
    ids = torch.tensor([token_ids], device=model.device)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.past_key_values, out.logits[0, -1]


@torch.no_grad()
def greedy(model, cache, first_token: int, steps: int):
    """Greedy decode ``steps`` tokens after ``first_token`` on top of ``cache``.

    Returns ``(tokens, first_step_logits)``: ``tokens`` starts with ``first_token``; the
    logits are those of the first decode step (the forward of ``first_token``).
    """
    tokens, first_logits, token = [first_token], None, first_token
    for _ in range(steps):
        ids = torch.tensor([[token]], device=model.device)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[0, -1]
        if first_logits is None:
            first_logits = logits.clone()
        token = int(logits.argmax())
        tokens.append(token)
    return tokens, first_logits


def reference(model, token_ids: list[int], steps: int):
    """Uninterrupted single-process generation: prefill then greedy decode, no broker."""
    cache, last = prefill(model, token_ids)
    return greedy(model, cache, int(last.argmax()), steps)
