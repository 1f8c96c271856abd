"""What the vLLM connector stores in the broker: namespaces, block keys and the block format.

Nothing here imports vLLM or torch.

- **Namespace.** ``{prefix}/{model name}-{fingerprint}``: the fingerprint hashes the model,
  the cache dtype, the block size, the number of layers, the model's total KV heads, the
  head size and whether the cache is an MLA latent; so two models (or two cache layouts of
  one model) never read each other's blocks. TP sizes are not in it: every TP layout of a
  model shares the namespace and reshards (see below).
- **Block keys.** Block ``i`` of a prompt is keyed by kvbroker's chained hash
  (:func:`kvbroker.prefix.block_hashes`, BLAKE2b over the token ids of blocks ``0..i``, the
  namespace and the request's ``cache_salt``), plus the shard suffix of the TP rank that
  published it (:func:`kvbroker.prefix.shard_block_key`). Deterministic across processes.
- **The tail.** A prompt of ``n`` tokens whose ``n - 1`` first tokens end inside a block also
  gets its last, partial block published, under :func:`tail_hash` of the chain so far and the
  tokens ``[k·B, n-1)`` of that block. A consumer with the same prompt therefore loads
  exactly ``n - 1`` tokens and computes only the last one (the P/D handoff); a prompt that
  only shares a prefix never matches another prompt's tail.
- **Block format.** :meth:`kvbroker.prefix.PrefixCache.publish_kv`'s buffers — one per
  (layer, K/V), ``past_key.{l}`` / ``past_value.{l}`` (``past_latent.{l}`` for MLA), each
  ``[head][token][head_dim]`` of this rank's heads, layer-major — laid back to back in ONE
  broker buffer ``kv`` (meta ``"packed": "kv"``), with publish_kv's meta otherwise. A
  block is then one extent to reserve, journal, seal and copy, where 64 named buffers cost
  the daemon ~5x more per block than the DMA of its 2 MiB takes (an 8B model's block);
  :meth:`kvbroker.prefix.KVPrefixMatch.load` reads (and reshards) both forms, so blocks
  published here load from a CPU or a CUDA cache alike.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbroker.blocks import PACKED_KV, AttentionFormat
from kvbroker.prefix import block_hashes

__all__ = ["FORMAT_VERSION", "PACKED", "BlockFormat", "namespace_for", "prompt_keys", "tail_hash"]

FORMAT_VERSION = 2  # 2: one packed buffer per block
PACKED = PACKED_KV  # the one buffer of a block


def namespace_for(
    model: str,
    *,
    dtype: str,
    block_size: int,
    num_layers: int,
    total_kv_heads: int | None,
    head_size: int,
    latent: bool,
    prefix: str = "vllm",
) -> str:
    """The broker namespace of a model's blocks in one cache layout."""
    facts = [
        FORMAT_VERSION,
        model,
        dtype,
        block_size,
        num_layers,
        None if latent else total_kv_heads,
        head_size,
        bool(latent),
    ]
    fingerprint = hashlib.blake2b(json.dumps(facts).encode(), digest_size=8).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    return f"{prefix}/{name}-{fingerprint}"


def tail_hash(prev: str | None, tokens: Sequence[int], *, namespace: str, cache_salt: str) -> str:
    """The key of a partial last block holding ``tokens``, after the chain ending in
    ``prev`` (None: the prompt is shorter than one block)."""
    import numpy as np

    h = hashlib.blake2b(digest_size=16, person=b"kvbroker-tail")
    for part in (namespace, cache_salt, prev or ""):
        raw = part.encode()
        h.update(len(raw).to_bytes(4, "little") + raw)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.hexdigest()


@dataclass
class PromptKeys:
    """The keys of one prompt: ``hashes`` of its full blocks, ``tail`` (or None), and what
    loading them all gives: ``len(keys)`` blocks covering ``n - 1`` tokens."""

    num_tokens: int
    block_size: int
    hashes: list[str]
    tail: str | None
    keys: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = self.hashes + ([self.tail] if self.tail else [])

    def tokens_of(self, num_blocks: int) -> int:
        """Prompt tokens covered by the first ``num_blocks`` keys, capped at ``n - 1`` (the
        engine must compute at least the last token to get logits)."""
        return min(num_blocks * self.block_size, max(0, self.num_tokens - 1))


def prompt_keys(
    tokens: Sequence[int], block_size: int, *, namespace: str, cache_salt: str
) -> PromptKeys:
    """Hashes of every full block of ``tokens`` and, when ``n - 1`` tokens end inside a
    block, the tail key of that block."""
    n = len(tokens)
    hashes = block_hashes(tokens, block_size, namespace=namespace, cache_salt=cache_salt)
    k = n // block_size
    tail = None
    if n > 1 and (n - 1) % block_size and n % block_size:
        tail = tail_hash(
            hashes[-1] if hashes else None,
            tokens[k * block_size : n - 1],
            namespace=namespace,
            cache_salt=cache_salt,
        )
    return PromptKeys(n, block_size, hashes, tail)


# One TP rank's published block: buffer names (layer-major), the size of each, the meta a
# reader checks (:meth:`kvbroker.blocks.AttentionFormat.check`), packed into PACKED.
BlockFormat = AttentionFormat
