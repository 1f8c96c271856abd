"""The daemon's configuration: one :class:`Key` declaration per setting, everything else derived.

A setting is declared once, in :data:`SETTINGS`: its name, parser, default, help, whether and
how SIGHUP applies it, and its ``serve`` flag. From that list come :class:`DaemonConfig`, the
TOML keys (with "did you mean" for a misspelt one), the ``KVBROKER_<KEY>`` variables (an
unknown ``KVBROKER_*`` variable is refused the same way), the ``serve`` options
(``cli/_settings.py``), the reload (:func:`reload_into`, called by ``Daemon.reload``) and the
configuration ``doctor`` checks against. Adding a setting is one ``Key(...)`` here, plus the
code that uses it. Its parser (a TOML value to the setting, or ValueError saying what is
wrong) is one of :mod:`~kvbroker._server.config_values`, named ``parse.<what>`` here; a kind
of value none of them reads gets its parser there.

Precedence: the TOML file, then ``KVBROKER_*`` variables, then flags (``pool_size`` <->
``KVBROKER_POOL_SIZE`` <-> ``--pool-size``). Each value is checked where it is read, so an
error names the file and key, the variable or the flag that holds the bad value, never just
"invalid configuration".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from .._wire.paths import default_socket_path
from . import config_values as parse
from .config_apply import LIVE, TO_BROKER, Call, Into, Owners, apply_owned
from .config_key import ENV_PREFIX, Key, env_name, flag_name
from .config_values import parse_listen_address

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ConfigError",
    "DaemonConfig",
    "Key",
    "KEYS",
    "SETTINGS",
    "load_config",
    "parse_listen_address",
    "reload_into",
]

DEFAULT_CONFIG_PATH = "/etc/kvbroker/kvbroker.toml"
CONFIG_ENV = "KVBROKER_CONFIG"
# KVBROKER_* variables that are not settings: read elsewhere, so not "unknown" to the daemon
# (which inherits them from the shell that runs the tests or a benchmark).
OTHER_VARIABLES = {
    CONFIG_ENV: "the configuration file (here)",
    "KVBROKER_EVENT_LOOP": "asyncio keeps asyncio's event loop (_server/daemon.py)",
    "KVBROKER_FAKE_GPUS": "fake GPUs for the ring tests (_server/rings.py)",
    "KVBROKER_PEER_SCRIPT": "the Mooncake peer script (_bench/peer.py)",
    "KVBROKER_COMMIT": "the commit a results file records, for a tree copied without git "
    "(_bench/_common.py)",
    "KVBROKER_CRASH_CYCLES": "tests/test_crash.py",
    "KVBROKER_FUZZ_FRAMES": "tests/test_fuzz.py",
    "KVBROKER_SOAK_LONG": "tests/test_soak.py",
    "KVBROKER_SOAK_SECONDS": "tests/test_soak.py",
    "KVBROKER_COPY_THREADS": "threads of a client's host copy engine (_client/engine.py)",
    "KVBROKER_NATIVE_COPY": "0: the copy engine's Python loops, not its C ones (_client/engine.py)",
    "KVBROKER_DEBUG": "tracebacks instead of one-line CLI errors (cli/_common.py)",
    # Click's shell-completion variable for the `kvbroker` program (`_KVBROKER_COMPLETE`).
    "KVBROKER_COMPLETE": "shell completion (tests/test_cli_ops.py)",
}


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message says where."""


def _socket_for_this_user() -> str:
    """The socket ``serve`` takes without ``--socket`` or ``$KVBROKER_SOCKET``, for whoever
    reads the help (root gets the system service's path)."""
    saved = os.environ.pop("KVBROKER_SOCKET", None)
    try:
        return default_socket_path()
    finally:
        if saved is not None:
            os.environ["KVBROKER_SOCKET"] = saved


# Consumers several settings share, each called once by a reload.
# Both tables at once: every connection's access is recomputed from its next request on, and
# the event feed re-decides what an unauthenticated stream carries.
POLICY = Call("broker.set_policy", "isolation", "quotas").then("events.policy_changed")
# The whole [sessions] table at once: lowered bounds are enforced at once.
RETENTION = Call("retention.configure", "retention_settings")

# -- THE settings: one declaration each ----------------------------------------------------
SETTINGS: tuple[Key, ...] = (
    Key("socket", parse.socket_path, default_socket_path, field="socket_path",
        flag=("--socket", "-s"),
        help="Daemon socket path (ignored when systemd passes one; KVBROKER_SOCKET sets it "
             "too).", metavar="PATH", shown=_socket_for_this_user,
        example="/tmp/kvbroker-example.sock"),
    # None: 1 GiB, or less to fit the free space in /dev/shm (DaemonConfig.resolved_pool_size).
    Key("pool_size", parse.size, None, flag=(), metavar="SIZE",
        help="Bytes per pool, e.g. 1G, 512M.", shown="1G, less to fit /dev/shm", example="256M"),
    Key("pools", parse.POOLS, 1, flag=(), metavar="N", text=int, help="Number of host pools.",
        example=2),
    Key("page_size", parse.page_size, "64K", flag=(), metavar="SIZE",
        help="Allocation granule (a power of two).", example="4K"),
    # Its consumers: the broker's leases, and the GPU rings' objects waiting for a claimer.
    Key("lease_ttl", parse.positive_duration, "30s", reload=Into("broker.{}", "rings.object_ttl"),
        flag=(), metavar="DURATION", help="Default lease TTL.", example="90s"),
    Key("high_watermark", parse.ratio, 0.95, reload=TO_BROKER, flag=(), metavar="FRACTION",
        text=float, help="Evict above this use.", example=0.97),
    Key("low_watermark", parse.ratio, 0.90, reload=TO_BROKER, flag=(), metavar="FRACTION",
        text=float, help="...down to this use.", shown="0.90", example=0.5),
    # A gid: its members may connect and map the pools (mode 0660); None: the owner only.
    Key("group", parse.group, None, flag=(), metavar="GROUP", example=0,
        help="Group whose members may connect (socket and pools mode 0660)."),
    # While the host has a CPU to spare (kvbroker._cpu): a wake-up across CPUs costs more
    # than serving a request.
    Key("busy_poll", parse.duration, "0.1ms", reload=LIVE, example="1ms",
        help="Keep the loop polling this long after the last request or reply instead of "
             "sleeping in epoll; 0 turns it off."),
    # Read replicas (kvbroker._server.replica): processes that follow the journal and answer
    # exists and match_prefix(hold=False), so those stop queueing on this one loop.
    Key("read_replicas", parse.replicas, "auto", flag=(), metavar="N", example=2,
        help="Processes answering exists and match_prefix(hold=False) from the journal; "
             "auto: one per 4 CPUs from 8 CPUs up, at most 4; 0: none. None beside "
             "[tier.disk] (the journal lists the pools' objects only).",
        shown="auto"),
    Key("max_connections", parse.CONNECTIONS, 1024, reload=LIVE, flag=(), metavar="N", text=int,
        help="Most client connections at once.", example=16),
    # Hardening (issue 16): what one client may hold of the daemon's time and memory.
    Key("max_wait", parse.positive_duration, "10m", reload=LIVE, example="1m",
        help="Longest a blocking claim (wait=...) waits for its key; a longer wait asked for "
             "ends with a timeout after this."),
    Key("max_connections_per_uid", parse.CONNECTIONS, 512, reload=LIVE, text=int, example=64,
        help="Most client connections one uid may hold at once (one tenant cannot take every "
             "slot of max_connections)."),
    Key("hello_timeout", parse.positive_duration, "10s", reload=LIVE, example="2s",
        help="A connection that has not said hello this long after connecting is closed."),
    Key("idle_timeout", parse.duration, "15m", reload=LIVE, example="1m",
        help="A connection that holds nothing (no lease, arena, wait or watch) and sends "
             "nothing this long is closed (clients reconnect by themselves); 0: never."),
    Key("max_write_buffers_total", parse.write_buffer, "256M", reload=LIVE, example="1G",
        help="Bytes of unread replies all connections together may hold; past it, the "
             "connection holding the most is disconnected (see max_write_buffer)."),
    Key("drain_timeout", parse.duration, "10s", reload=LIVE, flag=(), metavar="DURATION",
        example="1m", help="On SIGTERM, wait this long for held leases to end."),
    Key("log_level", parse.log_level, "info", reload=Call("daemon.set_log_level", "log_level"),
        flag=(), metavar="LEVEL", example="debug", help="debug, info, warning, error."),
    # (host, port) of the Prometheus endpoint, None when off.
    Key("metrics", parse_listen_address, "off", flag=(), metavar="HOST:PORT",
        example="127.0.0.1:9464",
        help="Serve Prometheus metrics on HOST:PORT (a bare PORT means loopback)."),
    # Integrity and limits (issue 8).
    Key("require_checksums", parse.boolean, False, reload=TO_BROKER, text=bool, example=True,
        help="Refuse seals that carry no checksum per buffer."),
    Key("max_leases_per_client", parse.LEASES, 65536, reload=TO_BROKER, text=int, example=100,
        help="Leases one connection may hold at once (a peer broker's pins: on all its "
             "connections together)."),
    Key("max_leases_per_uid", parse.LEASES, 262144, reload=TO_BROKER, text=int, example=1000,
        help="Leases the connections of one uid may hold at once, together (each costs the "
             "daemon ~400 B of memory that no quota counts); peers' pins count as the "
             "daemon's own uid."),
    Key("max_write_buffer", parse.write_buffer, "32M", example="64M",
        reload=Call("daemon.set_write_buffer_limit", "max_write_buffer"),
        help="Bytes of replies and pushes a peer may leave unread before it is disconnected "
             "(above the largest reply: 16 MiB frames)."),
    # Who may use which namespace, and namespace byte quotas (kvbroker._server.policy).
    Key("isolation", parse.isolation, {}, reload=POLICY, example={"mode": "tenant"},
        help="[isolation] namespace access policy."),
    Key("quotas", parse.quotas, {}, reload=POLICY, example={"team/*": "1G"},
        help="[quotas] namespace = byte limit."),
    # Pools of one tenant's own, which only its uid (or group) can map (issue 16).
    Key("tenant_pools", parse.tenant_pools, {},
        example={"alice": {"size": "64M", "user": 0, "namespaces": ["alice", "alice/*"]}},
        help="[tenant_pools.NAME] size, user or group, namespaces: a pool only that tenant "
             "can map, holding those namespaces."),
    # kvbroker._server.rings; off: no rings, and the daemon never loads the CUDA driver.
    Key("gpu_ring", parse.gpu_ring, "off", flag=(), metavar="SIZE", example="2G",
        help="Allocate a GPU staging ring of this size on each visible GPU, shared with "
             "clients through CUDA IPC (e.g. 1G)."),
    # Warm restart (kvbroker._server.journal): after a crash, and after a stop for a restart
    # (SIGUSR1, systemd's RestartKillSignal=), the next daemon adopts the pools and the journal
    # unless `cold`; a plain stop (SIGTERM) keeps them only with keep_pools_on_exit.
    Key("keep_pools_on_exit", parse.boolean, False, text=bool, shown="drop", example=True,
        flag=("--keep-pools-on-exit/--drop-pools-on-exit",),
        help="On SIGTERM too, keep the pools and their index for the next daemon (SIGUSR1, "
             "a restart, always keeps them; after a crash the next daemon adopts them)."),
    Key("cold", parse.boolean, False, flag=("--cold",), text=bool, example=True,
        help="Start empty: drop the pools and objects a previous daemon left."),
    Key("journal", parse.boolean, True, text=bool, example=False,
        help="Keep the index in a journal for warm restarts; false: every start is cold."),
    # Pages a writer may still be copying into although it lost them (lent at a crash, or its
    # connection cut off by the daemon). On reload, deadlines already set keep their length;
    # pages quarantined from then on get the new one.
    Key("restart_quarantine", parse.duration, "10s", reload=TO_BROKER, flag=(),
        metavar="DURATION", example="45s",
        help="Keep pages a writer may still be copying into (after a daemon restart or a "
             "cut-off) out of use this long."),
    # Broker-to-broker pulls through NIXL (issue 18; kvbroker._server.fleet), over a mutual
    # TLS control channel (issue 38): pulling and serving both need the three files.
    Key("transfer_listen", parse_listen_address, "off", section="transfer",
        example="127.0.0.1:7070",
        help="Serve this daemon's sealed objects to peer brokers on HOST:PORT (control "
             "channel; the bytes move through NIXL)."),
    Key("transfer_peers", parse.peers, (), section="transfer", example=["10.0.0.2:7070"],
        shown="[]",
        help="Peer brokers (HOST:PORT), the only ones pulled from (a client's peer= must "
             "name one) and served (a peer's certificate must name its HOST)."),
    Key("transfer_cert_file", parse.optional_path, "", section="transfer",
        example="/etc/kvbroker/node-a.pem",
        help="This node's certificate (PEM) for the brokers' mutual TLS; its subject "
             "alternative names are the host its peers list it under."),
    Key("transfer_key_file", parse.optional_path, "", section="transfer",
        example="/etc/kvbroker/node-a.key", help="The private key of cert_file (mode 0600)."),
    Key("transfer_ca_file", parse.optional_path, "", section="transfer",
        example="/etc/kvbroker/fleet-ca.pem",
        help="The fleet's CA (PEM): only brokers with a certificate it signed are served "
             "or pulled from."),
    Key("transfer_serve", parse.serve_rules, "*", section="transfer", shown='["*"]',
        example=["default", "prefix", "10.0.0.2=team-a/*"],
        help="Namespaces (globs) peers may pull from here; HOST=GLOB for one peer only. A "
             "tenant pool's namespaces are served only by a glob whose first path component "
             "has no wildcard (alice/*, not * or ?*): name them."),
    Key("transfer_node", parse.node_name, "", section="transfer", example="node-a",
        shown="the host name",
        help="This node's name, for peers and the event topic kv@<node>@<model>."),
    # Longer than transfer_timeout by default: a pull slower than the pin would fail at the
    # release (the peer's lease ended); a puller that dies ends its pins at once anyway.
    Key("transfer_pin_ttl", parse.positive_duration, "2m", section="transfer", example="5s",
        help="TTL of the lease a peer holds for us while we pull (keep it above "
             "transfer_timeout)."),
    Key("transfer_timeout", parse.positive_duration, "60s", section="transfer", example="2m",
        help="Give up a pull (connect, pin, NIXL READ) after this long."),
    # Sessions: the blocks agents and chats come back to (kvbroker._server.retention).
    Key("sessions_retain", parse.positive_duration, "10m", section="sessions", reload=RETENTION,
        example="30m", help="How long a request naming a session without `for` keeps its "
                            "blocks retained (renewed by each request)."),
    Key("sessions_max_retain", parse.positive_duration, "1h", section="sessions",
        reload=RETENTION, example="4h",
        help="The longest retention a request or `kvbroker retain` may ask for."),
    Key("sessions_pool_share", parse.ratio, 0.5, section="sessions", reload=RETENTION,
        text=float, example=0.3,
        help="The part of each pool sessions' retained blocks may hold, all tenants together; "
             "past it the lowest priority, least recently used lose retention first."),
    Key("sessions_tenant_quota", parse.optional_size, "off", section="sessions",
        reload=RETENTION, example="4G",
        help="Bytes one uid's sessions may retain together; past it that uid's own lowest "
             "priority, least recently used retained blocks lose retention (off: no limit "
             "but pool_share)."),
    Key("sessions_max_per_uid", parse.int_in(1, 1 << 20), 4096, section="sessions",
        reload=RETENTION, text=int, example=64,
        help="Sessions one uid may have at once."),
    # KV events for cache-aware routers (kvbroker._server.events).
    Key("events_publish", parse.zmq_endpoint, "off", section="events", example="tcp://*:5557",
        help="Publish vLLM-format KV events of prefix blocks on this ZMQ PUB endpoint."),
    Key("events_replay", parse.zmq_endpoint, "off", section="events", example="tcp://*:5558",
        help="ROUTER endpoint answering replay requests for missed batches."),
    Key("events_format", parse.event_format, "positional", section="events", example="tagged",
        help="positional (llm-d, vLLM array_like) or tagged (vLLM 0.32's decoder)."),
    Key("events_model", parse.model_name, "kvbroker", section="events", example="llama-3-8b",
        help="The model part of the event topic kv@<node>@<model>."),
    Key("events_replay_buffer", parse.size, "16M", section="events", example="64M",
        help="Payload bytes of past batches kept for replay (the last 10,000 batches at most)."),
    # CURVE (kvbroker._server.events.CurveKeys): only subscribers holding a listed key get
    # the stream; without it, isolation.mode = "tenant" publishes shared namespaces only.
    Key("events_curve_key", parse.optional_path, "", section="events",
        example="/etc/kvbroker/events/server.key_secret",
        help="The daemon's CURVE certificate (zmq.auth's *.key_secret, mode 0600): subscribers "
             "must authenticate, with curve_clients."),
    Key("events_curve_clients", parse.optional_path, "", section="events",
        example="/etc/kvbroker/events/subscribers",
        help="Directory of the public certificates (*.key) of the subscribers allowed to "
             "receive every namespace's events."),
    # The disk tier (issue 42; kvbroker._server.disk_tier): what the pools give up is kept
    # on local disk, promoted back when asked for, and found again after a reboot.
    Key("tier_disk_directories", parse.directories, (), section="tier.disk", shown="[] (off)",
        example=["/var/lib/kvbroker/nvme0"], help="Directories of the disk tier, one per "
        "device (one preallocated slot file each); none: no disk tier."),
    Key("tier_disk_size", parse.size, "16G", section="tier.disk", example="512G",
        help="Bytes of disk the tier takes, split over its directories (allocated at start)."),
    Key("tier_disk_policy", parse.disk_policy, "evicted", section="tier.disk", example="sealed",
        help="evicted: write back the objects the pools are about to give up; sealed: every "
             "sealed object, so all of the pools survives a reboot."),
    Key("tier_disk_writeback_watermark", parse.ratio, 0.80, section="tier.disk", text=float,
        reload=Into("disk.writeback_watermark"), shown="0.80", example=0.6,
        help="Pool use above which the least recently used objects are written to disk "
             "before they are evicted (below high_watermark)."),
    Key("tier_disk_writeback_inflight", parse.size, "256M", section="tier.disk", example="1G",
        help="Bytes being written to disk at once, at most: past it, write-back waits and "
             "an eviction of an object not on disk yet drops it."),
    Key("tier_disk_o_direct", parse.boolean, True, section="tier.disk", example=False,
        help="Read and write with O_DIRECT where the file system allows it (probed at "
             "start; false: buffered I/O)."),
    Key("tier_disk_io_threads", parse.IO_THREADS, 4, section="tier.disk", text=int,
        example=8, help="Threads doing the disk tier's reads and writes."),
)  # fmt: skip
KEYS: dict[str, Key] = {k.name: k for k in SETTINGS}
# Settings that are gone, and what to set instead: refused with that, not as unknown keys.
REMOVED: dict[str, str] = {
    "transfer_token_file": "the shared-token peer channel is gone (a relay could splice "
    "its frames); brokers now authenticate with mutual TLS: set "
    "[transfer] cert_file, key_file and ca_file (docs/fleet.md)",
}
SECTIONS: frozenset[str] = frozenset(k.section for k in SETTINGS if k.section)


def _resolved_pool_size(self: DaemonConfig) -> int:
    if self.pool_size is not None:
        return self.pool_size
    default = 1 << 30
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return default
    # Leave room for everything else that lives in /dev/shm.
    fit = (free // 2) // max(1, self.pools)
    return max(self.page_size, min(default, fit - fit % self.page_size))


DaemonConfig = dataclasses.make_dataclass(
    "DaemonConfig",
    [(k.attr, Any, k.dataclass_field()) for k in SETTINGS]
    + [("config_path", "str | None", dataclasses.field(default=None))],  # re-read on SIGHUP
    namespace={
        "__doc__": "Every setting of one daemon: a field per :data:`SETTINGS` key (``socket`` "
        "is ``socket_path``), plus the file it came from.",
        "__module__": __name__,
        "resolved_pool_size": _resolved_pool_size,
    },
)
_resolved_pool_size.__qualname__ = "DaemonConfig.resolved_pool_size"


def _retention_settings(self: DaemonConfig) -> Any:
    """The [sessions] table as the broker's retention takes it."""
    from .retention import RetentionSettings

    return RetentionSettings(
        retain=self.sessions_retain,
        max_retain=self.sessions_max_retain,
        pool_share=self.sessions_pool_share,
        tenant_quota=self.sessions_tenant_quota,
        max_per_uid=self.sessions_max_per_uid,
    )


DaemonConfig.retention_settings = _retention_settings
_retention_settings.__qualname__ = "DaemonConfig.retention_settings"


def _disk_settings_unused(self: DaemonConfig) -> list[str]:
    """The [tier.disk] settings given other values than their defaults while no directories
    are: a disk tier asked for that does not run (the daemon says so at start)."""
    if self.tier_disk_directories:
        return []
    default = DaemonConfig()
    return [
        k.where
        for k in SETTINGS
        if k.section == "tier.disk" and getattr(self, k.attr) != getattr(default, k.attr)
    ]


DaemonConfig.disk_settings_unused = _disk_settings_unused
_disk_settings_unused.__qualname__ = "DaemonConfig.disk_settings_unused"


def _did_you_mean(name: str, known, prefix: str = "") -> str:
    """ " (did you mean 'pool_size'?)", comparing names without their common ``prefix``."""
    import difflib

    cut = len(prefix)
    hint = difflib.get_close_matches(name[cut:], [k[cut:] for k in known], n=1)
    return f" (did you mean {prefix + hint[0]!r}?)" if hint else ""


def _env_layer(env: Mapping[str, str]) -> dict[str, str]:
    """The settings ``KVBROKER_*`` variables give; an unknown one is an error, like an
    unknown TOML key (a misspelt variable is a typo, not a wish to be ignored)."""
    known = {k.env for k in SETTINGS} | OTHER_VARIABLES.keys()
    for var in sorted(env):
        removed = REMOVED.get(var[len(ENV_PREFIX) :].lower())
        if var.startswith(ENV_PREFIX) and removed is not None:
            raise ConfigError(f"{var}: {removed}")
        if var.startswith(ENV_PREFIX) and var not in known:
            hint = _did_you_mean(var, known, ENV_PREFIX)
            raise ConfigError(f"unknown variable {var!r}{hint}")
    return {k.name: env[k.env] for k in SETTINGS if env.get(k.env) is not None}


def _read_file(path: str, required: bool) -> dict[str, Any]:
    try:  # here, not at the top: the CLI imports this module for serve's options
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: no such configuration file") from None
        return {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for section in SECTIONS:  # [tier.disk] is the table "disk" inside the table "tier"
        top, dot, rest = section.partition(".")
        outer = data.get(top)
        if dot and isinstance(outer, dict) and isinstance(outer.get(rest), dict):
            data[section] = outer.pop(rest)
            if not outer:
                del data[top]
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for sub, v in value.items():
                full = f"{key.replace('.', '_')}_{sub}"
                if full in REMOVED:
                    raise ConfigError(f"{path}: [{key}] {sub}: {REMOVED[full]}")
                if full not in KEYS or KEYS[full].section != key:
                    names = [k.toml_name for k in SETTINGS if k.section == key]
                    raise ConfigError(
                        f"{path}: unknown key {sub!r} in [{key}]{_did_you_mean(sub, names)}"
                    )
                flat[full] = v
            continue
        if key not in KEYS or KEYS[key].section:
            extra = _did_you_mean(key, KEYS)
            if isinstance(value, dict):
                tables = " and ".join(f"[{k.name}]" for k in SETTINGS if k.table)
                tables += "".join(f" and [{name}]" for name in sorted(SECTIONS))
                extra += f"; the only sections are {tables}, put every other key at the top"
            raise ConfigError(f"{path}: unknown key {key!r}{extra}")
        flat[key] = value
    return flat


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """The :class:`DaemonConfig` from ``path`` (else ``$KVBROKER_CONFIG``, else the default
    file if it exists), then ``KVBROKER_*`` variables, then ``flags`` (key -> value, None
    meaning not given). Raises :class:`ConfigError` naming the bad key, or an unknown key or
    ``KVBROKER_*`` variable."""
    env = os.environ if env is None else env
    required = path is not None or bool(env.get(CONFIG_ENV))
    path = path or env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH
    layers: list[tuple[Callable[[str], str], Mapping[str, Any]]] = [
        (lambda k: f"{path}: {KEYS[k].where if k in KEYS else k}", _read_file(path, required)),
        (env_name, _env_layer(env)),
        (flag_name, {k: v for k, v in (flags or {}).items() if v is not None}),
    ]
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name, layer in layers:
        for key, raw in layer.items():
            if key not in KEYS:
                raise ConfigError(f"{name(key)}: unknown setting")
            try:
                if name is env_name:
                    values[key] = KEYS[key].parse_text(raw)
                else:
                    values[key] = KEYS[key].parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{name(key)}: {exc}") from None
            where[key] = name(key)
    cfg = DaemonConfig()
    for key, value in values.items():
        setattr(cfg, KEYS[key].attr, value)
    if cfg.low_watermark > cfg.high_watermark:
        raise ConfigError(
            f"{where.get('low_watermark', 'low_watermark')}: low_watermark "
            f"({cfg.low_watermark:g}) must not exceed high_watermark ({cfg.high_watermark:g}, "
            f"from {where.get('high_watermark', 'the default')})"
        )
    if cfg.pool_size is not None and cfg.pool_size < cfg.page_size:
        raise ConfigError(
            f"{where['pool_size']}: a pool ({cfg.pool_size} bytes) must hold at least one page "
            f"({cfg.page_size} bytes)"
        )
    if cfg.read_replicas and cfg.tier_disk_directories:
        raise ConfigError(
            f"{where['read_replicas']}: read_replicas = {cfg.read_replicas} cannot run beside "
            f"[tier.disk] (directories from {where['tier_disk_directories']}): a replica "
            "answers exists and match_prefix(hold=false) from the journal, which lists the "
            "pools' objects only, so it would call a block on disk absent; set read_replicas "
            "to 0 or auto (none with a disk tier)"
        )
    cfg.config_path = path if os.path.exists(path) else None
    return cfg


def reload_into(
    running: DaemonConfig, new: DaemonConfig, owners: Owners, *, keep: tuple[str, ...] = ()
) -> tuple[list[str], list[tuple[str, Any, Any]]]:
    """SIGHUP: copy the reloadable settings of ``new`` into ``running`` and apply each key's
    ``reload`` to the daemon's ``owners`` (``Daemon.owners()``; a declaration several keys
    share, once). Returns what changed ("lease_ttl 30.0 -> 5.0"), and (field, old, new) for
    settings that changed but need a restart; ``keep`` names fields whose difference is not
    a change (the socket path under socket activation)."""
    changed, restart = [], []
    for key in SETTINGS:
        before, after = getattr(running, key.attr), getattr(new, key.attr)
        if before == after or key.attr in keep:
            continue
        if key.reloadable:
            changed.append(f"{key.attr} {before!r} -> {after!r}")
            setattr(running, key.attr, after)
        else:
            restart.append((key.attr, before, after))
    done: set[Any] = set()
    for key in SETTINGS:  # unchanged values too: the daemon's copies always match the config
        if key.reload is None or key.reload.once(key.attr) in done:
            continue
        done.add(key.reload.once(key.attr))  # one set_policy for [isolation] and [quotas]
        key.reload.apply(running, key.attr, owners)
    return changed, restart


def apply_to_owners(config: DaemonConfig, owners: Owners) -> None:
    """At the start, once the daemon's ``owners`` are built (``Daemon.owners()``): every copy
    of a setting its ``Key`` declares (``Into``), as a reload sets them
    (:mod:`~kvbroker._server.config_apply`)."""
    apply_owned(SETTINGS, config, owners)
