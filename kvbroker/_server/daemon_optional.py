"""The parts of the daemon a configuration turns on, started by :meth:`Daemon.serve`: the disk
tier ([tier.disk]) and the fleet (other nodes' brokers, KV events for routers)."""

from __future__ import annotations

import logging
import os
from typing import Any

from .._wire.paths import format_size
from .startup import DaemonError
from ..errors import KVBrokerError


log = logging.getLogger("kvbroker.daemon")


class OptionalParts:
    """Starting the disk tier and the fleet (a part of :class:`Daemon`)."""

    def _start_disk(self) -> None:
        """The disk tier ([tier.disk], kvbroker._server.disk_tier), when configured: its
        index read back, the pools' objects it holds a copy of (a warm restart) known."""
        if not self.config.tier_disk_directories:
            unused = self.config.disk_settings_unused()
            if unused:  # asked for a tier, silently getting none would mislead
                log.warning(
                    "%s set, but no [tier.disk] directories: no disk tier", ", ".join(unused)
                )
            return
        from . import disk_link

        b = self.broker
        quotas = b.accounts

        def quota_of(account: Any) -> int | None:  # its share of the pools ([quotas])
            q = quotas.quotas
            return q.limit(account) if isinstance(account, str) else q.tenant_limit(account)

        disk = disk_link.start(self.config, b.pools, quota_of)
        s = b.open_session(os.getpid(), os.getuid(), os.getgid())
        s.name, s.role, s.greeted = "disk tier", "promoter", True
        disk.bind(
            disk_link.DiskLink(
                directory=b.directory,
                free_object=b._free_object,
                reserve_extent=b.reserve_extent,
                seal=b.seal_all,
                live=b.leases.__contains__,
                discard=lambda ls: b.abort(ls, "its promotion from disk failed"),
                session=s,
                ttl=b.leases.max_lease_ttl,
            )
        )
        disk.adopt_pool_objects(b.directory.in_namespace(None))
        b.pages.tier = disk
        st = disk.statistics()
        log.info(
            "disk tier: %s in %s (%s), %d object(s) on disk",
            format_size(st.capacity),
            ", ".join(st.directories),
            "O_DIRECT" if st.o_direct else f"buffered: {st.o_direct_problem or 'o_direct = false'}",
            st.objects,
        )

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
