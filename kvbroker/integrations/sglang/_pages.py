"""The data path: pages of SGLang's host pool <-> broker blocks, on :mod:`kvbroker.blocks`.

No SGLang import; torch is touched only through the host pool's tensor (as numpy).

- **Write** (``batch_set_v1``): one :func:`kvbroker.blocks.reserve` for every block of the
  batch the node lacks (the batch's one round trip, all or nothing), each parented on the
  block before it in the chain (the page before, or the caller's last prefix page) so the
  broker evicts a chain from its leaf; each block's runs are copied from the host pool
  straight into its pool extent, hashed as they are copied; then one
  :func:`kvbroker.blocks.seal_later`, sent without waiting. The daemon answers a connection
  in order, so every later call of this backend (any of SGLang's threads: they share the
  connection) sees the pages sealed; the seal's reply is read by the next write (it came
  before that write's reservation) or at close, and a refused seal (an expired lease)
  aborts its leases and is counted (``seal_failed``) and logged: its pages are then misses,
  as evicted pages are. Blocks the node already holds cost no copy. A refusal of the
  reservation (pool full, quota) writes nothing.
- **Read** (``batch_get_v1``): one :func:`kvbroker.blocks.match_keys` over the batch's keys
  (block-major, shard-minor) takes one read lease on the leading run the node holds; each
  matched block's runs are copied from its pool extent straight into the host pool; the
  lease is released before the call returns. Pages count only when every shard of them
  matched; a block that is not what this store writes (another buffer or size: another
  writer of the namespace) ends the run there, counted (``read_bad_pages``) and warned of.
- **Count** (``batch_exists``): the same match with ``hold=False``: one round trip (to a read
  replica where the daemon runs them), nothing held.

Every broker error ends in the return value: misses, or a write that did not happen
(:mod:`kvbroker.integrations._link` for a daemon that is down). Nothing here raises into
SGLang's threads except programming errors, which are logged and counted as errors too.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass

from kvbroker import blocks
from kvbroker.errors import KVBrokerError, LimitExceeded, PoolFull, QuotaExceeded

from .._link import BrokerLink, Warnings
from ._format import PAGE, PageGeometry, Sharding

log = logging.getLogger("kvbroker.integrations.sglang")

__all__ = ["PageRef", "PageStore", "Source"]

_FULL = (PoolFull, QuotaExceeded, LimitExceeded)


@dataclass(frozen=True)
class PageRef:
    """Where one page lies: ``outer`` runs of ``run`` bytes of ``array`` (flat uint8), run
    ``r`` at ``start + r * stride``."""

    array: object
    start: int
    stride: int


class Source:
    """A flat uint8 view of a host pool buffer (or of one flat page), and its pages."""

    def __init__(self, array) -> None:
        self.array = array

    @classmethod
    def of_tensor(cls, tensor) -> Source:
        import torch

        return cls(tensor.detach().reshape(-1).view(torch.uint8).numpy())

    def page(self, token: int, geometry: PageGeometry) -> PageRef:
        return PageRef(self.array, geometry.start(token), geometry.outer_stride)

    @staticmethod
    def flat_page(tensor, geometry: PageGeometry) -> PageRef:
        """A page as SGLang's ``get_data_page(flat=True)`` gives it: its runs back to back."""
        import torch

        nbytes = geometry.outer * geometry.run
        if (
            tensor is None
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() != nbytes
        ):
            raise ValueError(
                f"kvbroker: a flat page must be a contiguous CPU tensor of {nbytes} bytes"
            )
        return PageRef(tensor.detach().reshape(-1).view(torch.uint8).numpy(), 0, geometry.run)


class PageKeys:
    """Broker keys of SGLang page hashes: salted per namespace and ``cache_salt``, then one
    per shard this rank holds (see :mod:`._format`)."""

    def __init__(self, namespace: str, cache_salt: str, suffixes: list[str], tag: str = "") -> None:
        self._base = hashlib.blake2b(
            digest_size=16,
            person=b"kvbroker-sglang",
            key=hashlib.blake2b(cache_salt.encode(), digest_size=32).digest(),
        )
        raw = namespace.encode()
        self._base.update(len(raw).to_bytes(4, "little") + raw)
        self.suffixes, self.tag = suffixes, tag

    def page(self, page_hash: str) -> str:
        """The page's key before its shard suffix; ``tag`` names an extra pool's pages."""
        h = self._base.copy()
        h.update(page_hash.encode())
        return h.hexdigest() + self.tag

    def blocks(self, page_hashes: list[str]) -> list[str]:
        """Block-major, shard-minor."""
        return [self.page(p) + s for p in page_hashes for s in self.suffixes]


class BlockStore:
    """What every store of one rank's blocks in one namespace shares: the link, the seals
    sent without waiting, counters, what a failure does. Thread-safe (SGLang's storage
    threads share it)."""

    def __init__(
        self,
        link: BrokerLink,
        namespace: str,
        keys: PageKeys,
        *,
        checksum: bool = True,
        warnings: Warnings | None = None,
    ) -> None:
        self.link, self.namespace, self.keys, self.checksum = link, namespace, keys, checksum
        self.warnings = warnings or link.warnings
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        # Seals sent without waiting: (client, pending reply, reservation, pages)
        self._sealing: list[tuple] = []

    def present(self, page_hashes: list[str]) -> list[bool]:
        """Which pages the node holds (every block of each), wherever they lie in a chain:
        one ``exists`` per block, sent together (one round trip)."""
        client = self.link.get()
        if client is None or not page_hashes:
            return [False] * len(page_hashes)
        try:
            asked = [
                client.ops.pipelined.exists(k, namespace=self.namespace)
                for k in self.keys.blocks(page_hashes)
            ]
            found = [bool(a.result()) for a in asked]
        except Exception as exc:  # noqa: BLE001 - SGLang's thread must go on
            self._failed(client, exc, "exists")
            return [False] * len(page_hashes)
        n = len(self.keys.suffixes)
        return [all(found[i * n : (i + 1) * n]) for i in range(len(page_hashes))]

    def _publish(
        self,
        client,
        page_hashes: list[str],
        request: list[dict],
        buffers: dict,
        meta: dict | None,
        fill,
    ) -> bool:
        """Reserve ``request`` (one round trip), ``fill(reservation, checksum kind)`` the
        reserved blocks (returning their checksums, or None), send their seal without
        waiting. False when nothing was stored (refused, or the broker failed)."""
        earlier = self._take_sealing()  # sent before this reservation: answered before it
        reservation = None
        try:
            reservation = blocks.reserve(client, self.namespace, request, buffers, meta)
            self._settle(earlier)
            earlier = []
            kind = client.checksum_kind if self.checksum else None
            sums = fill(reservation, kind)
            if reservation.taken:
                pending = blocks.seal_later(client, reservation.taken, sums)
                with self._lock:
                    self._sealing.append((client, pending, reservation, len(page_hashes)))
        except _FULL as exc:
            self._settle(earlier)
            self._count("write_skipped", len(page_hashes))
            self.warnings.warn(
                "full",
                "the broker refused %d HiCache pages (%s): they are not stored",
                len(page_hashes),
                exc,
            )
            return False
        except Exception as exc:  # noqa: BLE001
            if reservation is not None:
                try:
                    reservation.abort()
                except Exception:  # noqa: BLE001 - the connection may be gone, leases with it
                    pass
            self._count("write_skipped", len(page_hashes))
            self._failed(client, exc, "set")
            self._settle(earlier)
            return False
        written = sum(1 for lease in reservation.leases if lease is not None)
        self._count("written_blocks", written)
        self._count("existing_blocks", len(request) - written)
        return True

    def settle(self) -> None:
        """Wait for the replies of the seals sent so far (at close)."""
        self._settle(self._take_sealing())

    def _take_sealing(self) -> list[tuple]:
        with self._lock:
            sealing, self._sealing = self._sealing, []
        return sealing

    def _settle(self, sealing: list[tuple]) -> None:
        """Read the replies of ``sealing``; a refused seal aborts its leases, counted and
        logged (its pages are misses from then on)."""
        for client, pending, reservation, pages in sealing:
            try:
                pending.result()
            except Exception as exc:  # noqa: BLE001 - SGLang's thread must go on
                try:
                    reservation.abort()
                except Exception:  # noqa: BLE001 - the connection may be gone, leases with it
                    pass
                self._count("seal_failed", pages)
                self._failed(client, exc, "seal")

    def clear(self) -> bool:
        """Evict this rank's blocks in the namespace; False when the broker is down."""
        client = self.link.get()
        if client is None:
            return False
        pattern = (
            re.escape(self.keys.tag)
            + "("
            + "|".join(re.escape(s) for s in self.keys.suffixes)
            + ")$"
        )
        try:
            client.evict(namespace=self.namespace, match=pattern)
        except Exception as exc:  # noqa: BLE001
            self._failed(client, exc, "clear")
            return False
        return True

    # -- bookkeeping ----------------------------------------------------------------------------
    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def _failed(self, client, exc: BaseException, what: str) -> None:
        self._count("errors")
        if isinstance(exc, (KVBrokerError, OSError)):
            self.link.fail(exc, client)
            self.warnings.warn(
                f"error_{what}",
                "HiCache %s failed (%s: %s): served as a miss or an unwritten page",
                what,
                type(exc).__name__,
                exc,
            )
        else:
            log.error(
                "kvbroker: HiCache %s failed with an unexpected error; served as a miss "
                "or an unwritten page",
                what,
                exc_info=exc,
            )


class PageStore(BlockStore):
    """One rank's pages of a host pool (the KV pool, or a sliding-window pool: ``tag``)."""

    def __init__(
        self,
        link: BrokerLink,
        namespace: str,
        *,
        cache_salt: str,
        sharding: Sharding,
        geometry: PageGeometry,
        host: Source,
        checksum: bool = True,
        warnings: Warnings | None = None,
        tag: str = "",
    ) -> None:
        super().__init__(
            link,
            namespace,
            PageKeys(namespace, cache_salt, sharding.suffixes(), tag),
            checksum=checksum,
            warnings=warnings,
        )
        self.geometry, self.sharding, self.host = geometry, sharding, host
        self.split = sharding.per_rank
        self.piece = geometry.run // self.split  # bytes of one run a shard holds
        self.block_nbytes = geometry.outer * self.piece
        self.page_nbytes = geometry.outer * geometry.run

    def host_page(self, token: int) -> PageRef:
        return self.host.page(token, self.geometry)

    # -- the three calls ------------------------------------------------------------------------
    def count(self, page_hashes: list[str]) -> int:
        """How many leading pages the node holds (every shard of them)."""
        client = self.link.get()
        if client is None:
            return 0
        try:
            match = blocks.match_keys(
                client, self.namespace, self.keys.blocks(page_hashes), hold=False
            )
            return match.num_blocks // self.split
        except Exception as exc:  # noqa: BLE001 - SGLang's thread must go on (module docstring)
            self._failed(client, exc, "exists")
            return 0

    def read(self, page_hashes: list[str], pages: list[PageRef]) -> int:
        """Copy the leading pages the node holds into ``pages``; how many were copied."""
        client = self.link.get()
        if client is None:
            self._count("read_missed_down", len(page_hashes))
            return 0
        split, piece = self.split, self.piece
        try:
            with blocks.match_keys(
                client, self.namespace, self.keys.blocks(page_hashes), hold=True
            ) as match:
                found = 0
                # Each page's blocks are checked before a byte is copied: one another writer
                # stored with other buffers or sizes ends the run, the pages before it count.
                while (found + 1) * split <= match.num_blocks and self._intact(match, found):
                    ref = pages[found]
                    for j in range(split):
                        view = match.blocks[found * split + j][PAGE]
                        _scatter(view, ref, j * piece, piece, self.geometry.outer)
                    found += 1
        except Exception as exc:  # noqa: BLE001
            self._failed(client, exc, "get")
            return 0
        self._count("read_pages", found)
        self._count("read_missed", len(page_hashes) - found)
        return found

    def _intact(self, match, page: int) -> bool:
        """Whether every block of matched ``page`` is one this store writes (its one buffer
        of ``block_nbytes``); a page that is not is counted and warned of, never copied."""
        want = {PAGE: self.block_nbytes}
        for b in range(page * self.split, (page + 1) * self.split):
            got = {name: match.blocks[b][name].size for name in match.blocks[b]}
            if got != want:
                self._count("read_bad_pages")
                self.warnings.warn(
                    "bad_kv_page",
                    "a stored HiCache page holds buffers %s, not %s (another writer of the "
                    "namespace): it and the pages after it are read as misses",
                    got,
                    want,
                )
                return False
        return True

    def write(
        self, page_hashes: list[str], pages: list[PageRef], *, parent: str | None = None
    ) -> bool:
        """Store the pages the node lacks; True when every page is stored (now or before)."""
        client = self.link.get()
        if client is None:
            self._count("write_skipped", len(page_hashes))
            return False
        keys = self.keys.blocks(page_hashes)
        split = self.split
        # Each shard's chain is its own: the parent of shard j of page i is shard j of i - 1.
        first = self.keys.blocks([parent]) if parent is not None else [None] * split
        request = [
            {"key": k, "parent": keys[b - split] if b >= split else first[b]}
            for b, k in enumerate(keys)
        ]
        piece, outer = self.piece, self.geometry.outer

        def fill(reservation, kind):
            sums, j = [], 0
            for b, lease in enumerate(reservation.leases):
                if lease is None:
                    continue  # the node holds it already
                digest = _gather(
                    reservation.view(j, PAGE),
                    pages[b // split],
                    (b % split) * piece,
                    piece,
                    outer,
                    kind,
                )
                sums.append({PAGE: digest})
                j += 1
            return sums if kind is not None else None

        return self._publish(client, page_hashes, request, {PAGE: self.block_nbytes}, None, fill)


def _gather(dst, ref: PageRef, offset: int, piece: int, outer: int, kind):
    """Copy the ``outer`` pieces of page ``ref`` (``offset`` into each run) back to back into
    ``dst``, one pass; with ``kind``, return their checksum."""
    import numpy as np

    start = ref.start + offset
    if outer == 1:
        src = ref.array[start : start + piece]
    else:
        src = np.lib.stride_tricks.as_strided(
            ref.array[start:], shape=(outer, piece), strides=(ref.stride, 1), writeable=False
        )
    return blocks.copy(dst, src, kind)


def _scatter(src, ref: PageRef, offset: int, piece: int, outer: int) -> None:
    """Copy a block's bytes ``src`` back into the ``outer`` pieces of page ``ref``."""
    for r in range(outer):
        at = ref.start + r * ref.stride + offset
        blocks.copy_into(ref.array[at : at + piece], src[r * piece : (r + 1) * piece])
