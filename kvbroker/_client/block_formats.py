"""Block formats: what one block of a layer group holds, as frozen descriptors (public through
:mod:`kvbroker.blocks`, whose module doc says who owns what).

The attention format's bytes and meta are those :meth:`kvbroker.prefix.PrefixCache.publish_kv`
and the vLLM connector always published (``packed=None`` and ``packed="kv"``): blocks already
in a broker keep loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .prefix_match import SHARD_META_TAG
from .tp import shard_heads
from .._wire.names import kv_buffer_name
from ..errors import BadRequest, LayoutMismatch
from ..layout import Layout, itemsize_of

__all__ = [
    "AttentionFormat",
    "StateBuffer",
    "StateFormat",
    "PACKED_KV",
    "PACKED_STATE",
    "STATE_META_TAG",
    "shard_block_key",
]

PACKED_KV = "kv"  # the one buffer of a packed attention block
PACKED_STATE = "state"  # the one buffer of a packed state page
STATE_META_TAG = "kvbroker.blocks.state"  # meta key marking (and versioning) a state page


def shard_block_key(block_hash: str, tp_rank: int, tp_size: int, total_kv_heads: int | None) -> str:
    """The key of TP rank ``tp_rank`` of ``tp_size``'s shard of the block ``block_hash``.

    ``total_kv_heads`` None (an MLA latent cache: every rank holds the same bytes) names the
    shard ``h0``."""
    return f"{block_hash}/h{total_kv_heads or 0}.tp{tp_rank}of{tp_size}"


# -- formats -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionFormat:
    """One TP rank's block of an attention layer group: buffer names (layer-major), their
    sizes, the meta a reader checks, and the key suffix. ``window``: the group's sliding
    window in tokens (None: full attention); the bytes do not depend on it."""

    dtype: str  # element type of the engine cache (bytes move bit-exactly)
    num_layers: int
    block_size: int
    head_dim: int
    local_heads: int  # heads of this rank (1 for a latent cache)
    total_kv_heads: int | None  # the model's; None for an MLA latent cache
    tp_rank: int
    tp_size: int
    heads: tuple[int, int]  # [start, stop) of this rank's heads among the model's
    window: int | None = None
    packed: str | None = PACKED_KV  # every (layer, K/V) back to back in this one buffer
    infix: str | None = None  # buffer name infix (publish_kv's ``infix``)

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise BadRequest(f"a sliding window must be a positive int, not {self.window!r}")
        for what in ("num_layers", "block_size", "head_dim", "local_heads"):
            value = getattr(self, what)
            if not isinstance(value, int) or value < 1:
                raise BadRequest(
                    f"an attention format's {what} must be a positive int, not {value!r}"
                )
        itemsize_of(self.dtype)  # a known dtype, else BadRequest

    @classmethod
    def for_rank(
        cls,
        *,
        dtype: str,
        num_layers: int,
        block_size: int,
        head_dim: int,
        total_kv_heads: int | None,
        tp_rank: int = 0,
        tp_size: int = 1,
        **more: Any,
    ) -> AttentionFormat:
        """The format of TP rank ``tp_rank`` of ``tp_size``: its heads from
        :func:`shard_heads` (a latent cache, ``total_kv_heads`` None: one head row)."""
        span = shard_heads(tp_rank, tp_size, total_kv_heads)
        return cls(
            dtype=dtype,
            num_layers=num_layers,
            block_size=block_size,
            head_dim=head_dim,
            local_heads=1 if total_kv_heads is None else len(span),
            total_kv_heads=total_kv_heads,
            tp_rank=tp_rank,
            tp_size=tp_size,
            heads=(span.start, span.stop),
            **more,
        )

    @property
    def latent(self) -> bool:
        return self.total_kv_heads is None

    @property
    def components(self) -> tuple[str, ...]:
        return ("latent",) if self.latent else ("key", "value")

    @property
    def names(self) -> list[list[str]]:
        """``names[layer][component]``."""
        return [
            [kv_buffer_name(c, layer, self.infix) for c in self.components]
            for layer in range(self.num_layers)
        ]

    @property
    def flat_names(self) -> list[str]:
        """Every (layer, component) buffer, in the order they lie in the packed buffer."""
        return [name for row in self.names for name in row]

    @property
    def buffer_layout(self) -> Layout:
        """One (layer, component) buffer: ``[head][token][head_dim]`` of this rank's heads."""
        return Layout.contiguous(
            self.dtype,
            (self.local_heads, self.block_size, self.head_dim),
            ("head", "token", "head_dim"),
            iterated=("head",),
            sharded="head",
        )

    @property
    def buffer_nbytes(self) -> int:
        return self.local_heads * self.block_size * self.head_dim * itemsize_of(self.dtype)

    @property
    def block_nbytes(self) -> int:
        return self.buffer_nbytes * self.num_layers * len(self.components)

    def offset_of(self, layer: int, component: int) -> int:
        """Where buffer ``names[layer][component]`` starts in the packed buffer."""
        return (layer * len(self.components) + component) * self.buffer_nbytes

    def buffers(self) -> dict[str, int]:
        """The broker buffers of a block, ``{name: nbytes}``."""
        if self.packed is not None:
            return {self.packed: self.block_nbytes}
        return dict.fromkeys(self.flat_names, self.buffer_nbytes)

    def meta(self) -> dict:
        """What a reader checks (:meth:`check`; :meth:`KVPrefixMatch.load` reads it too)."""
        meta = {
            SHARD_META_TAG: 1,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads,
            "heads": list(self.heads),
            "num_layers": self.num_layers,
            "components": list(self.components),
            "infix": self.infix,
            "layout": self.buffer_layout.to_dict(),
        }
        if self.packed is not None:
            meta["packed"] = self.packed
        return meta

    def key(self, block_hash: str) -> str:
        """The key of this rank's shard of the block ``block_hash``."""
        return block_hash + shard_block_key("", self.tp_rank, self.tp_size, self.total_kv_heads)

    def check(self, meta: Any) -> Layout:
        """The stored buffer layout of a block of another rank (of any TP size) of this
        model, after checking it fits this format; LayoutMismatch naming the field if not."""
        if not isinstance(meta, dict) or meta.get(SHARD_META_TAG) != 1:
            raise LayoutMismatch("matched blocks were not published in the prefix block format")
        for what, published, local in (
            ("layers", meta["num_layers"], self.num_layers),
            ("components", meta["components"], list(self.components)),
            ("total KV heads", meta["total_kv_heads"], self.total_kv_heads),
        ):
            if published != local:
                raise LayoutMismatch(
                    f"layout mismatch on {what}: published {published!r}, local {local!r}"
                )
        stored = Layout.from_dict(meta["layout"])
        for what, published, local in (
            ("dtype", stored.dtype, self.dtype),
            ("block size", stored.size("token"), self.block_size),
            ("head_dim", stored.size("head_dim"), self.head_dim),
        ):
            if published != local:
                raise LayoutMismatch(
                    f"layout mismatch on {what}: published {published!r}, local {local!r}"
                )
        return stored

    def reachable(self, num_tokens: int) -> range:
        """The blocks a request of ``num_tokens`` computed tokens still reads: all of them
        under full attention; under a sliding window, those holding one of the last
        ``window - 1`` tokens (vLLM's rule: the blocks before are freed to the null block)."""
        end = -(-num_tokens // self.block_size)
        if self.window is None:
            return range(end)
        return range(min(end, max(0, num_tokens - self.window + 1) // self.block_size), end)


@dataclass(frozen=True)
class StateBuffer:
    """One named part of a state page: ``shape`` elements of ``dtype``, saved whole."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise BadRequest(f"a state buffer needs a name without '/', not {self.name!r}")
        if not all(isinstance(n, int) and n >= 0 for n in self.shape):
            raise BadRequest(f"state buffer {self.name}: bad shape {self.shape!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        itemsize_of(self.dtype)

    @property
    def nbytes(self) -> int:
        n = itemsize_of(self.dtype)
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class StateFormat:
    """One TP rank's state page of a layer group (a Mamba group's conv + SSM state of every
    layer, say): ``parts`` saved and loaded whole, back to back in one buffer (``packed``)
    or one named buffer each. A page is read only by the same TP layout (the state of a
    rank is whatever that rank computed); its key names the group's shard."""

    parts: tuple[StateBuffer, ...]
    tp_rank: int = 0
    tp_size: int = 1
    packed: str | None = PACKED_STATE

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        names = [p.name for p in self.parts]
        if not names or len(set(names)) != len(names):
            raise BadRequest(f"a state page needs parts of distinct names, not {names!r}")
        shard_heads(self.tp_rank, self.tp_size, None)  # validates the TP facts

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parts]

    @property
    def block_nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def offset_of(self, name: str) -> int:
        """Where part ``name`` starts in the packed buffer."""
        at = 0
        for p in self.parts:
            if p.name == name:
                return at
            at += p.nbytes
        raise KeyError(name)

    def buffers(self) -> dict[str, int]:
        if self.packed is not None:
            return {self.packed: self.block_nbytes}
        return {p.name: p.nbytes for p in self.parts}

    def meta(self) -> dict:
        return {
            STATE_META_TAG: 1,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "parts": [[p.name, p.dtype, list(p.shape)] for p in self.parts],
            "packed": self.packed,
        }

    def key(self, block_hash: str) -> str:
        return f"{block_hash}/state.tp{self.tp_rank}of{self.tp_size}"

    def check(self, meta: Any) -> None:
        """LayoutMismatch naming the field where a stored page's ``meta`` differs."""
        if not isinstance(meta, dict) or meta.get(STATE_META_TAG) != 1:
            raise LayoutMismatch("matched blocks are not state pages")
        mine = self.meta()
        for what in ("tp_size", "parts", "packed"):
            if meta.get(what) != mine[what]:
                raise LayoutMismatch(
                    f"layout mismatch on state {what}: published "
                    f"{meta.get(what)!r}, local {mine[what]!r}"
                )
