"""Regular expressions from clients (``select``, ``list``/``evict`` ``match``,
``match_buffers``): compiled by RE2, which matches in linear time, under a memory budget,
and kept in a small LRU cache."""

from __future__ import annotations

import re
from collections import OrderedDict

import re2

from ..errors import BadRequest

__all__ = ["client_regex"]

_MAX_REGEX = 1024
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a bad pattern is the client's error, answered, not logged
# RE2's memory budget per pattern (compiled program and DFA cache; 8 MiB by default): a
# pattern needing more is refused, and matching past the DFA budget falls back to linear
# NFA (slow: 256 KiB made a heavy pattern 30x slower). With at most _REGEX_CACHE patterns
# kept, 600 (or 2,400) distinct heavy patterns leave the daemon ~25 MiB larger (46 before).
_RE2_OPTIONS.max_mem = 1 << 20
_REGEX_CACHE = 32
_regex_cache: OrderedDict[str, re.Pattern] = OrderedDict()


def client_regex(text: str) -> re.Pattern:
    pattern = _regex_cache.get(text)
    if pattern is not None:
        _regex_cache.move_to_end(text)
    else:
        if len(text) > _MAX_REGEX:
            raise BadRequest(f"regex longer than {_MAX_REGEX} characters")
        try:
            # RE2 matches in linear time: a client's pattern cannot stall the daemon
            # (Python's re backtracks: "(a+)+$" against 40 a's runs for hours).
            pattern = re2.compile(text, options=_RE2_OPTIONS)
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode(errors="replace")
            raise BadRequest(f"bad regex {text!r}: {reason}") from None
        while len(_regex_cache) >= _REGEX_CACHE:
            _regex_cache.popitem(last=False)  # the least recently used
        _regex_cache[text] = pattern
    return pattern
