"""The daemon's read replicas (:mod:`kvbroker._server.replica`): started, watched, restarted,
stopped, and what they report applied to the broker.

The daemon binds each replica's socket itself, beside its own (``SOCKET.r0``, ``SOCKET.r1``,
... with the same owner, group and mode) and hands the listening socket to the replica
process, so a replica that dies is replaced on the same path while clients reconnect. The
replicas are stopped when the daemon starts draining: a draining daemon refuses new matches,
and a client whose replica is gone asks the daemon. Each replica writes its reports
(counters, matched keys) to a pipe the daemon reads on its loop.

How many: the ``read_replicas`` setting; ``auto`` is :func:`auto_count`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING

import msgpack

from .journal import journal_path
from .prefix_leases import keep_recent

if TYPE_CHECKING:
    from .daemon import Daemon

__all__ = ["Replicas", "auto_count"]

log = logging.getLogger("kvbroker.daemon")

# Counters a replica reports; anything else in a report is ignored.
_COUNTERS = frozenset({"requests", "errors", "prefix_queries", "prefix_hit_blocks",
                       "prefix_miss_blocks", "prefix_hit_tokens", "hits", "misses"})  # fmt: skip
_MAX_REPORT = 16 << 20


def auto_count(cpus: int) -> int:
    """``read_replicas = auto``: none below 8 CPUs (the daemon, its clients and their copies
    need them: a replica would take a core the writer's clients use), then one per 4 CPUs,
    at most 4 (measured on 16 CPUs: 4 replicas serve 16 clients at 2.3-2.4x the ops/s of 4;
    ``benchmarks/results/rpc-replicas-experiment/``)."""
    return 0 if cpus < 8 else min(4, cpus // 4)


def wanted(d: Daemon) -> int:
    """How many replicas this daemon runs: the setting, or none where it cannot have them
    (no journal to follow; a namespace policy, which only the daemon applies)."""
    cfg = d.config
    n = cfg.read_replicas
    auto = n is None
    if auto:
        n = auto_count(len(os.sched_getaffinity(0)))
    if n and (d.broker.journal is None or not d.broker.policy.open):
        why = ("journal = false" if d.broker.journal is None
               else f"isolation = {d.broker.policy.mode!r}")  # fmt: skip
        if not auto:
            log.warning("read_replicas = %d: none started (%s: replicas follow the journal "
                        "and serve only an open policy)", n, why)  # fmt: skip
        return 0
    return n


class Replicas:
    def __init__(self, d: Daemon) -> None:
        self.daemon = d
        self.paths: list[str] = []
        self._sockets: list[socket.socket] = []
        self._procs: list[subprocess.Popen | None] = []
        self._report_r: int | None = None
        self._report_w: int | None = None
        self._buf = b""
        self.restarts = 0

    def start(self) -> None:
        d = self.daemon
        n = wanted(d)
        if not n:
            return
        self._report_r, self._report_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        for i in range(n):
            path = f"{d.config.socket_path}.r{i}"
            self._sockets.append(_bind_like(path, d.config.socket_path))
            self.paths.append(path)
            self._procs.append(None)
            self._spawn(i)
        d._loop.add_reader(self._report_r, self._read_reports)
        d.broker.replica_paths = tuple(self.paths)  # named in hello from now on
        log.info("%d read replica(s) on %s.r*", n, d.config.socket_path)

    def reconcile(self) -> None:
        """After a reload: none while the policy is not open (a replica cannot apply it),
        and the configured number again once it is."""
        running = bool(self.paths)
        if running and not self.daemon.broker.policy.open:
            log.warning("isolation is no longer open: stopping the read replicas")
            self.stop()
        elif not running and not self.daemon.draining:
            self.start()

    def _spawn(self, i: int) -> None:
        d = self.daemon
        listen = self._sockets[i]
        self._procs[i] = subprocess.Popen(
            [sys.executable, "-m", "kvbroker._server.replica", str(listen.fileno()),
             journal_path(d.config.socket_path), str(self._report_w),
             str(d.config.max_connections)],
            pass_fds=(listen.fileno(), self._report_w), stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def check(self) -> None:
        """Replace the replicas that died (a crash, a kill): same socket, a new process."""
        for i, proc in enumerate(self._procs):
            if proc is not None and proc.poll() is not None:
                log.warning("read replica %d (pid %d) exited with %s: starting another",
                            i, proc.pid, proc.returncode)  # fmt: skip
                self.restarts += 1
                self._spawn(i)

    def stop(self) -> None:
        """Stop every replica and remove its socket (draining, or stopping)."""
        if self.daemon.broker is not None:
            self.daemon.broker.replica_paths = ()  # clients ask the daemon from now on
        procs, self._procs = [p for p in self._procs if p is not None], []
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock, path in zip(self._sockets, self.paths):
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._sockets, self.paths = [], []
        if self._report_r is not None:
            self._read_reports()  # their last counts
            with contextlib.suppress(Exception):
                self.daemon._loop.remove_reader(self._report_r)
            os.close(self._report_r)
            os.close(self._report_w)
            self._report_r = self._report_w = None

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
            if n > _MAX_REPORT:
                buf = b""  # not a report: drop what is buffered
                break
            if len(buf) < 4 + n:
                break
            self._apply(buf[4:4 + n])
            buf = buf[4 + n:]
        self._buf = buf

    def _apply(self, raw: bytes) -> None:
        b = self.daemon.broker
        try:
            report = msgpack.unpackb(raw, raw=False)
            counters, touched = report["c"], report["t"]
            for name, n in counters.items():
                if name in _COUNTERS and isinstance(n, int) and n > 0:
                    b.counters[name] += n
            for namespace, keys in touched.items():
                space = b.by_namespace.get(namespace)
                if space:
                    keep_recent(b, [o for o in map(space.get, keys) if o is not None])
        except (ValueError, TypeError, KeyError, AttributeError, msgpack.ExtraData) as exc:
            log.warning("a read replica's report makes no sense (%s): ignored", exc)


def _bind_like(path: str, model: str) -> socket.socket:
    """A listening socket at ``path`` with the owner group and mode of the socket ``model``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # ours: a previous daemon of this socket left it
    st = os.stat(model)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    if st.st_gid != os.getegid():
        os.chown(path, -1, st.st_gid)
    os.chmod(path, st.st_mode & 0o777)
    sock.listen(512)
    return sock
