"""The daemon's read replicas (:mod:`kvbroker._server.replica`): started, watched, restarted,
stopped, and what they report applied to the broker.

The daemon binds each replica's socket itself, beside its own (``SOCKET.r0``, ``SOCKET.r1``,
... with the same owner, group and mode) and hands the listening socket to the replica
process. A replica that dies loses its socket at once (its path removed: clients connecting
find none and ask the daemon, instead of waiting in a backlog nobody accepts) and is started
again on the same path, after 1 s, then 2, 4 ... up to 60 s while it keeps dying within 10 s
of its start. The replicas are stopped when the daemon starts draining (a draining daemon
refuses new matches; a client whose replica is gone asks the daemon), when its journal fails
(nothing left to follow), and restarted on a reload (they take the daemon's connection
limits and lease TTLs as they were when they started; none run under an isolation policy
other than open). Each replica writes its reports (counters, matched keys) to one pipe the
daemon reads on its loop, in messages of at most ``PIPE_BUF`` bytes.

Nothing here may stop the daemon: a replica that cannot be started is logged and left out.
How many: the ``read_replicas`` setting; ``auto`` is :func:`auto_count`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import msgpack

from .journal import journal_path
from .replica import MESSAGE_MAX

if TYPE_CHECKING:
    from .hosting import DaemonView

__all__ = ["Replicas", "auto_count"]

log = logging.getLogger("kvbroker.daemon")

# Counters a replica reports; anything else in a report is ignored.
_COUNTERS = frozenset(
    {
        "requests",
        "errors",
        "prefix_queries",
        "prefix_hit_blocks",
        "prefix_miss_blocks",
        "prefix_hit_tokens",
        "hits",
        "misses",
    }
)
_MOST = 64  # read_replicas' upper bound: stale sockets up to this index are removed
_SHORT_LIFE = 10.0  # a replica that dies sooner than this after its start backs off
_BACKOFF_MAX = 60.0


def auto_count(cpus: int) -> int:
    """``read_replicas = auto``: none below 8 CPUs (the daemon, its clients and their copies
    need them: a replica would take a core the writer's clients use), then one per 4 CPUs,
    at most 4 (measured on 16 CPUs: 4 replicas serve 16 clients at 2.3-2.4x the ops/s of 4;
    ``benchmarks/results/rpc-replicas-experiment/``)."""
    return 0 if cpus < 8 else min(4, cpus // 4)


class _Slot:
    """One replica: its socket path, its listening socket and process while it runs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.failures = 0  # deaths in a row, each within _SHORT_LIFE of its start
        self.due = 0.0  # when to start it again (monotonic)


class Replicas:
    def __init__(self, d: DaemonView) -> None:
        self.daemon = d
        self._slots: list[_Slot] = []
        self._report_r: int | None = None
        self._report_w: int | None = None
        self._buf = b""

    def wanted(self) -> int:
        """How many replicas this daemon runs: the setting, or none where it cannot have them
        (no journal to follow, or it failed; a namespace policy, which only the daemon applies;
        a disk tier, whose objects the journal does not list)."""
        n = self.daemon.config.read_replicas
        auto = n is None
        if auto:
            n = auto_count(len(os.sched_getaffinity(0)))
        journal, policy = self.daemon.broker.journal, self.daemon.broker.policy
        disk = self.daemon.broker.pages.tier is not None  # [tier.disk]
        if n and (journal is None or journal.failed or not policy.open or disk):
            why = (
                "journal = false"
                if journal is None
                else "the journal failed"
                if journal.failed
                else "[tier.disk] is on"
                if disk
                else f"isolation = {policy.mode!r}"
            )
            if auto and disk:
                log.info(
                    "read_replicas = auto: none beside [tier.disk] (replicas follow the "
                    "journal, which lists the pools' objects only)"
                )
            elif not auto:
                log.warning(
                    "read_replicas = %d: none started (%s: replicas follow the journal "
                    "and serve only an open policy)",
                    n,
                    why,
                )
            return 0
        return n

    def _publish_paths(self) -> None:
        """Name in hello the replicas that run now."""
        self.daemon.broker.replica_paths = tuple(s.path for s in self._slots if s.proc)

    # -- start and stop -----------------------------------------------------------------------
    def start(self) -> None:
        d = self.daemon
        _remove_stale(d.config.socket_path)
        n = self.wanted()
        if not n:
            return
        try:
            self._report_r, self._report_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            d.loop.add_reader(self._report_r, self._read_reports)
            for i in range(n):
                slot = _Slot(f"{d.config.socket_path}.r{i}")
                self._slots.append(slot)
                self._spawn(slot)
        except OSError as exc:  # (a socket path too long for .rN, no fds, no fork ...)
            log.error("cannot start read replicas (%s): serving without them", exc.strerror or exc)
            self.stop()
            return
        self._publish_paths()
        log.info("%d read replica(s) on %s.r*", n, d.config.socket_path)

    def _spawn(self, slot: _Slot) -> None:
        d, cfg = self.daemon, self.daemon.config
        if slot.sock is None:
            slot.sock = _bind_like(slot.path, cfg.socket_path)
        settings = {
            "max_connections": cfg.max_connections,
            "max_connections_per_uid": cfg.max_connections_per_uid,
            "hello_timeout": cfg.hello_timeout,
            "idle_timeout": cfg.idle_timeout,
            "lease_ttl": d.broker.lease_ttl,
            "max_lease_ttl": d.broker.max_lease_ttl,
        }
        fd = slot.sock.fileno()
        slot.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbroker._server.replica",
                str(fd),
                journal_path(cfg.socket_path),
                str(self._report_w),
                str(os.getpid()),
                json.dumps(settings),
            ],
            pass_fds=(fd, self._report_w),
            stdin=subprocess.DEVNULL,
        )
        slot.started = time.monotonic()

    def check(self) -> None:
        """Once a second: replace the replicas that died, stop them all if the journal
        failed. Never raises (it runs on the daemon's housekeeping loop)."""
        if not self._slots:
            return
        try:
            journal = self.daemon.broker.journal
            if journal is None or journal.failed:
                log.warning("the journal failed: stopping the read replicas")
                self.stop()
                return
            now = time.monotonic()
            changed = False
            for i, slot in enumerate(self._slots):
                if slot.proc is not None and slot.proc.poll() is not None:
                    short = now - slot.started < _SHORT_LIFE
                    slot.failures = slot.failures + 1 if short else 1
                    slot.due = now + min(_BACKOFF_MAX, 2.0 ** (slot.failures - 1))
                    log.warning(
                        "read replica %d (pid %d) exited with %s: starting another in %.0f s",
                        i,
                        slot.proc.pid,
                        slot.proc.returncode,
                        slot.due - now,
                    )
                    slot.proc = None
                    self.daemon.broker.counters["replica_exits"] += 1
                    _close(slot)  # clients find no socket and ask the daemon meanwhile
                    changed = True
                elif slot.proc is None and now >= slot.due:
                    changed = True
                    try:
                        self._spawn(slot)
                    except OSError as exc:
                        slot.failures += 1
                        slot.due = now + min(_BACKOFF_MAX, 2.0 ** (slot.failures - 1))
                        log.error(
                            "cannot start read replica %d (%s): trying again in %.0f s",
                            i,
                            exc.strerror or exc,
                            slot.due - now,
                        )
            if changed:
                self._publish_paths()
        except Exception:  # never take the housekeeping loop down
            log.exception("read replicas: check failed")

    def reconcile(self) -> None:
        """After a reload: restart the replicas with the new settings, or stop them (the
        policy is no longer open), or start them (it is open again). Never raises."""
        try:
            running = bool(self._slots)
            if running:
                if not self.daemon.broker.policy.open:
                    log.warning("isolation is no longer open: stopping the read replicas")
                self.stop()
            if not self.daemon.draining:
                self.start()
        except Exception:  # a reload must finish
            log.exception("read replicas: reload failed")

    def stop(self) -> None:
        """Stop every replica and remove its socket (draining, stopping, reloading)."""
        if self.daemon.broker is not None:
            self.daemon.broker.replica_paths = ()  # clients ask the daemon from now on
        slots, self._slots = self._slots, []
        for slot in slots:
            if slot.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.terminate()
        for slot in slots:
            if slot.proc is not None:
                try:
                    slot.proc.wait(5)
                except subprocess.TimeoutExpired:
                    slot.proc.kill()
                    slot.proc.wait()
            _close(slot)
        if self._report_r is not None:
            self._read_reports()  # their last counts
            with contextlib.suppress(Exception):
                self.daemon.loop.remove_reader(self._report_r)
            os.close(self._report_r)
            self._report_r = None
        if self._report_w is not None:
            os.close(self._report_w)
            self._report_w = None
        self._buf = b""

    # -- reports ---------------------------------------------------------------------------------
    def _read_reports(self) -> None:
        while True:
            try:
                data = os.read(self._report_r, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            self._buf += data
        buf = self._buf
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "little")
            if n + 4 > MESSAGE_MAX:
                log.warning("a read replica's report is not one: dropped what was read")
                buf = b""
                break
            if len(buf) < 4 + n:
                break
            self._apply(buf[4 : 4 + n])
            buf = buf[4 + n :]
        self._buf = buf

    def _apply(self, raw: bytes) -> None:
        b = self.daemon.broker
        try:
            report = msgpack.unpackb(raw, raw=False)
            counters, touched = report["c"], report["t"]
            for name, n in counters.items():
                if name in _COUNTERS and isinstance(n, int) and n > 0:
                    b.counters[name] += n
                    if name == "requests":
                        b.counters["replica_requests"] += n
            for namespace, keys in touched.items():
                space = b.directory.namespace(namespace)
                if space:
                    b.directory.touch([o for o in map(space.get, keys) if o is not None])
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.ExtraData) as exc:
            log.warning("a read replica's report makes no sense (%s): ignored", exc)


def _close(slot: _Slot) -> None:
    if slot.sock is not None:
        slot.sock.close()
        slot.sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(slot.path)


def _remove_stale(socket_path: str) -> None:
    """Remove replica sockets a previous daemon of this socket left (killed before it could):
    a replica it orphaned must not be reached through them."""
    for i in range(_MOST):
        path = f"{socket_path}.r{i}"
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)


def _bind_like(path: str, model: str) -> socket.socket:
    """A listening socket at ``path`` with the owner group and mode of the socket ``model``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    st = os.stat(model)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        if st.st_gid != os.getegid():
            os.chown(path, -1, st.st_gid)
        os.chmod(path, st.st_mode & 0o777)
        sock.listen(512)
    except BaseException:
        sock.close()
        raise
    return sock
