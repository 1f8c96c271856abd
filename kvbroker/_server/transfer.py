"""Broker-to-broker transfer of sealed objects through NIXL (daemon side).

Two parts, both owned by a daemon:

- :class:`NixlEndpoint` — one NIXL agent (UCX backend; over TCP where there is no RDMA:
  ``UCX_TLS=tcp``). It registers the daemon's pools **once**; a peer that holds the agent's
  metadata can then READ any extent of them with no work on this side but UCX progress (the
  agent's progress thread). The pulling side reads a list of extents with **one** NIXL READ:
  :func:`coalesce` merges extents that are adjacent on both sides, and the whole list goes in
  one transfer request (:meth:`NixlEndpoint.read`). No byte crosses Python or the control
  channel.
- The control channel — a small authenticated request/reply protocol over TCP on
  ``[transfer] listen``: :class:`PeerServer` (the serving daemon, on its asyncio loop) and
  :class:`PeerClient` (the pulling daemon). It carries NIXL metadata (``hello``), and
  ``pin``/``release``/``renew`` of objects: ``pin`` takes a read lease held for the peer
  (bounded by a TTL, released when the peer's connection closes) and returns the object's
  extents, buffers, meta and checksums in the same reply. What a pin means is the
  :class:`Provider`'s business (the broker, in the daemon).

Authentication: a shared secret (``[transfer] token_file``), never sent. The server opens
with a random nonce; the client answers ``HMAC-SHA256(token, "c" | server nonce | client
nonce | client node)``, the server proves itself back with ``HMAC(token, "s" | client nonce |
server nonce | server node)``. A wrong token, or (when ``allow`` is set) an address not among
the configured peers, is refused before anything else is read, and the refused side gets
:class:`PeerUnavailable` saying so. NIXL metadata (which lets its holder READ the registered
pools) is only handed to an authenticated peer. Like every RDMA-style transport, the fabric
itself is trusted: run ``listen`` and UCX on the serving network, not on a public one.

``nixl`` is an optional extra (``pip install 'kvbroker[transfer]'``); it is imported only when
an endpoint is created. The control channel needs nothing beyond msgpack.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib
import itertools
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from ..errors import KVBrokerError, PeerUnavailable, ProtocolError, TransferFailed
from ..errors import error_for_code

__all__ = [
    "EXTRA",
    "NixlEndpoint",
    "PeerClient",
    "PeerServer",
    "PeerUnavailable",
    "Provider",
    "ReadResult",
    "TransferFailed",
    "coalesce",
    "load_nixl",
    "parse_address",
    "read_token",
]

log = logging.getLogger("kvbroker.transfer")

EXTRA = "transfer"  # pip install 'kvbroker[transfer]'
PROTOCOL = "kvbroker-peer/1"
_MAX_FRAME = 64 << 20
_HEADER = struct.Struct(">I")
_NONCE = 32



# -- NIXL ------------------------------------------------------------------------------------

def load_nixl():
    """The NIXL Python API module. The backend wheels (``nixl_cu12`` ...) are imported
    directly: the ``nixl`` meta package imports torch to pick one, a second we do not pay."""
    errors = []
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            api = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        # NIXL logs every agent and backend creation at INFO on stdout (its "nixl" logger);
        # keep its warnings unless NIXL_LOG_LEVEL asks for more.
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise ImportError(
        f"broker-to-broker transfer needs NIXL: pip install 'kvbroker[{EXTRA}]' "
        f"(tried {'; '.join(errors)})"
    )


def coalesce(remote: Sequence[tuple[int, int]], local: Sequence[tuple[int, int]]
             ) -> list[tuple[int, int, int]]:
    """Pair ``remote`` extents ``(addr, len)`` with ``local`` ones holding the same bytes in
    the same order, split where either side breaks and merged where both sides run on.
    Returns ``(remote_addr, local_addr, len)`` triples: the descriptors of one READ."""
    total_r = sum(n for _, n in remote)
    total_l = sum(n for _, n in local)
    if total_r != total_l:
        raise ValueError(f"remote extents hold {total_r} bytes, local ones {total_l}")
    out: list[tuple[int, int, int]] = []
    ri = li = 0
    r_addr, r_left = remote[0] if remote else (0, 0)
    l_addr, l_left = local[0] if local else (0, 0)
    while ri < len(remote) and li < len(local):
        if r_left == 0:
            ri += 1
            if ri < len(remote):
                r_addr, r_left = remote[ri]
            continue
        if l_left == 0:
            li += 1
            if li < len(local):
                l_addr, l_left = local[li]
            continue
        n = min(r_left, l_left)
        if out and out[-1][0] + out[-1][2] == r_addr and out[-1][1] + out[-1][2] == l_addr:
            ra, la, m = out[-1]
            out[-1] = (ra, la, m + n)
        else:
            out.append((r_addr, l_addr, n))
        r_addr += n
        r_left -= n
        l_addr += n
        l_left -= n
    return out


@dataclass(frozen=True)
class ReadResult:
    nbytes: int
    descriptors: int
    seconds: float


class NixlEndpoint:
    """A daemon's NIXL agent. ``register`` its pools once; ``read`` from a peer's pools.

    ``read`` blocks until the transfer ends: call it from a worker thread, never on the
    daemon's event loop. Agent calls are serialised by NIXL (``NIXL_THREAD_SYNC_STRICT``).
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",),
                 progress_thread: bool = True) -> None:
        self._api = api = load_nixl()
        conf = api.nixl_agent_config(
            enable_prog_thread=progress_thread, enable_listen_thread=False,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.agent = api.nixl_agent(name, conf)
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise RuntimeError(f"NIXL backend(s) {missing} unavailable (plugins: "
                               f"{self.agent.plugin_list})")
        self._registered: list = []
        self._peers: dict[str, str] = {}  # agent name -> label (for messages)
        self._lock = threading.Lock()
        self.reads = 0
        self.bytes_read = 0

    def register(self, regions: Iterable[tuple[int, int]]) -> None:
        """Register host memory ``(addr, len)`` regions (the pools) with every backend."""
        descs = [(int(a), int(n), 0, "") for a, n in regions]
        if descs:
            self._registered.append(self.agent.register_memory(descs, "DRAM"))

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes, label: str = "") -> str:
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        with self._lock:
            self._peers[name] = label or name
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            known = self._peers.pop(name, None)
        if known is not None:
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - the peer may be gone already
                log.debug("removing NIXL peer %s failed", name, exc_info=True)

    def read(self, peer: str, remote: Sequence[tuple[int, int]],
             local: Sequence[tuple[int, int]], *, timeout: float = 30.0) -> ReadResult:
        """Copy the bytes of ``remote`` extents of ``peer`` into ``local`` extents (this
        agent's registered memory) with one NIXL READ. Raises :class:`TransferFailed`."""
        label = self._peers.get(peer, peer)
        triples = coalesce(remote, local)
        if not triples:
            return ReadResult(0, 0, 0.0)
        np = _numpy()
        arr = np.array(triples, dtype=np.uint64)
        zeros = np.zeros(len(triples), dtype=np.uint64)
        local_descs = np.stack([arr[:, 1], arr[:, 2], zeros], axis=1)
        remote_descs = np.stack([arr[:, 0], arr[:, 2], zeros], axis=1)
        nbytes = int(arr[:, 2].sum())
        t0 = time.perf_counter()
        ldl = self.agent.get_xfer_descs(local_descs, "DRAM")
        rdl = self.agent.get_xfer_descs(remote_descs, "DRAM")
        try:
            handle = self.agent.initialize_xfer("READ", ldl, rdl, peer)
        except Exception as e:
            raise TransferFailed(f"NIXL READ from {label} could not start: {e}") from e
        try:
            try:
                state = self.agent.transfer(handle)
                deadline = t0 + timeout
                spins = 0
                while state == "PROC":
                    if time.perf_counter() > deadline:
                        raise TransferFailed(f"NIXL READ of {nbytes} bytes from {label} did "
                                             f"not finish in {timeout:.1f}s")
                    spins += 1
                    if spins > 200:
                        time.sleep(0.0002 if spins < 2000 else 0.002)
                    state = self.agent.check_xfer_state(handle)
            except TransferFailed:
                raise
            except Exception as e:  # nixlRemoteDisconnectError & co. (the peer died)
                raise TransferFailed(f"NIXL READ of {nbytes} bytes from {label} failed: "
                                     f"{type(e).__name__}: {e}") from e
            if state != "DONE":
                raise TransferFailed(f"NIXL READ of {nbytes} bytes from {label} failed "
                                     f"(state {state})")
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an aborted transfer may refuse release
                log.debug("releasing a NIXL transfer handle failed", exc_info=True)
        dt = time.perf_counter() - t0
        self.reads += 1
        self.bytes_read += nbytes
        return ReadResult(nbytes, len(triples), dt)

    def close(self) -> None:
        for name in list(self._peers):
            self.remove_peer(name)
        for reg in self._registered:
            try:
                self.agent.deregister_memory(reg)
            except Exception:  # noqa: BLE001
                log.debug("deregistering NIXL memory failed", exc_info=True)
        self._registered.clear()


def _numpy():
    import numpy

    return numpy


# -- the control channel ---------------------------------------------------------------------

def read_token(path: str) -> bytes:
    """The shared secret in ``path`` (surrounding whitespace stripped). The file must not be
    readable by others: a token anyone on the host can read authenticates nobody."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(f"{path}: token file must not be accessible by group or others "
                         f"(chmod 600)")
    token = open(path, "rb").read().strip()
    if len(token) < 16:
        raise ValueError(f"{path}: token must be at least 16 bytes")
    return token


def parse_address(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` (with ``default_port``)."""
    host, sep, port = addr.rpartition(":")
    if addr.startswith("[") and "]" in addr:
        host, _, rest = addr[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif not sep or "]" in port:
        host, port = addr, ""
    if not port:
        if default_port is None:
            raise ValueError(f"{addr!r}: expected HOST:PORT")
        return host, default_port
    return host, int(port)


def _mac(token: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, b"".join(parts), hashlib.sha256).digest()


def _pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


async def _recv(reader: asyncio.StreamReader) -> Any:
    head = await reader.readexactly(_HEADER.size)
    (n,) = _HEADER.unpack(head)
    if n > _MAX_FRAME:
        raise ProtocolError(f"peer frame of {n} bytes exceeds {_MAX_FRAME}")
    return msgpack.unpackb(await reader.readexactly(n), raw=False)


class Provider(Protocol):
    """What a :class:`PeerServer` serves: the daemon's broker, or a test table.

    ``peer`` identifies one authenticated connection; every lease it got ends with it."""

    def pin(self, peer: int, namespace: str, key: str, ttl: float, consume: bool) -> dict: ...

    def release(self, peer: int, lease: int, consumed: bool) -> None: ...

    def renew(self, peer: int, lease: int, ttl: float) -> None: ...

    def drop_peer(self, peer: int) -> None: ...


class PeerServer:
    """Serves pins of this daemon's objects and its NIXL metadata to authenticated peers."""

    def __init__(self, provider: Provider, *, token: bytes, node: str,
                 metadata: bytes | None, agent: str | None,
                 allow: Iterable[str] | None = None, handshake_timeout: float = 5.0) -> None:
        self.provider = provider
        self.node = node
        self._token = token
        self._metadata = metadata
        self._agent = agent
        self._allow = None if allow is None else {_resolve(h) for h in allow}
        self._handshake_timeout = handshake_timeout
        self._server: asyncio.base_events.Server | None = None
        self._ids = itertools.count(1)
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0
        self.served_pins = 0

    @property
    def peers(self) -> int:
        return len(self._conns)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        """Stop listening, end every peer connection (their leases are dropped)."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._serve_one(reader, writer)
        except asyncio.CancelledError:
            pass  # close(): the connection ends like any other (asyncio's stream callback
            # would log a cancelled handler as an error)
        finally:
            self._tasks.discard(task)

    async def _serve_one(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        peer_addr = writer.get_extra_info("peername") or ("?", 0)
        pid = None
        try:
            who = await asyncio.wait_for(self._handshake(reader, writer, peer_addr),
                                         self._handshake_timeout)
            if who is None:
                return
            pid = next(self._ids)
            self._conns[pid] = writer
            log.info("peer %s (%s) connected", who, peer_addr[0])
            hook = getattr(self.provider, "peer_connected", None)
            if hook is not None:
                hook(pid, who, f"{peer_addr[0]}:{peer_addr[1]}")
            while True:
                try:
                    req = await _recv(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(_pack(self._handle(pid, req)))
                await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError,
                ProtocolError, ValueError, TypeError) as e:
            log.info("peer connection from %s ended: %s", peer_addr[0], e)
        finally:
            if pid is not None:
                self._conns.pop(pid, None)
                self.provider.drop_peer(pid)
            writer.close()

    async def _handshake(self, reader, writer, peer_addr) -> str | None:
        if self._allow is not None and peer_addr[0] not in self._allow:
            self.refused += 1
            writer.write(_pack({"error": "forbidden",
                                "message": f"{peer_addr[0]} is not a configured peer of "
                                           f"{self.node}"}))
            await writer.drain()
            return None
        nonce = secrets.token_bytes(_NONCE)
        writer.write(_pack({"proto": PROTOCOL, "node": self.node, "nonce": nonce}))
        await writer.drain()
        hello = await _recv(reader)
        if not isinstance(hello, dict):
            raise ProtocolError("bad peer hello")
        cnonce, cnode, mac = hello.get("nonce"), hello.get("node"), hello.get("mac")
        if not (isinstance(cnonce, bytes) and len(cnonce) == _NONCE and isinstance(cnode, str)
                and isinstance(mac, bytes)):
            raise ProtocolError("bad peer hello")
        if not hmac.compare_digest(mac, _mac(self._token, b"c", nonce, cnonce, cnode.encode())):
            self.refused += 1
            writer.write(_pack({"error": "forbidden",
                                "message": f"{self.node} refused {cnode}: wrong token"}))
            await writer.drain()
            return None
        writer.write(_pack({"ok": True,
                            "mac": _mac(self._token, b"s", cnonce, nonce, self.node.encode()),
                            "agent": self._agent, "metadata": self._metadata}))
        await writer.drain()
        return cnode

    def _handle(self, pid: int, req: Any) -> dict:
        try:
            if not isinstance(req, dict):
                raise ProtocolError("a peer request must be a map")
            op = req.get("op")
            if op == "pin":
                ns, key = req.get("namespace", "default"), req.get("key")
                ttl, consume = req.get("ttl", 30.0), bool(req.get("consume", False))
                if not isinstance(ns, str) or not isinstance(key, str):
                    raise ProtocolError("pin needs namespace and key strings")
                if not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
                    raise ProtocolError("pin ttl must be in (0, 3600] seconds")
                out = self.provider.pin(pid, ns, key, float(ttl), consume)
                self.served_pins += 1
                return {"ok": True, **out}
            if op == "pin_prefix":
                ns, keys = req.get("namespace", "default"), req.get("keys")
                ttl = req.get("ttl", 30.0)
                if not isinstance(ns, str) or not isinstance(keys, list) or not all(
                        isinstance(k, str) for k in keys) or len(keys) > 8192:
                    raise ProtocolError("pin_prefix needs a namespace and a list of keys")
                if not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
                    raise ProtocolError("pin ttl must be in (0, 3600] seconds")
                out = self.provider.pin_prefix(pid, ns, keys, float(ttl))
                self.served_pins += 1
                return {"ok": True, **out}
            if op == "lookup":
                ns, key = req.get("namespace", "default"), req.get("key")
                if not isinstance(ns, str) or not isinstance(key, str):
                    raise ProtocolError("lookup needs namespace and key strings")
                return {"ok": True, "info": self.provider.lookup(pid, ns, key)}
            if op == "release":
                self.provider.release(pid, int(req["lease"]), bool(req.get("consumed", False)))
                return {"ok": True}
            if op == "renew":
                self.provider.renew(pid, int(req["lease"]), float(req.get("ttl", 30.0)))
                return {"ok": True}
            raise ProtocolError(f"unknown peer op {op!r}")
        except KVBrokerError as e:
            return {"error": e.code, "message": e.message or str(e)}
        except (KeyError, ValueError, TypeError) as e:
            return {"error": "protocol", "message": f"bad peer request: {e}"}


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


class PeerClient:
    """A pulling daemon's connection to one peer's :class:`PeerServer` (asyncio)."""

    def __init__(self, address: str, *, token: bytes, node: str,
                 connect_timeout: float = 5.0, request_timeout: float = 30.0) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.node = node
        self._token = token
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self.peer_node: str | None = None
        self.agent: str | None = None
        self.metadata: bytes | None = None

    async def connect(self) -> PeerClient:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port), self._connect_timeout)
            first = await asyncio.wait_for(_recv(self._reader), self._connect_timeout)
            if "error" in first:
                raise PeerUnavailable(f"peer {self.address} refused: {first.get('message')}")
            if first.get("proto") != PROTOCOL or not isinstance(first.get("nonce"), bytes):
                raise PeerUnavailable(f"peer {self.address} does not speak {PROTOCOL}")
            snonce, snode = first["nonce"], str(first.get("node"))
            cnonce = secrets.token_bytes(_NONCE)
            self._writer.write(_pack({"node": self.node, "nonce": cnonce,
                                      "mac": _mac(self._token, b"c", snonce, cnonce,
                                                  self.node.encode())}))
            await self._writer.drain()
            reply = await asyncio.wait_for(_recv(self._reader), self._connect_timeout)
            if "error" in reply:
                raise PeerUnavailable(f"peer {self.address} refused: {reply.get('message')}")
            mac = reply.get("mac")
            if not (isinstance(mac, bytes) and hmac.compare_digest(
                    mac, _mac(self._token, b"s", cnonce, snonce, snode.encode()))):
                raise PeerUnavailable(f"peer {self.address} failed to prove the shared token")
        except PeerUnavailable:
            await self.close()
            raise
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                ProtocolError, ValueError) as e:
            await self.close()
            raise PeerUnavailable(f"peer {self.address} unavailable: "
                                  f"{type(e).__name__}: {e}") from e
        self.peer_node = snode
        self.agent, self.metadata = reply.get("agent"), reply.get("metadata")
        return self

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def request(self, req: dict) -> dict:
        if not self.connected:
            raise PeerUnavailable(f"peer {self.address} is not connected")
        async with self._lock:
            try:
                self._writer.write(_pack(req))
                await self._writer.drain()
                reply = await asyncio.wait_for(_recv(self._reader), self._request_timeout)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                    ProtocolError) as e:
                await self.close()
                raise PeerUnavailable(f"peer {self.address} ({self.peer_node}) went away: "
                                      f"{type(e).__name__}: {e}") from e
        if "error" in reply:
            err = error_for_code(str(reply["error"]), f"peer {self.address}: "
                                                      f"{reply.get('message', '')}")
            raise err
        return reply

    async def pin(self, key: str, *, namespace: str = "default", ttl: float = 30.0,
                  consume: bool = False) -> dict:
        return await self.request({"op": "pin", "namespace": namespace, "key": key,
                                   "ttl": ttl, "consume": consume})

    async def pin_prefix(self, keys: list[str], *, namespace: str = "default",
                         ttl: float = 30.0) -> dict:
        return await self.request({"op": "pin_prefix", "namespace": namespace, "keys": keys,
                                   "ttl": ttl})

    async def lookup(self, key: str, *, namespace: str = "default") -> dict | None:
        return (await self.request({"op": "lookup", "namespace": namespace,
                                    "key": key}))["info"]

    async def release(self, lease: int, *, consumed: bool = False) -> None:
        await self.request({"op": "release", "lease": lease, "consumed": consumed})

    async def renew(self, lease: int, ttl: float = 30.0) -> None:
        await self.request({"op": "renew", "lease": lease, "ttl": ttl})

    async def close(self) -> None:
        w, self._writer = self._writer, None
        if w is not None:
            w.close()
            try:
                await w.wait_closed()
            except (OSError, ConnectionError):
                pass
