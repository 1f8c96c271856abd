"""Prefix KV reuse across data-parallel ranks: chained block hashes, longest-prefix match.

An engine's KV is published in blocks of ``block_size`` tokens. Block ``i`` is keyed by a
chained hash ``h_i = H(h_{i-1}, tokens of block i, namespace, cache_salt)`` (BLAKE2b, stable
across processes and Python runs), so a key names the whole prefix up to that block, and a
prefix never matches across namespaces or cache salts: tenants do not share prompts.

Ownership
---------
- :meth:`PrefixCache.publish` reserves every missing block in one round trip, copies each
  byte once, and seals them in a second; blocks already published cost no copy.
- :meth:`PrefixCache.match` returns a :class:`PrefixMatch`: one read lease covering every
  matched block (one round trip for all of them). Its views stay valid until ``release`` (the end of
  the ``with`` block): copy what you need into your own cache first. While held, the blocks
  are never evicted — many DP ranks may hold the same blocks at once.
- The broker evicts a chain from its leaf: a block goes only after every block that extends it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._client import Client, WriteLease, _np, copy_into, nbytes_of
from .errors import KVBrokerError

__all__ = ["PrefixCache", "PrefixMatch", "block_hashes"]

_DIGEST = 16


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    namespace: str = "default",
    cache_salt: str = "",
) -> list[str]:
    """Chained hashes of every *full* block of ``token_ids`` (hex strings)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    seed = hashlib.blake2b(digest_size=_DIGEST, person=b"kvbroker-prefix")
    seed.update(len(namespace).to_bytes(4, "little") + namespace.encode())
    seed.update(len(cache_salt).to_bytes(4, "little") + cache_salt.encode())
    prev = seed.digest()
    out = []
    n_full = len(token_ids) // block_size
    # Tokens as little-endian int64, converted once: per-token Python would dominate.
    raw = memoryview(_token_bytes(token_ids[: n_full * block_size]))
    step = 8 * block_size
    blake2b = hashlib.blake2b
    for b in range(n_full):
        h = blake2b(prev, digest_size=_DIGEST)
        h.update(raw[b * step : (b + 1) * step])
        prev = h.digest()
        out.append(prev.hex())
    return out


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    import numpy as np

    return np.asarray(token_ids, dtype="<i8").tobytes()


class MatchedBlock:
    """Read-only views of one matched block, valid while its :class:`PrefixMatch` is held."""

    __slots__ = ("_match", "_extents")

    def __init__(self, match: PrefixMatch, extents: dict[str, tuple[int, int, int]]) -> None:
        self._match = match
        self._extents = extents

    def __getitem__(self, name: str):
        if self._match.released:
            raise KVBrokerError("the prefix match was released; its views are gone")
        pool, offset, nbytes = self._extents[name]
        view = _np().frombuffer(self._match.client._mapping(pool).mm, dtype="uint8",
                                count=nbytes, offset=offset)  # fmt: skip
        view.flags.writeable = False
        return view

    def __iter__(self):
        return iter(self._extents)

    def keys(self):
        return self._extents.keys()


class PrefixMatch:
    """One read lease on the longest published prefix; release it once copied."""

    def __init__(self, client: Client, reply: dict, block_size: int, asked_at: float) -> None:
        self.client = client
        self.block_size = block_size
        self.lease: int | None = reply["lease"]
        self.ttl: float = reply["ttl"]
        self.meta: dict | None = (reply.get("metas") or [None])[0]
        names = reply["names"]
        self._raw = reply["blocks"]
        self._names = names
        self._blocks: list[MatchedBlock] | None = None
        self._safe_until = asked_at + 0.9 * self.ttl
        self.released = self.lease is None

    @property
    def blocks(self) -> list[MatchedBlock]:
        if self._blocks is None:  # built on first use: a caller may only want the count
            out = []
            for raw in self._raw:
                if isinstance(raw, dict):
                    ext = {n: tuple(e) for n, e in raw.items()}
                else:
                    pool = raw[0]
                    ext = {n: (pool, raw[1 + 2 * i], raw[2 + 2 * i])
                           for i, n in enumerate(self._names)}  # fmt: skip
                out.append(MatchedBlock(self, ext))
            self._blocks = out
        return self._blocks

    @property
    def num_blocks(self) -> int:
        return len(self._raw)

    @property
    def num_tokens(self) -> int:
        return len(self._raw) * self.block_size

    def renew(self, ttl: float | None = None) -> None:
        if self.lease is not None:
            asked_at = time.monotonic()
            ((_, granted),) = self.client._call("renew", leases=[self.lease], ttl=ttl)["expires_in"]
            self._safe_until = asked_at + 0.9 * granted

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if time.monotonic() < self._safe_until:
            self.client._session.send_only("release", lease=self.lease)
        else:
            self.client._call("release", lease=self.lease)

    def __enter__(self) -> PrefixMatch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class PrefixCache:
    """A DP rank's view of the node's prefix cache for one namespace and cache salt."""

    def __init__(
        self,
        client: Client,
        *,
        namespace: str = "prefix",
        block_size: int = 16,
        cache_salt: str = "",
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.block_size = block_size
        self.cache_salt = cache_salt

    def hashes(self, token_ids: Sequence[int]) -> list[str]:
        return block_hashes(token_ids, self.block_size, namespace=self.namespace,
                            cache_salt=self.cache_salt)  # fmt: skip

    def publish(
        self,
        token_ids: Sequence[int],
        blocks: Sequence[Mapping[str, Any]] | Callable[[int], Mapping[str, Any]],
        *,
        block_sizes: Mapping[str, int] | None = None,
        meta: dict | None = None,
    ) -> int:
        """Publish the full blocks of ``token_ids``; returns how many were new.

        ``blocks``: block ``i``'s buffers ({name: array/tensor/bytes}), as a sequence, or as
        a function of ``i`` together with ``block_sizes`` ({name: nbytes}, the same for every
        block): the function is then called only for blocks the node lacks, so nothing is
        gathered for blocks that are already there.
        """
        keys = self.hashes(token_ids)
        if not keys:
            return 0
        if callable(blocks):
            if block_sizes is None:
                raise TypeError("publish: a function of the block index needs block_sizes")
            get = blocks
            sizes = [dict(block_sizes)] * len(keys)
        else:
            if len(blocks) < len(keys):
                raise ValueError(f"publish: {len(keys)} full blocks but {len(blocks)} given")
            get = blocks.__getitem__
            sizes = [{name: nbytes_of(b) for name, b in blocks[i].items()}
                     for i in range(len(keys))]  # fmt: skip
        request = [
            {"key": k, "parent": keys[i - 1] if i else None, "buffers": sizes[i], "meta": meta}
            for i, k in enumerate(keys)
        ]
        reply = self.client._call("reserve_blocks", namespace=self.namespace, blocks=request)
        leases = []
        try:
            for i, res in enumerate(reply["results"]):
                if res.get("exists"):
                    continue
                lease = WriteLease(self.client, self.namespace, keys[i],
                                   {"lease": res["lease"], "ttl": reply["ttl"],
                                    "buffers": res["buffers"]})  # fmt: skip
                for name, src in get(i).items():
                    if sizes[i][name]:
                        copy_into(lease[name], src)
                lease._drop_views()
                leases.append(lease.id)
        except BaseException:
            for res in reply["results"]:
                if "lease" in res:
                    self.client._session.send_only("abort", lease=res["lease"])
            raise
        if leases:
            self.client._call("seal_many", leases=leases)
        return len(leases)

    def match(
        self,
        token_ids: Sequence[int],
        *,
        hashes: list[str] | None = None,
        ttl: float | None = None,
    ) -> PrefixMatch:
        """One read lease on the longest run of leading blocks the node holds.

        Never more than ``len(token_ids) - 1`` tokens: the engine must prefill at least one
        token to get logits. ``hashes``: this prompt's block hashes if the engine already
        computed them (e.g. when the request arrived).
        """
        usable = max(0, len(token_ids) - 1) // self.block_size
        if hashes is None:
            hashes = self.hashes(token_ids[: usable * self.block_size])
        keys = hashes[:usable]
        asked_at = time.monotonic()
        reply = self.client._call("match_prefix", namespace=self.namespace, keys=keys,
                                  block_tokens=self.block_size, ttl=ttl)  # fmt: skip
        return PrefixMatch(self.client, reply, self.block_size, asked_at)
