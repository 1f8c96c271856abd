"""A read replica of the directory: a process of its own that follows the daemon's journal
and answers the two read-only requests schedulers make most, ``exists`` and
``match_prefix(hold=False)``, so that they stop queueing on the writer's one event loop.

Why, and what it keeps: ``docs/design.md``, "Why one writer, and what scaling the control
plane needs". The daemon starts ``read_replicas`` of them (:mod:`kvbroker._server.replicas`)
and names their sockets in its ``hello`` reply; a client sends those two requests to one of
them and everything else to the daemon.

Consistency. Before it answers the requests one read brought, a replica reads the journal to
its end. The daemon writes a change's records before it replies to the change, so every
change acknowledged to any client before the request was sent is seen: a client that put a
key and then tells another client, which asks a replica, finds it. What a replica cannot see
is a change not yet acknowledged: a replace being written may read as absent for those
microseconds (an ``exists`` or a match count is a hint either way: a claim can still miss).

Ownership. The replica owns nothing but its connections and its copy of the directory (a map
of names, no pages, no leases). It never writes the journal. What it owes the daemon goes up
a pipe, at most every :data:`REPORT_PERIOD`, in messages of at most ``PIPE_BUF`` bytes (each
written whole or not at all, so several replicas share the pipe and a full pipe loses a
message, never the framing): its counters (requests, prefix queries and hits) and the keys its
matches found, which the daemon moves to the new end of its LRU as a
``hold=False`` match there would (a prefix a scheduler keeps finding is not evicted first).

When it cannot follow the journal (removed after a write failure, damaged, not there yet) it
answers ``unavailable`` and the client asks the daemon instead; when the daemon replaces the
file (compaction), it replays the new one. It exits when the daemon does (whose pid it is
given: a daemon killed while it started is noticed too). It keeps the daemon's connection
limits: ``max_connections``, ``max_connections_per_uid``, ``hello_timeout``,
``idle_timeout`` (the daemon restarts its replicas on a reload, with the new values).

    python -m kvbroker._server.replica LISTEN_FD JOURNAL REPORT_FD DAEMON_PID SETTINGS_JSON
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import struct
import sys
import time
import zlib
from collections import Counter
from typing import Any

import msgpack

from .._wire.frames import (
    FrameDecoder,
    FrameEncoder,
    FrameError,
    SharedUnpacker,
    answer_id,
    as_request,
)
from .._wire.protocol import (
    MAX_BUFFERS,
    MAX_REQUEST,
    OPS,
    PROTOCOL_VERSION,
    REPLICA_OPS,
    answered_by_a_replica,
    validate_args,
)
from ..errors import BadRequest, BrokerUnavailable, KVBrokerError, ProtocolError
from .journal import _FRAME, _MAX_RECORD, MAGIC

__all__ = ["REPLICA_OPS", "REPORT_PERIOD", "JournalFollower"]

REPORT_PERIOD = 0.05  # seconds between reports to the daemon (counters, matched keys)
_MAX_TOUCHED = 65536  # matched keys per report; beyond, the LRU hint is dropped
# One report message: written whole or not at all (POSIX: a pipe write of at most PIPE_BUF).
MESSAGE_MAX = select.PIPE_BUF
_HIGH_WATER = 1 << 20  # unread replies per connection before it stops reading
# (The requests a replica answers, REPLICA_OPS: the op table's ``replica`` column.)
# Its connections share one msgpack Unpacker between frames, as the daemon's do.
_SHARED = SharedUnpacker(MAX_REQUEST)


class JournalFollower:
    """``namespace -> key -> serial`` as the journal at ``path`` says, read up to its end by
    :meth:`catch_up`. ``problem`` says why it cannot answer (None: it can)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._pending = b""  # the start of a record the daemon is still writing
        self._seed = 0  # the file's checksum seed, from its header (kvbroker._server.journal)
        self.by_namespace: dict[str, dict[str, int]] = {}
        self._names: dict[int, tuple[str, str]] = {}  # serial -> (namespace, key)
        self.problem: str | None = "the journal has not been read yet"
        self.replays = 0  # times the file was (re)read from its start

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _reopen(self) -> None:
        self.close()
        self._pending, self.by_namespace, self._names, self._seed = b"", {}, {}, 0
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self.problem = f"cannot read the journal {self.path}: {exc.strerror or exc}"
            return
        self.problem = "the journal has no header yet"
        self.replays += 1

    def catch_up(self) -> None:
        """Apply whatever the daemon appended since the last call."""
        if self._fd is None or os.fstat(self._fd).st_nlink == 0:  # none, or replaced
            self._reopen()
            if self._fd is None:
                return
        chunks = [self._pending] if self._pending else []
        while data := os.read(self._fd, 1 << 20):
            chunks.append(data)
        if not chunks or (len(chunks) == 1 and self._pending):
            return
        data = b"".join(chunks)
        self._pending = data[self._apply_frames(data) :]

    def _apply_frames(self, data: bytes) -> int:
        """Apply the whole records of ``data``; returns where the first incomplete one
        starts. A damaged record stops the follower until the file is replaced."""
        pos, size, head = 0, len(data), _FRAME.size
        while pos + head <= size:
            magic, n, crc = _FRAME.unpack_from(data, pos)
            if magic != MAGIC or n > _MAX_RECORD:
                return self._damaged(pos, size)
            end = pos + head + n
            if end > size:
                break  # the daemon is still writing it
            body = data[pos + head : end]
            # Records are checksummed from the file's seed, its header from 0.
            header = crc != zlib.crc32(body, self._seed)
            if header and crc != zlib.crc32(body):
                return self._damaged(pos, size)
            try:
                entry = msgpack.unpackb(body, raw=False)
                if header and entry["t"] != "h":
                    return self._damaged(pos, size)
                self._apply(entry)
            except (ValueError, TypeError, KeyError, AttributeError, msgpack.ExtraData):
                return self._damaged(pos, size)
            pos = end
        return pos

    def _damaged(self, pos: int, size: int) -> int:
        self.problem = f"the journal {self.path} is damaged at byte {pos}: asking the daemon"
        self.by_namespace, self._names = {}, {}
        return size  # nothing more of this file is trusted; a replaced file is read again

    def _apply(self, entry: dict[str, Any]) -> None:
        t = entry["t"]
        if t == "h":  # a file starts with its header: a fresh directory
            self.by_namespace, self._names, self.problem = {}, {}, None
            self._seed = int(entry["seed"])
        elif self.problem is not None:
            return  # records before a readable header
        elif t == "s":
            o = entry["o"]
            ns, key, serial = o["namespace"], o["key"], o["serial"]
            self.by_namespace.setdefault(ns, {})[key] = serial
            self._names[serial] = (ns, key)
        elif t == "u":
            serial = entry["s"]
            ident = self._names.pop(serial, None)
            if ident is not None:
                space = self.by_namespace.get(ident[0])
                if space is not None and space.get(ident[1]) == serial:
                    del space[ident[1]]
                    if not space:
                        del self.by_namespace[ident[0]]

    def matched(self, namespace: str, keys: list[Any]) -> int:
        """How many leading ``keys`` are published (the daemon's ``matched_run``)."""
        space = self.by_namespace.get(namespace)
        if not space:
            return 0
        n = 0
        for k in keys:
            if k.__class__ is not str or k not in space:
                break
            n += 1
        return n


class _Replica:
    """The replica's state shared by its connections: the follower, the daemon's limits, the
    counters and the matched keys owed to the daemon."""

    def __init__(self, follower: JournalFollower, report_fd: int, settings: dict) -> None:
        self.follower = follower
        self.report_fd = report_fd
        self.settings = settings
        self.max_lease_ttl = settings["max_lease_ttl"]  # the TTL rule's bound, as the daemon's
        self.connections: set[_ReplicaConnection] = set()
        self.per_uid: Counter[int] = Counter()
        self.counters: Counter[str] = Counter()
        self.touched: dict[str, list[str]] = {}
        self._n_touched = 0

    def touch(self, namespace: str, keys: list[str]) -> None:
        if self._n_touched + len(keys) <= _MAX_TOUCHED:
            self.touched.setdefault(namespace, []).extend(keys)
            self._n_touched += len(keys)

    def report(self) -> None:
        """What is owed to the daemon, in messages of at most MESSAGE_MAX bytes."""
        counters, touched = dict(self.counters), self.touched
        self.counters, self.touched, self._n_touched = Counter(), {}, 0
        if counters:
            self._send({"c": counters, "t": {}})
        for namespace, keys in touched.items():
            batch: list[str] = []
            size = len(namespace.encode()) + 32
            for key in keys:
                n = len(key.encode()) + 3
                if batch and size + n > MESSAGE_MAX - 8:
                    self._send({"c": {}, "t": {namespace: batch}})
                    batch, size = [], len(namespace.encode()) + 32
                batch.append(key)
                size += n
            if batch:
                self._send({"c": {}, "t": {namespace: batch}})

    def _send(self, report: dict) -> None:
        msg = msgpack.packb(report)
        if len(msg) + 4 > MESSAGE_MAX:
            return  # one key longer than a message: that LRU hint is dropped
        try:
            os.write(self.report_fd, len(msg).to_bytes(4, "little") + msg)
        except BlockingIOError:
            pass  # the pipe is full (the daemon is behind): this message is lost, whole
        except OSError:
            os._exit(0)  # the daemon is gone

    def sweep(self) -> None:
        """Close connections that never said hello in time, or held nothing and said nothing
        for idle_timeout (a replica's connection holds nothing)."""
        now = time.monotonic()
        hello, idle = self.settings["hello_timeout"], self.settings["idle_timeout"]
        for conn in list(self.connections):
            if (not conn.greeted and now - conn.connected_at > hello) or (
                idle > 0 and now - conn.last_active > idle
            ):
                conn.transport.abort()


class _ReplicaConnection(asyncio.Protocol):
    def __init__(self, replica: _Replica) -> None:
        self.replica = replica
        self.decoder = FrameDecoder(MAX_REQUEST, shared=_SHARED)
        self.encoder = FrameEncoder()
        self.transport: asyncio.Transport | None = None
        self.greeted = False
        self.uid: int | None = None
        self.connected_at = self.last_active = time.monotonic()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        r, limits = self.replica, self.replica.settings
        sock = transport.get_extra_info("socket")
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            uid = struct.unpack("3i", raw)[1]
        except OSError:
            uid = -1
        if (
            len(r.connections) >= limits["max_connections"]
            or r.per_uid[uid] >= limits["max_connections_per_uid"]
        ):
            transport.abort()  # the client asks the daemon, which says why if it must
            return
        self.uid = uid
        r.per_uid[uid] += 1
        r.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        r = self.replica
        if self.uid is not None and self in r.connections:
            r.connections.discard(self)
            r.per_uid[self.uid] -= 1
            if r.per_uid[self.uid] <= 0:
                del r.per_uid[self.uid]

    def pause_writing(self) -> None:  # a client that does not read its replies
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        try:
            messages = self.decoder.receive(data)
        except FrameError:  # the stream cannot resync: closed (the client asks the daemon)
            self.transport.abort()
            return
        if not messages:
            return
        self.replica.follower.catch_up()
        out = [self._answer(msg) for msg in messages]
        if out:
            self.transport.write(b"".join(out))
        if self.transport.get_write_buffer_size() > _HIGH_WATER:
            self.transport.abort()

    def _answer(self, msg: Any) -> bytes:
        rid = answer_id(msg)
        self.replica.counters["requests"] += 1
        try:
            rid, op, raw_args = as_request(msg)
            if op not in REPLICA_OPS:
                raise BadRequest(
                    f"{op}: a read replica answers only {sorted(REPLICA_OPS)}; ask the daemon"
                )
            args = validate_args(op, raw_args, self.replica)
            if not answered_by_a_replica(op, args):
                raise BadRequest(
                    f"{op}: a read replica answers it only with {_when(op)}; ask the daemon"
                )
            if op != "hello" and not self.greeted:
                raise ProtocolError("the first request on a connection must be hello")
            result = getattr(self, "op_" + op)(**args)
        except KVBrokerError as exc:
            self.replica.counters["errors"] += 1
            return self.encoder.refusal(rid, exc)
        except Exception as exc:  # noqa: BLE001 (a bug here: the client asks the daemon)
            self.replica.counters["errors"] += 1
            return self.encoder.refusal(rid, BrokerUnavailable(f"read replica: {exc!r}"))
        return self.encoder.reply(rid, result)

    def _following(self) -> JournalFollower:
        f = self.replica.follower
        if f.problem is not None:
            raise BrokerUnavailable(f"read replica: {f.problem}")
        return f

    def op_hello(self, version: int, name: str, role: str) -> dict:
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported (a read replica "
                f"speaks {PROTOCOL_VERSION})"
            )
        self.greeted = True
        return {"version": PROTOCOL_VERSION, "replica": True, "server_pid": os.getpid()}

    def op_exists(self, namespace: str, key: str) -> bool:
        space = self._following().by_namespace.get(namespace)
        return space is not None and key in space

    def op_match_prefix(
        self,
        namespace: str,
        keys: list,
        block_tokens: int,
        ttl: Any,
        peer: Any,
        hold: bool,
        retain: Any,
    ) -> dict:
        # (peer, hold and retain as the op table's replica column says: checked in _answer)
        ttl = self.replica.settings["lease_ttl"] if ttl is None else float(ttl)
        if len(keys) > MAX_BUFFERS:
            raise BadRequest(f"match_prefix: at most {MAX_BUFFERS} keys per request")
        f = self._following()
        matched = f.matched(namespace, keys)
        c = self.replica.counters
        c["prefix_queries"] += 1
        c["prefix_hit_blocks"] += matched
        c["prefix_miss_blocks"] += len(keys) - matched
        c["prefix_hit_tokens"] += matched * block_tokens
        c["hits" if matched else "misses"] += 1
        if matched:
            self.replica.touch(namespace, keys[:matched])
        return {"ttl": ttl, "matched": matched, "lease": None, "names": [], "blocks": []}

    def op_ping(self) -> dict:
        return {"version": PROTOCOL_VERSION, "replica": True}


def _when(op: str) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in OPS[op].replica.when)


async def _serve(listen: socket.socket, replica: _Replica, daemon_pid: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: _ReplicaConnection(replica), sock=listen)
    ticks = 0
    async with server:
        while os.getppid() == daemon_pid:  # the daemon gone: so is its replica
            await asyncio.sleep(REPORT_PERIOD)
            replica.report()
            ticks += 1
            if ticks % 20 == 0:  # once a second
                replica.sweep()


def main(argv: list[str]) -> None:
    listen_fd, journal, report_fd, daemon_pid, settings = argv
    if os.getppid() != int(daemon_pid):
        return  # the daemon died while this process started
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    listen = socket.socket(fileno=int(listen_fd))
    listen.setblocking(False)
    os.set_blocking(int(report_fd), False)
    follower = JournalFollower(journal)
    follower.catch_up()
    replica = _Replica(follower, int(report_fd), json.loads(settings))
    asyncio.run(_serve(listen, replica, int(daemon_pid)))


if __name__ == "__main__":
    main(sys.argv[1:])
