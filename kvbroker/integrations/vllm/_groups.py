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

TP: vLLM shards an attention group by heads (any TP layout reads it, resharded) and a state
group per rank too: a GDN layer's SSM state by value heads, its conv state by channels, each
of the q, k and v blocks split on its own (the conv weight's loader,
``mamba_v2_sharded_weight_loader``), so rank ``r`` holds ``[q_r | k_r | v_r]``; Mamba2 the same
with ``[x_r | B_r | C_r]`` and its heads, Mamba1 its inner channels. :func:`state_splits` says
so per state tensor (``(axis, segments)``: the model's blocks along the sharded axis as
``(units, unit width)``, each block's units split evenly over the ranks), from the model's config, checked against vLLM's
shapes (each block a count of units, heads or groups, that must divide over the ranks: vLLM
replicates Mamba2 groups that do not); a state whose split it cannot tell (another kind of layer, Mamba2 groups replicated
across ranks, an unknown config) is read by the same TP layout only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbroker.errors import LayoutMismatch

from ._format import FORMAT_VERSION

__all__ = [
    "FULL",
    "SLIDING",
    "STATE",
    "Group",
    "alignment",
    "check_peer_layouts",
    "groups_of",
    "hybrid_namespace",
    "state_splits",
]

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
    state_shapes: tuple[tuple[int, ...], ...] = ()  # this engine's TP rank's
    state_dtypes: tuple[str, ...] = ()
    page_nbytes: int = 0  # state: bytes of one layer's page (padding included)
    tp_size: int = 1  # the engine's (state_shapes are one rank's of it)
    # state: per state tensor, (axis, ((units, width), ...)) as state_splits says; empty: not
    # reshardable (only this TP layout reads the group's pages)
    state_splits: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()

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

    @property
    def reshardable(self) -> bool:
        """Whether another TP layout's pages of this group can be read (attention: always)."""
        if self.kind != STATE:
            return True
        return len(self.state_splits) == len(self.state_shapes) > 0

    def shapes_for(self, tp_size: int) -> tuple[tuple[int, ...], ...]:
        """One rank's state tensor shapes under TP ``tp_size``; LayoutMismatch where the
        group cannot be laid out so."""
        if tp_size == self.tp_size:
            return self.state_shapes
        if not self.reshardable:
            raise LayoutMismatch(
                f"the state of group {self.index} cannot be resharded between "
                f"TP {self.tp_size} and TP {tp_size}"
            )
        out = []
        for shape, (axis, segments) in zip(self.state_shapes, self.state_splits, strict=True):
            if any(units % tp_size for units, _ in segments):
                raise LayoutMismatch(
                    f"group {self.index}: state blocks of "
                    f"{[units for units, _ in segments]} heads or groups do "
                    f"not split over TP {tp_size}"
                )
            out.append(
                tuple(
                    sum(u // tp_size * w for u, w in segments) if i == axis else n
                    for i, n in enumerate(shape)
                )
            )
        return tuple(out)

    def facts(self) -> list:
        """What makes this group's blocks readable by another engine: in the namespace. A
        reshardable state group gives the model's shapes (every TP layout shares the
        namespace, as attention groups do); another gives this rank's, and its page."""
        shapes, page = self.state_shapes, self.page_nbytes
        if self.kind == STATE and self.reshardable:
            shapes, page = self.shapes_for(1), 0
        return [
            self.kind,
            self.block_size,
            len(self.layer_names),
            self.dtype,
            self.num_kv_heads,
            self.head_size,
            self.window,
            [list(s) for s in shapes],
            list(self.state_dtypes),
            page,
        ]


def _dtype(d: Any) -> str:
    return str(d).removeprefix("torch.")


def _attr(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _channel_axis(shape: tuple[int, ...], channels: int) -> int | None:
    """The axis of a 2-d conv state (vLLM orients it either way) holding ``channels``."""
    hits = [i for i, n in enumerate(shape) if n == channels]
    return hits[0] if len(shape) == 2 and len(hits) == 1 else None


def state_splits(mamba_type: Any, shapes: Any, hf_config: Any, tp_size: int) -> tuple:
    """How vLLM shards each state tensor of a Mamba layer of ``mamba_type`` (its enum's name:
    ``GDN_ATTN``, ``MAMBA2``, ``MAMBA1``) over TP: per tensor ``(axis, segments)``, the model's
    blocks along ``axis`` as ``(units, unit width)``, each block's units split evenly over the
    ranks in rank order; or ``()`` where it cannot tell (see the module docstring). Checked
    against ``shapes``, this rank's under ``tp_size``."""
    kind = getattr(mamba_type, "name", str(mamba_type)).rsplit(".", 1)[-1]
    shapes = [tuple(s) for s in shapes]
    c = hf_config
    if c is None or len(shapes) != 2:
        return ()
    if kind == "GDN_ATTN":
        hk, hv = _attr(c, "linear_num_key_heads"), _attr(c, "linear_num_value_heads")
        dk, dv = _attr(c, "linear_key_head_dim"), _attr(c, "linear_value_head_dim")
        if None in (hk, hv, dk, dv):
            return ()
        conv, ssm = [(hk, dk), (hk, dk), (hv, dv)], [(hv, 1)]
    elif kind == "MAMBA2":
        heads = _attr(c, "mamba_n_heads", "mamba_num_heads")
        groups = _attr(c, "mamba_n_groups", "n_groups")
        state = _attr(c, "mamba_d_state", "ssm_state_size")
        head_dim = _attr(c, "mamba_d_head", "mamba_head_dim")
        if None in (heads, groups, state, head_dim) or groups % tp_size:
            return ()  # (vLLM replicates groups across ranks when they do not divide)
        conv, ssm = [(heads, head_dim), (groups, state), (groups, state)], [(heads, 1)]
    elif kind == "MAMBA1":
        inner = _attr(c, "intermediate_size")
        if inner is None:
            return ()
        conv, ssm = [(inner, 1)], [(inner, 1)]
    else:
        return ()
    if any(units % tp_size for units, _ in conv + ssm):
        return ()
    local = sum(u // tp_size * w for u, w in conv)
    out = ((_channel_axis(shapes[0], local), tuple(conv)), (0, tuple(ssm)))
    for shape, (ax, segments) in zip(shapes, out, strict=True):
        if ax is None or shape[ax] != sum(u // tp_size * w for u, w in segments):
            return ()  # not the layout this knows: not resharded
    return out


def check_peer_layouts(groups: Sequence[Group], peer_tp_sizes: Sequence[int]) -> None:
    """ValueError naming the group where an engine of one of ``peer_tp_sizes`` could not be
    read (a state group that cannot be resharded, or whose blocks do not split so)."""
    for g in groups:
        for peer in peer_tp_sizes:
            if peer == g.tp_size:
                continue
            try:
                g.shapes_for(peer)
            except LayoutMismatch as exc:
                raise ValueError(
                    f"KVBrokerConnector: peer_tp_sizes {list(peer_tp_sizes)}: {exc}. vLLM shards "
                    "a Mamba / linear-attention state per TP rank; kvbroker reshards GDN, "
                    "Mamba2 (groups divisible by the TP size) and Mamba1 states, read from the "
                    "model's config; this group's state is read only by an engine of the same "
                    "TP size"
                ) from None


def groups_of(
    kv_cache_config: Any,
    *,
    tp_size: int = 1,
    total_kv_heads: int = 0,
    use_mla: bool = False,
    hf_config: Any = None,
) -> list[Group]:
    """The groups of vLLM's ``KVCacheConfig``; raises ValueError for a kind of group the
    connector cannot store. ``total_kv_heads``: the model's, for the attention groups under
    TP (a group's spec counts one rank's heads); ``hf_config``: the model's (text) config,
    for how its state groups are sharded (:func:`state_splits`)."""
    if use_mla:
        raise ValueError("KVBrokerConnector does not serve hybrid models with an MLA cache")
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        heads = getattr(spec, "num_kv_heads", 0) if tp_size == 1 else total_kv_heads
        names = tuple(g.layer_names)
        if kind in ("FullAttentionSpec", "MLAAttentionSpec"):
            out.append(
                Group(
                    i,
                    FULL,
                    spec.block_size,
                    names,
                    _dtype(spec.dtype),
                    heads,
                    spec.head_size,
                    tp_size=tp_size,
                )
            )
        elif kind == "SlidingWindowSpec":
            if getattr(spec, "extra_retained_tokens", 0):
                raise ValueError(
                    "KVBrokerConnector does not serve sliding-window groups that "
                    "retain extra tokens (multi-module speculative decoding)"
                )
            out.append(
                Group(
                    i,
                    SLIDING,
                    spec.block_size,
                    names,
                    _dtype(spec.dtype),
                    heads,
                    spec.head_size,
                    window=spec.sliding_window,
                    tp_size=tp_size,
                )
            )
        elif kind == "MambaSpec":
            if getattr(spec, "mamba_cache_mode", "none") != "align":
                raise ValueError(
                    "KVBrokerConnector stores Mamba / linear-attention state only with "
                    f"mamba_cache_mode='align' (this engine has {spec.mamba_cache_mode!r}): "
                    "enable prefix caching"
                )
            if getattr(spec, "num_speculative_blocks", 0):
                raise ValueError(
                    "KVBrokerConnector does not serve Mamba groups with speculative decoding blocks"
                )
            splits = (
                ()
                if getattr(spec, "tp_replicated", False)
                else state_splits(
                    getattr(spec, "mamba_type", None), spec.shapes, hf_config, tp_size
                )
            )
            out.append(
                Group(
                    i,
                    STATE,
                    spec.block_size,
                    names,
                    state_shapes=tuple(tuple(s) for s in spec.shapes),
                    state_dtypes=tuple(_dtype(d) for d in spec.dtypes),
                    page_nbytes=spec.page_size_bytes,
                    tp_size=tp_size,
                    state_splits=splits,
                )
            )
        else:
            raise ValueError(
                f"KVBrokerConnector does not serve KV cache groups of kind {kind} "
                f"(group {i}, layers {', '.join(names[:3])}...)"
            )
        if not getattr(g, "enable_kv_transfer", True) or getattr(g, "host_resident", False):
            raise ValueError(
                f"KVBrokerConnector does not serve group {i}: vLLM marks it "
                "host-resident or not transferable"
            )
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
