"""The control channel between brokers (issue 18; mutual TLS since issue 38): a small
request/reply protocol over TLS on ``[transfer] listen``, between :class:`PeerServer` (the
serving daemon, on its asyncio loop) and :class:`PeerClient` (the pulling daemon). It carries
NIXL metadata (in the hello), and ``pin``/``release``/``renew`` of objects: ``pin`` takes a
read lease held for the peer (bounded by a TTL, released when the peer's connection closes)
and returns the object's extents, buffers, meta and checksums in the same reply. The ops and
their arguments are declared once, in :data:`kvbroker._wire.peer.PEER_OPS`. What a pin means
is the :class:`Provider`'s business (the broker, in the daemon). The bytes themselves move
through NIXL (:mod:`kvbroker._server.transfer`).

Authentication is TLS 1.3 with certificates on both sides (Python's :mod:`ssl`; ``[transfer]
cert_file``, ``key_file``, ``ca_file``): each side accepts only a certificate signed by the
fleet's CA; the pulling side checks that the serving peer's certificate names the host it
dialled (ordinary hostname verification), and the serving side that the pulling peer's
certificate names the host of one of its ``[transfer] peers`` (its identity, which
``[transfer] serve`` authorizes per namespace). Every frame after the handshake is
authenticated and encrypted by TLS, so a relay can neither rewrite, splice nor replay one.
No frame is read before the handshake (OpenSSL bounds its buffers), and at most
:data:`MAX_HANDSHAKES` handshakes run at once, at most :data:`MAX_HANDSHAKES_PER_SOURCE` of
them from one address (one host stalling handshakes cannot keep the peers out). NIXL
metadata (which lets its holder READ the registered pools) is only handed to an
authenticated peer.

Ownership: a :class:`PeerServer` owns its listening socket and its connections (each one's
leases end with it, through ``Provider.drop_peer``); a :class:`PeerClient` owns its one
connection. Needs nothing beyond msgpack and Python's ssl.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import os
import socket
import ssl
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any, Protocol

import msgpack

from .._wire.frames import FrameDecoder
from .._wire.peer import PEER_OPS, PEER_PROTOCOL, validate_peer_args
from .._wire.protocol import check_args
from ..errors import KVBrokerError, PeerUnavailable, ProtocolError, error_for_code

__all__ = [
    "MAX_HANDSHAKES",
    "MAX_HANDSHAKES_PER_SOURCE",
    "PeerClient",
    "PeerServer",
    "Provider",
    "certificate_names",
    "identity",
    "parse_address",
    "tls_contexts",
]

log = logging.getLogger("kvbroker.transfer")

# What one frame may hold. A peer is authenticated (TLS) before it sends any frame; its
# requests are small (pin_prefix names at most MAX_BUFFERS keys), and the replies a puller
# reads (a prefix's descriptions with their token ids) are the largest messages.
MAX_PEER_REQUEST = 8 << 20
MAX_PEER_REPLY = 64 << 20
# TLS handshakes in progress at once: a connection past this is closed unanswered, so
# unauthenticated connections cannot pile up (each costs OpenSSL's bounded buffers only).
MAX_HANDSHAKES = 16
# Of those, from one source address (an IPv6 one by its /64): a host that stalls handshakes
# fills its own share, never every slot, so the configured peers still get in.
MAX_HANDSHAKES_PER_SOURCE = 4


def tls_contexts(
    cert_file: str, key_file: str, ca_file: str
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The peer channel's (serving, pulling) TLS contexts: TLS 1.3, this node's certificate
    and key, and only certificates signed by ``ca_file`` accepted, on both sides (mutual
    TLS). Raises ValueError (a key others can read) or OSError / ssl.SSLError."""
    st = os.stat(key_file)
    if st.st_mode & 0o077:
        raise ValueError(
            f"{key_file}: a private key must not be accessible by group or others (chmod 600)"
        )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname: the peer's address
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(cert_file, key_file)
        ctx.load_verify_locations(cafile=ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return server, client


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


def identity(host: str) -> str:
    """How a host is compared with the names of a certificate: an IP address in its
    canonical form, a DNS name in lower case."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.lower().rstrip(".")


def certificate_names(cert: dict | None) -> list[str]:
    """The hosts a verified peer certificate names: its subject alternative names (DNS
    names and IP addresses), or its common name when it has none."""
    if not cert:
        return []
    names = [identity(v) for k, v in cert.get("subjectAltName", ()) if k in ("DNS", "IP Address")]
    if not names:
        names = [
            identity(v) for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"
        ]
    return names


def _source(host: str) -> str:
    """What the per-source handshake cap counts by: an IPv4 address, an IPv6 /64 (one host
    is commonly given a whole /64)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.version == 4:
        return str(ip)
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class _Frames:
    """msgpack messages from a stream, through the wire's frame codec under the channel's
    limit (a frame past ``limit`` bytes, or bytes that are not msgpack: a ProtocolError,
    never buffered whole)."""

    def __init__(self, reader: asyncio.StreamReader, limit: int) -> None:
        self._reader = reader
        self._decoder = FrameDecoder(limit, sender="the peer")
        self._ready: deque[Any] = deque()

    async def recv(self) -> Any:
        while not self._ready:
            data = await self._reader.read(1 << 16)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            self._ready.extend(self._decoder.receive(data))
        return self._ready.popleft()


class Provider(Protocol):
    """What a :class:`PeerServer` serves: the daemon's broker, or a test table.

    ``peer`` identifies one authenticated connection; every lease it got ends with it.
    Arguments arrive checked against :data:`~kvbroker._wire.peer.PEER_OPS` (types, and a
    TTL's range up to the provider's ``max_lease_ttl``); the other values (names) are the
    provider's to check, as the local ops check them."""

    max_lease_ttl: float

    def pin(self, peer: int, namespace: str, key: str, ttl: float, consume: bool) -> dict: ...

    def pin_prefix(self, peer: int, namespace: str, keys: list, ttl: float) -> dict: ...

    def lookup(self, peer: int, namespace: str, key: str) -> dict | None: ...

    def release(self, peer: int, lease: int, consumed: bool) -> None: ...

    def renew(self, peer: int, lease: int, ttl: float) -> None: ...

    def drop_peer(self, peer: int) -> None: ...


class PeerServer:
    """Serves pins of this daemon's objects and its NIXL metadata to the configured peers,
    over mutual TLS (see the module doc)."""

    def __init__(
        self,
        provider: Provider,
        *,
        tls: ssl.SSLContext,
        peers: Iterable[str],
        node: str,
        metadata: bytes | None,
        agent: str | None,
        handshake_timeout: float = 5.0,
        max_handshakes: int = MAX_HANDSHAKES,
        max_handshakes_per_source: int = MAX_HANDSHAKES_PER_SOURCE,
    ) -> None:
        self.provider = provider
        self.node = node
        self._tls = tls
        self._peers = {identity(h) for h in peers}
        self._metadata = metadata
        self._agent = agent
        self._handshake_timeout = handshake_timeout
        self._max_handshakes = max_handshakes
        self._handshaking = 0
        self._max_per_source = max_handshakes_per_source
        self._handshaking_from: Counter[str] = Counter()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._ids = itertools.count(1)
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0
        self.served_pins = 0

    @property
    def peers(self) -> int:
        return len(self._conns)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        # Our own accept loop, not asyncio.start_server: a connection past the cap is
        # closed before any TLS work, and each admitted one gets its TLS server side from
        # connect_accepted_socket (StreamWriter.start_tls on an accepted stream loses the
        # ClientHello under uvloop, the daemon's loop, about one time in two).
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._listener.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        return self._listener.getsockname()[:2]

    async def close(self) -> None:
        """Stop listening, end every peer connection (their leases are dropped)."""
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self._listener)
            except OSError as e:  # EMFILE and the like: wait, as asyncio's server does
                log.warning("accepting a peer connection failed: %s", e)
                await asyncio.sleep(1.0)
                continue
            source = _source(addr[0])
            if (
                self._handshaking >= self._max_handshakes
                or self._handshaking_from[source] >= self._max_per_source
            ):
                self.refused += 1
                log.warning(
                    "peer connection from %s refused: %d TLS handshakes in progress (%d from it)",
                    addr[0],
                    self._handshaking,
                    self._handshaking_from[source],
                )
                conn.close()
                continue
            self._handshaking += 1
            self._handshaking_from[source] += 1
            task = loop.create_task(self._serve(conn, addr, source))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket, addr, source: str) -> None:
        try:
            await self._serve_one(conn, addr, source)
        except asyncio.CancelledError:
            pass  # close(): the connection ends like any other

    def _handshake_ended(self, source: str) -> None:
        self._handshaking -= 1
        self._handshaking_from[source] -= 1
        if self._handshaking_from[source] <= 0:
            del self._handshaking_from[source]

    async def _serve_one(self, conn: socket.socket, peer_addr, source: str) -> None:
        loop = asyncio.get_running_loop()
        pid = None
        writer = None
        try:
            try:
                reader = asyncio.StreamReader()
                protocol = asyncio.StreamReaderProtocol(reader)
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol,
                    conn,
                    ssl=self._tls,
                    ssl_handshake_timeout=self._handshake_timeout,
                )
                writer = asyncio.StreamWriter(transport, protocol, reader, loop)
                who, node = await asyncio.wait_for(
                    self._identify(reader, writer, peer_addr), self._handshake_timeout
                )
            except BaseException:
                self.refused += 1  # not admitted: a failed handshake, a refused certificate
                raise
            finally:
                self._handshake_ended(source)
            if who is None:
                self.refused += 1
                return
            pid = next(self._ids)
            self._conns[pid] = writer
            log.info("peer %s (%s, %s) connected", node, who, peer_addr[0])
            hook = getattr(self.provider, "peer_connected", None)
            if hook is not None:
                hook(pid, node or who, f"{peer_addr[0]}:{peer_addr[1]}", who)
            frames = _Frames(reader, MAX_PEER_REQUEST)
            while True:
                try:
                    req = await frames.recv()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(_pack(self._handle(pid, req)))
                await writer.drain()
        except ssl.SSLError as e:
            log.info(
                "peer connection from %s refused: TLS: %s",
                peer_addr[0],
                getattr(e, "verify_message", None) or e.reason or e,
            )
        except (
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            ConnectionError,
            ProtocolError,
            OSError,
        ) as e:
            log.info("peer connection from %s ended: %r", peer_addr[0], e)
        finally:
            if pid is not None:
                self._conns.pop(pid, None)
                self.provider.drop_peer(pid)
            if writer is not None:
                writer.close()
            else:
                conn.close()

    async def _identify(self, reader, writer, peer_addr) -> tuple[str | None, str]:
        """After the TLS handshake (the peer's certificate verified against the CA), its
        identity: one of its certificate's names must be a configured peer's host. Returns
        that host (None when refused) and the node name the peer gave in its hello."""
        names = certificate_names(writer.get_extra_info("peercert"))
        who = next((n for n in names if n in self._peers), None)
        if who is None:
            log.warning(
                "peer connection from %s refused: its certificate names %s, none "
                "of [transfer] peers",
                peer_addr[0],
                names[:4],
            )
            writer.write(
                _pack(
                    {
                        "error": "forbidden",
                        "message": f"{self.node} refused a certificate naming "
                        f"{', '.join(names[:4]) or 'nothing'}: not one of its "
                        "[transfer] peers",
                    }
                )
            )
            await writer.drain()
            return None, ""
        hello = await _Frames(reader, 4096).recv()
        try:
            if not isinstance(hello, dict) or hello.get("op") != "hello":
                raise ProtocolError("the first peer frame must be a hello")
            args = check_args("peer hello", PEER_OPS["hello"], hello.get("args"), None)
            if args["proto"] != PEER_PROTOCOL:
                raise ProtocolError(f"peer speaks {args['proto']!r}, not {PEER_PROTOCOL}")
        except KVBrokerError as e:
            writer.write(_pack({"error": e.code, "message": e.message or str(e)}))
            await writer.drain()
            return None, ""
        writer.write(
            _pack(
                {
                    "ok": True,
                    "proto": PEER_PROTOCOL,
                    "node": self.node,
                    "agent": self._agent,
                    "metadata": self._metadata,
                }
            )
        )
        await writer.drain()
        return who, args["node"][:255]

    def _handle(self, pid: int, req: Any) -> dict:
        """One request, its arguments checked against the declared peer ops (their values
        by the provider, with the local ops' checks)."""
        try:
            if not isinstance(req, dict) or req.keys() - {"op", "args"}:
                raise ProtocolError("a peer request must be a map {op, args}")
            op = req.get("op")
            args = validate_peer_args(op, req.get("args"), self.provider)
            if op == "pin":
                out = self.provider.pin(
                    pid, args["namespace"], args["key"], args["ttl"], args["consume"]
                )
                self.served_pins += 1
                return {"ok": True, **out}
            if op == "pin_prefix":
                out = self.provider.pin_prefix(pid, args["namespace"], args["keys"], args["ttl"])
                self.served_pins += 1
                return {"ok": True, **out}
            if op == "lookup":
                return {
                    "ok": True,
                    "info": self.provider.lookup(pid, args["namespace"], args["key"]),
                }
            if op == "release":
                self.provider.release(pid, args["lease"], args["consumed"])
                return {"ok": True}
            self.provider.renew(pid, args["lease"], args["ttl"])  # the table has no other op
            return {"ok": True}
        except KVBrokerError as e:
            return {"error": e.code, "message": e.message or str(e)}


class PeerClient:
    """A pulling daemon's connection to one peer's :class:`PeerServer` (asyncio, mutual
    TLS: the peer's certificate must be signed by our CA and name the host we connect
    to)."""

    def __init__(
        self,
        address: str,
        *,
        tls: ssl.SSLContext,
        node: str,
        connect_timeout: float = 5.0,
        request_timeout: float = 30.0,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.node = node
        self._tls = tls
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._frames: _Frames | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self.peer_node: str | None = None
        self.agent: str | None = None
        self.metadata: bytes | None = None

    async def connect(self) -> PeerClient:
        try:
            reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(
                    self.host,
                    self.port,
                    ssl=self._tls,
                    server_hostname=self.host,
                    ssl_handshake_timeout=self._connect_timeout,
                ),
                self._connect_timeout,
            )
            self._frames = _Frames(reader, MAX_PEER_REPLY)
            self._writer.write(
                _pack({"op": "hello", "args": {"proto": PEER_PROTOCOL, "node": self.node}})
            )
            await self._writer.drain()
            reply = await asyncio.wait_for(self._frames.recv(), self._connect_timeout)
            if not isinstance(reply, dict):
                raise ProtocolError("bad peer hello")
            if "error" in reply:
                raise PeerUnavailable(f"peer {self.address} refused: {reply.get('message')}")
            if reply.get("proto") != PEER_PROTOCOL:
                raise PeerUnavailable(f"peer {self.address} does not speak {PEER_PROTOCOL}")
        except PeerUnavailable:
            await self.close()
            raise
        except ssl.SSLCertVerificationError as e:
            await self.close()
            raise PeerUnavailable(
                f"peer {self.address}: its certificate was refused ({e.verify_message})"
            ) from None
        except (ssl.SSLError, asyncio.IncompleteReadError, ConnectionResetError) as e:
            # TLS 1.3: a server that refuses our certificate does so after our side of the
            # handshake ended; we learn it as an alert, or as the connection closing.
            await self.close()
            why = getattr(e, "reason", None) or "closed before its hello"
            raise PeerUnavailable(
                f"peer {self.address} refused the TLS session (not our "
                f"CA's certificate, or not one of its peers?): {why}"
            ) from None
        except (OSError, asyncio.TimeoutError, ProtocolError, ValueError) as e:
            await self.close()
            raise PeerUnavailable(
                f"peer {self.address} unavailable: {type(e).__name__}: {e}"
            ) from e
        self.peer_node = str(reply.get("node"))[:255]
        agent, metadata = reply.get("agent"), reply.get("metadata")
        self.agent = agent if isinstance(agent, str) else None
        self.metadata = metadata if isinstance(metadata, bytes) else None
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
                reply = await asyncio.wait_for(self._frames.recv(), self._request_timeout)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ProtocolError) as e:
                await self.close()
                raise PeerUnavailable(
                    f"peer {self.address} ({self.peer_node}) went away: {type(e).__name__}: {e}"
                ) from e
        if not isinstance(reply, dict):
            await self.close()
            raise PeerUnavailable(f"peer {self.address} answered with a non-map")
        if "error" in reply:
            raise error_for_code(
                str(reply["error"]), f"peer {self.address}: {str(reply.get('message', ''))[:500]}"
            )
        return reply

    async def call(self, op: str, **args: Any) -> dict:
        return await self.request({"op": op, "args": args})

    async def pin(
        self, key: str, *, namespace: str = "default", ttl: float = 30.0, consume: bool = False
    ) -> dict:
        return await self.call("pin", namespace=namespace, key=key, ttl=ttl, consume=consume)

    async def pin_prefix(
        self, keys: list[str], *, namespace: str = "default", ttl: float = 30.0
    ) -> dict:
        return await self.call("pin_prefix", namespace=namespace, keys=keys, ttl=ttl)

    async def lookup(self, key: str, *, namespace: str = "default") -> dict | None:
        return (await self.call("lookup", namespace=namespace, key=key)).get("info")

    async def release(self, lease: int, *, consumed: bool = False) -> None:
        await self.call("release", lease=lease, consumed=consumed)

    async def renew(self, lease: int, ttl: float = 30.0) -> None:
        await self.call("renew", lease=lease, ttl=ttl)

    async def close(self) -> None:
        w, self._writer = self._writer, None
        if w is not None:
            w.close()
            try:
                await asyncio.wait_for(w.wait_closed(), 5)
            except (OSError, ConnectionError, asyncio.TimeoutError):
                pass
