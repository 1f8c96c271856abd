"""Broker-to-broker transfer of sealed objects through NIXL (daemon side).

Two parts, both owned by a daemon:

- :class:`NixlEndpoint` — one NIXL agent (UCX backend; over TCP where there is no RDMA:
  ``UCX_TLS=tcp``). It registers the daemon's pools **once**; a peer that holds the agent's
  metadata can then READ any extent of them with no work on this side but UCX progress (the
  agent's progress thread). The pulling side reads a list of extents with **one** NIXL READ:
  :func:`coalesce` merges extents that are adjacent on both sides, and the whole list goes in
  one transfer request (:meth:`NixlEndpoint.read`). No byte crosses Python or the control
  channel.
- The control channel between brokers (mutual TLS; :mod:`kvbroker._server.peer_channel`,
  whose :class:`PeerServer`, :class:`PeerClient` and helpers this module re-exports):
  NIXL metadata in its hello, and ``pin``/``release``/``renew`` of objects.

``nixl`` is an optional extra (``pip install 'kvbroker[transfer]'``); it is imported only when
an endpoint is created.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..errors import PeerUnavailable, TransferFailed
from .peer_channel import (
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    PeerClient,
    PeerServer,
    Provider,
    certificate_names,
    identity,
    parse_address,
    tls_contexts,
)

__all__ = [
    "EXTRA",
    "MAX_HANDSHAKES",
    "MAX_HANDSHAKES_PER_SOURCE",
    "NixlEndpoint",
    "PeerClient",
    "PeerServer",
    "PeerUnavailable",
    "Provider",
    "ReadResult",
    "TransferFailed",
    "coalesce",
    "load_nixl",
    "certificate_names",
    "identity",
    "parse_address",
    "tls_contexts",
]

log = logging.getLogger("kvbroker.transfer")

EXTRA = "transfer"  # pip install 'kvbroker[transfer]'


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


def coalesce(
    remote: Sequence[tuple[int, int]], local: Sequence[tuple[int, int]]
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

    def __init__(
        self, name: str, *, backends: Sequence[str] = ("UCX",), progress_thread: bool = True
    ) -> None:
        self._api = api = load_nixl()
        conf = api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            enable_listen_thread=False,
            backends=list(backends),
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.name = name
        self.agent = api.nixl_agent(name, conf)
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise RuntimeError(
                f"NIXL backend(s) {missing} unavailable (plugins: {self.agent.plugin_list})"
            )
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

    def read(
        self,
        peer: str,
        remote: Sequence[tuple[int, int]],
        local: Sequence[tuple[int, int]],
        *,
        timeout: float = 30.0,
    ) -> ReadResult:
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
                        raise TransferFailed(
                            f"NIXL READ of {nbytes} bytes from {label} did "
                            f"not finish in {timeout:.1f}s"
                        )
                    spins += 1
                    if spins > 200:
                        time.sleep(0.0002 if spins < 2000 else 0.002)
                    state = self.agent.check_xfer_state(handle)
            except TransferFailed:
                raise
            except Exception as e:  # nixlRemoteDisconnectError & co. (the peer died)
                raise TransferFailed(
                    f"NIXL READ of {nbytes} bytes from {label} failed: {type(e).__name__}: {e}"
                ) from e
            if state != "DONE":
                raise TransferFailed(
                    f"NIXL READ of {nbytes} bytes from {label} failed (state {state})"
                )
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
