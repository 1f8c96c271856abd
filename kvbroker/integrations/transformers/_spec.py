"""Model facts and Cache plumbing of :mod:`kvbroker.integrations.transformers`: dtype and
integer-view helpers, :class:`KVSpec` (layers, KV heads as the model's attention caches them,
head_dim, dtype), reading the layers of a transformers ``Cache`` and building a
``DynamicCache`` from tensors. Torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import BadRequest, LayoutMismatch
from ...kv import ClaimResult, kv_buffer_name
from ...layout import itemsize_of
from ._landing import settle

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def _torch():
    import torch

    return torch


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bf16"`` / ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype)
    name = name[len("torch.") :] if name.startswith("torch.") else name
    name = _DTYPE_ALIASES.get(name, name)
    itemsize_of(name)  # BadRequest for an unknown dtype
    return name


def _np_int_dtype(itemsize: int):
    """The numpy twin of :func:`_int_dtype` (same signedness: copies never cast)."""
    import numpy

    return numpy.dtype("u1" if itemsize == 1 else f"i{itemsize}")


def _np_copyto(dst, src) -> None:
    import numpy

    numpy.copyto(dst, src, casting="no")  # same integer type: a byte copy, never a conversion


def _torch_dtype(name: str):
    return getattr(_torch(), name)


def _int_dtype(itemsize: int):
    torch = _torch()
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def _ints(tensor):
    """``tensor``'s memory as integers of its item size: a view, bytes rather than values."""
    return tensor.view(_int_dtype(tensor.element_size()))


def _copy_source(tensor):
    """What to hand to ``copy_into``: host memory as a numpy integer view, so the copy is one
    single-threaded numpy pass (torch's multi-threaded ``copy_`` stalls on a busy host: a
    barrier waits for a descheduled worker); device memory as a torch view (one D2H copy)."""
    ints = _ints(tensor)
    return ints.numpy() if ints.device.type == "cpu" else ints


def _pool_tensor(view):
    """A torch tensor over a read-only pool view (uint8 numpy); only ever read from."""
    with warnings.catch_warnings():  # torch warns that the array is not writable: we only read
        warnings.simplefilter("ignore", UserWarning)
        return _torch().from_numpy(view)


def _check_size(dst, view) -> None:
    """The uint8 pool ``view`` holds exactly tensor ``dst``'s bytes."""
    if view.nbytes != dst.numel() * dst.element_size():
        raise LayoutMismatch(
            f"layout mismatch on buffer size: published {view.nbytes} bytes, local "
            f"{tuple(dst.shape)} × {dst.element_size()} bytes"
        )


def _copy_from_pool(dst, view) -> None:
    """Copy the uint8 pool ``view`` into tensor ``dst`` (any device, any strides), bit for bit."""
    _check_size(dst, view)
    if dst.device.type == "cpu":  # numpy: one single-threaded pass (see _copy_source)
        np_ints = _np_int_dtype(dst.element_size())
        _np_copyto(_ints(dst).numpy(), view.view(np_ints).reshape(tuple(dst.shape)))
        return
    ints = _int_dtype(dst.element_size())
    _ints(dst).copy_(_pool_tensor(view).view(ints).view(dst.shape))  # one H2D copy


# -- model facts ----------------------------------------------------------------------------


def cached_kv_heads(config: Any) -> int:
    """KV heads per layer in the model's cache, counted the way its attention counts them.

    Most configs say it (``num_key_value_heads``; Falcon's ``num_kv_heads``). Multi-query
    models whose config keeps no such count cache ONE head: Falcon with ``multi_query`` and
    not ``new_decoder_architecture`` (its attention uses ``num_kv_heads`` only in the new
    architecture or without multi-query), GPT-BigCode with ``multi_query``. Falcon's new
    decoder architecture broadcasts its ``num_kv_heads`` K/V heads to every query head before
    caching, so its cache holds ``num_attention_heads`` heads.
    """
    heads = int(config.num_attention_heads)
    model_type = str(getattr(config, "model_type", "") or "")
    multi_query = bool(getattr(config, "multi_query", False))
    if model_type == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return heads
        if multi_query:
            return 1
        return int(getattr(config, "num_kv_heads", None) or heads)
    explicit = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
    if explicit:
        return int(explicit)
    return 1 if multi_query else heads


@dataclass(frozen=True)
class KVSpec:
    """What a model's KV cache looks like: layers, KV heads (all of them), head_dim, dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model_type: str = ""

    @classmethod
    def from_config(cls, config: Any, dtype: Any = None) -> KVSpec:
        """The spec of a transformers config (``dtype``: defaults to the config's ``dtype``)."""
        text = config
        if hasattr(config, "get_text_config"):  # multimodal configs nest the decoder's
            text = config.get_text_config(decoder=True)
        try:
            heads = int(text.num_attention_heads)
            kv_heads = cached_kv_heads(text)
            head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
            layers = int(text.num_hidden_layers)
        except AttributeError as exc:
            raise BadRequest(
                f"config {type(config).__name__} lacks a KV cache fact: {exc}"
            ) from None
        if dtype is None:
            dtype = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
            if dtype is None:
                raise BadRequest("KVSpec.from_config: the config names no dtype; pass dtype=")
        return cls(
            layers,
            kv_heads,
            head_dim,
            _dtype_name(dtype),
            str(getattr(text, "model_type", "") or ""),
        )

    @classmethod
    def from_model(cls, model: Any) -> KVSpec:
        return cls.from_config(model.config, model.dtype)

    def to_meta(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "model_type": self.model_type,
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> KVSpec:
        return cls(
            int(meta["num_layers"]),
            int(meta["num_kv_heads"]),
            int(meta["head_dim"]),
            str(meta["dtype"]),
            str(meta.get("model_type", "")),
        )

    def check_published(self, published: KVSpec, what: str) -> None:
        """Raise LayoutMismatch naming the first fact where ``published`` differs from self."""
        for label, attr in (
            ("layers", "num_layers"),
            ("KV heads", "num_kv_heads"),
            ("head_dim", "head_dim"),
            ("dtype", "dtype"),
        ):
            theirs, mine = getattr(published, attr), getattr(self, attr)
            if theirs != mine:
                model = published.model_type and f", published by a {published.model_type!r} model"
                raise LayoutMismatch(
                    f"layout mismatch on {label} ({what}{model}): published {theirs}, local {mine}"
                )


def _local_spec(model: Any, config: Any, dtype: Any) -> tuple[KVSpec, Any]:
    if model is not None:
        return KVSpec.from_model(model), model.config
    if config is None:
        raise BadRequest("pass the claiming model (model=) or its config (config=, dtype=)")
    return KVSpec.from_config(config, dtype), config


# -- reading and building Cache objects ------------------------------------------------------


@dataclass
class _Layer:
    keys: Any
    values: Any
    seen: int  # tokens this layer has processed (a sliding-window layer stores fewer)

    @property
    def stored(self) -> int:
        return self.keys.shape[-2]


def _read_layers(cache: Any) -> list[_Layer]:
    """The per-layer K/V tensors of a transformers Cache (or a sequence of (K, V) pairs)."""
    layers = []
    if hasattr(cache, "layers"):
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        for i, layer in enumerate(cache.layers):
            settle(layer)  # a claimed cache's layer still landing: its copies first
            if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
                raise BadRequest(
                    f"layer {i} is a {type(layer).__name__}: only DynamicLayer and "
                    "DynamicSlidingWindowLayer caches (the DynamicCache that model(..., "
                    "use_cache=True) returns) can be published"
                )
            if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
                raise BadRequest(f"layer {i} of the cache is empty: run the prefill first")
            seen = getattr(layer, "cumulative_length", None)
            layers.append(
                _Layer(
                    layer.keys, layer.values, layer.keys.shape[-2] if seen is None else int(seen)
                )
            )
    else:
        for pair in cache:
            k, v = pair[0], pair[1]
            layers.append(_Layer(k, v, k.shape[-2]))
    if not layers:
        raise BadRequest("the cache has no layers")
    first = layers[0]
    for i, layer in enumerate(layers):
        k, v = layer.keys, layer.values
        if k.dim() != 4 or k.shape != v.shape:
            raise BadRequest(
                f"layer {i}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be "
                "[batch, kv_heads, seq, head_dim]"
            )
        f = first.keys
        if (k.dtype, k.shape[:2], k.shape[3]) != (
            f.dtype,
            f.shape[:2],
            f.shape[3],
        ) or v.dtype != k.dtype:
            raise BadRequest(
                f"layer {i} is {k.dtype} {tuple(k.shape)}, layer 0 is {first.keys.dtype} "
                f"{tuple(first.keys.shape)}: every layer must share dtype, batch, heads, head_dim"
            )
        if layer.seen != first.seen:
            raise BadRequest(f"layer {i} has seen {layer.seen} tokens, layer 0 {first.seen}")
    return layers


def _spec_of(layers: list[_Layer], config: Any) -> KVSpec:
    k = layers[0].keys
    model_type = ""
    mine = KVSpec(len(layers), int(k.shape[1]), int(k.shape[3]), _dtype_name(k.dtype))
    if config is not None:
        # The cache must be the config's: catches a config from another model at publish time.
        said = KVSpec.from_config(config, k.dtype)
        model_type = said.model_type
        for label, attr in (
            ("layers", "num_layers"),
            ("KV heads", "num_kv_heads"),
            ("head_dim", "head_dim"),
        ):
            if getattr(mine, attr) != getattr(said, attr):
                raise LayoutMismatch(
                    f"layout mismatch on {label}: the cache has {getattr(mine, attr)}, its "
                    f"config ({said.model_type or type(config).__name__}) says "
                    f"{getattr(said, attr)}"
                )
    return KVSpec(mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.dtype, model_type)


def _build_cache(config: Any, kvs: Sequence[tuple[Any, Any]], seq_len: int):
    """A DynamicCache (layer types from ``config``) whose layers own the given tensors."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    if not cache.layers:  # no config: plain full-attention layers
        cache.layers = [DynamicLayer() for _ in kvs]
    if len(cache.layers) != len(kvs):
        raise LayoutMismatch(
            f"layout mismatch on layers: published {len(kvs)}, the local config makes "
            f"{len(cache.layers)} cache layers"
        )
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, kvs, strict=True)):
        kind = type(layer)
        if kind not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise BadRequest(
                f"the local config makes layer {i} a {kind.__name__}, which this "
                "adapter cannot fill"
            )
        stored = k.shape[-2]
        if kind is DynamicLayer and stored != seq_len:
            raise LayoutMismatch(
                f"layout mismatch on sliding window (layer {i}): published {stored} of "
                f"{seq_len} tokens (a sliding-window layer), local layer is full attention"
            )
        # Setting the tensors directly: update() would concatenate, i.e. copy them again.
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        if kind is DynamicSlidingWindowLayer:
            # DynamicSlidingWindowLayer.update keeps the last window - 1 tokens.
            if stored != min(seq_len, layer.sliding_window - 1):
                raise LayoutMismatch(
                    f"layout mismatch on sliding window (layer {i}): published {stored} stored "
                    f"tokens of {seq_len}, local window {layer.sliding_window}"
                )
            layer.cumulative_length = seq_len
    return cache


META_TAG = "kvbroker.transformers"  # meta key marking (and versioning) what this module published


@dataclass
class PublishedCache:
    """What :func:`publish_cache` published: the key, bytes copied, wall time."""

    key: str
    seq_len: int
    nbytes: int
    seconds: float


@dataclass
class ClaimedCache:
    """A rebuilt ``DynamicCache`` (owned by the caller) and what came with it.

    ``seq_len``: tokens the cache has seen (the position of the next token). ``meta``: the
    publisher's ``extra`` meta. ``result``: kvbroker.kv's ClaimResult for TP claims.
    """

    cache: Any
    seq_len: int
    spec: KVSpec
    meta: dict = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0
    result: ClaimResult | None = None
    # claim_cache(overlap): the copies still landing; finish() waits for the lease's release
    landing: Any = None


def _buffer_names(num_layers: int) -> list[tuple[str, str]]:
    return [(kv_buffer_name("key", i), kv_buffer_name("value", i)) for i in range(num_layers)]
