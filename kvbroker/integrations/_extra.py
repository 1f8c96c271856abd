"""An engine's extra config for kvbroker: a key it does not know is said, not ignored.

The daemon refuses an unknown setting; an adapter cannot refuse one (the engine would not
start, and the dict may carry the engine's own keys), but a misspelt key (``"sock"``,
``"load_asnyc"``) silently meant the default: the engine then served from another socket, or
synchronously, with nothing saying why. :func:`unknown_keys` names such keys, with the key
it was probably meant to be, for the adapter to log once at start. No engine import.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

__all__ = ["unknown_keys"]


def unknown_keys(
    extra: Mapping[str, Any], known: Collection[str], *, shared: bool = False
) -> list[str]:
    """A line per key of ``extra`` not in ``known``: ``'sock' (did you mean 'socket'?)``.
    ``shared``: the dict carries the engine's own keys too (SGLang's backend config), so only
    keys close to one of ``known`` are named, as the likely misspellings."""
    lines = []
    for key in extra:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.75)
        if close:
            lines.append(f"{key!r} (did you mean {close[0]!r}?)")
        elif not shared:
            lines.append(f"{key!r} (known: {', '.join(sorted(known))})")
    return lines
