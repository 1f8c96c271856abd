"""Names of KV buffers: ``past_key.{i}``, ``past_value.{i}``, ``past_latent.{i}``, with an
optional engine infix ``past_key.{i}_{P}`` (the QEfficient convention; see ``docs/design.md``).

The daemon calls :func:`check_buffer_name` on every buffer of a reservation, so a malformed KV
name is refused at publish time instead of silently never matching a claimer's regex. Names
that do not start with a KV prefix (``vision_embeds``, ``logits``...) are left alone: they are
never renamed and never selected by :func:`kv_select_regex`.

``P`` is ASCII letters and digits only: no ``.`` (it separates the layer), no ``_`` (it
separates the infix) and no spaces, so ``past_(key|value)\\.\\d+_P`` selects exactly the KV
buffers of one infix.
"""

from __future__ import annotations

import re

from ..errors import BadRequest

__all__ = [
    "KV_KINDS",
    "check_buffer_name",
    "check_infix",
    "kv_buffer_name",
    "kv_select_regex",
]

# The kinds of KV buffer: key and value of attention heads, or the one latent of MLA caches.
KV_KINDS = ("key", "value", "latent")

_KV_PREFIX = re.compile(r"past_(?:key|value|latent)\.")
_KV_NAME = re.compile(r"past_(?:key|value|latent)\.(?:0|[1-9][0-9]*)(?:_[A-Za-z0-9]+)?")
_INFIX = re.compile(r"[A-Za-z0-9]+")


def check_infix(infix: str | None) -> str | None:
    """``infix`` itself, or BadRequest saying why it cannot be one. None means no infix."""
    if infix is None:
        return None
    if not isinstance(infix, str) or not _INFIX.fullmatch(infix):
        raise BadRequest(
            f"KV buffer infix {infix!r} is invalid: it must be non-empty ASCII letters and "
            "digits only (no '.', '_' or spaces)"
        )
    return infix


def check_buffer_name(name: str) -> None:
    """Refuse a KV-looking buffer name that is malformed (bad layer index or infix)."""
    if _KV_PREFIX.match(name) and not _KV_NAME.fullmatch(name):
        raise BadRequest(
            f"buffer name {name!r} starts like a KV buffer but is not "
            "past_{key|value|latent}.{layer} or past_{key|value|latent}.{layer}_{infix} "
            "(layer: a decimal index; infix: non-empty ASCII letters and digits, no '.', '_' "
            "or spaces)"
        )


def kv_buffer_name(kind: str, layer: int, infix: str | None = None) -> str:
    """The buffer name of one layer's key, value or latent cache."""
    if kind not in KV_KINDS:
        raise BadRequest(f"KV buffer kind must be one of {KV_KINDS}, not {kind!r}")
    if not isinstance(layer, int) or layer < 0:
        raise BadRequest(f"layer index must be a non-negative int, not {layer!r}")
    suffix = "" if check_infix(infix) is None else f"_{infix}"
    return f"past_{kind}.{layer}{suffix}"


def kv_select_regex(infix: str | None = None, kinds: tuple[str, ...] = ("key", "value")) -> str:
    """A claim ``select`` regex (full match) for the KV buffers of ``infix`` and nothing else.

    Without an infix it selects only un-infixed KV names; non-KV buffers never match.
    """
    for kind in kinds:
        if kind not in KV_KINDS:
            raise BadRequest(f"KV buffer kind must be one of {KV_KINDS}, not {kind!r}")
    suffix = "" if check_infix(infix) is None else "_" + re.escape(infix)
    return rf"past_(?:{'|'.join(kinds)})\.\d+{suffix}"
