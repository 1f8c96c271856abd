"""``kvbroker doctor``'s checks of the data path's engines on this CPU: the checksum hash's
rate and build, the clients' host copy engine (C loops or Python), the daemon's prefix scan."""

from __future__ import annotations

import os
import time
from .config import DaemonConfig
from .doctor_check import Check


def check_checksum_hash(cfg: DaemonConfig) -> Check:
    """The hash under every host checksum (python-xxhash's xxh3_64, kvbroker._wire.checksum):
    its rate on one core here, and whether its build uses the CPU's AVX2 / AVX-512."""
    import xxhash

    from .._wire.checksum import CHUNK, chunk_digest, simd_dispatch

    name = "checksum hash"
    chunk = bytearray(CHUNK)
    chunk_digest(chunk)  # in cache from here on: the engine hashes a chunk right after its copy
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(4):
            chunk_digest(chunk)
        times.append((time.perf_counter() - start) / 4)
    rate = CHUNK / sorted(times)[2] / 1e9
    detail = f"python-xxhash {xxhash.VERSION}, xxh3 at {rate:.1f} GB/s on one core"
    dispatch = simd_dispatch()
    if dispatch is False:
        return Check(
            name,
            "warn",
            detail + ": built for SSE2 only, without the run-time choice of AVX2 / "
            "AVX-512 (2.7x slower on an H100 host's Xeon than a build with it)",
            "pip install -U 'xxhash>=4.1' where the clients and the daemon run",
        )
    return Check(name, "ok", detail + (", AVX2 / AVX-512 chosen at run time" if dispatch else ""))


def check_copy_engine(cfg: DaemonConfig) -> Check:
    """Whether the clients' host copy engine runs its C loops here (kvbroker._client.engine):
    without them a checksummed copy over several threads hands the GIL over twice per MiB."""
    name = "copy engine"
    try:
        from .._copyhash import STREAM_STORES
    except ImportError:
        return Check(
            name,
            "warn",
            "Python loops: the optional C extension kvbroker._copyhash was not built "
            "when kvbroker was installed (no C compiler or Python headers); "
            "checksummed copies over several threads are slower",
            "install gcc and the Python headers (python3-dev), then reinstall kvbroker",
        )
    if os.environ.get("KVBROKER_NATIVE_COPY", "1") == "0":
        return Check(
            name,
            "warn",
            "Python loops: KVBROKER_NATIVE_COPY=0 turns the C loops off",
            "unset KVBROKER_NATIVE_COPY",
        )
    # as the clients' engine binds it (the daemon never imports the client's modules)
    import xxhash
    from xxhash import _xxhash

    from .._copyhash import bind_hash, fused_state

    try:
        bind_hash(_xxhash.__file__)
    except OSError as exc:
        return Check(
            name,
            "warn",
            f"C loops cannot use python-xxhash's library ({exc}): Python loops",
            "reinstall xxhash (python-xxhash 4.1 or later)",
        )
    from .._copyhash import copy_hashed, hash_chunks

    # as the clients' engine checks them at import (kvbroker._client.engine): wrong digests
    # make every client fall back to the Python loops
    probe = bytes(range(251)) * 40
    want = [xxhash.xxh3_64_intdigest(probe[at : at + 1000]) for at in range(0, len(probe), 1000)]
    if hash_chunks(probe, 1000) != want or copy_hashed(bytearray(len(probe)), probe, 1000) != want:
        return Check(
            name,
            "warn",
            "Python loops: the C loops' digests are not xxhash's "
            "xxh3_64 (a broken build of csrc/copyhash.c), so the clients do not use "
            "them",
            "rebuild kvbroker (pip install --force-reinstall) and report the "
            "compiler and CPU (`lscpu`) to kvbroker",
        )
    stores = (
        "copies of half the last-level cache (16 MiB at least) or more store non-temporally"
        if STREAM_STORES
        else "no streaming stores on this architecture"
    )
    state = fused_state()
    if state == "digests differ":  # the one-pass loop is wrong on this CPU: it stays off
        return Check(
            name,
            "warn",
            "C loops, each chunk copied, then hashed: the one-pass "
            "copy+hash disagreed with xxHash's digests on this CPU when checked, so it "
            "is off (copies that hash read each chunk twice); " + stores,
            "report the CPU (`lscpu`) and python-xxhash's version to kvbroker",
        )
    passes = {
        "one pass": "each chunk copied and hashed in one pass (AVX2)",
        "no AVX2": "each chunk copied, then hashed (no AVX2 here: two passes)",
        "not built": "each chunk copied, then hashed (no one-pass loop for this "
        "architecture: two passes)",
    }.get(state, f"each chunk copied, then hashed (one-pass loop: {state})")
    return Check(
        name, "ok", f"C loops (csrc/copyhash.c), one GIL release per range; {passes}; " + stores
    )


def check_prefix_scan(cfg: DaemonConfig) -> Check:
    """Whether the daemon reads a prefix match's blocks in its C pass
    (kvbroker._server.prefix_leases): without it a match of 512 blocks takes about twice as
    long in the daemon."""
    name = "prefix scan"
    try:
        from .._prefixscan import lend_scan  # noqa: F401
    except ImportError:
        return Check(
            name,
            "warn",
            "Python passes: the optional C extension kvbroker._prefixscan was not "
            "built when kvbroker was installed (no C compiler or Python headers); "
            "prefix matches of many blocks are slower",
            "install gcc and the Python headers (python3-dev), then reinstall kvbroker",
        )
    return Check(name, "ok", "C pass (csrc/prefixscan.c), one read of each matched block")
