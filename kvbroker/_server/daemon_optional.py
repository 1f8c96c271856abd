"""The part of the daemon a configuration turns on that the daemon hosts itself, started by
:meth:`Daemon.serve`: the fleet (other nodes' brokers, KV events for routers). The disk tier
([tier.disk]) is the broker's: the start builds it (kvbroker._server.startup)."""

from __future__ import annotations

from .startup import DaemonError
from ..errors import KVBrokerError


class OptionalParts:
    """Starting the fleet (a part of :class:`Daemon`)."""

    async def _start_fleet(self) -> None:
        """Peer pulls and serving ([transfer]) and KV events ([events]), when configured
        (kvbroker._server.fleet): NIXL and pyzmq are imported only then."""
        cfg = self.config
        if not (
            cfg.transfer_cert_file
            or cfg.transfer_key_file
            or cfg.transfer_ca_file
            or cfg.transfer_listen
            or cfg.transfer_peers
            or cfg.events_publish
        ):
            return
        from .fleet import Fleet

        self.fleet = Fleet(self)
        try:
            await self.fleet.start()
        except KVBrokerError as exc:
            raise DaemonError(str(exc)) from None
