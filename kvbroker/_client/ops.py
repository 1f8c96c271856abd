"""The typed op stubs, as the client reaches them. They live in the contract,
:mod:`kvbroker._wire.ops`, so that every speaker asking the daemon (this client and the TUI's
asyncio one) names ops through the same stubs."""

from .._wire.ops import LEASE_OPS, Ops

__all__ = ["LEASE_OPS", "Ops"]
