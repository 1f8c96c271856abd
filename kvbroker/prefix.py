"""Prefix KV reuse across data-parallel ranks: chained block hashes, longest-prefix match.

An engine's KV is published in blocks of ``block_size`` tokens. Block ``i`` is keyed by a
chained hash ``h_i = H(h_{i-1}, tokens of block i, namespace, cache_salt)`` (BLAKE2b, stable
across processes and Python runs), so a key names the whole prefix up to that block, and a
prefix never matches across namespaces or cache salts: tenants do not share prompts.

Ownership
---------
- :meth:`PrefixCache.publish` reserves every missing block in one round trip, copies each
  byte once, and seals them in a second; blocks already published cost no copy.
- :meth:`PrefixCache.match` returns a :class:`PrefixMatch` holding one read lease per matched
  block (one round trip for all of them). Its views stay valid until ``release`` (the end of
  the ``with`` block): copy what you need into your own cache first. While held, the blocks
  are never evicted — many DP ranks may hold the same blocks at once.
- The broker evicts a chain from its leaf: a block goes only after every block that extends it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._client import Client, WriteLease, _Lease, copy_into, nbytes_of

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
    for b in range(n_full):
        block = token_ids[b * block_size : (b + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=_DIGEST)
        h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in block))
        prev = h.digest()
        out.append(prev.hex())
    return out


class _BlockLease(_Lease):
    pass


class PrefixMatch:
    """Read leases on the longest published prefix; release them when copied."""

    def __init__(self, client: Client, namespace: str, reply: dict, block_size: int,
                 asked_at: float) -> None:  # fmt: skip
        self.client = client
        self.block_size = block_size
        ttl = reply["ttl"]
        self.blocks: list[_BlockLease] = [
            _BlockLease(client, namespace, "", {"lease": b["lease"], "ttl": ttl,
                                                "buffers": b["buffers"]}, asked_at)
            for b in reply["blocks"]
        ]  # fmt: skip
        self.metas = [b.get("meta") for b in reply["blocks"]]
        self._safe_until = asked_at + 0.9 * ttl
        self.released = not self.blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        ids = [b.id for b in self.blocks]
        for b in self.blocks:
            b._drop_views()
        if time.monotonic() < self._safe_until:
            self.client._session.send_only("release_many", leases=ids)
        else:
            self.client._call("release_many", leases=ids)

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

    def match(self, token_ids: Sequence[int], *, ttl: float | None = None) -> PrefixMatch:
        """Read leases on the longest run of leading blocks the node holds.

        Never more than ``len(token_ids) - 1`` tokens: the engine must prefill at least one
        token to get logits.
        """
        usable = max(0, len(token_ids) - 1) // self.block_size
        keys = self.hashes(token_ids[: usable * self.block_size])
        asked_at = time.monotonic()
        reply = self.client._call("match_prefix", namespace=self.namespace, keys=keys,
                                  block_tokens=self.block_size, ttl=ttl)  # fmt: skip
        return PrefixMatch(self.client, self.namespace, reply, self.block_size, asked_at)
