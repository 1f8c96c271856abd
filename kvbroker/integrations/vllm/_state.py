"""State pages of a hybrid model's Mamba / linear-attention groups <-> broker blocks.

No vLLM import; torch only through the tensors given.

vLLM (``mamba_cache_mode="align"``) keeps one state page per layer of a Mamba group at a
block position where a prefill chunk ended: the layer's state tensors (e.g. GDN's conv and
SSM state) at that engine block id, in the bytes of one KV cache page. A broker block holds a
group's state at one position whole: every layer's state bytes back to back in one buffer
``state`` (:class:`StateFormat`), keyed by the group's key of the block hash at that position
plus the TP shard (a GDN state is sharded per TP rank, so only the same TP layout reads it).

Ownership: the engine's pages are vLLM's; a save copies them into its reserved extents within
the step (``wait_for_save``) and seals them or aborts them there; a load holds one read lease
while it copies into the engine block it was planned for (vLLM keeps the request parked, and
the block its own, until the load is reported over).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from kvbroker.errors import KVBrokerError, LayoutMismatch
from kvbroker.prefix import PrefixCache, shard_block_key

from . import _ops

__all__ = ["STATE", "StateFormat", "StateSave", "load_state", "state_key", "state_pieces"]

STATE = "state"  # the one buffer of a state block


def state_key(group_key: str, tp_rank: int, tp_size: int) -> str:
    """The broker key of TP rank ``tp_rank``'s state at a block (``group_key``: the group's
    key of the block hash there)."""
    return group_key + shard_block_key("", tp_rank, tp_size, None)


def state_pieces(tensor) -> list:
    """A layer's state tensors (vLLM hands one tensor, or one per state) as uint8 views
    ``[num_blocks, bytes]`` of each block's bytes."""
    import torch

    parts = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    out = []
    for t in parts:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise LayoutMismatch("a Mamba state must be a CPU tensor (host caches only)")
        per_block = t[0].numel() * t.element_size()
        block = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        flat = block.reshape(t.shape[0], -1) if block[0].is_contiguous() else None
        if flat is None or flat.shape[1] != per_block:
            raise LayoutMismatch(f"a Mamba state tensor of shape {tuple(t.shape)} is not "
                                 "contiguous per block")  # fmt: skip
        out.append(flat)
    return out


@dataclass(frozen=True)
class StateFormat:
    """One TP rank's state block of a group: ``layer_nbytes[l]`` bytes of layer ``l``'s
    state, laid back to back in buffer ``state``."""

    layer_nbytes: tuple[int, ...]
    tp_rank: int
    tp_size: int

    @property
    def nbytes(self) -> int:
        return sum(self.layer_nbytes)

    def meta(self) -> dict:
        return {"kind": "state", "layer_nbytes": list(self.layer_nbytes),
                "tp_rank": self.tp_rank, "tp_size": self.tp_size}  # fmt: skip


def _layer_bytes(layers: Sequence[list], block: int):
    """The numpy views of every piece of every layer's state at engine block ``block``."""
    return [p[block].numpy() for pieces in layers for p in pieces]


class StateSave:
    """Publishing a group's states (``items``: ``(key, engine block)``, keys sharded) in one
    step: ``reserve()``, ``copy()``, ``seal()`` or ``abort()``."""

    def __init__(self, client, namespace: str, fmt: StateFormat, layers: Sequence[list],
                 items: Sequence[tuple[str, int]], checksums: bool = True) -> None:  # fmt: skip
        self.client, self.namespace, self.fmt, self.layers = client, namespace, fmt, layers
        self.items = list(items)
        self.checksums = checksums
        self.leases: list[int] = []
        self._targets: list[tuple[int, tuple[int, int, int]]] = []
        self.existing = 0
        self.done = False

    def reserve(self) -> None:
        blocks = [{"key": key, "parent": None} for key, _ in self.items]
        reserved = _ops.reserve_blocks(self.client, self.namespace, blocks,
                                       {STATE: self.fmt.nbytes}, self.fmt.meta())  # fmt: skip
        j = 0
        for (_, block), lease in zip(self.items, reserved.leases):
            if lease is None:
                self.existing += 1
                continue
            self.leases.append(lease)
            self._targets.append((block, reserved.extents(j)[STATE]))
            j += 1

    @property
    def new_blocks(self) -> int:
        return len(self._targets)

    def copy(self) -> None:
        import numpy as np

        for block, extent in self._targets:
            dst = _ops.extent_view(self.client, extent)
            at = 0
            for src in _layer_bytes(self.layers, block):
                np.copyto(dst[at : at + src.size], src)
                at += src.size

    def seal(self) -> None:
        self.done = True
        try:
            sums = None
            if self.checksums and self.leases:
                from kvbroker._client.engine import default_engine
                from kvbroker._client.integrity import digest_here

                kind = self.client.checksum_kind
                views = [_ops.extent_view(self.client, e) for _, e in self._targets]
                digests = default_engine().run_jobs(
                    [functools.partial(digest_here, v, kind) for v in views],
                    self.fmt.nbytes * len(views))
                sums = [{STATE: d} for d in digests]
            _ops.seal_many(self.client, self.leases, sums)
        except BaseException:
            _ops.abort_leases(self.client, self.leases)
            raise

    def abort(self) -> None:
        if not self.done:
            self.done = True
            _ops.abort_leases(self.client, self.leases)


def load_state(client, namespace: str, fmt: StateFormat, layers: Sequence[list], key: str,
               block: int) -> bool:  # fmt: skip
    """Copy the state block ``key`` into engine block ``block`` of every layer, whole; False
    (nothing written) when the node does not hold it."""
    import numpy as np

    pc = PrefixCache(client, namespace=namespace, block_size=1)  # keys given whole
    with pc.match(range(2), hashes=[key]) as m:
        if m.num_blocks < 1:
            return False
        src = m.blocks[0][STATE]
        if src.size != fmt.nbytes:
            raise LayoutMismatch(f"state block {key} holds {src.size} bytes, this engine's "
                                 f"state is {fmt.nbytes}")  # fmt: skip
        at = 0
        for dst in _layer_bytes(layers, block):
            np.copyto(dst, src[at : at + dst.size])
            at += dst.size
    return True


def check_state(fmt: StateFormat, layers: Sequence[list]) -> None:
    got = tuple(sum(p.shape[1] for p in pieces) for pieces in layers)
    if got != fmt.layer_nbytes:
        raise KVBrokerError(f"state layers of {got} bytes, the format says {fmt.layer_nbytes}")
