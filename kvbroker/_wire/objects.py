"""How an object's buffers lie in its extent: the one layout both sides compute.

The daemon lays out a reservation this way (``reserve``, ``reserve_blocks``, ``publish``);
a client filling a write arena computes the same offsets before it asks, and a GPU ring
object is laid out the same way inside its region.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["BUFFER_ALIGN", "aligned", "buffer_offsets"]

# Every buffer starts on this boundary: DMA engines and vector loads want it.
BUFFER_ALIGN = 256


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the next multiple of :data:`BUFFER_ALIGN`."""
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def buffer_offsets(sizes: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Offsets of the named buffers, in order, inside one extent, and the extent's span."""
    offsets, offset = {}, 0
    for name, nbytes in sizes.items():
        offsets[name] = offset
        offset += aligned(nbytes)
    return offsets, offset
