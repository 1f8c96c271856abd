"""How a daemon starts: the socket's lock, the warm restart from a journal (or a cold start),
the pools, the broker, the disk tier, the GPU rings and the listening socket (bound, or passed
by systemd), and how what a start built is freed.

:class:`Startup` owns what a start sets up until the daemon's shutdown undoes it: the lock
file (and what the previous daemon left in it), the pools, the broker and its journal, the
disk tier, the rings, the socket file. :meth:`Startup.start` returns them as one
:class:`Started`, which ``Daemon.serve`` takes in one place and serves from;
:meth:`Startup.stop` frees them (all of them, or what a start that failed half-way built).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._wire.paths import format_size
from ..errors import KVBrokerError
from .broker import Broker
from .journal import Journal, JournalError, journal_path
from .pool import HostPool, segment_prefix, unlink_segment
from .systemd import listen_fds

if TYPE_CHECKING:
    from .config import DaemonConfig

__all__ = ["KEPT", "DaemonError", "Started", "Startup"]

log = logging.getLogger("kvbroker.daemon")


class DaemonError(Exception):
    """The daemon cannot start (socket held, shared memory too small, ...)."""


# First line of <socket>.lock after a daemon stopped keeping its pools for the next one
# (while one serves, its pid; after a crash, the dead one's pid).
KEPT = "kept"


@dataclass(frozen=True)
class Started:
    """What a start built, which the daemon serves from (:meth:`Startup.start`); the
    :class:`Startup` that built it frees it (:meth:`Startup.stop`)."""

    broker: Broker  # with its journal when the daemon holds the socket's lock
    pools: tuple[HostPool, ...]  # the broker's, adopted or created
    # The clients' socket: bound by the start (not listening yet: a client that comes before
    # the daemon serves is refused, not kept waiting), or passed by systemd or the caller.
    sock: socket.socket
    adopted: bool  # the pools and objects are a previous daemon's (a warm restart)
    activated: bool  # the socket is systemd's: its path is not ours to set
    rings: Any = None  # kvbroker._server.rings.RingService, with gpu_ring
    disk: Any = None  # kvbroker._server.disk_tier.DiskTier, with [tier.disk]


class Startup:
    """What a daemon's start sets up, and owns until its shutdown: the socket's lock (and
    what the previous daemon left in the lock file), the pools (adopted or created), the
    broker and its journal, the disk tier, the GPU rings, the socket file it bound."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.pools: list[HostPool] = []
        self.lock_fd: int | None = None
        self.previous_segments: list[str] = []
        self.previous_kept = False  # the previous daemon stopped keeping its pools for us
        self.adopted = False  # this daemon took over a previous one's pools
        self.activated = False  # serving a socket systemd passed: its path is not ours to set
        self.owns_socket_file = False
        self.broker: Broker | None = None
        self.disk: Any = None
        self.rings: Any = None

    def start(
        self,
        listen_socket: socket.socket | None,
        on_sealed: Callable[[tuple[str, str]], None],
    ) -> Started:
        """Owns, until :meth:`stop` (also when it raises half-way): the socket's lock (unless
        the caller passes ``listen_socket``), the pools, the broker and its journal, the disk
        tier, the GPU rings, the socket file it binds; ``on_sealed`` hears every seal."""
        lock = listen_socket is None
        if listen_socket is None:
            listen_socket = self.activated_socket()
        if lock:
            self.acquire_lock()
        broker = self.broker = self.start_broker()
        broker.on_sealed = on_sealed
        self.disk = self.start_disk(broker)
        if self.config.gpu_ring:
            self.rings = self.open_rings(broker, on_sealed)
        if self.lock_fd is not None:
            self.write_lock_record()
        sock = listen_socket if listen_socket is not None else self.bind()
        return Started(
            broker, tuple(self.pools), sock, self.adopted, self.activated, self.rings, self.disk
        )

    def keeps(self, wanted: bool, serving: bool) -> bool:
        """Whether :meth:`stop` leaves the pools and their journal to the next daemon: when
        ``wanted`` (a restart, keep_pools_on_exit), or when it adopted them and never got to
        ``serving`` (a start that fails leaves them as it found them); only with a journal
        that works."""
        journal = self.broker.journal if self.broker is not None else None
        keep = wanted or (self.adopted and not serving)
        return keep and journal is not None and not journal.failed

    async def stop(self, kept: bool) -> None:
        """Frees what the start built (every connection gone): the disk tier's writes and
        files, the rings, the journal (``kept``: compacted and closed for the next daemon,
        else removed), the pools (unless ``kept``), the lock and the socket file."""
        broker, disk, rings = self.broker, self.disk, self.rings
        self.disk = self.rings = None
        if disk is not None:  # writes in flight end (they read the pools), the index synced
            try:
                await disk.drain()
            except Exception:
                log.exception("finishing the disk tier's writes failed")
            disk.close()
        if rings is not None:
            rings.close()  # no lease holds a region any more
            broker.attach_rings(None)
        journal = broker.journal if broker is not None else None
        if kept:
            # Every lease has ended: what is left is the sealed objects, for the next daemon.
            broker.compact_journal()
            journal.close()
            log.info(
                "kept %d pool(s) and %d object(s) for the next daemon",
                len(self.pools),
                broker.brief_statistics().objects,
            )
        else:
            if journal is not None:
                journal.remove()
            for pool in self.pools:
                pool.unlink()
        self.release_lock(kept)

    def acquire_lock(self) -> None:
        """Owns: the socket's lock (``<socket>.lock``), and what its last holder left in it."""
        path = self.config.socket_path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        lock_path = path + ".lock"
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 64, 0).split(b"\n", 1)[0].decode(errors="replace")
                os.close(fd)
                raise DaemonError(
                    f"another kvbroker daemon (pid {holder.strip() or '?'}) is serving "
                    f"{path}; stop it first or choose another --socket"
                ) from None
            # A daemon stopping cleanly unlinks the file it locked: ours must still be there.
            try:
                if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        # The lock was free, so whoever wrote this file is gone: the segments it left are
        # adopted (warm restart) or dropped once the journal has been read.
        previous = os.pread(fd, 1 << 16, 0).decode(errors="replace").split("\n")
        self.previous_kept = previous[0].strip() == KEPT
        self.previous_segments = [n for n in (n.strip() for n in previous[1:]) if n]
        self.lock_fd = fd

    def drop_segments(self, names, keep=()) -> None:
        """Frees: the shared memory segments ``names`` a previous daemon left (not ``keep``)."""
        for name in names:
            if name in keep or not os.path.exists("/dev/shm" + name):
                continue
            try:
                unlink_segment(name)  # a tenant's pool too
                log.info("removed shared memory %s left by a previous daemon", name)
            except Exception as exc:
                log.warning(
                    "cannot remove shared memory %s left by a previous daemon: %s", name, exc
                )

    def _unadoptable(self, old: list[dict], dropped: str, refusal: str) -> bool:
        """The previous daemon's pools cannot be taken as they are: pools it kept for this one (a
        cache) are dropped, saying ``dropped`` (returns False: start empty); pools a crash left
        are refused with ``refusal`` (the operator decides: the same settings, or --cold)."""
        if self.previous_kept:
            log.warning("%s", dropped)
            self.drop_segments([p["name"] for p in old])
            return False
        raise DaemonError(refusal)

    def start_broker(self) -> Broker:
        """Owns: the pools and the broker (with its journal), adopted from the journal a previous
        daemon left (warm restart), or fresh. Only a daemon holding the socket's lock keeps a
        journal."""
        cfg = self.config
        recovered = None
        cold = cfg.cold or not cfg.journal
        if self.lock_fd is not None:
            path = journal_path(cfg.socket_path)
            try:
                recovered = Journal.load(path)
            except JournalError as exc:
                if not cold:
                    raise DaemonError(f"{exc}; start with --cold to discard it") from None
                os.unlink(path)
            if recovered is not None and cold:
                log.info(
                    "--cold: dropping the %d object(s) a previous daemon left",
                    len(recovered.objects),
                )
                self.drop_segments([p["name"] for p in recovered.pools])
                os.unlink(path)
                recovered = None
        adopted = self.adopted = recovered is not None and self.adopt_pools(recovered)
        self.drop_segments(self.previous_segments, keep={p.name for p in self.pools})
        if not adopted:
            self.create_pools()
        broker = Broker(
            self.pools,
            lease_ttl=self.config.lease_ttl,
            high_watermark=self.config.high_watermark,
            low_watermark=self.config.low_watermark,
            socket_path=self.config.socket_path,
            require_checksums=self.config.require_checksums,
            policy=self.config.isolation,
            quotas=self.config.quotas,
            max_leases_per_client=self.config.max_leases_per_client,
            max_leases_per_uid=self.config.max_leases_per_uid,
            restart_quarantine=self.config.restart_quarantine,
            retention=self.config.retention_settings(),
        )

        if adopted:
            report: dict[str, list[str]] = {}
            try:
                n = broker.restore(
                    recovered.objects.values(),
                    [(p, s, n) for (p, s), n in recovered.lent.items()],
                    recovered.sessions.values(),
                    report=report,
                    dropped=recovered.dropped_serials,
                    verify=recovered.suspect,
                )
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                self.pools.clear()  # not ours to drop: the operator decides (--cold)
                raise DaemonError(
                    f"{journal_path(cfg.socket_path)} does not describe its pools consistently "
                    f"({type(exc).__name__}: {exc}); start with --cold to discard it"
                ) from None
            used = sum(p.allocator.used * p.page_size for p in self.pools)
            for reason, names in report.items():
                recovered.dropped.setdefault(reason, []).extend(names)
            ndropped = sum(len(v) for v in recovered.dropped.values())
            log.info(
                "warm restart (epoch %d): adopted %d pool(s) and %d sealed object(s), "
                "%s in use (%d extent(s) lent for writing quarantined for %g s)%s",
                recovered.epoch + 1,
                len(self.pools),
                n,
                format_size(used),
                len(recovered.lent),
                cfg.restart_quarantine,
                f"; cut a torn record of {recovered.torn_bytes} bytes at the end"
                if recovered.torn_bytes
                else "",
            )
            if recovered.suspect:
                kept = _keep_damaged(path)
                log.warning(
                    "journal %s was damaged: %d damaged stretch(es) skipped (%s); kept %d "
                    "object(s), dropped %d%s; the damaged file is kept as %s",
                    path,
                    len(recovered.damaged),
                    ", ".join(f"bytes {a}-{b}" for a, b in recovered.damaged[:8]) or "none",
                    n,
                    ndropped,
                    "".join(
                        f"; {len(v)} because {r} ({', '.join(v[:3])}"
                        f"{', ...' if len(v) > 3 else ''})"
                        for r, v in recovered.dropped.items()
                    ),
                    kept,
                )
        if self.lock_fd is not None and cfg.journal:
            epoch = recovered.epoch + 1 if adopted else 1
            journal = Journal(
                journal_path(cfg.socket_path), epoch, [p.describe() for p in self.pools]
            )
            broker.attach_journal(journal, recovered.next_id if adopted else 1)
        return broker

    def adopt_pools(self, rec) -> bool:
        """Owns: the previous daemon's pools, mapped from the recovered geometry; False (start
        cold) when the segments are gone, DaemonError when the configuration asks for
        different pools."""
        cfg = self.config
        tenants = list(cfg.tenant_pools)
        old = rec.pools
        want_size = cfg.pool_size - cfg.pool_size % cfg.page_size if cfg.pool_size else None
        sizes = {p["size"] for p in old[: cfg.pools]}
        pages = {p["page_size"] for p in old}
        tenant_sizes = [p["size"] for p in old[cfg.pools :]]
        want_tenant = [t.size - t.size % cfg.page_size for t in tenants]
        if (
            len(old) != cfg.pools + len(tenants)
            or pages != {cfg.page_size}
            or tenant_sizes != want_tenant
            or (want_size is not None and sizes != {want_size})
        ):
            return self._unadoptable(
                old,
                f"the previous daemon of {cfg.socket_path} kept {len(rec.objects)} sealed "
                f"object(s) for this one in {len(old)} pool(s) of {format_size(max(sizes))} with "
                f"pages of {format_size(max(pages))}, but this configuration asks for {cfg.pools} "
                f"pool(s) of {format_size(want_size) if want_size else 'default size'} with pages "
                f"of {format_size(cfg.page_size)}: dropping them, starting empty",
                f"the previous daemon of {cfg.socket_path} left {len(rec.objects)} sealed "
                f"object(s) in {len(old)} pool(s) of {format_size(max(sizes))} with pages of "
                f"{format_size(max(pages))}, but this configuration asks for {cfg.pools} "
                f"pool(s) of {format_size(want_size) if want_size else 'default size'} with "
                f"pages of {format_size(cfg.page_size)}: start with the same geometry to keep "
                "them, or with --cold to drop them",
            )
        changed = _owners_changed(cfg, old, tenants)
        if changed:  # a pool given to someone else must not hand them the old owner's bytes
            return self._unadoptable(
                old,
                f"the previous daemon of {cfg.socket_path} kept {len(rec.objects)} sealed "
                f"object(s) for this one, but this configuration gives its pools other owners "
                f"({'; '.join(changed)}): dropping them, starting empty",
                f"the previous daemon of {cfg.socket_path} left {len(rec.objects)} sealed "
                f"object(s) in pools that this configuration gives other owners "
                f"({'; '.join(changed)}): start with the same owners to keep them, or with "
                "--cold to drop them",
            )
        try:
            for i, p in enumerate(old):
                pool = HostPool.adopt(i, p["name"], p["size"], p["page_size"])
                if i >= cfg.pools:
                    pool.tenant = tenants[i - cfg.pools]
                self.pools.append(pool)
        except KVBrokerError as exc:
            log.warning(
                "cannot adopt the previous daemon's pools (%s): starting cold, its "
                "%d object(s) are lost",
                exc,
                len(rec.objects),
            )
            self.pools.clear()
            self.drop_segments([p["name"] for p in old])
            return False
        return True

    def write_lock_record(self) -> None:
        """The lock file says who holds it and which segments are its (for a successor)."""
        record = "\n".join([str(os.getpid())] + [p.name for p in self.pools]) + "\n"
        os.ftruncate(self.lock_fd, 0)
        os.pwrite(self.lock_fd, record.encode(), 0)

    def bind(self) -> socket.socket:
        """Owns: the socket file, bound at the configured path (a stale one is replaced)."""
        path = self.config.socket_path
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # stale: its daemon died without cleaning up
                log.info("removed stale socket %s", path)
            else:
                raise DaemonError(f"something is already listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177 if self.config.group is None else 0o117)
        try:
            sock.bind(path)
        finally:
            os.umask(old_umask)
        self.owns_socket_file = True
        if self.config.group is not None:
            os.chown(path, -1, self.config.group)
            os.chmod(path, 0o660)
        # No listen() here: the daemon's server listens once everything else has started.
        sock.setblocking(False)
        return sock

    def create_pools(self) -> None:
        """Owns: new pools (the shared ones, then one per tenant pool)."""
        cfg = self.config
        size = cfg.resolved_pool_size()
        prefix = segment_prefix()
        mode = 0o600 if cfg.group is None else 0o660
        for i in range(cfg.pools):
            self.pools.append(
                HostPool(i, f"{prefix}.{i}", size, cfg.page_size, mode=mode, gid=cfg.group)
            )
        for t in cfg.tenant_pools:  # only its tenant's processes may open it
            i = len(self.pools)
            self.pools.append(
                HostPool(
                    i,
                    f"{prefix}.{i}",
                    t.size,
                    cfg.page_size,
                    tenant=t,
                    mode=0o600 if t.uid is not None else 0o660,
                    uid=t.uid,
                    gid=t.gid,
                )
            )

    def start_disk(self, broker: Broker) -> Any:
        """Owns: the disk tier ([tier.disk], kvbroker._server.disk_tier) when configured (else
        None), linked to ``broker``: its index read back, the pools' objects it holds a copy
        of (a warm restart) known."""
        if not self.config.tier_disk_directories:
            unused = self.config.disk_settings_unused()
            if unused:  # asked for a tier, silently getting none would mislead
                log.warning(
                    "%s set, but no [tier.disk] directories: no disk tier", ", ".join(unused)
                )
            return None
        from . import disk_link

        quotas = broker.accounts

        def quota_of(account: Any) -> int | None:  # its share of the pools ([quotas])
            q = quotas.quotas
            return q.limit(account) if isinstance(account, str) else q.tenant_limit(account)

        disk = disk_link.start(self.config, broker.pools, quota_of)
        s = broker.open_session(os.getpid(), os.getuid(), os.getgid())
        s.name, s.role, s.greeted = "disk tier", "promoter", True
        disk.bind(
            disk_link.DiskLink(
                directory=broker.directory,
                free_object=broker._free_object,
                reserve_extent=broker.reserve_extent,
                seal=broker.seal_all,
                live=broker.leases.__contains__,
                discard=lambda ls: broker.abort(ls, "its promotion from disk failed"),
                session=s,
                ttl=broker.leases.max_lease_ttl,
            )
        )
        disk.adopt_pool_objects(broker.directory.in_namespace(None))
        broker.pages.tier = disk
        st = disk.statistics()
        log.info(
            "disk tier: %s in %s (%s), %d object(s) on disk",
            format_size(st.capacity),
            ", ".join(st.directories),
            "O_DIRECT" if st.o_direct else f"buffered: {st.o_direct_problem or 'o_direct = false'}",
            st.objects,
        )
        return disk

    def open_rings(self, broker: Broker, on_sealed: Callable[[tuple[str, str]], None]) -> Any:
        """Owns: the GPU staging rings (kvbroker._server.rings.RingService), lending ids from
        ``broker``'s registry, attached to it."""
        from .rings import RingService, open_backend

        backend = open_backend()
        # (its settings, object_ttl among them, come from their Keys: the daemon applies them)
        rings = RingService(
            backend, self.config.gpu_ring, on_sealed=on_sealed, registry=broker.registry
        )
        broker.attach_rings(rings)
        if not rings.rings:
            log.warning("--gpu-ring: no GPU is visible; serving without GPU rings")
        for r in rings.rings:
            size = format_size(rings.size)
            log.info("GPU ring %d: %s on %s (%s)", r.index, size, r.bus_id, r.name)
        return rings

    def release_lock(self, kept: bool) -> None:
        """Frees: the lock (and the socket file this daemon bound). ``kept``: the pools stay
        for the next daemon, which the lock file tells it; else the lock file goes too."""
        if self.owns_socket_file:
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        if self.lock_fd is None:
            return
        if kept:  # the next daemon adopts the pools; tell it they were kept on purpose
            record = "\n".join([KEPT] + [p.name for p in self.pools]) + "\n"
            os.ftruncate(self.lock_fd, 0)
            os.pwrite(self.lock_fd, record.encode(), 0)
        else:  # nothing left for a successor: no file either (unlinked while locked)
            try:
                os.unlink(self.config.socket_path + ".lock")
            except FileNotFoundError:
                pass
        os.close(self.lock_fd)
        self.lock_fd = None

    def activated_socket(self) -> socket.socket | None:
        """The socket systemd passed (socket activation), if any; the others it closes."""
        socks = listen_fds()
        if not socks:
            return None
        usable = [s for s in socks if s.family == socket.AF_UNIX and s.type == socket.SOCK_STREAM]
        for extra in socks:
            if extra not in usable[:1]:
                log.warning(
                    "ignoring socket fd %d passed by systemd: not a Unix stream "
                    "socket, or not the first",
                    extra.fileno(),
                )
                extra.close()
        if not usable:
            raise DaemonError(
                "systemd passed sockets but none is a Unix stream socket "
                "(ListenStream=/path in kvbroker.socket)"
            )
        sock = usable[0]
        sock.setblocking(False)
        name = sock.getsockname()
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name and not name.startswith("\0") and name != self.config.socket_path:
            # The socket unit decides where clients connect; report that path, lock next to it.
            log.info("socket activation: serving %s (not %s)", name, self.config.socket_path)
            self.config.socket_path = name
        else:
            log.info("socket activation: serving %s", self.config.socket_path)
        self.activated = True
        return sock


def _keep_damaged(path: str) -> str:
    """Copy a damaged journal aside (the daemon rewrites it next) for inspection; the
    three latest copies are kept."""
    import glob
    import shutil

    aside = f"{path}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        shutil.copyfile(path, aside)
    except OSError as exc:
        return f"(nowhere: {exc.strerror})"
    for old in sorted(glob.glob(path + ".damaged-*"), key=os.path.getmtime)[:-3]:
        try:
            os.unlink(old)
        except OSError:
            pass
    return aside


def _owners_changed(cfg, old: list[dict], tenants: list) -> list[str]:
    """How the segments ``old`` (a journal's pools) are owned otherwise than ``cfg`` would
    create them: the shared pools by the daemon's uid (and ``group``, mode 0660, if set), a
    tenant pool by its user (0600) or its group (0660). The owner a segment was made with is
    what the kernel checks; a segment that is gone is HostPool.adopt's to report."""
    out = []
    for i, p in enumerate(old):
        try:
            st = os.stat("/dev/shm" + p["name"])
        except OSError:
            continue
        if i < cfg.pools:
            what, uid, gid = "shared", os.geteuid(), cfg.group
            mode = 0o600 if cfg.group is None else 0o660
        else:
            t = tenants[i - cfg.pools]
            what = f"tenant_pools.{t.name}"
            uid, gid, mode = (
                (t.uid, None, 0o600) if t.uid is not None else (os.geteuid(), t.gid, 0o660)
            )
        have = (st.st_uid, st.st_gid, st.st_mode & 0o7777)
        if have[0] != uid or (gid is not None and have[1] != gid) or have[2] != mode:
            out.append(
                f"pool {i} ({what}) is owned by uid {have[0]}, gid {have[1]}, mode "
                f"{have[2]:04o}; the configuration asks for uid {uid}"
                f"{'' if gid is None else f', gid {gid}'}, mode {mode:04o}"
            )
    return out
