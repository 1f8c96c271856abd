"""``kvbroker doctor``: is this host ready to run the service, and if not, what to change.

Each check looks at one thing the daemon or its clients rely on and returns ok / warn / fail /
skip with a fix an operator can paste. Nothing here needs the daemon to be running, and torch
is imported only when it is installed and a GPU is visible.
"""

from __future__ import annotations

import glob
import grp
import importlib.util
import mmap
import os
import pwd
import resource
import shutil
import stat
import subprocess
import time
from collections.abc import Callable

from .config import DaemonConfig
from .._wire.paths import format_size
from .doctor_check import Check
from .doctor_engines import check_checksum_hash, check_copy_engine, check_prefix_scan

__all__ = ["Check", "run_checks", "render", "SERVICE_USER"]

SERVICE_USER = "kvbroker"  # the User= of systemd/kvbroker.service


def _pool_bytes(cfg: DaemonConfig) -> int:
    return cfg.resolved_pool_size() * cfg.pools


def _gpu_nodes() -> list[str]:
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def check_memlock(cfg: DaemonConfig) -> Check:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = _pool_bytes(cfg)
    fix = (
        "the unit sets LimitMEMLOCK=infinity; for a shell or container: "
        "'ulimit -l unlimited', '* - memlock unlimited' in /etc/security/limits.d/kvbroker.conf, "
        "or 'docker run --ulimit memlock=-1'"
    )
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "unlimited")
    detail = f"{format_size(soft)} for this process, pools need {format_size(need)}"
    if soft >= need:
        return Check("memlock", "ok", detail)
    # Pinning (cudaHostRegister, mlock) only happens with a GPU; without one this is harmless.
    return Check("memlock", "fail" if _gpu_nodes() else "warn", detail, fix)


def check_shm(cfg: DaemonConfig) -> Check:
    fix = (
        "grow it: 'mount -o remount,size=64G /dev/shm' (and the size= option in /etc/fstab), "
        "or 'docker run --shm-size=64g'; or lower pool_size"
    )
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return Check("/dev/shm", "fail", f"not usable: {exc.strerror}", "mount a tmpfs on /dev/shm")
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    need = _pool_bytes(cfg)
    detail = (
        f"{format_size(free)} free of {format_size(total)}, "
        f"pools need {format_size(need)} ({cfg.pools} x {format_size(need // cfg.pools)})"
    )
    if not os.access("/dev/shm", os.W_OK | os.X_OK):
        return Check(
            "/dev/shm", "fail", detail + "; not writable by this user", "chmod 1777 /dev/shm"
        )
    if free < need:
        return Check("/dev/shm", "fail", detail, fix)
    return Check("/dev/shm", "ok", detail)


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_socket_dir(cfg: DaemonConfig) -> Check:
    path = cfg.socket_path
    sdir = os.path.dirname(os.path.abspath(path))
    name = "socket directory"
    if not os.path.isdir(sdir):
        base = _nearest_existing(sdir)
        if os.access(base, os.W_OK | os.X_OK):
            return Check(name, "ok", f"{sdir} will be created (under {base})")
        return Check(
            name,
            "fail",
            f"{sdir} does not exist and {base} is not writable",
            "the unit's RuntimeDirectory=kvbroker creates /run/kvbroker; by hand: "
            f"'install -d -o {SERVICE_USER} -g {SERVICE_USER} -m 0755 {sdir}'",
        )
    st = os.stat(sdir)
    mode = stat.S_IMODE(st.st_mode)
    detail = f"{sdir} mode {mode:04o} owner {_user(st.st_uid)}:{_group(st.st_gid)}"
    if mode & 0o002 and not mode & stat.S_ISVTX:
        return Check(
            name, "fail", detail + ": anyone may replace the socket", f"chmod o-w {sdir} (or +t)"
        )
    if not os.path.exists(path) and not os.access(sdir, os.W_OK | os.X_OK):
        return Check(
            name,
            "fail",
            detail + ": this user cannot create the socket there",
            f"chown {SERVICE_USER} {sdir}, or run as its owner",
        )
    if os.path.exists(path):
        sst = os.stat(path)
        smode = stat.S_IMODE(sst.st_mode)
        detail += f"; socket mode {smode:04o} group {_group(sst.st_gid)}"
        if smode & 0o006:
            return Check(
                name,
                "fail",
                detail + ": every user may connect",
                'serve with group = "kvbroker" (mode 0660), or SocketMode=0660',
            )
        if cfg.group is not None and sst.st_gid != cfg.group:
            return Check(
                name,
                "warn",
                detail + f": configured group is {_group(cfg.group)}",
                "restart the daemon, or fix SocketGroup= in kvbroker.socket",
            )
    return Check(name, "ok", detail)


def check_service_user(cfg: DaemonConfig) -> Check:
    name = "service user"
    try:
        pw = pwd.getpwnam(SERVICE_USER)
    except KeyError:
        return Check(
            name,
            "warn",
            f"no user {SERVICE_USER!r} (needed by kvbroker.service)",
            "systemd-sysusers /usr/lib/sysusers.d/kvbroker.conf, or "
            f"'useradd --system --no-create-home --shell /usr/sbin/nologin {SERVICE_USER}'",
        )
    limit = _sys_uid_max()
    detail = f"{SERVICE_USER} uid {pw.pw_uid}"
    if pw.pw_uid > limit:
        # logind's RemoveIPC=yes deletes a regular user's POSIX shm when they log out.
        return Check(
            name,
            "fail",
            f"{detail} is not a system user (> {limit}): logind would "
            "remove its shared memory at logout",
            f"recreate it with 'useradd --system' (uid <= {limit})",
        )
    return Check(name, "ok", f"{detail} (system user)")


def _sys_uid_max() -> int:
    try:
        with open("/etc/login.defs") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "SYS_UID_MAX" and parts[1].isdigit():
                    return int(parts[1])
    except OSError:
        pass
    return 999


def check_gpu(cfg: DaemonConfig) -> Check:
    nodes = _gpu_nodes()
    name = "GPU visibility"
    if not nodes and not os.path.exists("/dev/nvidiactl"):
        return Check(name, "skip", "no /dev/nvidia* on this host: host pools only")
    blocked = [
        n
        for n in nodes + ["/dev/nvidiactl", "/dev/nvidia-uvm"]
        if os.path.exists(n) and not os.access(n, os.R_OK | os.W_OK)
    ]
    if blocked:
        return Check(
            name,
            "fail",
            f"cannot open {', '.join(blocked)}",
            "add the user to the group owning them (often 'video'), and keep "
            "DeviceAllow=char-nvidia* rwm in the unit",
        )
    if not os.path.exists("/dev/nvidia-uvm"):
        return Check(
            name,
            "fail",
            "/dev/nvidia-uvm is missing: CUDA cannot start",
            "run 'nvidia-modprobe -u -c=0' at boot, or enable nvidia-persistenced",
        )
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return Check(name, "ok", f"{len(nodes)} device node(s); nvidia-smi not installed")
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return Check(name, "fail", "nvidia-smi -L hung for 20 s", "check the driver (dmesg)")
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    if out.returncode != 0 or not gpus:
        return Check(
            name,
            "fail",
            f"nvidia-smi failed: {(out.stderr or out.stdout).strip()}",
            "check that the driver is loaded and matches its user-space libraries",
        )
    return Check(name, "ok", f"{len(gpus)} GPU(s): " + "; ".join(g.split(" (")[0] for g in gpus))


def check_host_register(cfg: DaemonConfig) -> Check:
    name = "cudaHostRegister"
    if not _gpu_nodes():
        return Check(name, "skip", "no GPU")
    if importlib.util.find_spec("torch") is None:
        return Check(name, "skip", "torch is not installed here; clients check it at attach")
    import torch  # only now: it takes seconds to import

    if not torch.cuda.is_available():
        return Check(
            name,
            "fail",
            "torch sees no CUDA device although /dev/nvidia* exist",
            "check CUDA_VISIBLE_DEVICES and that torch is a CUDA build",
        )
    size = 64 << 20
    # A /dev/shm mapping, like the clients' view of a pool.
    buf = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
    try:
        ptr = _address_of(buf)
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, size, 0)
        took = time.perf_counter() - t0
        if int(err) != 0:
            return Check(
                name,
                "fail",
                f"cudaHostRegister of {format_size(size)} failed: {err}",
                "raise the memlock limit (LimitMEMLOCK=infinity) and check IOMMU settings",
            )
        cudart.cudaHostUnregister(ptr)
    finally:
        buf.close()
    return Check(name, "ok", f"{format_size(size)} registered in {took * 1e3:.1f} ms")


def _address_of(buf: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_socket_unit(cfg: DaemonConfig) -> Check:
    """The configured socket against kvbroker.socket's ListenStream= (kvbroker._unitcheck)."""
    from .._unitcheck import UNIT_PATHS, check_socket_unit as compare

    verdict = compare(cfg.socket_path, UNIT_PATHS)
    return Check("socket unit", verdict.status, verdict.detail, verdict.fix)


def check_pools(cfg: DaemonConfig) -> Check:
    """The running daemon's pool segments are still in /dev/shm, at their size (one that
    vanished under it: new clients cannot map it; the daemon logs POOL LOST)."""
    name = "pool segments"
    if not os.path.exists(cfg.socket_path):
        return Check(name, "skip", f"no daemon serving {cfg.socket_path}")
    import socket

    from .._wire.frames import FrameDecoder, FrameEncoder, result_of
    from .._wire.protocol import PROTOCOL_VERSION
    from ..errors import KVBrokerError

    try:  # the hello reply names the pools (the server side never imports the client)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(cfg.socket_path)
            hello = {"version": PROTOCOL_VERSION, "name": "kvbroker doctor", "role": ""}
            sock.sendall(FrameEncoder().request(1, "hello", hello))
            decoder, replies = FrameDecoder(sender="the daemon"), []
            while not replies:
                data = sock.recv(1 << 16)
                if not data:
                    raise OSError("the daemon closed the connection")
                replies = decoder.receive(data)
        pools = result_of(replies[0])["pools"]
    except (OSError, KeyError, TypeError, ValueError, KVBrokerError) as exc:
        return Check(name, "skip", f"cannot ask the daemon at {cfg.socket_path}: {exc}")
    hidden = sum(1 for p in pools if p.get("hidden"))  # other tenants': not named to us
    pools = [p for p in pools if not p.get("hidden")]
    bad = []
    for p in pools:
        try:
            size = os.stat("/dev/shm" + p["name"]).st_size
        except FileNotFoundError:
            bad.append(f"pool {p['index']} ({p['name']}) is gone")
            continue
        if size != p["size"]:
            bad.append(f"pool {p['index']} ({p['name']}) holds {size} bytes, not {p['size']}")
    if bad:
        return Check(
            name,
            "fail",
            "; ".join(bad) + ": new clients cannot map it",
            "restart the daemon (the objects in that pool are lost); find what "
            "removes files in /dev/shm (systemd-logind RemoveIPC=, a cleanup job)",
        )
    return Check(
        name,
        "ok",
        f"{len(pools)} pool(s) present at their size"
        + (f" ({hidden} of other tenants not named to uid {os.getuid()})" if hidden else ""),
    )


def _tls_with_itself(server, client) -> dict:
    """A TLS handshake of this node's serving and pulling contexts with each other, in
    memory: both certificates are verified by the CA as a peer's would be. Returns the
    certificate as the peer sees it."""
    import ssl

    client.check_hostname = False  # which host it names is reported, not checked here
    bios = [ssl.MemoryBIO() for _ in range(4)]
    srv = server.wrap_bio(bios[0], bios[1], server_side=True)
    cli = client.wrap_bio(bios[2], bios[3], server_side=False)
    done = set()
    for _ in range(20):
        for end, out, into in ((cli, bios[3], bios[0]), (srv, bios[1], bios[2])):
            try:
                end.do_handshake()
                done.add(end)
            except ssl.SSLWantReadError:
                pass
            into.write(out.read())
        if len(done) == 2:
            return cli.getpeercert()
    raise ValueError("the TLS handshake with itself did not finish")


def check_peer_tls(cfg: DaemonConfig) -> Check:
    """[transfer]: the mutual TLS files load, the certificate is valid now, and it names a
    host (the one its peers list this node under)."""
    name = "peer-tls"
    files = {
        "cert_file": cfg.transfer_cert_file,
        "key_file": cfg.transfer_key_file,
        "ca_file": cfg.transfer_ca_file,
    }
    if not any(files.values()) and cfg.transfer_listen is None and not cfg.transfer_peers:
        return Check(name, "skip", "no [transfer] peers: this node pulls from and serves no broker")
    missing = [k for k, v in files.items() if not v]
    if missing:
        return Check(
            name,
            "fail",
            f"[transfer] {' and '.join(missing)} not set: brokers "
            "authenticate each other with mutual TLS",
            "set cert_file, key_file and ca_file in [transfer] (a certificate of "
            "the fleet's CA naming this node's host)",
        )
    if not cfg.transfer_peers:
        return Check(
            name,
            "fail",
            "[transfer] peers is empty",
            "list the brokers (HOST:PORT) this node pulls from and serves",
        )
    import ssl

    from .transfer import certificate_names, tls_contexts

    try:
        info = _tls_with_itself(
            *tls_contexts(files["cert_file"], files["key_file"], files["ca_file"])
        )
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        return Check(
            name,
            "fail",
            f"[transfer] TLS files: {exc}",
            "check the paths, that the key is the certificate's (mode 0600) and "
            "that ca_file signed the certificate",
        )
    left = ssl.cert_time_to_seconds(info["notAfter"]) - time.time()
    names = certificate_names(info)
    detail = (
        f"{files['cert_file']} names {', '.join(names[:4]) or 'no host'}, valid "
        f"{left / 86400:.0f} more day(s); {len(cfg.transfer_peers)} peer(s)"
    )
    if left <= 0:
        return Check(
            name,
            "fail",
            detail.replace("valid", "expired:"),
            "renew the certificate (peers refuse it)",
        )
    if left < 14 * 86400:
        return Check(name, "warn", detail, "renew the certificate before it expires")
    return Check(name, "ok", detail)


def _filesystem(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount ``path`` is on (/proc/self/mounts)."""
    path = os.path.realpath(path)
    best = ("/", "?")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, fields[2])
    except OSError:
        pass
    return best


def check_disk_tier(cfg: DaemonConfig) -> Check:
    """[tier.disk]: each directory usable, its file system, room for its share, O_DIRECT."""
    from .disk_store import SLOTS_NAME, probe_direct

    dirs = cfg.tier_disk_directories
    if not dirs:
        unused = cfg.disk_settings_unused()
        if unused:  # a tier asked for that will not run
            return Check(
                "disk_tier",
                "warn",
                f"{', '.join(unused)} set, but no [tier.disk] directories: no disk tier",
                "set [tier.disk] directories (one per device), or drop those settings",
            )
        return Check("disk_tier", "skip", "no [tier.disk] directories (no disk tier)")
    share = cfg.tier_disk_size // len(dirs)
    said, warn, fail, fixes = [], False, False, []
    for d in dirs:
        if not os.path.isdir(d):
            base = _nearest_existing(d)
            if not os.access(base, os.W_OK | os.X_OK):
                fail = True
                said.append(f"{d}: missing, and {base} is not writable")
                fixes.append(f"install -d -m 0700 -o {SERVICE_USER} {d}")
                continue
            said.append(f"{d}: missing (the daemon creates it)")
            d = base
        elif not os.access(d, os.W_OK | os.X_OK):
            fail = True
            said.append(f"{d}: not writable")
            fixes.append(f"chown {SERVICE_USER} {d}")
            continue
        mnt, fstype = _filesystem(d)
        st = os.statvfs(d)
        kept = os.path.join(d, SLOTS_NAME)
        have = os.path.getsize(kept) if os.path.isfile(kept) else 0
        free = st.f_bavail * st.f_frsize + have
        problem = probe_direct(d)
        note = f"{d}: {fstype} on {mnt}, {format_size(free)} free for {format_size(share)}, " + (
            "O_DIRECT" if problem is None else f"no O_DIRECT ({problem}): buffered I/O"
        )
        said.append(note)
        if free < share:
            fail = True
            fixes.append(f"free space on {mnt} or lower [tier.disk] size")
        if problem is not None and cfg.tier_disk_o_direct:
            warn = True
            fixes.append(
                f"put {d} on a file system with O_DIRECT (ext4, xfs) for reads that "
                "bypass the page cache"
            )
        if fstype in ("tmpfs", "ramfs"):
            warn = True
            fixes.append(
                f"{d} is in memory ({fstype}): it takes RAM and does not survive a "
                "reboot; use a directory on a local SSD"
            )
    said.append(
        "no read replicas beside it (they answer exists and match_prefix(hold=false) from the "
        "journal, which lists the pools' objects only: every request goes to the daemon)"
    )
    status = "fail" if fail else "warn" if warn else "ok"
    return Check("disk_tier", status, "; ".join(said), "; ".join(fixes))


CHECKS: tuple[Callable[[DaemonConfig], Check], ...] = (
    check_memlock,
    check_shm,
    check_socket_dir,
    check_socket_unit,
    check_service_user,
    check_gpu,
    check_host_register,
    check_checksum_hash,
    check_copy_engine,
    check_prefix_scan,
    check_pools,
    check_peer_tls,
    check_disk_tier,
)


def run_checks(cfg: DaemonConfig) -> list[Check]:
    results = []
    for check in CHECKS:
        try:
            results.append(check(cfg))
        except Exception as exc:  # a broken check is a finding, not a crash
            name = check.__name__.removeprefix("check_")
            results.append(Check(name, "fail", f"the check itself failed: {exc!r}"))
    return results


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status.upper():<5} {c.name:<17} {c.detail}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"{'':<6}{'':<17} fix: {c.fix}")
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    lines.append("")
    lines.append(f"{failed} failed, {warned} warning(s)" if failed or warned else "all good")
    return "\n".join(lines)
