"""vLLM's KV cache groups as the connector sees them (hybrid models, vLLM's HMA).

Nothing here imports vLLM or torch: :func:`groups_of` reads a ``KVCacheConfig`` duck-typed.

Under vLLM's hybrid KV cache manager a model's layers form one KV cache group per kind of
layer (and per layer count: Gemma-3's 5 sliding + 1 full layers make 5 sliding groups and 1
full one). Each group has its own block table; every group's layers alias one memory pool,
and a block id belongs to one group at a time (freed, it may move to another group). So a
block is stored under a key that names its group (:meth:`Group.key`), and each group keeps
its own chain of block hashes over its own block size (Gemma-4: sliding 64, full 32).

The kinds the connector serves:

- ``full`` (``FullAttentionSpec``): a hit of ``T`` tokens needs every block before ``T``.
- ``sliding`` (``SlidingWindowSpec``): the next token attends to the last ``window`` tokens
  only, so a hit of ``T`` tokens needs only the blocks from ``(T - window + 1) // B`` on
  (:meth:`Group.first_needed`); vLLM gives the skipped positions the null block (id 0),
  which is never read or written. vLLM frees an out-of-window block as soon as the next step
  is scheduled, so a block is saved in the step that computed it.
- ``state`` (``MambaSpec``, linear attention / Mamba, ``mamba_cache_mode="align"``): one state
  page per request (conv + SSM state), the state after a block boundary where a prefill chunk
  ended. It is saved and loaded whole, and a hit must end at such a boundary.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._format import FORMAT_VERSION

__all__ = ["FULL", "SLIDING", "STATE", "Group", "alignment", "groups_of", "hybrid_namespace"]

FULL, SLIDING, STATE = "full", "sliding", "state"


@dataclass(frozen=True)
class Group:
    """One KV cache group: ``kind``, its ``block_size`` (tokens per block), its layers
    and what its blocks hold (attention: dtype, KV heads, head size; state: one page of
    ``page_nbytes`` per layer, the state tensors' shapes and dtypes)."""

    index: int
    kind: str
    block_size: int
    layer_names: tuple[str, ...]
    dtype: str = ""
    num_kv_heads: int = 0  # the model's (every TP rank's together)
    head_size: int = 0
    window: int | None = None  # sliding: tokens the next token attends to, itself included
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()
    page_nbytes: int = 0  # state: bytes of one layer's page (padding included)

    @property
    def attention(self) -> bool:
        return self.kind in (FULL, SLIDING)

    def key(self, block_hash: str) -> str:
        """The hash of a block of this group: the prompt's chained hash, plus the group."""
        return f"{block_hash}.g{self.index}"

    def first_needed(self, tokens: int) -> int:
        """The first block a hit of ``tokens`` tokens needs in this group (earlier ones are
        outside the window, or states the last one supersedes)."""
        if self.kind == SLIDING:
            return max(0, tokens - self.window + 1) // self.block_size
        if self.kind == STATE:
            return max(0, tokens // self.block_size - 1)
        return 0

    def facts(self) -> list:
        """What makes this group's blocks readable by another engine: in the namespace."""
        return [self.kind, self.block_size, len(self.layer_names), self.dtype, self.num_kv_heads,
                self.head_size, self.window, [list(s) for s in self.state_shapes],
                list(self.state_dtypes), self.page_nbytes]  # fmt: skip


def _dtype(d: Any) -> str:
    return str(d).removeprefix("torch.")


def groups_of(kv_cache_config: Any, *, tp_size: int = 1, total_kv_heads: int = 0,
              use_mla: bool = False) -> list[Group]:  # fmt: skip
    """The groups of vLLM's ``KVCacheConfig``; raises ValueError for a kind of group the
    connector cannot store. ``total_kv_heads``: the model's, for the attention groups under
    TP (a group's spec counts one rank's heads)."""
    if use_mla:
        raise ValueError("KVBrokerConnector does not serve hybrid models with an MLA cache")
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        heads = getattr(spec, "num_kv_heads", 0) if tp_size == 1 else total_kv_heads
        names = tuple(g.layer_names)
        if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            out.append(Group(i, FULL, spec.block_size, names, _dtype(spec.dtype), heads,
                             spec.head_size))  # fmt: skip
        elif kind == "SlidingWindowSpec":
            if getattr(spec, "extra_retained_tokens", 0):
                raise ValueError("KVBrokerConnector does not serve sliding-window groups that "
                                 "retain extra tokens (multi-module speculative decoding)")
            out.append(Group(i, SLIDING, spec.block_size, names, _dtype(spec.dtype), heads,
                             spec.head_size, window=spec.sliding_window))  # fmt: skip
        elif kind == "MambaSpec":
            if getattr(spec, "mamba_cache_mode", "none") != "align":
                raise ValueError(
                    "KVBrokerConnector stores Mamba / linear-attention state only with "
                    f"mamba_cache_mode='align' (this engine has {spec.mamba_cache_mode!r}): "
                    "enable prefix caching")
            if getattr(spec, "num_speculative_blocks", 0):
                raise ValueError("KVBrokerConnector does not serve Mamba groups with "
                                 "speculative decoding blocks")
            out.append(Group(i, STATE, spec.block_size, names,
                             state_shapes=tuple(tuple(s) for s in spec.shapes),
                             state_dtypes=tuple(_dtype(d) for d in spec.dtypes),
                             page_nbytes=spec.page_size_bytes))  # fmt: skip
        else:
            raise ValueError(f"KVBrokerConnector does not serve KV cache groups of kind {kind} "
                             f"(group {i}, layers {', '.join(names[:3])}...)")
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise ValueError(f"KVBrokerConnector does not serve group {i}: vLLM marks it "
                             "host-resident or not transferable")
    return out


def hybrid_namespace(model: str, groups: Sequence[Group], *, prefix: str = "vllm") -> str:
    """The broker namespace of a hybrid model's blocks: every group's facts in the
    fingerprint (and ``hybrid`` in the name, so it never meets a classic namespace)."""
    facts = [FORMAT_VERSION, "hybrid", model, [g.facts() for g in groups]]
    fingerprint = hashlib.blake2b(json.dumps(facts).encode(), digest_size=8).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").rsplit("/", 1)[-1])[:40] or "model"
    return f"{prefix}/{name}-hybrid-{fingerprint}"


def alignment(groups: Sequence[Group]) -> int:
    """The token count every group's block size divides: where a hit short of the whole
    prompt may end (vLLM aligns its own prefix-cache hits the same way)."""
    return math.lcm(*(g.block_size for g in groups))
