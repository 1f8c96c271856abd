"""EXPERIMENT (branch replica-experiment, not shipped): a read replica of the directory.

A process that follows the daemon's journal and answers the read-only requests that a
scheduler makes most (``lookup``, ``match_prefix`` with ``hold=False``) on its own socket,
so that they no longer queue on the single writer's event loop. Consistency: before it
answers what it read from a connection, the replica reads the journal to its end; the writer
flushes a change's records before it replies, so every change acknowledged to anyone before
the request was sent is seen (read-your-writes across clients). A compaction replaces the
journal file: the replica sees its file unlinked and replays the new one.

    python -m kvbroker._server.replica SOCKET JOURNAL
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import msgpack

from .journal import _frames
from .._wire.protocol import PROTOCOL_VERSION

_MAX_FRAME = 1 << 20


class Directory:
    """namespace -> key -> serial, as the journal says."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        self.tail = b""
        self.by_ns: dict[str, dict[str, int]] = {}
        self.where: dict[int, tuple[str, str]] = {}

    def _open(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self.tail = None, b""
        self.by_ns, self.where = {}, {}
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            pass

    def catch_up(self) -> None:
        if self.fd is None or os.fstat(self.fd).st_nlink == 0:  # none yet, or compacted
            self._open()
            if self.fd is None:
                return
        chunks = [self.tail] if self.tail else []
        while data := os.read(self.fd, 1 << 20):
            chunks.append(data)
        if len(chunks) == (1 if self.tail else 0):
            return
        data = b"".join(chunks)
        entries, _damaged, torn = _frames(data)
        self.tail = data[len(data) - torn:] if torn else b""
        for _pos, e in entries:
            t = e.get("t")
            if t == "s":
                o = e["o"]
                ns, key, serial = o["namespace"], o["key"], o["serial"]
                self.by_ns.setdefault(ns, {})[key] = serial
                self.where[serial] = (ns, key)
            elif t == "u":
                ident = self.where.pop(e["s"], None)
                if ident is not None:
                    space = self.by_ns.get(ident[0])
                    if space is not None and space.get(ident[1]) == e["s"]:
                        del space[ident[1]]


class ReplicaConnection(asyncio.Protocol):
    def __init__(self, directory: Directory) -> None:
        self.dir = directory
        self.unpacker = msgpack.Unpacker(max_buffer_size=_MAX_FRAME)
        self.packer = msgpack.Packer()
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        self.dir.catch_up()
        out = []
        for msg in self.unpacker:
            rid, op, args = msg.get("id"), msg.get("op"), msg.get("args") or {}
            try:
                result = getattr(self, "op_" + op)(**args)
                out.append(self.packer.pack({"id": rid, "ok": True, "result": result}))
            except Exception as exc:
                out.append(self.packer.pack({"id": rid, "ok": False, "error": {
                    "code": "bad_request", "message": f"replica: {op}: {exc}"}}))
        if out:
            self.transport.write(b"".join(out))

    def op_hello(self, version, name="", role=""):
        if version != PROTOCOL_VERSION:
            raise ValueError("protocol version")
        return {"version": PROTOCOL_VERSION, "server_version": "replica",
                "server_pid": os.getpid(), "session": 0, "lease_ttl": 0.0, "pools": [],
                "epoch": 0, "checksum_kinds": []}  # fmt: skip

    def op_lookup(self, namespace, key, peer=None):
        space = self.dir.by_ns.get(namespace)
        serial = None if space is None else space.get(key)
        return None if serial is None else {"namespace": namespace, "key": key}

    def op_match_prefix(self, namespace, keys, block_tokens=0, ttl=None, peer=None, hold=True):
        if hold or peer is not None:
            raise ValueError("a replica answers only hold=False, without a peer")
        space = self.dir.by_ns.get(namespace) or {}
        n = 0
        for k in keys:
            if k.__class__ is not str or k not in space:
                break
            n += 1
        return {"ttl": ttl or 0.0, "matched": n, "lease": None, "names": [], "blocks": []}

    def op_ping(self):
        return {}


def main(sock_path: str, journal: str) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    directory = Directory(journal)

    async def serve() -> None:
        with __import__("contextlib").suppress(FileNotFoundError):
            os.unlink(sock_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(sock_path)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(lambda: ReplicaConnection(directory), sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
