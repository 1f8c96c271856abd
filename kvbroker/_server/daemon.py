"""The daemon: one asyncio process serving the broker on a Unix socket.

It serves what its start built (:class:`~kvbroker._server.startup.Started`: the pools, the
broker, the listening socket; :class:`~kvbroker._server.startup.Startup` builds and frees
them) and owns the rest: the connections, the fleet and the read replicas, the periodic work
(lease expiry, journal compaction, systemd status and watchdog), drain and shutdown, SIGHUP
reload. Each connection is a :class:`~kvbroker._server.connection.Connection` (transport and
framing); the state lives in :class:`~kvbroker._server.broker.Broker`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from .broker import Broker
from .connection import Connection
from .._cpu import cpu_spare
from .config import DaemonConfig, apply_to_owners, reload_into
from .daemon_optional import OptionalParts
from .replicas import Replicas
from .systemd import Notifier
from .._wire.paths import format_size
from .._wire.stats import Statistics
from .pool import HostPool, pools_summary
from .startup import DaemonError, Started, Startup
from ..errors import BrokerUnavailable, KVBrokerError

__all__ = ["DaemonConfig", "Daemon", "DaemonError", "run_daemon"]

log = logging.getLogger("kvbroker.daemon")

_EXPIRY_TICK = 0.1
_STATUS_PERIOD = 5.0  # seconds between STATUS= updates to systemd


# The signal that stops the daemon for a restart (systemd's RestartKillSignal=): drain as
# SIGTERM does, then keep the pools and the journal for the next daemon instead of freeing
# them. SIGTERM and SIGINT (systemctl stop, ^C) free them, unless keep_pools_on_exit.
RESTART_SIGNAL = signal.SIGUSR1


class Daemon(OptionalParts):
    """Serves what its start built (the pools, the broker, the socket) for one ``serve``."""

    def __init__(
        self,
        config: DaemonConfig,
        *,
        notifier: Notifier | None = None,
        reload_config: Callable[[], DaemonConfig] | None = None,
    ) -> None:
        self.config = config
        self.startup = Startup(config)  # builds what the daemon serves from, and frees it
        self.started: Started | None = None  # what it built, once the start got through
        self.broker: Broker | None = None  # the started one
        self.connections: set[Connection] = set()
        # Connections waiting in a blocking claim, by the key they wait for; a connection
        # removes itself when its wait ends (answered, timed out, its peer gone).
        self._waiters: dict[tuple[str, str], set[Connection]] = {}
        self.per_uid: dict[int, int] = {}  # open connections per peer uid
        self._backlogged: set[Connection] = set()  # connections with replies not yet sent
        self._stop: asyncio.Event | None = None
        self._restart = False  # stopping for a restart (RESTART_SIGNAL): keep the pools
        self._serving = False  # it got as far as serving (a start that fails keeps adopted pools)
        self._server: asyncio.AbstractServer | None = None
        self._last_activity = 0.0
        self._polling = False
        # Busy-poll only while CPUs are spare (kvbroker._cpu): on a saturated host the
        # spinning daemon takes the CPU its own clients need.
        self._cpu_spare = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self.notifier = notifier or Notifier()
        self._reload_config = reload_config
        self.draining = False
        self._force_stop: asyncio.Event | None = None
        self._metrics = None
        self.fleet: Any = None  # kvbroker._server.fleet.Fleet, with [transfer] or [events]
        self.replicas = Replicas(self)  # read replicas (kvbroker._server.replicas)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop it serves on (None before ``serve``)."""
        return self._loop

    @property
    def pools(self) -> tuple[HostPool, ...]:
        """The host pools this daemon serves (adopted or created by its start)."""
        return self.started.pools if self.started is not None else ()

    def note_activity(self) -> None:
        if self.config.busy_poll <= 0 or not self._cpu_spare:
            return
        self._last_activity = time.monotonic()
        if not self._polling:
            self._polling = True
            self._loop.call_soon(self._keep_polling)

    def _keep_polling(self) -> None:
        # A ready callback makes asyncio poll epoll with a zero timeout instead of sleeping.
        if time.monotonic() - self._last_activity < self.config.busy_poll:
            # A client may be waiting for this very CPU: let it run (returns at once when
            # nothing else waits here).
            os.sched_yield()
            self._loop.call_soon(self._keep_polling)
        else:
            self._polling = False

    def loop_time(self) -> float:
        return self._loop.time() if self._loop is not None else time.monotonic()

    def forget(self, conn: Connection) -> None:
        """A connection ended: it no longer counts for its uid nor the reply budget."""
        if conn.counted:
            conn.counted = False
            left = self.per_uid.get(conn.uid, 0) - 1
            if left > 0:
                self.per_uid[conn.uid] = left
            else:
                self.per_uid.pop(conn.uid, None)
        self._backlogged.discard(conn)

    def backlogged(self, conn: Connection) -> None:
        """``conn`` has replies its peer has not read yet: hold every connection's unread
        replies under max_write_buffers_total, cutting off the one holding the most."""
        backlog = self._backlogged
        backlog.add(conn)
        total, sizes = 0, []
        for c in list(backlog):
            n = c.transport.get_write_buffer_size() if not c.closed else 0
            if n == 0:
                backlog.discard(c)
            else:
                total += n
                sizes.append((n, c.session.id if c.session else 0, c))
        budget = self.config.max_write_buffers_total
        sizes.sort(key=lambda x: (x[0], x[1]))
        while total > budget and sizes:
            n, _, worst = sizes.pop()
            worst.cut_for_budget(total)
            backlog.discard(worst)
            total -= n

    def _sweep_connections(self) -> None:
        """Close connections that never said hello within hello_timeout, and connections
        holding nothing that sent nothing for idle_timeout."""
        cfg = self.config
        now = self.loop_time()
        for conn in list(self.connections):
            s = conn.session
            if conn.closed or s is None:
                continue
            quiet = now - conn.last_active
            if not conn.reading and conn.peer_gone():  # it stopped reading, its peer left
                log.info("session %d: its peer hung up while it was not reading", s.id)
                conn.transport.abort()
            elif not s.greeted and now - conn.connected_at > cfg.hello_timeout and (not s.leases):
                conn.close_quietly(f"no hello within {cfg.hello_timeout:g} s (hello_timeout)")
            elif cfg.idle_timeout > 0 and quiet > cfg.idle_timeout and conn.holds_nothing():
                conn.close_quietly(
                    f"it held nothing and sent nothing for {quiet:.0f} s "
                    "(idle_timeout); reconnect when needed"
                )

    def check_pools(self) -> list[str]:
        """Check every pool's segment (one stat each); say loudly, once, when one vanished
        or changed: no new object goes there (clients would fail to map it). Returns the
        problems found."""
        problems = []
        for pool in self.pools:
            problem = pool.check()
            if problem is None:
                continue
            problems.append(problem)
            if pool.lost is None:
                pool.lost = problem
                held = self.broker.statistics(occupancy_cells=0).pools[pool.index].objects
                log.error(
                    "POOL LOST: %s. Nothing new goes into pool %d; its %d object(s) "
                    "can no longer be mapped by new clients; restart the daemon "
                    "(its objects in that pool are lost)",
                    problem,
                    pool.index,
                    held,
                )
        return problems

    def add_waiter(self, key: tuple[str, str], conn: Connection) -> None:
        self._waiters.setdefault(key, set()).add(conn)

    def remove_waiter(self, key: tuple[str, str], conn: Connection) -> None:
        conns = self._waiters.get(key)
        if conns is not None:
            conns.discard(conn)
            if not conns:
                del self._waiters[key]

    def waiting(self) -> int:
        """How many connections wait in a blocking claim."""
        return sum(len(c) for c in self._waiters.values())

    def _on_sealed(self, key: tuple[str, str]) -> None:
        disk, obj = self.started.disk, self.broker.objects.get(key)
        if disk is not None and obj is not None:  # a disk copy of an older object goes
            disk.sealed(obj)  # (evicted already by its own seal: its demotion replaced it)
        # Called inside the seal's request: the waiters claim from the loop, just after.
        conns = self._waiters.pop(key, None)
        if conns:
            for conn in conns:
                self._loop.call_soon(conn.sealed)

    def request_stop(self, restart: bool = False) -> None:
        """First call: drain and stop; ``restart`` (RESTART_SIGNAL): then keep the pools for
        the next daemon. A second call (another signal, ^C): stop without waiting."""
        if self._stop is None:
            return
        if self._stop.is_set():
            self._force_stop.set()
        else:
            self._restart = restart
        self._stop.set()

    @property
    def keeps_pools(self) -> bool:
        """Whether this daemon, once stopped, leaves its pools and their journal to the next
        one (a restart, or keep_pools_on_exit) rather than freeing them."""
        wanted = self._restart or self.config.keep_pools_on_exit
        return self.startup.keeps(wanted, serving=self._serving)

    async def serve(
        self,
        listen_socket: socket.socket | None = None,
        on_ready: Callable[[Daemon], None] | None = None,
    ) -> None:
        """Serve until SIGTERM/SIGINT or :meth:`request_stop`; cleans up everything it made.

        Without ``listen_socket``, a socket passed by systemd (socket activation) is used if
        there is one, else the daemon binds ``config.socket_path`` itself.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._force_stop = asyncio.Event()
        tasks: list[asyncio.Task] = []
        try:
            started = self.startup.start(listen_socket, self._on_sealed)
            self.started, self.broker = started, started.broker  # what it serves from
            apply_to_owners(self.config, self.owners())  # each copy its Key declares
            await self._start_fleet()
            self._server = await loop.create_unix_server(
                lambda: Connection(self), sock=started.sock
            )
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            loop.add_signal_handler(RESTART_SIGNAL, self.request_stop, True)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
            if self.config.metrics is not None:
                from .metrics import MetricsServer

                try:
                    self._metrics = MetricsServer(self.config.metrics, self.statistics_threadsafe)
                except OSError as exc:  # a refusal to start like any other, said as one
                    host, port = self.config.metrics
                    raise DaemonError(
                        f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
                    ) from None
                log.info("metrics on %s", self._metrics.url)
            tasks.append(loop.create_task(self._expiry_loop()))
            tasks.append(loop.create_task(self._status_loop()))
            if self.notifier.watchdog_interval:
                tasks.append(loop.create_task(self._watchdog_loop()))
            log.info(
                "serving on %s: %s, pages of %s",
                self.config.socket_path,
                pools_summary(self.pools),
                format_size(self.config.page_size),
            )
            self.replicas.start()  # last: a start refused before this leaves no process
            # Only now: the socket is listening and the pools exist, so clients may come.
            self.notifier.ready(self.summary())
            self._serving = True
            if on_ready is not None:
                on_ready(self)
            await self._stop.wait()
            await self._drain()
        except (DaemonError, KVBrokerError) as exc:
            # A refusal to start: said before the shutdown's "stopped", and only once.
            log.error("%s", exc)
            exc.logged = True
            raise
        finally:
            for task in tasks:
                task.cancel()
            self.replicas.stop()
            await self._shutdown()

    def summary(self) -> str:
        """One line for systemd's STATUS= (shown by ``systemctl status``)."""
        if self.broker is None:
            return "starting"
        s = self.broker.brief_statistics()
        state = "draining" if self.draining else "serving"
        return (
            f"{state}: {s.clients} client(s), {s.objects} object(s), {s.leases} lease(s), "
            f"{format_size(s.used)} of {format_size(s.capacity)} used"
        )

    def _leases(self) -> int:
        return self.broker.brief_statistics().leases if self.broker is not None else 0

    def statistics_threadsafe(self, timeout: float = 5.0) -> Statistics:
        """Broker.statistics() taken on the event loop, for callers in other threads
        (metrics): the broker's dicts change under any thread that iterates them off the
        loop."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()

        def take() -> None:
            try:
                fut.set_result(self.broker.statistics(occupancy_cells=0))
            except Exception as exc:
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        return fut.result(timeout)

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(_STATUS_PERIOD)
            self.notifier.status(self.summary())

    async def _watchdog_loop(self) -> None:
        # Pinged from the event loop itself: a loop that stops turning stops the pings.
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(self.notifier.watchdog_interval)

    async def _drain(self) -> None:
        """Stop accepting; let held leases end (seal, release, expire) for drain_timeout."""
        self.draining = True
        if self._server is not None:
            self._server.close()  # under socket activation, systemd keeps queueing new clients
        # A draining daemon refuses new matches; clients whose replica is gone ask it.
        self.replicas.stop()
        for conn in list(self.connections):
            conn.cancel_wait(BrokerUnavailable.code, "kvbroker is shutting down")
        held = self._leases()
        self.notifier.stopping(self.summary())
        if self._restart and not self.keeps_pools:
            log.warning(
                "stopping for a restart, but without a journal (journal = false, or "
                "it failed): the pools are freed"
            )
        keep = (
            "keeping the pools for the next daemon"
            if self.keeps_pools
            else "then freeing the pools"
        )
        if not held or self.config.drain_timeout <= 0:
            log.info("stopping (%s)", keep)
            return
        log.info(
            "stopping: waiting up to %gs for %d lease(s) to end (%s)",
            self.config.drain_timeout,
            held,
            keep,
        )
        deadline = self._loop.time() + self.config.drain_timeout
        while self._leases() and not self._force_stop.is_set():
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                log.warning(
                    "drain timed out after %gs: ending %d lease(s) still held",
                    self.config.drain_timeout,
                    self._leases(),
                )
                return
            try:
                await asyncio.wait_for(self._force_stop.wait(), min(0.05, remaining))
            except asyncio.TimeoutError:
                pass
        if self._leases():
            log.warning("stopping now: ending %d lease(s) still held", self._leases())
        else:
            log.info("drained: every lease ended")

    def owners(self) -> dict[str, Any]:
        """The owners a setting's Key names (config_apply.OWNERS), as this daemon runs them
        now; None for a part it does not run (yet)."""
        b = self.broker
        return {
            "daemon": self,
            "broker": b,
            "retention": b.retention if b is not None else None,
            "rings": b.rings if b is not None else None,
            "disk": b.pages.tier if b is not None else None,
            "events": getattr(self.fleet, "events", None),
        }

    def set_write_buffer_limit(self, high: int) -> None:
        """A new max_write_buffer applies to every open connection (new ones read it)."""
        for conn in self.connections:
            if conn.transport is not None and not conn.closed:
                conn.transport.set_write_buffer_limits(high=high)

    def set_log_level(self, level: str) -> None:
        logging.getLogger().setLevel(level.upper())

    def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change while running."""
        if self._reload_config is None:
            log.warning(
                "SIGHUP: this daemon was not started from a configuration; nothing to reload"
            )
            return
        self.notifier.reloading()
        try:
            new = self._reload_config()
        except Exception as exc:  # a bad edit must not take the daemon down
            log.error("reload failed, keeping the running configuration: %s", exc)
            self.notifier.ready(self.summary())
            return
        old = self.config
        # What changes where is declared with each setting (kvbroker._server.config).
        activated = self.started is not None and self.started.activated
        changed, restart = reload_into(
            old, new, self.owners(), keep=("socket_path",) if activated else ()
        )
        for name, before, after in restart:  # the socket under activation is kvbroker.socket's
            log.warning(
                "reload: %s changed (%r -> %r) but needs a restart to take effect",
                name,
                before,
                after,
            )
        log.info(
            "reloaded %s: %s",
            old.config_path or "the configuration",
            "; ".join(changed) if changed else "nothing changed",
        )
        self.replicas.reconcile()  # a policy that is no longer open: no replicas
        self.notifier.ready(self.summary())

    async def _expiry_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(_EXPIRY_TICK)
            ticks += 1
            self._cpu_spare = cpu_spare()
            if ticks % 10 == 0:  # once a second
                try:
                    self._sweep_connections()
                except Exception:
                    log.exception("connection sweep failed")
                if not self.draining:
                    self.replicas.check()  # a replica that died: another on its socket
            if ticks % 20 == 0:  # every 2 s
                self.check_pools()
            try:
                self.broker.expire()
                self.broker.retention.expire()  # sessions whose time passed
            except Exception:
                log.exception("lease expiry failed")
            disk = self.started.disk
            if disk is not None:  # write back what the pools will evict next
                disk.kick()
                if ticks % 10 == 0:
                    disk.sweep()  # copies of objects unlinked since (consumed, replaced)
            journal = self.broker.journal
            try:
                if journal is not None and journal.wants_compaction():
                    self.broker.compact_journal()
            except Exception:
                log.exception("journal compaction failed")

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, RESTART_SIGNAL):
            loop.remove_signal_handler(sig)
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.cut_off = True  # a writer left past drain_timeout may still be copying
            conn.transport.close()
            conn.connection_lost(None)
        if self._server is not None:
            await self._server.wait_closed()
        elif self.started is not None:  # a start refused before serving on it
            self.started.sock.close()
        if self.fleet is not None:  # before the pools go: NIXL has them registered
            try:
                await self.fleet.close()
            except Exception:
                log.exception("stopping the fleet service failed")
            self.fleet = None
        await self.startup.stop(self.keeps_pools)  # what the start built: pools, broker...
        log.info("stopped")


def _uvloop() -> Any:
    """The uvloop module when it is installed: its event loop serves a request in ~10 % less
    time than asyncio's own (an ``exists`` round trip: 49-56 against 55-66 us on the 2-core VM,
    interleaved). ``KVBROKER_EVENT_LOOP=asyncio`` keeps asyncio's loop; None means that one."""
    if os.environ.get("KVBROKER_EVENT_LOOP", "").lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run_daemon(
    config: DaemonConfig, reload_config: Callable[[], DaemonConfig] | None = None
) -> int:
    """Run the daemon in the foreground; returns the process exit status."""
    notifier = Notifier.from_environ()
    try:
        serving = Daemon(config, notifier=notifier, reload_config=reload_config).serve()
        uvloop = _uvloop()
        (asyncio.run if uvloop is None else uvloop.run)(serving)
    except (DaemonError, KVBrokerError) as exc:
        if not getattr(exc, "logged", False):
            log.error("%s", exc)
        return 1
    return 0
