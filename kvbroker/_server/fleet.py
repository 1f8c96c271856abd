"""The daemon's side of the fleet (issue 18): pulling sealed objects from peer brokers and
serving its own to them through NIXL, and publishing KV events for routers.

:class:`Fleet` is owned by the daemon (started after the broker, closed before the pools):

- one :class:`~kvbroker._server.transfer.NixlEndpoint` with every pool registered once (the
  daemon maps its pools for this: NIXL needs their addresses in this process, and a pull
  verifies the checksums of what it read);
- with ``[transfer] listen``, a :class:`~kvbroker._server.peer_channel.PeerServer` (mutual
  TLS) whose :class:`~kvbroker._server.fleet_serving.BrokerProvider` pins objects for peers
  through the broker's own lease machinery (the serving side, limited by ``[transfer] serve``);
- pulls (:meth:`Fleet.fetch`, :meth:`Fleet.fetch_prefix`), asked by ``claim``/``fetch``/
  ``match_prefix`` with ``peer=`` (the handlers raise :class:`~.state.Deferred`) of a
  configured peer only: pin and describe on the peer (one round trip), the description
  checked as a local seal (:mod:`kvbroker._server.pin_reply`), a write lease in our pool for
  each object (the fleet's session, charged to the asking session's tenants), **one** NIXL
  READ of every extent (coalesced; in a worker thread, never on the event loop), the
  checksums recorded at the peer's seal verified (in the thread too), the peer's lease
  released (a consume counted there if the claim consumes; a
  lease that had ended by then fails the pull: its pages may have been reused mid-read),
  then sealed here with its meta, consumers, parent, tokens and checksums. Nothing is sealed
  before all of that succeeded; a failure discards the write leases (pages of a READ that
  may still be landing go into the timed quarantine) and releases the peer's lease. One
  pull per (peer, namespace, key) at a time: concurrent claims share it; an object already
  here is never pulled.
- with ``[events] publish``, the KV event feed for routers
  (:class:`~kvbroker._server.fleet_events.EventFeed`).

The control channel and NIXL calls never block the event loop: connects, pins and releases
are asyncio; NIXL reads and checksum passes run in the loop's default executor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._wire.stats import EventStatistics, PeerInfo, TransferStatistics
from ..errors import (
    BadRequest,
    Exists,
    Forbidden,
    KVBrokerError,
    LeaseExpired,
    PeerUnavailable,
    TransferFailed,
)
from . import transfer
from .checks import check_name
from .fleet_events import EventFeed, announced, block_event_hash
from .fleet_pull import PullSteps, _Peer
from .fleet_serving import BrokerProvider
from .pin_reply import looked_up
from .disk_store import PoolPages
from .pool import open_segment

if TYPE_CHECKING:
    from .broker import Broker
    from .hosting import DaemonView
    from .state import Lease, Session

__all__ = ["Fleet", "BrokerProvider", "EventFeed", "block_event_hash", "announced"]

log = logging.getLogger("kvbroker.fleet")


# -- the daemon's fleet ----------------------------------------------------------------------------


class Fleet(PullSteps):
    """NIXL endpoint, peer server, pulls and events of one daemon (see the module doc)."""

    def __init__(self, daemon: DaemonView) -> None:
        cfg = daemon.config
        self.daemon = daemon
        self.broker: Broker = daemon.broker
        self.node = cfg.transfer_node or socket.gethostname().split(".")[0] or "kvbroker"
        self.timeout: float = cfg.transfer_timeout
        self.pin_ttl: float = cfg.transfer_pin_ttl
        self.listen: str = ""
        self._server_tls: ssl.SSLContext | None = None
        self._client_tls: ssl.SSLContext | None = None
        # (identity of the host, port) -> the address as [transfer] peers writes it
        self._configured: dict[tuple[str, int], str] = {}
        self.endpoint: transfer.NixlEndpoint | None = None
        self.server: transfer.PeerServer | None = None
        self.provider: BrokerProvider | None = None
        self.events: EventFeed | None = None
        self._maps: list = []  # each pool's mapping, registered with NIXL; never read here
        self.pages: list[PoolPages] = []  # each pool's segment, read with pread
        self.bases: list[int] = []
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._pulls: dict[tuple, asyncio.Task] = {}
        self.session: Session | None = None
        self.pulls = 0
        self.bytes_pulled = 0
        self.failures: Counter[str] = Counter()
        # The latest failed pulls' (namespace, message): a message names its keys, so a
        # tenant's stat shows the latest of a namespace it may read (snapshot.statistics_for)
        self.recent_failures: deque[tuple[str, str]] = deque(maxlen=64)
        # The latest pull: bytes, seconds of its NIXL READ alone, seconds of the whole pull
        # (pin to seal) — what benchmarks/bench_remote.py sets beside the claim's own time.
        self.last_pull: tuple[int, float, float] = (0, 0.0, 0.0)
        # ... and where the rest of that pull's time went, phase -> seconds (pin, reserve,
        # read, verify, release, seal, ...; see _pull_inner): what issue 43's profile reads.
        self.last_phases: dict[str, float] = {}
        self.closed = False
        self._read_seconds = 0.0

    @property
    def pulling(self) -> bool:
        return self.endpoint is not None

    # -- start and stop ----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.daemon.config
        self.broker.fleet = self
        if cfg.events_publish:
            self.events = EventFeed(self.daemon, self.node)
        files = {
            "cert_file": cfg.transfer_cert_file,
            "key_file": cfg.transfer_key_file,
            "ca_file": cfg.transfer_ca_file,
        }
        if not any(files.values()):
            if cfg.transfer_listen is not None or cfg.transfer_peers:
                raise KVBrokerError(
                    "[transfer] listen and peers need cert_file, key_file "
                    "and ca_file: brokers authenticate each other with "
                    "mutual TLS"
                )
            return
        missing = [k for k, v in files.items() if not v]
        if missing:
            raise KVBrokerError(
                f"[transfer] needs cert_file, key_file and ca_file; {' and '.join(missing)} not set"
            )
        if not cfg.transfer_peers:
            raise KVBrokerError(
                "[transfer] peers is empty: list the brokers (HOST:PORT) "
                "this node pulls from and serves"
            )
        try:
            self._server_tls, self._client_tls = transfer.tls_contexts(
                files["cert_file"], files["key_file"], files["ca_file"]
            )
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise KVBrokerError(f"[transfer] TLS files: {exc}") from None
        self._configured = {}
        for address in cfg.transfer_peers:
            host, port = transfer.parse_address(address)
            self._configured[(transfer.identity(host), port)] = address
        os.environ.setdefault("UCX_TLS", "tcp")  # no RDMA here unless the operator says so
        try:
            self.endpoint = transfer.NixlEndpoint(f"kvbroker-{self.node}-{os.getpid()}")
        except ImportError as exc:
            raise KVBrokerError(str(exc)) from None
        self._map_pools()
        self.endpoint.register(zip(self.bases, (p.size for p in self.broker.pools), strict=True))
        s = self.broker.open_session(os.getpid(), os.getuid(), os.getgid())
        s.name, s.role, s.greeted = "fleet", "puller", True
        self.session = s
        if cfg.transfer_listen is not None:
            host, port = cfg.transfer_listen
            self.provider = BrokerProvider(self.broker, self.bases, cfg.transfer_serve, self.pages)
            self.server = transfer.PeerServer(
                self.provider,
                tls=self._server_tls,
                node=self.node,
                metadata=self.endpoint.metadata(),
                agent=self.endpoint.name,
                peers=[transfer.parse_address(p)[0] for p in cfg.transfer_peers],
            )
            host, port = await self.server.start(host, port)
            self.listen = f"{host}:{port}"
            log.info(
                "serving peers on %s as %s (NIXL agent %s)",
                self.listen,
                self.node,
                self.endpoint.name,
            )

    def _map_pools(self) -> None:
        import mmap

        import numpy as np
        import posix_ipc

        for pool in self.broker.pools:
            try:
                shm = open_segment(pool.name)  # a tenant's pool too
            except (OSError, posix_ipc.Error) as exc:
                raise KVBrokerError(
                    f"[transfer] cannot map pool {pool.index} ({pool.name}): "
                    f"{exc} (a daemon that is not root needs CAP_CHOWN for "
                    "a pool owned by a tenant's user)"
                ) from None
            try:
                mm = mmap.mmap(shm.fd, pool.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                shm.close_fd()
                raise
            # The mapping is NIXL's (registered); the daemon's own reads go through the
            # segment (a client may truncate it: a load past its end is a SIGBUS).
            self.pages.append(PoolPages(pool.index, shm.fd, pool.size))
            view = np.frombuffer(mm, dtype=np.uint8)
            self._maps.append(view)
            self.bases.append(int(view.ctypes.data))

    async def close(self) -> None:
        """Stop serving peers (their leases end), wait for pulls in flight, drop the peers
        and the NIXL agent. Before the pools are unlinked."""
        self.closed = True
        if self.server is not None:
            await self.server.close()
        pulls = list(self._pulls.values())
        if pulls:
            await asyncio.wait(pulls, timeout=self.timeout)
        for peer in list(self._peers.values()):
            await peer.client.close()
        self._peers.clear()
        if self.endpoint is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.endpoint.close)
        if self.events is not None:
            await self.events.close()
        self.broker.fleet = None
        self._maps.clear()
        for pages in self.pages:
            pages.close()
        self.pages.clear()

    # -- peers ---------------------------------------------------------------------------------
    def configured(self, address: str) -> str:
        """``address`` as ``[transfer] peers`` lists it, else Forbidden (or any local user
        could have this daemon dial, and relay through, a port of their own)."""
        try:
            host, port = transfer.parse_address(address)
            ident = (transfer.identity(host), port)
        except ValueError:
            raise BadRequest(f"peer {address[:300]!r}: expected HOST:PORT") from None
        found = self._configured.get(ident)
        if found is None:
            known = ", ".join(list(self._configured.values())[:8])
            raise Forbidden(
                f"peer {address[:300]!r} is not one of this daemon's [transfer] peers ({known})"
            )
        return found

    async def _peer(self, address: str) -> _Peer:
        address = self.configured(address)
        peer = self._peers.get(address)
        if peer is not None and peer.client.connected:
            return peer
        if peer is not None:
            self._drop(address)
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(lambda _t: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str) -> _Peer:
        client = transfer.PeerClient(
            address,
            tls=self._client_tls,
            node=self.node,
            connect_timeout=min(5.0, self.timeout),
            request_timeout=self.timeout,
        )
        await client.connect()
        if not client.metadata or not client.agent:
            await client.close()
            raise PeerUnavailable(f"peer {address} ({client.peer_node}) serves no NIXL agent")
        try:
            agent = self.endpoint.add_peer(client.metadata, label=f"{client.peer_node} ({address})")
        except Exception as exc:  # noqa: BLE001 - NIXL's own errors
            await client.close()
            raise PeerUnavailable(f"peer {address}: NIXL refused its metadata: {exc}") from exc
        peer = self._peers[address] = _Peer(client, agent)
        log.info("connected to peer %s (%s), NIXL agent %s", address, client.peer_node, agent)
        return peer

    def _drop(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            self.endpoint.remove_peer(peer.agent)
            asyncio.get_running_loop().create_task(peer.client.close())

    # -- pulls ---------------------------------------------------------------------------------
    def _check(self, address: str, namespace: str, keys: Sequence[str]) -> str:
        """What every pull and peer lookup checks first: this daemon pulls, ``address`` is
        a configured peer (returned as configured), and the names are ones a local op
        would take."""
        if self.closed or self.endpoint is None:
            raise BadRequest(
                "this daemon pulls from no peer (set [transfer] peers, "
                "cert_file, key_file and ca_file)"
            )
        address = self.configured(address)
        check_name("namespace", namespace)
        for key in keys:
            check_name("key", key)
        return address

    async def lookup(self, address: str, namespace: str, key: str) -> dict | None:
        address = self._check(address, namespace, (key,))
        peer = await self._peer(address)
        try:
            info = await peer.client.lookup(key, namespace=namespace)
        except PeerUnavailable:
            self._drop(address)
            raise
        try:  # the client is given the object asked, well formed, or an error
            return looked_up(info, namespace, key)
        except ValueError as exc:
            raise TransferFailed(
                f"peer {address} answered a lookup of {namespace}/{key[:80]} "
                f"with a bad description: {exc}"
            ) from None

    async def fetch(
        self, address: str, namespace: str, key: str, consume: bool, asker: Session | None = None
    ) -> bool:
        """Pull ``namespace/key`` from the peer unless it is here; True when it moved.
        What it pulls is charged to the tenants of ``asker`` (the session that asked)."""
        address = self._check(address, namespace, (key,))
        if (namespace, key) in self.broker.objects:
            return False
        tenants = self._tenants(asker)
        return await self._shared(
            (address, namespace, key),
            lambda: self._pull(address, namespace, "pin", [key], consume, tenants),
        )

    async def fetch_prefix(
        self, address: str, namespace: str, keys: list[str], asker: Session | None = None
    ) -> bool:
        """Pull the leading run of ``keys`` that the peer holds (one READ for all)."""
        address = self._check(address, namespace, keys)
        keys = [k for k in keys if (namespace, k) not in self.broker.objects]
        if not keys:
            return False
        tenants = self._tenants(asker)
        return await self._shared(
            (address, namespace, tuple(keys)),
            lambda: self._pull(address, namespace, "pin_prefix", keys, False, tenants),
        )

    def _tenants(self, asker: Session | None) -> tuple:
        # A pull takes pages as a put of the asker's would: its tenants' quotas (issue 38).
        return self.broker.accounts.tenants_of(asker) if asker is not None else ()

    async def _shared(self, ident: tuple, start) -> bool:
        task = self._pulls.get(ident)
        if task is None:
            task = asyncio.get_running_loop().create_task(start())
            self._pulls[ident] = task
            task.add_done_callback(lambda _t: self._pulls.pop(ident, None))
        # A waiter that gives up (its connection closed, its timeout) leaves the pull going.
        return await asyncio.shield(task)

    async def _pull(
        self,
        address: str,
        namespace: str,
        how: str,
        keys: list[str],
        consume: bool,
        tenants: tuple = (),
    ) -> bool:
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            moved = await self._pull_inner(address, namespace, how, keys, consume, tenants, phases)
        except KVBrokerError as exc:
            self.failures[exc.code] += 1
            self.recent_failures.append((namespace, f"{address}: {exc.message or exc}"[:300]))
            raise
        except Exception as exc:
            self.failures["internal"] += 1
            self.recent_failures.append((namespace, f"{address}: {type(exc).__name__}"))
            log.exception("pull from %s failed", address)
            raise TransferFailed(
                f"pull from {address} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if moved:
            self.last_pull = (moved, self._read_seconds, time.perf_counter() - t0)
            self.last_phases = phases
            log.debug(
                "pulled %d byte(s) from %s in %.1f ms",
                moved,
                address,
                (time.perf_counter() - t0) * 1e3,
            )
        return moved > 0

    async def _pull_inner(
        self,
        address: str,
        namespace: str,
        how: str,
        keys: list[str],
        consume: bool,
        tenants: tuple,
        phases: dict[str, float],
    ) -> int:
        clock = time.perf_counter
        t = clock()
        peer = await self._peer(address)
        client = peer.client
        phases["connect"], t = clock() - t, clock()
        try:
            if how == "pin":
                pinned = await client.pin(
                    keys[0], namespace=namespace, ttl=self.pin_ttl, consume=consume
                )
            else:
                pinned = await client.pin_prefix(keys, namespace=namespace, ttl=self.pin_ttl)
        except PeerUnavailable:
            self._drop(address)
            raise
        phases["pin"], t = clock() - t, clock()
        remote_lease = pinned.get("lease")
        if remote_lease is None and not pinned.get("objects"):
            return 0  # the peer holds none of the prefix
        b = self.broker
        leases: list[Lease] = []
        read_started = False
        released = False
        try:
            if remote_lease.__class__ is not int:
                raise TransferFailed(
                    f"peer {address} answered a pin without a lease; nothing was sealed"
                )
            # Every description checked before anything is reserved: a reply describes
            # exactly the objects asked, each as a local seal would have to be.
            described = self._described(pinned, address, namespace, how, keys)
            remote, plans = [], []  # extents there, (lease, object)
            for d in described:
                ident = (namespace, d.key)
                if ident in b.objects:
                    continue  # here already (sealed while we asked): not pulled twice
                if ident in b.pending:
                    if how == "pin":
                        raise Exists(f"{namespace}/{d.key} is being published here")
                    break  # a prefix: stop the run at a block a local writer is writing
                lease = self._reserve(d, tenants)
                leases.append(lease)
                plans.append((lease, d))
                remote += d.extents
            nbytes = sum(n for _, n in remote)
            phases["reserve"], t = clock() - t, clock()
            if plans:
                read_started = True
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(
                    None, self._read_and_verify, peer, address, plans, phases
                )
            # the executor's hand-offs: thread start and the loop's wake-up after it
            phases["handoff"] = clock() - t - phases.get("read", 0) - phases.get("verify", 0)
            t = clock()
            # The peer's lease must still have held when the copy ended, or its pages may
            # have been reused under the READ: release it, fenced, before sealing anything.
            released = True
            try:
                await client.release(remote_lease, consumed=consume and bool(plans))
            except LeaseExpired as exc:
                raise TransferFailed(
                    f"pull from {address}: the peer's lease ended before "
                    f"the copy was released ({exc.message}); discarded "
                    "what was read"
                ) from None
            except PeerUnavailable:
                self._drop(address)
                raise
            phases["release"], t = clock() - t, clock()
            for lease, d in plans:  # parents first, as the peer listed them
                obj = lease.obj
                obj.checksums = d.checksums
                obj.consumers = 1 if consume else d.consumers
                obj.parent_key = d.parent
                obj.tokens = d.tokens
            # One eviction after the whole chain: evicting after each seal took the chain's
            # root, a leaf until its child was sealed a moment later.
            b.seal_all([lease for lease, _ in plans])
            for lease, _ in plans:
                b.record_transfer("pull", self.session, lease.obj, lease.obj.nbytes)
            self.pulls += 1
            self.bytes_pulled += nbytes
            phases["seal"] = clock() - t
            return nbytes
        except BaseException as exc:
            timed_out = isinstance(exc, TransferFailed) and "did not finish" in str(exc)
            for lease in leases:
                if lease.id in b.leases:  # not sealed
                    self._discard(lease, quarantine=read_started and timed_out)
            if not released and remote_lease.__class__ is int:
                try:
                    await client.release(remote_lease, consumed=False)
                except (KVBrokerError, OSError):
                    pass  # the peer ends it with its TTL or with our connection
            raise

    # -- statistics ----------------------------------------------------------------------------
    def last_failure(self, can: Callable[[str], bool] | None = None) -> str:
        """The latest failed pull's message, or the latest of a namespace ``can`` admits."""
        for namespace, message in reversed(self.recent_failures):
            if can is None or can(namespace):
                return message
        return ""

    def statistics(self) -> tuple[TransferStatistics | None, EventStatistics | None]:
        t = None
        if self.endpoint is not None:
            pv = self.provider
            t = TransferStatistics(
                node=self.node,
                listen=self.listen,
                peers=tuple(
                    PeerInfo(address=a, node=p.client.peer_node or "", connected=p.client.connected)
                    for a, p in self._peers.items()
                ),
                serving=self.server.peers if self.server is not None else 0,
                leases_served=pv.leases if pv is not None else 0,
                in_flight=len(self._pulls),
                pulls=self.pulls,
                bytes_pulled=self.bytes_pulled,
                pins_served=pv.pins_served if pv is not None else 0,
                bytes_served=pv.bytes_served if pv is not None else 0,
                failures=sum(self.failures.values()),
                failures_by_code=dict(self.failures),
                refused=self.server.refused if self.server is not None else 0,
                last_failure=self.last_failure(),
                last_pull_bytes=self.last_pull[0],
                last_read_seconds=self.last_pull[1],
                last_pull_seconds=self.last_pull[2],
                last_pull_phases=dict(self.last_phases),
            )
        e = self.events.statistics() if self.events is not None else None
        return t, e
