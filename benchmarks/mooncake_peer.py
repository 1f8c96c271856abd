#!/usr/bin/env python3
"""Mooncake Store's side of ``kvbroker bench peer``: put+get times in kvbroker's own pattern.

Run it with the Python that has Mooncake (``pip install mooncake-transfer-engine-non-cuda``;
the set-up is in docs/operating.md, "Comparing with Mooncake"). Standard library only: kvbroker is
not installed there. ``kvbroker bench peer --mooncake-python PYTHON`` runs it, then kvbroker's
``transfer`` scenario on the same sizes, and compares the medians.

What it does:

- starts a private ``mooncake_master`` on 127.0.0.1 (free ports; ``P2PHANDSHAKE`` metadata, so
  no etcd nor HTTP metadata server) and, for the ``dummy`` and ``tcp`` modes, one
  ``mooncake_client``: Mooncake's "real client", the daemon that owns the memory segment;
- runs each mode in a fresh worker process (this file with ``--worker``), through
  ``mooncake.store.MooncakeDistributedStore``:

  ``dummy``     ``setup_dummy()``: the worker talks RPC to the real client and the bytes move
                through shared memory; the design closest to kvbroker's;
  ``embedded``  ``setup()`` with the segment inside the worker (put and get in one process);
  ``tcp``       ``setup()`` without a segment of its own: the bytes cross TCP loopback to the
                real client;

- per size, the loop of kvbroker's ``transfer`` scenario: 3 untimed warm-up round trips, then
  ``--ops`` times: a memcpy of the source into the destination (timed on its own, as kvbroker
  does), ``put_from(key)``, ``get_into(key)`` (each timed), the bytes checked against the
  source, the key removed (untimed; ``force``, because a read leaves a lease on the object).
  Zero-copy API, on registered buffers; every key's bytes differ (a stamp), so a get that
  returned another object's bytes, or nothing, is caught. Before timing, the segment is
  written once (untimed), so no timed put pays the first touch of its pages;
- stops what it started (by process id; they also get SIGTERM should this process die) and
  writes JSON.

Output (``--json-out``), what ``kvbroker/_bench/peer.py`` reads: a list with one entry per
mode, ``{"mode", "setup_s", "mooncake", "sizes": [{"size", "put": STATS, "get": STATS,
"memcpy": STATS, "data_ok", "errors"}]}``, STATS being ``{"n", "median_ms", "p90_ms",
"p99_ms", "GBps_at_median"}``, ``data_ok`` whether every get returned the bytes put, and
``errors`` what went wrong (the figures of a size with errors are incomplete). A mode that
failed is ``{"mode", "error"}``. The exit status is 1 when any mode or size had an error.
GB/s use 10^9 bytes.

The wheel links libibverbs even without RDMA hardware: where ``import mooncake.store`` fails
for libibverbs.so.1, unpack the Debian packages libibverbs1, libnl-3-200 and
libnl-route-3-200 (docs/operating.md) and put their library folders on ``LD_LIBRARY_PATH``, or name the
unpacked tree with ``--deb-root``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import json
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported by file path
from latency_stats import stats  # benchmarks/latency_stats.py, beside this file

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MODES = ("dummy", "embedded", "tcp")
WARMUP = 3
RESULT_TAG = "MOONCAKE_PEER_RESULT "  # the worker's result line on its stdout
DISTRIBUTIONS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
LIB_HINT = (
    "Mooncake's wheel needs libibverbs.so.1, libnl-3 and libnl-route-3: apt-get download "
    "libibverbs1 libnl-3-200 libnl-route-3-200, dpkg -x each into one folder, and pass it as "
    "--deb-root or put its usr/lib/<arch> and lib/<arch> folders on LD_LIBRARY_PATH "
    "(docs/operating.md, 'Comparing with Mooncake')"
)


def with_hint(message: str) -> str:
    """``message``, with what to unpack where it is about the libraries the wheel lacks."""
    return f"{message}. {LIB_HINT}" if "libibverbs" in message or "libnl" in message else message


# ------------------------------------------------------------------------------ measuring


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None)


def _remove(store, key):
    """Remove ``key`` even while a read lease holds it; the status."""
    try:
        return store.remove(key, True)
    except TypeError:  # a binding without the force argument
        return store.remove(key)


def _stamp(addr, size, value):
    """Write ``value`` into the first and the last 8 bytes of [addr, addr + size)."""
    v = ctypes.c_uint64(value)
    ctypes.memmove(addr, ctypes.byref(v), 8)
    ctypes.memmove(addr + size - 8, ctypes.byref(v), 8)


def prefault(store, src, chunk, segment, tag, patience=15.0):
    """Write about 80 % of the segment once, untimed, then remove it: the timed puts land on
    pages already touched. Retries the first put while the segment is still being mounted
    (a real client that has just started). Returns the seconds it took."""
    t0 = time.perf_counter()
    keys, end = [], time.monotonic() + patience
    while len(keys) * chunk < 0.8 * segment:
        key = f"{tag}-prefault-{len(keys)}"
        rc = store.put_from(key, src, chunk)
        if rc != 0:
            if keys or time.monotonic() > end:
                break  # full (or never ready: the timed loop reports the put's status)
            time.sleep(0.2)
            continue
        keys.append(key)
    for key in keys:
        _remove(store, key)
    return time.perf_counter() - t0


def measure(store, src, dst, sizes, ops, deadline=None, warmup=WARMUP, tag="peer"):
    """kvbroker's ``transfer`` loop on a set-up store; one entry per size.

    ``src`` and ``dst`` are addresses of registered buffers of at least ``max(sizes)`` bytes;
    ``src`` holds the payload. Each round trip stamps its own index into the source, copies
    the source into the destination (timed: the memcpy that kvbroker's side times in the same
    loop), spoils the destination's stamps, puts, gets, compares the whole destination with
    the source and removes the key."""
    memcmp = _libc().memcmp
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    out = []
    for size in sizes:
        if size < 16:
            raise ValueError(f"sizes below 16 bytes cannot carry the stamps: {size}")
        cp, put, get, errors = [], [], [], []
        data_ok = True
        for i in range(warmup + ops):
            if deadline is not None and time.time() > deadline:
                errors.append(f"time budget spent after {max(0, i - warmup)} timed round trips")
                break
            key = f"{tag}-{size}-{i}"
            _stamp(src, size, (size << 20) + i)
            t0 = time.perf_counter()
            ctypes.memmove(dst, src, size)
            t1 = time.perf_counter()
            _stamp(dst, size, 0xFFFFFFFFFFFFFFFF)
            t2 = time.perf_counter()
            rc = store.put_from(key, src, size)
            t3 = time.perf_counter()
            if rc != 0:
                errors.append(f"put_from {key} returned {rc}")
                break
            got = store.get_into(key, dst, size)
            t4 = time.perf_counter()
            if got != size:
                errors.append(f"get_into {key} returned {got}, not {size}")
                _remove(store, key)
                break
            if memcmp(dst, src, size) != 0:
                data_ok = False
                errors.append(f"get_into {key}: bytes differ from what was put")
            rc = _remove(store, key)
            if rc != 0:
                errors.append(f"remove {key} returned {rc}")
            if i >= warmup:
                cp.append(t1 - t0)
                put.append(t3 - t2)
                get.append(t4 - t3)
        out.append(
            {
                "size": size,
                "put": stats(put, size),
                "get": stats(get, size),
                "memcpy": stats(cp, size),
                "data_ok": data_ok,
                "errors": errors[:5],
            }
        )
    return out


# -------------------------------------------------------------------------------- worker
def mooncake_version():
    try:
        from importlib import metadata
    except ImportError:  # Python 3.7
        return None
    for dist in DISTRIBUTIONS:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


class Buffers:
    """Two registered buffers of ``size`` bytes: from the store's shared pool for a dummy
    client (the real client must see them), else anonymous memory of this process."""

    def __init__(self, store, mode, size):
        self.store, self.size, self._maps = store, size, []
        if mode == "dummy":
            self.addrs = [store.alloc_from_mem_pool(size) for _ in range(2)]
            if not all(self.addrs):
                raise RuntimeError(f"alloc_from_mem_pool({size}) returned 0")
        else:
            self._maps = [mmap.mmap(-1, size) for _ in range(2)]
            self.addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in self._maps]
        self.registered = []
        for addr in self.addrs:
            rc = store.register_buffer(addr, size)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
            self.registered.append(addr)

    def close(self):
        for addr in self.registered:
            self.store.unregister_buffer(addr)
        self.registered = []


def worker(a) -> int:
    sizes = a.sizes
    result = {"mode": a.worker, "mooncake": mooncake_version()}
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        result["error"] = with_hint(f"import mooncake.store failed: {exc}")
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 1
    store = MooncakeDistributedStore()
    biggest = max(sizes)
    t0 = time.perf_counter()
    if a.worker == "dummy":  # the pool holds this worker's two buffers
        rc = store.setup_dummy(2 * biggest + 64 * MiB, 64 * MiB, a.client)
    else:
        segment = a.segment if a.worker == "embedded" else 0
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 64 * MiB, "tcp", "", a.master)
    result["setup_s"] = time.perf_counter() - t0
    if rc != 0:
        result["error"] = f"{'setup_dummy' if a.worker == 'dummy' else 'setup'} returned {rc}"
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 1
    bufs = None
    try:
        bufs = Buffers(store, a.worker, biggest)
        src, dst = bufs.addrs
        ctypes.memmove(src, os.urandom(biggest), biggest)
        tag = f"{a.worker}-{os.getpid()}"
        if a.prefault:
            result["prefault_s"] = prefault(store, src, biggest, a.segment, tag)
        result["sizes"] = measure(store, src, dst, sizes, a.ops, a.deadline, a.warmup, tag)
    except Exception as exc:  # noqa: BLE001 - reported as this mode's error
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if bufs is not None:
            bufs.close()
        store.close()
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


# -------------------------------------------------------------------------- orchestrator
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent():  # runs in the child between fork and exec (Linux)
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Process:
    """A child started by this driver, its output in a log file; stopped by its own id."""

    def __init__(self, name, argv, log_path, env):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open while the child runs
        # preexec_fn: this process starts its children from its only thread
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=_die_with_parent,
        )  # noqa: PLW1509

    def wait_listening(self, port, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(
            f"{self.name} did not listen on port {port} in {timeout:.0f} s: {self.tail()}"
        )

    def tail(self, n=600):
        self._log.flush()
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace").strip()
        return text[-n:] if text else "(no output)"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


def library_env(deb_roots) -> dict:
    """This environment, with the library folders of each unpacked Debian tree first on
    LD_LIBRARY_PATH."""
    env = dict(os.environ)
    dirs = []
    for root in deb_roots:
        for sub in ("usr/lib", "lib"):
            base = os.path.join(root, sub)
            if os.path.isdir(base):
                dirs += sorted(
                    os.path.join(base, d) for d in os.listdir(base) if d.endswith("-linux-gnu")
                )
                dirs.append(base)
    if dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            dirs + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
        )
    return env


def mooncake_binary(name) -> str:
    spec = importlib.util.find_spec("mooncake")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = os.path.join(folder, name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name, path=os.path.dirname(sys.executable))
    if found:
        return found
    raise RuntimeError(
        f"{name} not found in the mooncake package ({folders}) nor beside {sys.executable}"
    )


def run_worker(mode, a, master, client, deadline, env) -> dict:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--master",
        master,
        "--client",
        client,
        "--sizes",
        ",".join(map(str, a.sizes)),
        "--ops",
        str(a.ops),
        "--deadline",
        str(deadline - 2),
        "--segment",
        str(a.segment),
        "--prefault",
        str(a.prefault),
        "--warmup",
        str(a.warmup),
    ]
    log_path = os.path.join(a.workdir, f"worker-{mode}.log")
    with open(log_path, "wb") as log:
        try:
            p = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                timeout=max(5.0, deadline - time.time()),
                preexec_fn=_die_with_parent,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"mode": mode, "error": "worker ran past the time budget"}
    for line in reversed(p.stdout.decode(errors="replace").splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    with open(log_path, "rb") as f:
        tail = f.read().decode(errors="replace").strip()[-600:]
    return {"mode": mode, "error": f"worker exited with {p.returncode}: {tail}"}


def fmt_size(n) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n // KiB} KiB" if n >= KiB and n % KiB == 0 else f"{n} B"


def table(results) -> str:
    header = (
        f"{'mode':9} {'size':>8} {'put ms':>9} {'get ms':>9} {'put+get ms':>11} "
        f"{'GB/s':>7} {'memcpy ms':>10}  check"
    )
    lines = [header]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:9} error: {r['error']}")
            continue
        for z in r["sizes"]:
            if not z["put"] or not z["get"]:
                lines.append(f"{r['mode']:9} {fmt_size(z['size']):>8} -- {z['errors']}")
                continue
            rt = z["put"]["median_ms"] + z["get"]["median_ms"]
            lines.append(
                f"{r['mode']:9} {fmt_size(z['size']):>8} {z['put']['median_ms']:9.3f} "
                f"{z['get']['median_ms']:9.3f} {rt:11.3f} "
                f"{2 * z['size'] / rt / 1e6:7.2f} {z['memcpy']['median_ms']:10.3f}  "
                f"{'ok' if z['data_ok'] else 'BAD'} {'; '.join(z['errors'])}"
            )
    return "\n".join(lines)


def run_mode(mode, a, deadline, env) -> dict:
    """One mode on a Mooncake of its own: a fresh master and, for ``dummy`` and ``tcp``, a
    fresh real client (with a real client beside it, the master would place some of
    ``embedded``'s objects in that client's segment, over TCP); all stopped afterwards."""
    rpc_port, metrics_port, client_port = free_port(), free_port(), free_port()
    master_addr, client_addr = f"127.0.0.1:{rpc_port}", f"127.0.0.1:{client_port}"
    started = []
    try:
        master = Process(
            "mooncake_master",
            [
                mooncake_binary("mooncake_master"),
                "--rpc_address=127.0.0.1",
                f"--rpc_port={rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={metrics_port}",
                "--enable_http_metadata_server=false",
                "--enable_metric_reporting=false",
            ],
            os.path.join(a.workdir, f"master-{mode}.log"),
            env,
        )
        started.append(master)
        master.wait_listening(rpc_port, 20)
        print(
            f"[mooncake_peer] {mode}: mooncake_master pid {master.proc.pid} on {master_addr}",
            flush=True,
        )
        if mode in ("dummy", "tcp"):
            client = Process(
                "mooncake_client",
                [
                    mooncake_binary("mooncake_client"),
                    "--host=127.0.0.1",
                    f"--port={client_port}",
                    f"--global_segment_size={a.segment}",
                    f"--master_server_address={master_addr}",
                    "--metadata_server=P2PHANDSHAKE",
                    "--protocol=tcp",
                ],
                os.path.join(a.workdir, f"client-{mode}.log"),
                env,
            )
            started.append(client)
            client.wait_listening(client_port, 20)
            print(
                f"[mooncake_peer] {mode}: mooncake_client pid {client.proc.pid} on {client_addr}",
                flush=True,
            )
        return run_worker(mode, a, master_addr, client_addr, deadline, env)
    except RuntimeError as exc:
        return {"mode": mode, "error": with_hint(f"{exc} (logs in {a.workdir})")}
    finally:
        for p in reversed(started):
            p.stop()


def orchestrate(a) -> int:
    start = time.time()
    deadline = start + a.budget
    if importlib.util.find_spec("mooncake") is None:
        print(
            f"mooncake_peer: Mooncake is not installed for {sys.executable}: pip install "
            "mooncake-transfer-engine-non-cuda (docs/operating.md, 'Comparing with Mooncake')",
            file=sys.stderr,
        )
        return 1
    os.makedirs(a.workdir, exist_ok=True)
    env = library_env(a.deb_root)
    # the libraries first, once, before anything is started
    p = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        print(
            f"mooncake_peer: {with_hint(f'import mooncake.store failed: {why}')}", file=sys.stderr
        )
        return 1
    results = []
    for mode in a.modes:
        if deadline - time.time() < 5:
            r = {"mode": mode, "error": "time budget spent before this mode"}
        else:
            r = run_mode(mode, a, deadline, env)
        results.append(r)
        if "error" in r:
            print(f"[mooncake_peer] {mode}: {r['error']}", file=sys.stderr, flush=True)
    print(table(results))
    print(f"[mooncake_peer] {time.time() - start:.1f} s; logs in {a.workdir}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        print(f"[mooncake_peer] wrote {a.json_out}")
    failed = any("error" in r or any(z["errors"] for z in r["sizes"]) for r in results)
    return 1 if failed else 0


def _sizes(text):
    out = [int(float(s)) for s in text.split(",") if s.strip()]
    if not out or min(out) < 16:
        raise argparse.ArgumentTypeError("sizes in bytes, 16 or more, e.g. 262144,33554432")
    return out


def _modes(text):
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = set(out) - set(MODES)
    if not out or bad:
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}; got {text!r}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--modes",
        type=_modes,
        default=["dummy", "embedded"],
        help=f"comma-separated, of {', '.join(MODES)} (default dummy,embedded)",
    )
    ap.add_argument(
        "--sizes",
        type=_sizes,
        default=[256 * KiB, 4 * MiB, 32 * MiB],
        help="object sizes in bytes, comma-separated",
    )
    ap.add_argument("--ops", type=int, default=50, help="timed round trips per size")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed round trips first")
    ap.add_argument(
        "--segment",
        type=int,
        default=GiB,
        help="bytes of the segment that holds the objects (default 1 GiB)",
    )
    ap.add_argument(
        "--prefault",
        type=int,
        choices=(0, 1),
        default=1,
        help="1: write the segment once, untimed, before timing (default)",
    )
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for everything")
    ap.add_argument(
        "--workdir",
        help="logs of the master, the client and the workers "
        "(default: a new folder under the temporary directory)",
    )
    ap.add_argument(
        "--deb-root",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder where libibverbs1, libnl-3-200 and libnl-route-3-200 were "
        "unpacked (dpkg -x); its library folders go on LD_LIBRARY_PATH",
    )
    ap.add_argument("--json-out", metavar="FILE", help="write the results here")
    # the worker's own arguments (the orchestrator passes them)
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.ops < 1:
        ap.error("--ops must be 1 or more")
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="mooncake-peer-")
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
