"""The attacks of issue 16, rerun against a real daemon: what they cost it now.

- ``dying_waiters``: ``--engines`` processes each hold a write arena and block in
  ``claim(wait=120)``; all are SIGKILLed; seconds until the daemon has let go of every
  connection, arena and byte they held;
- ``waits``: 2,000 connections, one after another, each blocking in ``claim(wait=600)`` on a
  distinct key and then closing (plus 400 held open at once): daemon RSS growth;
- ``unread``: 20 connections that pipeline ``stat`` and never read: daemon RSS growth (the
  defaults: 32M per connection, 256M for all together);
- ``regexes``: 600 distinct heavy regexes through ``list(match=...)``: RSS growth;
- ``fairness``: an honest client's ``lookup`` p50/p99 while another connection pipelines
  64 KiB batches of ``list`` (reading every reply), 3,800 objects in the daemon;
- ``journal``: ``--restarts`` warm restarts, each from a copy of one journal damaged a
  different way (truncated, 1 bit flipped, 8 bytes overwritten), over the same pools: how
  many served wrong bytes (every object's bytes name their key and version), hung, or were
  refused, and what each logged.

Usage: ``python benchmarks/attacks.py [--only NAME ...] [--restarts 60] [--out
benchmarks/results/attacks-cpu]`` (writes ``.json`` and ``.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvbroker._bench._common import measured_commit  # noqa: E402
from kvbroker._server.journal import journal_path  # noqa: E402
from kvbroker.errors import KVBrokerError, NotFound  # noqa: E402
from kvbroker.testing import DaemonProcess, drop_leftover_pools  # noqa: E402

HELLO = msgpack.packb({"id": 1, "op": "hello", "args": {"version": 1}})


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def wait_until(pred, timeout: float, step: float = 0.01) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(HELLO)
    s.settimeout(10)
    u = msgpack.Unpacker(raw=False)
    while True:
        u.feed(s.recv(65536))
        for _ in u:
            return s


class Daemon:
    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvb-attack-")
        self.path = os.path.join(self.dir, "s.sock")
        self.proc = DaemonProcess(self.path, *args, env=env)

    def __enter__(self) -> DaemonProcess:
        return self.proc

    def __exit__(self, *exc) -> None:
        self.proc.stop()
        drop_leftover_pools(self.path)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- 1. dying waiters -------------------------------------------------------------------------
ENGINE = """
import sys, time
from kvbroker import Client
c = Client(sys.argv[1], arena_size=4 << 20)
c.put("warm-" + sys.argv[2], {"x": b"1" * 1000})   # takes a write arena
print("ready", flush=True)
c.claim("never-" + sys.argv[2], wait=120)
"""


def dying_waiters(engines: int) -> dict:
    with Daemon("--pool-size", "256M", "--page-size", "64K") as d:
        with d.client() as c:
            base_used = c.stat().pools[0].used
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", ENGINE, d.socket_path, str(i)], stdout=subprocess.PIPE
                )
                for i in range(engines)
            ]
            for p in procs:
                p.stdout.readline()
            time.sleep(0.5)
            st = c.stat()
            held = {
                "clients": len(st.clients) - 1,
                "arenas": st.arenas,
                "used_mib": mib(st.pools[0].used),
            }
            t0 = time.monotonic()
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait()
            killed = time.monotonic() - t0

            def clean() -> bool:
                s = c.stat()
                objects = sum(1 for _ in c.list(match="^warm-"))
                used = s.pools[0].used - base_used
                return len(s.clients) == 1 and s.arenas == 0 and used <= objects * 65536

            took = wait_until(clean, 60)
    return {
        "engines": engines,
        "held_before_kill": held,
        "cleanup_seconds_after_last_kill": None if took is None else round(took, 3),
        "kill_seconds": round(killed, 3),
    }


# -- 2. waits, unread replies, regexes: memory ----------------------------------------------
def waits(n: int = 2000, held: int = 400) -> dict:
    with Daemon("--pool-size", "64M", "--page-size", "4K") as d:
        with d.client() as c:
            c.stat()
            before = rss(d.proc.pid)
            for i in range(n):
                s = raw(d.socket_path)
                s.sendall(
                    msgpack.packb(
                        {"id": 2, "op": "claim", "args": {"key": f"gone-{i}", "wait": 600}}
                    )
                )
                s.close()
            wait_until(lambda: len(c.stat().clients) == 1, 30)
            after_closed = rss(d.proc.pid)
            socks = []
            for i in range(held):
                s = raw(d.socket_path)
                s.sendall(
                    msgpack.packb(
                        {"id": 2, "op": "claim", "args": {"key": f"held-{i}", "wait": 600}}
                    )
                )
                socks.append(s)
            wait_until(lambda: len(c.stat().clients) == held + 1, 30)
            while_held = rss(d.proc.pid)
            for s in socks:
                s.close()
            wait_until(lambda: len(c.stat().clients) == 1, 30)
            after = rss(d.proc.pid)
    return {
        "closed_waiters": n,
        "rss_growth_mib_after_closed_waiters": mib(after_closed - before),
        "held_waiters": held,
        "rss_growth_mib_while_held": mib(while_held - before),
        "rss_growth_mib_after_all_closed": mib(after - before),
    }


def unread(n: int = 20) -> dict:
    with Daemon("--pool-size", "64M", "--page-size", "4K") as d:
        with d.client() as c:
            for i in range(50):
                c.put(f"k{i}", {"x": b"1"})
            before = rss(d.proc.pid)
            socks = []
            req = msgpack.packb({"id": 2, "op": "stat", "args": {}})
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(d.socket_path)
                s.setblocking(False)
                s.send(HELLO)
                socks.append(s)
            # Until the daemon has cut some off and its RSS has been flat for 5 s (or 120 s).
            t0 = time.monotonic()
            peak, flat_since = 0, time.monotonic()
            while time.monotonic() - t0 < 120:
                for s in socks:
                    try:
                        s.send(req * 500)
                    except (BlockingIOError, OSError):
                        pass
                now = rss(d.proc.pid)
                if now > peak + (1 << 20):
                    flat_since = time.monotonic()
                peak = max(peak, now)
                if time.monotonic() - flat_since > 5 and "disconnected:" in d.log():
                    break
                time.sleep(0.05)
            flooded = time.monotonic() - t0
            t0 = time.perf_counter()
            c.lookup("k1")
            lookup_ms = (time.perf_counter() - t0) * 1e3
            cut = d.log().count("disconnected:")
            for s in socks:
                s.close()
    return {
        "connections": n,
        "rss_peak_growth_mib": mib(peak - before),
        "flood_seconds": round(flooded, 1),
        "disconnected_by_daemon": cut,
        "honest_lookup_ms_after": round(lookup_ms, 2),
    }


def regexes(n: int = 600) -> dict:
    with Daemon("--pool-size", "64M", "--page-size", "4K") as d:
        with d.client() as c:
            for i in range(50):
                c.put(f"key-{i}-" + "ab" * 100, {"x": b"1"})
            before = rss(d.proc.pid)
            t0 = time.monotonic()
            for i in range(n):
                c.list(match=r"(\w{30}|[a-z]{20}\d{5}){8}" + f"x{{{i % 50 + 1}}}" + "y" * (i % 7))
            took = time.monotonic() - t0
            after = rss(d.proc.pid)
    return {"regexes": n, "rss_growth_mib": mib(after - before), "seconds": round(took, 2)}


# -- 3. fairness ------------------------------------------------------------------------------
HAMMER = """
import msgpack, socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(msgpack.packb({"id": 1, "op": "hello", "args": {"version": 1}}))
ns = None if sys.argv[2] == "-" else sys.argv[2]
req = msgpack.packb({"id": 9, "op": "list", "args": {"namespace": ns,
                                                     "limit": int(sys.argv[3])}})
def drain():
    while s.recv(1 << 22):
        pass
threading.Thread(target=drain, daemon=True).start()
batch = req * 3000
while True:
    s.sendall(batch)
"""


def percentiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {
        "p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
        "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3),
        "n": len(lat),
    }


def fairness(n: int = 2000) -> dict:
    out = {}
    with Daemon("--pool-size", "64M", "--page-size", "4K") as d:
        with d.client() as c:
            for i in range(3800):
                c.put(f"obj-{i}", {"x": b"1"}, namespace=f"tenant{i % 4}")
            c.put("mine", {"x": b"1"}, namespace="honest")

            def measure():
                lat = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    c.lookup("mine", namespace="honest")
                    lat.append(time.perf_counter() - t0)
                return percentiles(lat)

            out["quiet"] = measure()
            for label, ns, limit in (
                ("list_one_namespace_limit5", "tenant0", 5),
                ("list_one_namespace_limit50", "tenant0", 50),
                ("list_everything_3800_objects", "-", 10000),
            ):
                h = subprocess.Popen(
                    [sys.executable, "-c", HAMMER, d.socket_path, ns, str(limit)],
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)
                r = measure()
                r["hammer_still_connected"] = h.poll() is None
                h.kill()
                h.wait()
                out[label] = r
    return out


# -- 4. damaged journals ----------------------------------------------------------------------
def content(key: str, version: int, n: int) -> bytes:
    head = f"{key}:{version}:".encode()
    seed = int.from_bytes(hashlib.blake2b(head, digest_size=8).digest(), "little")
    body = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return (head + body)[: max(n, len(head))]


def consistent(key: str, data: bytes) -> bool:
    try:
        k, v, _ = data.split(b":", 2)
        return k.decode() == key and data == content(key, int(v), len(data))
    except ValueError:
        return False


def damage(data: bytes, rng) -> tuple[bytes, str]:
    mode = int(rng.integers(0, 3))
    buf = bytearray(data)
    if mode == 0:
        at = int(rng.integers(1, len(data)))
        return bytes(buf[:at]), f"truncated at byte {at} of {len(data)}"
    if mode == 1:
        at = int(rng.integers(0, len(data)))
        bit = int(rng.integers(0, 8))
        buf[at] ^= 1 << bit
        return bytes(buf), f"bit {bit} of byte {at} flipped"
    at = int(rng.integers(0, len(data) - 8))
    buf[at : at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
    return bytes(buf), f"8 bytes overwritten at byte {at}"


def journal(restarts: int, seed: int = 16) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvb-journal-")
    path = os.path.join(tmp, "s.sock")
    args = ("--pool-size", "2M", "--page-size", "4K")
    rng = np.random.default_rng(seed)
    keys = [f"k{i}" for i in range(40)]
    d = DaemonProcess(path, *args)
    with d.client(arena_size=0) as c:
        version = 0
        for step in range(500):
            key = keys[int(rng.integers(0, len(keys)))]
            if rng.integers(0, 8) == 0:
                c.evict(key=key)
                continue
            version += 1
            n = int(rng.integers(100, 60000))
            c.put(
                key, {"x": content(key, version, n)}, replace=True, checksum=bool(step % 2)
            )  # half sealed without checksums
        live = {o.key for o in c.list()}
    d.stop(signal.SIGKILL)
    jpath = journal_path(path)
    original = open(jpath, "rb").read()
    trials = []
    for _trial in range(restarts):
        data, how = damage(original, rng)
        with open(jpath, "wb") as f:
            f.write(data)
        start = len(open(d.log_path, "rb").read()) if os.path.exists(d.log_path) else 0
        t = {"damage": how}
        try:
            dd = DaemonProcess(path, *args, ready_timeout=30)
        except RuntimeError as exc:
            text = str(exc)
            t["outcome"] = "hung" if "not ready" in text else "refused"
            t["logged"] = [ln for ln in text.splitlines() if "ERROR" in ln or "WARNING" in ln][-3:]
            trials.append(t)
            continue
        wrong, kept, resurrected = [], 0, 0
        try:
            with dd.client(arena_size=0, timeout=30) as c:
                for key in keys:
                    try:
                        got = c.get(key)["x"].tobytes()
                    except NotFound:
                        continue
                    kept += 1
                    resurrected += key not in live
                    if not consistent(key, got):
                        wrong.append(key)
            t["outcome"] = "wrong bytes" if wrong else "ok"
        except KVBrokerError as exc:
            t["outcome"] = f"hung or failed: {type(exc).__name__}: {exc}"
        t.update(
            {"kept": kept, "live_before": len(live), "resurrected": resurrected, "wrong": wrong}
        )
        log = dd.log()
        t["logged"] = [
            ln.split(": ", 1)[-1][:400]
            for ln in log.splitlines()
            if ("WARNING" in ln or "ERROR" in ln) and "journal" in ln.lower() or "torn record" in ln
        ][-3:]
        dd.stop(signal.SIGKILL)  # keep the pools as they are for the next trial
        trials.append(t)
        del start
    drop_leftover_pools(path)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {
        "restarts": len(trials),
        "served_wrong_bytes": sum(t["outcome"] == "wrong bytes" for t in trials),
        "hung": sum(t["outcome"].startswith("hung") for t in trials),
        "refused": sum(t["outcome"] == "refused" for t in trials),
        "objects_live_before": len(live),
        "objects_kept_mean": round(float(np.mean([t.get("kept", 0) for t in trials])), 1),
        "resurrected_total": sum(t.get("resurrected", 0) for t in trials),
    }
    return {"summary": summary, "trials": trials}


ATTACKS = ("dying_waiters", "waits", "unread", "regexes", "fairness", "journal")


def machine() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def markdown(res: dict) -> str:
    lines = [
        f"# Issue 16 attacks, rerun (commit {res['commit']})",
        "",
        f"`{res['command']}` on {res['machine']['cpus']} CPUs ({res['machine']['cpu']}), "
        f"load average at start {res['machine']['load_avg_at_start']}",
        "",
    ]
    r = res["results"]
    if "dying_waiters" in r:
        x = r["dying_waiters"]
        lines.append(
            f"- **Dying waiters**: {x['engines']} engines holding "
            f"{x['held_before_kill']} SIGKILLed inside claim(wait=120): everything "
            f"freed {x['cleanup_seconds_after_last_kill']} s after the last kill."
        )
    if "waits" in r:
        x = r["waits"]
        lines.append(
            f"- **Waits**: {x['closed_waiters']} connections each dying in "
            f"claim(wait=600) on a distinct key: RSS +{x['rss_growth_mib_after_closed_waiters']} "
            f"MiB; {x['held_waiters']} held at once: +{x['rss_growth_mib_while_held']} MiB, "
            f"+{x['rss_growth_mib_after_all_closed']} MiB once closed."
        )
    if "unread" in r:
        x = r["unread"]
        lines.append(
            f"- **Unread replies**: {x['connections']} connections pipelining stat, "
            f"never reading, for {x.get('flood_seconds')} s: peak RSS "
            f"+{x['rss_peak_growth_mib']} MiB, "
            f"{x['disconnected_by_daemon']} disconnected by the daemon."
        )
    if "regexes" in r:
        x = r["regexes"]
        lines.append(
            f"- **Regexes**: {x['regexes']} distinct heavy patterns: RSS "
            f"+{x['rss_growth_mib']} MiB ({x['seconds']} s)."
        )
    if "fairness" in r:
        x = r["fairness"]
        for k, v in x.items():
            extra = (
                f", pipelining client still connected: {v['hammer_still_connected']}"
                if "hammer_still_connected" in v
                else ""
            )
            lines.append(
                f"- **Honest lookup, {k}**: p50 {v['p50_ms']} ms, p99 {v['p99_ms']} ms "
                f"({v['n']} lookups{extra})"
            )
    if "journal" in r:
        s = r["journal"]["summary"]
        lines += [
            f"- **Damaged journals**: {s['restarts']} restarts: served wrong bytes "
            f"{s['served_wrong_bytes']}, hung {s['hung']}, refused {s['refused']}; "
            f"{s['objects_live_before']} objects live before, {s['objects_kept_mean']} "
            f"kept on average, {s['resurrected_total']} resurrected in all (correct "
            "bytes).",
            "",
            "| damage | outcome | kept | logged |",
            "|---|---|---|---|",
        ]
        for t in r["journal"]["trials"]:
            logged = " / ".join(t.get("logged", [])).replace("|", "\\|")
            lines.append(f"| {t['damage']} | {t['outcome']} | {t.get('kept', '')} | {logged} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=ATTACKS, default=list(ATTACKS))
    ap.add_argument("--restarts", type=int, default=60)
    ap.add_argument("--engines", type=int, default=50)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "attacks-cpu")
    )
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    res = {
        "commit": measured_commit(),
        "machine": machine(),
        "command": "python benchmarks/attacks.py " + " ".join(sys.argv[1:]),
        "results": {},
    }
    if set(a.only) != set(ATTACKS) and os.path.exists(a.out + ".json"):  # update those rerun
        with open(a.out + ".json") as f:
            old = json.load(f)
        res["results"] = old.get("results", {})
        res["command"] = old.get("command", "") + "; then " + res["command"]
    for name in a.only:
        t0 = time.monotonic()
        if name == "dying_waiters":
            out = dying_waiters(a.engines)
        elif name == "journal":
            out = journal(a.restarts)
        else:
            out = globals()[name]()
        res["results"][name] = out
        shown = out["summary"] if name == "journal" else out
        print(f"{name} ({time.monotonic() - t0:.0f} s): {json.dumps(shown)}", flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(res))
    print(f"wrote {a.out}.json and {a.out}.md")


if __name__ == "__main__":
    main()
