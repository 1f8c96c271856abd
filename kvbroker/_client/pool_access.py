"""Client's public reach into what it holds: its pool mappings and its connection state.

The block API (:mod:`kvbroker.blocks`) and the engine adapters copy between an engine's cache
and pool extents a lease lent them; these are the methods they do it with, so that nothing
outside ``kvbroker._client`` reads a client's mappings or session. A mixin of
:class:`~kvbroker.Client` (its own body is at the class-size limit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mappings import PoolMapping

__all__ = ["PoolAccess"]


class PoolAccess:
    """``pool_view``, ``pool_address`` and ``connected`` of :class:`~kvbroker.Client`, and the
    mapping they read through."""

    __slots__ = ()

    def _mapping(self, index: int) -> PoolMapping:
        """This process's mapping of pool ``index``, mapped on first use and held until the
        client closes (or a cold restart names new pools)."""
        return self._maps.get(index, self.pools)  # type: ignore[attr-defined]

    def pool_view(
        self, pool: int, offset: int = 0, nbytes: int | None = None, *, writable: bool = False
    ) -> Any:
        """A numpy uint8 array over ``nbytes`` (default: to the end) of pool ``pool`` from
        ``offset`` in this process's mapping, read-only unless ``writable``. Its bytes are
        the caller's only while a lease lends them; ValueError when it runs past the pool."""
        mapping = self._mapping(pool)  # type: ignore[attr-defined]
        if nbytes is None:
            nbytes = mapping.size - offset
        return mapping.view(offset, nbytes, writable)

    def pool_address(self, pool: int) -> int:
        """The address of pool ``pool``'s mapping in this process (what a DMA engine
        registers), mapped on first use; valid until the client closes or the daemon
        restarts cold (:attr:`epoch` changes)."""
        from .gpu_copy import _address

        return _address(self._mapping(pool).mm)  # type: ignore[attr-defined]

    @property
    def connected(self) -> bool:
        """False once the connection broke (a daemon that died or restarted; the next call
        reconnects, waiting up to ``reconnect`` seconds) or the client closed. Leases of a
        broken connection are gone already: nothing needs sending to end them."""
        return not self._closed and not self._session.broken  # type: ignore[attr-defined]
