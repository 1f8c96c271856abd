"""What the SGLang backend stores in the broker: namespaces, page keys and where a page lies.

Nothing here imports SGLang or torch (the host pool is read through its attributes).

- **Namespace.** ``{prefix}/{model name}-{fingerprint}``: the fingerprint hashes the model,
  the host pool's class and layout, its dtype, its per-token geometry with the model's
  total KV heads (not this rank's) and the page size, and the pool's own
  ``storage_format_tag``; so two models, or two layouts of one model's host cache, never
  read each other's pages. TP sizes are not in it: every TP layout that cuts heads the
  same way shares the namespace, and the shard suffix of a key says which heads it holds.
- **Keys.** Page ``i`` of a request is named by SGLang's own page hash (a SHA-256 chain over
  the token ids, already seeded with the request's ``cache_salt`` and ``extra_key``), keyed
  with the namespace and the backend's ``cache_salt`` through BLAKE2b (:class:`._pages.PageKeys`):
  tenants sharing a node never share or probe each other's pages, as with the vLLM
  connector. Then the shard: :func:`kvbroker.prefix.shard_block_key` of the heads the
  block holds, plus ``.pp{r}of{n}`` / ``.cp{r}of{n}`` / ``.dcp{r}of{n}`` where SGLang splits a
  page between pipeline or context-parallel ranks.
- **Heterogeneous TP** (SGLang's ``tp_lcm_size``; ``should_split_heads`` with the
  ``page_head`` layout): a rank stores each page as ``tp_lcm_size / tp_size`` blocks, one per
  shard of ``heads / tp_lcm_size`` heads, keyed ``tp{j}of{tp_lcm_size}``: engines of every
  TP size dividing ``tp_lcm_size`` write and read the same shards. In ``page_head`` a page
  is ``[K/V][head][token][layer][head_dim]``, so a shard is two contiguous runs.
- **A block** is one broker buffer (``page``) holding the page's runs back to back in the
  host pool's order: the K run then the V run (``page_first``, ``page_first_direct``,
  ``page_head``), or K of every layer then V of every layer (``layer_first``); an MLA pool's
  latent run(s). Bytes move bit-exactly between the host pool and the broker, one copy each.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass

from kvbroker.blocks import shard_block_key

__all__ = ["FORMAT_VERSION", "PAGE", "PageGeometry", "Sharding", "namespace_for"]

FORMAT_VERSION = 1
PAGE = "page"  # the one buffer of a block
# Where a layout puts the token axis (sliced [t, t + page_size)) or the page axis (indexed
# t // page_size) in one component's shape; an MHA pool's buffer has a leading K/V axis.
_AXES = {
    "layer_first": (1, "token"),
    "page_first": (0, "token"),
    "page_first_direct": (0, "page"),
    "page_head": (0, "page"),
}


@dataclass(frozen=True)
class Sharding:
    """Which heads of the model one rank's blocks hold, and the keys' shard suffixes."""

    total_kv_heads: int | None  # None: rank-replicated (MLA), every rank the same bytes
    shards: int  # shards a page is cut into across the whole model (tp_lcm_size or tp_size)
    first: int  # this rank's first shard
    per_rank: int  # shards each rank holds (tp_lcm_size / tp_size when splitting, else 1)
    extra: str = ""  # .pp / .cp / .dcp suffix

    def suffixes(self) -> list[str]:
        return [
            shard_block_key("", self.first + j, self.shards, self.total_kv_heads) + self.extra
            for j in range(self.per_rank)
        ]

    @classmethod
    def of(cls, config, head_num: int | None) -> Sharding:
        """From SGLang's ``HiCacheStorageConfig`` and the host pool's heads per rank."""
        extra = ""
        for name, rank, size in (
            ("pp", config.pp_rank, config.pp_size),
            ("cp", config.attn_cp_rank, config.attn_cp_size),
            ("dcp", config.dcp_rank, config.dcp_size),
        ):
            if size > 1:
                extra += f".{name}{rank}of{size}"
        if config.is_mla_model or head_num is None:
            return cls(None, 1, 0, 1, extra)
        split = config.tp_lcm_size // config.tp_size if config.should_split_heads else 1
        if head_num % split:
            raise ValueError(
                f"kvbroker: {head_num} KV heads per rank do not split into "
                f"tp_lcm_size / tp_size = {split} shards"
            )
        return cls(
            head_num * config.tp_size, config.tp_size * split, config.tp_rank * split, split, extra
        )


@dataclass(frozen=True)
class PageGeometry:
    """Where the pages of a host pool's contiguous buffer lie, in bytes.

    A page starting at token ``t`` is ``outer`` runs of ``run`` bytes, run ``r`` at
    ``start(t) + r * outer_stride``; a block of shard ``j`` of ``split`` holds piece ``j`` of
    each run (``run / split`` bytes, heads being the outermost axis of a ``page_head`` run).
    """

    layout: str
    page_size: int
    outer: int
    outer_stride: int
    run: int
    per_position: int  # bytes from one position of the token/page axis to the next
    by_page: bool  # the axis counts pages, not tokens
    nbytes: int  # the whole buffer

    @classmethod
    def of(
        cls,
        layout: str,
        shape: tuple[int, ...],
        itemsize: int,
        page_size: int,
        size: int,
        *,
        paired: bool,
    ) -> PageGeometry:
        """``shape``: the host pool's buffer; ``paired``: it has a leading K/V axis (MHA)."""
        if layout not in _AXES:
            raise ValueError(
                f"kvbroker: SGLang host layout {layout!r} is not supported "
                f"(supported: {', '.join(_AXES)})"
            )
        axis, kind = _AXES[layout]
        axis += 1 if paired else 0
        expect = size if kind == "token" else size // page_size
        if len(shape) <= axis or shape[axis] != expect:
            raise ValueError(
                f"kvbroker: host pool buffer of shape {tuple(shape)} does "
                f"not match layout {layout!r} ({kind} axis {axis} of "
                f"{expect})"
            )
        per_position = math.prod(shape[axis + 1 :]) * itemsize
        return cls(
            layout,
            page_size,
            math.prod(shape[:axis]),
            math.prod(shape[axis:]) * itemsize,
            per_position * (page_size if kind == "token" else 1),
            per_position,
            kind == "page",
            math.prod(shape) * itemsize,
        )

    def start(self, token: int) -> int:
        if token % self.page_size:
            raise ValueError(
                f"kvbroker: host index {token} is not at a page boundary "
                f"(page size {self.page_size})"
            )
        return (token // self.page_size if self.by_page else token) * self.per_position

    def block_nbytes(self, split: int) -> int:
        return self.outer * self.run // split


def namespace_for(
    model: str,
    *,
    pool: str,
    layout: str,
    dtype: str,
    geometry: list,
    total_kv_heads: int | None,
    page_size: int,
    format_tag: str | None,
    prefix: str = "sglang",
) -> str:
    """The broker namespace of a model's pages in one host cache layout."""
    facts = [
        FORMAT_VERSION,
        model,
        pool,
        layout,
        dtype,
        geometry,
        total_kv_heads,
        page_size,
        format_tag,
    ]
    fingerprint = hashlib.blake2b(json.dumps(facts).encode(), digest_size=8).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.rstrip("/").rsplit("/", 1)[-1])[:48] or "model"
    return f"{prefix}/{name}-{fingerprint}"
