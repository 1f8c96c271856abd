"""State pages of a hybrid model's Mamba / linear-attention groups <-> broker blocks.

No vLLM import; torch only through the tensors given. A group's pages are a
:class:`StatePages` on the engine's device: host caches copy through numpy views here, CUDA
caches through device staging and DMA (:func:`._cuda.save_cuda`, :func:`._cuda.load_state_cuda`).

vLLM (``mamba_cache_mode="align"``) keeps one state page per layer of a Mamba group at a
block position where a prefill chunk ended: the layer's state tensors (e.g. GDN's conv and
SSM state) at that engine block id, in the bytes of one KV cache page. A broker block holds a
group's state at one position whole: a :class:`kvbroker.blocks.StateFormat` page whose parts
are every layer's state tensors (``l{layer}.s{i}``, shapes and dtypes from vLLM's
``MambaSpec``), back to back in one buffer, keyed by the group's key of the block hash at
that position plus the TP shard (a GDN state is sharded per TP rank, so only the same TP
layout reads it).

Ownership: the engine's pages are vLLM's; a save copies them into its reserved extents within
the step (``wait_for_save``) and seals them or aborts them there; a load holds one read lease
while it copies into the engine block it was planned for (vLLM keeps the request parked, and
the block its own, until the load is reported over).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbroker import blocks
from kvbroker.errors import LayoutMismatch

from ._groups import Group

__all__ = [
    "StatePages",
    "StateSave",
    "load_state",
    "load_state_resharded",
    "reshard_page",
    "state_format",
    "state_pieces",
]


def state_format(group: Group, tp_rank: int, tp_size: int) -> blocks.StateFormat:
    """TP rank ``tp_rank`` of ``tp_size``'s state page of ``group``: every layer's state
    tensors (another TP size than the engine's: as :meth:`Group.shapes_for` lays them out)."""
    shapes = group.shapes_for(tp_size)
    parts = [
        blocks.StateBuffer(f"l{layer}.s{i}", dtype, shape)
        for layer in range(len(group.layer_names))
        for i, (shape, dtype) in enumerate(zip(shapes, group.state_dtypes, strict=True))
    ]
    return blocks.StateFormat(tuple(parts), tp_rank=tp_rank, tp_size=tp_size)


def state_pieces(tensor) -> list:
    """A layer's state tensors (vLLM hands one tensor, or one per state) as uint8 views
    ``[num_blocks, bytes]`` of each block's bytes, on the tensors' device."""
    import torch

    parts = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    out = []
    for t in parts:
        if not isinstance(t, torch.Tensor):
            raise LayoutMismatch(f"a Mamba state must be a tensor, not {type(t).__name__}")
        if not t[0].is_contiguous():
            raise LayoutMismatch(
                f"a Mamba state tensor of shape {tuple(t.shape)} is not contiguous per block"
            )
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        out.append(raw.reshape(t.shape[0], -1))
    return out


class StatePages:
    """A state group's pages in the engine's cache: ``layers[l]`` the uint8 views ``[num_blocks,
    bytes]`` of layer ``l``'s state tensors (:func:`state_pieces`), a broker page being every
    layer's pieces at one engine block, back to back. The views are vLLM's memory: nothing
    here keeps a copy."""

    def __init__(self, layers: Sequence[list]) -> None:
        self.layers = [list(pieces) for pieces in layers]
        devices = {p.device for pieces in self.layers for p in pieces}
        if len(devices) != 1:
            raise LayoutMismatch(f"a state group's tensors lie on {len(devices)} devices")
        self.device = devices.pop()
        self.pieces = [p for pieces in self.layers for p in pieces]  # in page order
        self.page_nbytes = sum(p.shape[1] for p in self.pieces)

    def gather(self, ids, out) -> None:
        """Copy the pages at engine blocks ``ids`` (an int64 tensor on the device) into the
        rows of ``out`` (``[len(ids), page_nbytes]`` uint8), on the current stream."""
        at = 0
        for p in self.pieces:
            width = p.shape[1]
            out[:, at : at + width].copy_(p.index_select(0, ids))
            at += width

    def scatter(self, ids, src) -> None:
        """Write the rows of ``src`` (``[len(ids), page_nbytes]``) whole into the pages at
        engine blocks ``ids``, on the current stream."""
        at = 0
        for p in self.pieces:
            width = p.shape[1]
            p[ids] = src[:, at : at + width]
            at += width


def check_pages(fmt: blocks.StateFormat, pages: StatePages) -> None:
    """LayoutMismatch unless each layer's state tensors hold its parts' bytes."""
    per_layer = fmt.block_nbytes // max(1, len(pages.layers))
    for layer, pieces in enumerate(pages.layers):
        got = sum(p.shape[1] for p in pieces)
        if got != per_layer:
            raise LayoutMismatch(
                f"state layer {layer} holds {got} bytes per block, vLLM's spec says {per_layer}"
            )


def _engine_bytes(pages: StatePages, block: int):
    """Every piece of every layer's state at engine block ``block``, in page order (host)."""
    return [p[block].numpy() for p in pages.pieces]


class StateSave:
    """Publishing a group's states (``items``: ``(group key, engine block, session)``, the
    session its request named or None) in one step: ``reserve()``, ``copy()``, ``seal()`` or
    ``abort()``."""

    def __init__(
        self,
        client,
        namespace: str,
        fmt: blocks.StateFormat,
        pages: StatePages,
        items: Sequence[tuple[str, int, dict | None]],
        checksums: bool = True,
    ) -> None:
        self.client, self.namespace, self.fmt, self.pages = client, namespace, fmt, pages
        self.items = list(items)
        self.checksums = checksums
        self.reservation: blocks.Reservation | None = None
        self._targets: list[int] = []  # engine block of each reserved page
        self.existing = 0
        self.done = False

    def reserve(self) -> None:
        buffers, meta = self.fmt.buffers(), self.fmt.meta()
        whole = blocks.Reservation.empty(self.client, list(buffers))
        try:  # one reservation per run of one session's pages (a reservation names one)
            at = 0
            for i in range(1, len(self.items) + 1):
                if i == len(self.items) or self.items[i][2] != self.items[at][2]:
                    wanted = [
                        {"key": self.fmt.key(key), "parent": None} for key, _, _ in self.items[at:i]
                    ]
                    whole = whole + blocks.reserve(
                        self.client, self.namespace, wanted, buffers, meta, retain=self.items[at][2]
                    )
                    at = i
        except BaseException:
            whole.abort()
            raise
        self.reservation = whole
        for (_, block, _), lease in zip(self.items, self.reservation.leases, strict=True):
            if lease is None:
                self.existing += 1
            else:
                self._targets.append(block)

    @property
    def new_blocks(self) -> int:
        return len(self._targets)

    def copy(self) -> None:
        for j, block in enumerate(self._targets):
            at = 0
            for src in _engine_bytes(self.pages, block):
                blocks.copy(self.reservation.view(j, self.fmt.packed, at, src.size), src)
                at += src.size

    def seal(self) -> None:
        self.done = True
        if self.reservation is None:
            return
        try:
            self.reservation.seal(self.reservation.checksums() if self.checksums else None)
        except BaseException:
            self.reservation.abort()
            raise

    def abort(self) -> None:
        if not self.done:
            self.done = True
            if self.reservation is not None:
                self.reservation.abort()


def load_state(
    client, namespace: str, fmt: blocks.StateFormat, pages: StatePages, group_key: str, block: int
) -> bool:
    """Copy the state page at ``group_key`` into engine block ``block`` of every layer, whole;
    False (nothing written) when the node does not hold it."""
    import numpy as np

    with blocks.match(client, namespace, fmt, [group_key]) as m:
        if m.num_blocks < 1:
            return False
        src = m.blocks[0][fmt.packed]
        at = 0
        for dst in _engine_bytes(pages, block):
            np.copyto(dst, src[at : at + dst.size])
            at += dst.size
    return True


def reshard_page(group: Group, sources: Sequence, tp_rank: int, tp_size: int):
    """TP rank ``tp_rank`` of ``tp_size``'s state page of ``group`` (a uint8 tensor), made of
    the pages ``sources[q]`` (uint8 tensors) of every rank ``q`` of another TP layout: each
    state tensor's blocks (:func:`._groups.state_splits`) put back whole from the source
    ranks' slices, then this rank's slice of each taken, in the engine's dtypes."""
    import torch

    source_size = len(sources)
    src_fmt, dst_fmt = state_format(group, 0, source_size), state_format(group, tp_rank, tp_size)
    out = torch.empty(dst_fmt.block_nbytes, dtype=torch.uint8, device=sources[0].device)
    for part, dst_part in zip(src_fmt.parts, dst_fmt.parts, strict=True):
        axis, segments = group.state_splits[int(part.name.rsplit(".s", 1)[1])]
        dtype = getattr(torch, part.dtype)
        at = src_fmt.offset_of(part.name)
        shards = [
            src[at : at + part.nbytes].clone().view(dtype).view(part.shape) for src in sources
        ]
        mine, start = [], 0  # (offsets along the axis, in a source rank's tensor)
        for units, width in segments:
            per_source, per_rank = units // source_size * width, units // tp_size * width
            whole = torch.cat([s.narrow(axis, start, per_source) for s in shards], axis)
            mine.append(whole.narrow(axis, tp_rank * per_rank, per_rank))
            start += per_source
        local = torch.cat(mine, axis).contiguous()
        assert tuple(local.shape) == dst_part.shape
        to = dst_fmt.offset_of(dst_part.name)
        out[to : to + dst_part.nbytes] = local.view(-1).view(torch.uint8)
    return out


def load_state_resharded(
    client,
    namespace: str,
    group: Group,
    pages: StatePages,
    group_key: str,
    block: int,
    tp_rank: int,
    source_tp_sizes: Sequence[int],
) -> bool:
    """Load the state at ``group_key`` into engine block ``block`` from the pages of another TP
    layout (the first of ``source_tp_sizes`` whose every rank's page the node holds, under one
    read lease), resharded (:func:`reshard_page`); False (nothing written) when none does.
    The pages are read through host views: one extra copy, on this rarely taken path."""
    import numpy as np
    import torch

    for source in source_tp_sizes:
        if source == group.tp_size:
            continue
        fmts = [state_format(group, q, source) for q in range(source)]
        with blocks.match_keys(client, namespace, [f.key(group_key) for f in fmts]) as m:
            if m.num_blocks < source:
                continue
            for i, fmt in enumerate(fmts):  # each rank's page was a writer's own choice
                fmt.check(m.meta_of(i))
            sources = [
                torch.from_numpy(np.array(b[f.packed])) for b, f in zip(m.blocks, fmts, strict=True)
            ]
        page = reshard_page(group, sources, tp_rank, group.tp_size).to(pages.device)
        pages.scatter(torch.tensor([block], device=pages.device), page[None])
        if pages.device.type == "cuda":
            torch.cuda.current_stream(pages.device).synchronize()  # landed before reported
        return True
    return False
