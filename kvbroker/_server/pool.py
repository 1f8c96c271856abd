"""Host shared-memory pools, created and owned by the daemon (clients map them:
:mod:`kvbroker._client.mappings`).

The daemon creates one POSIX shared-memory segment per pool (posix_ipc), mode 0600 (0660
with a group), and reserves its pages with ``posix_fallocate`` so the segment is backed
before any client touches it: a /dev/shm too small fails at start with a clear message
instead of a SIGBUS in some engine later. The daemon itself never maps the KV bytes.

A client maps each pool once per process (:class:`PoolMapping`) with ``MAP_POPULATE`` so the
first transfers do not pay a page fault per 4 KiB page.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil

import posix_ipc

from .allocator import ExtentAllocator
from .._wire.paths import format_size
from ..errors import KVBrokerError

__all__ = ["HostPool", "open_segment", "pools_summary", "segment_prefix", "unlink_segment"]

log = logging.getLogger("kvbroker.daemon")


def segment_prefix(pid: int | None = None) -> str:
    """Name prefix of this daemon instance's segments: unique per instance."""
    return f"/kvbroker.{pid or os.getpid()}.{secrets.token_hex(4)}"


class HostPool:
    """One shared-memory segment carved into pages, owned by the daemon."""

    def __init__(
        self,
        index: int,
        name: str,
        size: int,
        page_size: int,
        *,
        mode: int = 0o600,
        gid: int | None = None,
        uid: int | None = None,
        tenant: object = None,
    ) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise KVBrokerError(f"page size must be a power of two, got {page_size}")
        if size < page_size:
            raise KVBrokerError(
                f"pool size {format_size(size)} is smaller than one page ({format_size(page_size)})"
            )
        size -= size % page_size
        self.index = index
        self.name = name
        self.size = size
        self.page_size = page_size
        self._shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=0)
        try:
            os.fchmod(self._shm.fd, mode)  # posix_ipc's mode is filtered by the umask
            if gid is not None or uid is not None:
                os.fchown(self._shm.fd, -1 if uid is None else uid, -1 if gid is None else gid)
            os.ftruncate(self._shm.fd, size)
            try:
                os.posix_fallocate(self._shm.fd, 0, size)
            except OSError as exc:
                free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
                raise KVBrokerError(
                    f"cannot reserve {format_size(size)} of shared memory for pool {index} "
                    f"({exc.strerror}); /dev/shm has {format_size(free)} free: "
                    "use a smaller --pool-size or enlarge /dev/shm"
                ) from exc
        except BaseException:
            self._shm.close_fd()
            unlink_segment(name)  # fchown may have made it a tenant's already
            raise
        self._shm.close_fd()
        self.allocator = ExtentAllocator(size // page_size)
        self.lost: str | None = None  # why the segment is unusable (check), once it is
        self.tenant = tenant  # a policy.TenantPool: only its tenant can map it

    def check(self) -> str | None:
        """Why the segment is no longer what the daemon made (gone, resized), or None. One
        stat(2) of /dev/shm: cheap enough to run every few seconds."""
        try:
            st = os.stat("/dev/shm" + self.name)
        except FileNotFoundError:
            return f"shared memory {self.name} of pool {self.index} is gone (unlinked)"
        except OSError as exc:
            return f"shared memory {self.name} of pool {self.index}: {exc.strerror}"
        if st.st_size != self.size:
            return (
                f"shared memory {self.name} of pool {self.index} holds {st.st_size} bytes, "
                f"not {self.size} (truncated?)"
            )
        return None

    @classmethod
    def adopt(cls, index: int, name: str, size: int, page_size: int) -> HostPool:
        """Take over the segment a previous daemon of this socket created (warm restart).

        Its bytes are kept as they are; the caller rebuilds the allocator from its journal.
        Raises KVBrokerError when the segment is gone or its size is not ``size``.
        """
        try:  # stat, not open: a tenant's pool may be mapped by its tenant only
            actual = os.stat("/dev/shm" + name).st_size
        except FileNotFoundError:
            raise KVBrokerError(f"shared memory {name} of pool {index} is gone") from None
        if actual != size:
            raise KVBrokerError(
                f"shared memory {name} of pool {index} holds {format_size(actual)} ({actual} "
                f"bytes), not {format_size(size)} ({size} bytes)"
            )
        pool = cls.__new__(cls)
        pool.index, pool.name, pool.size, pool.page_size = index, name, size, page_size
        pool.allocator = ExtentAllocator(size // page_size)
        pool.lost = None
        pool.tenant = None
        return pool

    def rebuild(self, live: list[tuple[int, int]]) -> None:
        """Owns: exactly the ``live`` extents (start, npages), the rest free: an adopted
        pool's allocator rebuilt from what a restore keeps."""
        self.allocator = ExtentAllocator.with_live(self.allocator.capacity, live)

    def describe(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "size": self.size,
            "page_size": self.page_size,
        }

    def unlink(self) -> None:
        try:
            unlink_segment(self.name)
        except (OSError, posix_ipc.Error) as exc:
            log.warning(
                "cannot remove shared memory %s of pool %d (%s): it stays in /dev/shm "
                "until removed by hand or the machine restarts",
                self.name,
                self.index,
                exc,
            )


def pools_summary(pools: list[HostPool]) -> str:
    """The pools in a few words, for the start-up line: how many shared ones of what size,
    and each tenant pool's own size ("2 shared pool(s) of 4.0 MiB, tenant pools alice 8.0
    MiB, team-b 16.0 MiB")."""
    shared = [p for p in pools if p.tenant is None]
    tenants = [p for p in pools if p.tenant is not None]
    if not tenants:
        return f"{len(pools)} pool(s) of {format_size(pools[0].size)}"
    sizes = "/".join(format_size(n) for n in sorted({p.size for p in shared})) or "-"
    return f"{len(shared)} shared pool(s) of {sizes}, tenant pools " + ", ".join(
        f"{p.tenant.name} {format_size(p.size)}" for p in tenants
    )


def open_segment(name: str) -> posix_ipc.SharedMemory:
    """Open the segment ``name`` read-write, for the daemon's own mapping (transfers). A
    tenant pool owned by its tenant's user (0600) is not a non-root daemon's to open: it
    takes the segment back for the open and gives it back (CAP_CHOWN, which made it the
    tenant's); the descriptor, and a mapping of it, stay valid."""
    try:
        return posix_ipc.SharedMemory(name)
    except posix_ipc.PermissionsError:
        path = "/dev/shm" + name
        owner = os.stat(path).st_uid
        os.chown(path, os.geteuid(), -1)
        try:
            return posix_ipc.SharedMemory(name)
        finally:
            os.chown(path, owner, -1)


def unlink_segment(name: str) -> None:
    """Remove the segment ``name`` (one already gone: nothing to do). /dev/shm is sticky:
    only a file's owner may remove it, and a tenant pool belongs to its tenant's user; the
    daemon gives it back to itself first (CAP_CHOWN, which made it the tenant's)."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
    except posix_ipc.PermissionsError:
        try:
            os.chown("/dev/shm" + name, os.geteuid(), -1)
        except FileNotFoundError:
            return
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
