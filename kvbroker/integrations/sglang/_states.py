"""State pages of a hybrid model's Mamba pool (SGLang's ``MambaPoolHost``) <-> broker blocks.

No SGLang import; torch is touched only through the host pool's tensors (as numpy).

SGLang's Mamba host pool keeps one *slot* per saved state (its page size is 1): in its
``page_first`` layouts each of its buffers (the SSM ``temporal_buffer``, one ``conv_buffer``
per conv state, the model's ``slot_state_buffers``) is ``[slot, ...]``, so a slot is one
contiguous row of each. A broker block holds one slot whole: a
:class:`kvbroker.blocks.StateFormat` page whose parts are those rows (``temporal``,
``conv{i}``, ``slot{i}``; shapes and dtypes from the buffers), back to back in one buffer,
its meta checked on read. Keys: the page's key (:class:`._pages.PageKeys`, tagged with the
pool's name) plus the state's TP shard (the state is sharded per TP rank, so only the same
TP layout reads it). A state page stands alone (no parent): SGLang saves one at the end of
a backed-up span and restores the one at the end of a hit.

Ownership: as :mod:`._pages`: SGLang owns its host pool, a call reads (set) or writes (get)
only the slots it names, until it returns.
"""

from __future__ import annotations

from kvbroker import blocks
from kvbroker.errors import LayoutMismatch

from .._link import BrokerLink, Warnings
from ._pages import BlockStore, PageKeys

__all__ = ["StateStore", "state_rows"]


def state_rows(pool) -> list[tuple[str, object]]:
    """``(part name, tensor [slot, ...])`` of a Mamba host pool, in its page order; ValueError
    when a slot is not one contiguous row of each buffer."""
    if getattr(pool, "layout", None) not in ("page_first", "page_first_direct"):
        raise ValueError(
            f"the Mamba host pool's layout {getattr(pool, 'layout', None)!r} "
            "is not a slot-major one (page_first, page_first_direct)"
        )
    named = [("temporal", pool.temporal_buffer)]
    named += [(f"conv{i}", b) for i, b in enumerate(pool.conv_buffer)]
    named += [(f"slot{i}", b) for i, b in enumerate(getattr(pool, "slot_state_buffers", ()))]
    out = []
    for name, tensor in named:
        if tensor.numel() == 0:
            continue  # a conv-only model has no SSM state
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"the Mamba host pool's {name} buffer is not one contiguous CPU tensor"
            )
        out.append((name, tensor))
    if not out:
        raise ValueError("the Mamba host pool has no state buffers")
    return out


class StateStore(BlockStore):
    """One rank's state pages of a Mamba host pool."""

    def __init__(
        self,
        link: BrokerLink,
        namespace: str,
        *,
        cache_salt: str,
        pool,
        tp_rank: int,
        tp_size: int,
        tag: str,
        checksum: bool = True,
        warnings: Warnings | None = None,
    ) -> None:
        import torch

        rows = state_rows(pool)
        self.format = blocks.StateFormat(
            tuple(
                blocks.StateBuffer(name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
                for name, t in rows
            ),
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        suffix = self.format.key("")
        super().__init__(
            link,
            namespace,
            PageKeys(namespace, cache_salt, [suffix], tag),
            checksum=checksum,
            warnings=warnings,
        )
        # each buffer as uint8 rows, one per slot
        self.rows = [t.detach().reshape(t.shape[0], -1).view(torch.uint8).numpy() for _, t in rows]
        self.slots = self.rows[0].shape[0]
        self.page_nbytes = self.format.block_nbytes

    def _check(self, slots: list[int]) -> None:
        for s in slots:
            if not 0 <= s < self.slots:
                raise IndexError(f"Mamba host slot {s} is outside the pool's {self.slots}")

    def count(self, page_hashes: list[str]) -> int:
        """How many leading pages' states the node holds."""
        present = self.present(page_hashes)
        return present.index(False) if False in present else len(present)

    def read(self, page_hashes: list[str], slots: list[int]) -> int:
        """Copy the leading states the node holds into host ``slots``; how many were."""
        client = self.link.get()
        if client is None:
            self._count("read_missed_down", len(page_hashes))
            return 0
        try:
            self._check(slots)
            keys = self.keys.blocks(page_hashes)
            with blocks.match_keys(client, self.namespace, keys) as match:
                found = 0
                # Each page is checked before it is copied: one a writer stored with other
                # parts or bytes ends the run, and the pages before it still count.
                while found < match.num_blocks and self._intact(match, found):
                    src, at = match.blocks[found][self.format.packed], 0
                    for rows in self.rows:
                        dst = rows[slots[found]]
                        blocks.copy_into(dst, src[at : at + dst.size])
                        at += dst.size
                    found += 1
        except Exception as exc:  # noqa: BLE001 - SGLang's thread must go on
            self._failed(client, exc, "get")
            return 0
        self._count("read_pages", found)
        self._count("read_missed", len(page_hashes) - found)
        return found

    def _intact(self, match, i: int) -> bool:
        """Whether matched page ``i`` holds this pool's state page: its meta and its one
        buffer's size; a page that does not is counted and warned of, never copied."""
        try:
            self.format.check(match.meta_of(i))
            got = {name: match.blocks[i][name].size for name in match.blocks[i]}
            if got != {self.format.packed: self.page_nbytes}:
                raise LayoutMismatch(
                    f"a state page holds buffers {got}, not "
                    f"{{{self.format.packed!r}: {self.page_nbytes}}}"
                )
        except LayoutMismatch as exc:
            self._count("read_bad_pages")
            self.warnings.warn(
                "bad_state_page",
                "a stored Mamba state page does not match this pool (%s): read as a miss",
                exc,
            )
            return False
        return True

    def write(self, page_hashes: list[str], slots: list[int]) -> bool:
        """Store the states the node lacks; True when every one is stored (now or before)."""
        client = self.link.get()
        if client is None:
            self._count("write_skipped", len(page_hashes))
            return False
        try:
            self._check(slots)
        except IndexError as exc:
            self._failed(client, exc, "set")
            return False
        request = [{"key": k, "parent": None} for k in self.keys.blocks(page_hashes)]
        packed = self.format.packed

        def fill(reservation, kind):
            j = 0
            for b, lease in enumerate(reservation.leases):
                if lease is None:
                    continue  # the node holds it already
                at = 0
                for rows in self.rows:
                    src = rows[slots[b]]
                    blocks.copy(reservation.view(j, packed, at, src.size), src)
                    at += src.size
                j += 1
            return reservation.checksums() if kind is not None else None

        return self._publish(
            client, page_hashes, request, self.format.buffers(), self.format.meta(), fill
        )
