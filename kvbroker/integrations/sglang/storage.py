r"""``KVBrokerStorage``: kvbroker as an SGLang HiCache storage backend (the "L3" tier).

SGLang's ``dynamic`` backend builds it as ``KVBrokerStorage(storage_config, kwargs)`` from
``--hicache-storage-backend-extra-config`` (see the package docstring for the command line);
its cache controller then registers the host pool (``register_mem_pool_host``) and calls, from
its prefetch and backup threads, ``batch_exists`` (how many leading pages of a prompt the node
holds), ``batch_get_v1`` (pages into the host pool) and ``batch_set_v1`` (pages out of it).
With ``"interface_v1": 1`` those are zero-copy: each page's bytes are copied once, straight
between SGLang's host pool and the broker's shared-memory pools, a batch of pages in one
round trip (:mod:`._pages`). Without it SGLang uses the older ``batch_get``/``batch_set`` on
flat page tensors, which this backend serves too (one more copy, SGLang's). A hybrid model's
extra pools come through the v2 calls (``register_mem_host_pool_v2``, ``batch_exists_v2``,
``batch_get_v2`` / ``batch_set_v2`` over ``PoolTransfer``\ s): a Mamba pool's states as
state pages (:mod:`._states`), a sliding-window pool's pages as the KV pool's, each pool in a
namespace of its own and its name in its keys; any other pool is a miss.

Extra config keys, beside SGLang's ``backend_name``, ``module_path``, ``class_name``,
``interface_v1`` and ``tp_lcm_size``:

- ``socket``: the daemon's socket (default: ``$KVBROKER_SOCKET``, then kvbroker's defaults);
- ``namespace``: prefix of the broker namespace (default ``sglang``; under ``[isolation]``
  tenant mode use one the engine's user may write, e.g. ``"USER/sglang"``);
- ``model_id``: the model's identity in the namespace (default: SGLang's model name);
- ``cache_salt``: mixed into every key (default none): engines with different salts never
  share pages, even in one namespace;
- ``checksum`` (default true): record each page's checksum at seal (``kvbroker verify``);
- ``timeout`` (seconds, default 5): the longest a broker call may take before the broker is
  treated as down; ``retry_min`` / ``retry_max`` (seconds, default 1 / 30): the first and
  the longest wait between reconnection attempts while it is down.

What SGLang expects when the broker cannot help (:mod:`kvbroker.integrations._link`): a daemon
that is down, restarting or hung costs misses (``batch_exists`` 0, ``batch_get_v1`` all False)
and skipped writes (``batch_set_v1`` all False), never an exception: an exception in SGLang's
backup thread ends its backups (returning None does too, its docstring says). A full pool or
quota skips that batch's writes. Each kind of trouble is logged once, then at most once per
30 s.

Ownership: SGLang owns its host pool; a call reads (set) or writes (get) only the pages its
``host_indices`` name, and only until it returns. The broker owns every stored page; a get
holds one read lease over the matched pages while it copies, released before it returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .._extra import unknown_keys
from .._link import BrokerLink, LinkWords, Warnings
from ._format import PageGeometry, Sharding, namespace_for
from ._pages import PageStore, Source
from ._states import StateStore

log = logging.getLogger("kvbroker.integrations.sglang")

__all__ = ["KVBrokerStorage"]

# The extra config keys this backend reads (the module docstring says each). The dict holds
# SGLang's own keys too, so only a key close to one of these is logged, as a misspelling.
EXTRA_KEYS = (
    "socket",
    "namespace",
    "model_id",
    "cache_salt",
    "checksum",
    "timeout",
    "retry_min",
    "retry_max",
)

# What the broker being down means for SGLang (kvbroker.integrations._link).
_LINK_WORDS = LinkWords(
    down="SGLang keeps serving without it (its storage tier misses, pages are not written)",
    back="HiCache storage reads and writes resume",
)


def _metrics():
    """SGLang's ``StorageMetrics`` (its metrics collector asserts the type), or None."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except ImportError:
        return None
    return StorageMetrics


class KVBrokerStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        for unknown in unknown_keys(extra, EXTRA_KEYS, shared=True):
            log.warning("kvbroker: HiCache storage extra config key %s is ignored", unknown)
        self.prefix = str(extra.get("namespace", "sglang"))
        self.model = str(extra.get("model_id") or storage_config.model_name or "model")
        self.cache_salt = str(extra.get("cache_salt", ""))
        checksum = extra.get("checksum", True)
        if not isinstance(checksum, bool):
            raise ValueError(f"kvbroker: checksum must be true or false, not {checksum!r}")
        self.checksum = checksum
        socket = extra.get("socket") or os.environ.get("KVBROKER_SOCKET") or None
        self.warnings = Warnings(log)
        rank = f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            rank += f"-pp{storage_config.pp_rank}"
        self.link = BrokerLink(
            socket,
            name=f"sglang-{rank}-{os.getpid()}",
            role="kv_both",
            timeout=float(extra.get("timeout", 5.0)),
            retry_min=float(extra.get("retry_min", 1.0)),
            retry_max=float(extra.get("retry_max", 30.0)),
            warnings=self.warnings,
            words=_LINK_WORDS,
        )
        self.store: PageStore | None = None
        self.namespace: str | None = None
        self.mem_pool_host = None
        self.pools: dict[str, PageStore | StateStore] = {}  # a hybrid model's extra pools
        self.unsupported: dict[str, str] = {}  # its pools not stored, and why
        self._stats_lock = threading.Lock()
        self._metrics: dict[str, list] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self.store = self._page_store(pool)
        self.namespace = self.store.namespace
        sharding = self.store.sharding
        log.info(
            "kvbroker: HiCache storage for %s, namespace %s, layout %s, %d shard(s) of "
            "%s per page, socket %s",
            self.model,
            self.namespace,
            pool.layout,
            sharding.per_rank,
            "all heads"
            if sharding.total_kv_heads is None
            else f"{sharding.total_kv_heads // sharding.shards} head(s)",
            self.link.socket or "default",
        )

    def _page_store(self, pool, name: str = "") -> PageStore:
        """The store of a host pool of attention pages: the KV pool, or (``name``) a hybrid
        model's sliding-window pool, in a namespace of its own (its geometry's)."""
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        # Exactly these: a subclass may keep part of a page outside kv_buffer (the MXFP8
        # pool's scales), which storing kv_buffer alone would restore stale.
        if type(pool) not in (MHATokenToKVPoolHost, MLATokenToKVPoolHost):
            raise ValueError(
                f"kvbroker: HiCache host pool {type(pool).__name__} is not "
                "stored (only MHATokenToKVPoolHost and MLATokenToKVPoolHost "
                "pages, whose kv_buffer holds them whole)"
            )
        buffer = pool.kv_buffer
        if (
            not hasattr(buffer, "data_ptr")
            or buffer.device.type != "cpu"
            or not buffer.is_contiguous()
        ):
            raise ValueError(
                "kvbroker: the HiCache host pool must be one contiguous CPU "
                f"tensor (kv_buffer); {type(pool).__name__} has another "
                "form"
            )
        mla = bool(self.config.is_mla_model)
        head_num = None if mla else int(pool.head_num)
        if not mla and getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise ValueError(
                "kvbroker: K and V head sizes differ; the host pool's layout "
                "for that is not supported"
            )
        geometry = PageGeometry.of(
            pool.layout,
            tuple(buffer.shape),
            buffer.element_size(),
            pool.page_size,
            pool.size,
            paired=not mla,
        )
        sharding = Sharding.of(self.config, head_num)
        if sharding.per_rank > 1 and pool.layout != "page_head":
            raise ValueError(
                "kvbroker: splitting heads (tp_lcm_size) needs the page_head "
                f"host layout, not {pool.layout!r}"
            )
        facts = [
            getattr(pool, attr, None)
            for attr in ("layer_num", "head_dim", "v_head_dim", "kv_cache_dim")
        ]
        namespace = namespace_for(
            self.model,
            pool=type(pool).__name__ + (f".{name}" if name else ""),
            layout=pool.layout,
            dtype=str(pool.dtype).removeprefix("torch."),
            geometry=facts,
            total_kv_heads=sharding.total_kv_heads,
            page_size=pool.page_size,
            format_tag=getattr(pool, "storage_format_tag", None),
            prefix=self.prefix,
        )
        return PageStore(
            self.link,
            namespace,
            cache_salt=self.cache_salt,
            sharding=sharding,
            geometry=geometry,
            host=Source.of_tensor(buffer),
            checksum=self.checksum,
            warnings=self.warnings,
            tag=f".{name}" if name else "",
        )

    def _store(self) -> PageStore:
        if self.store is None:
            raise RuntimeError("kvbroker: register_mem_pool_host was not called")
        return self.store

    def _starts(self, n: int, host_indices) -> list[int] | None:
        page = self._store().geometry.page_size
        if host_indices is None or host_indices.numel() != n * page:
            self.warnings.warn(
                "bad_call",
                "host_indices hold %s tokens for %d pages of %d: the batch is skipped",
                None if host_indices is None else host_indices.numel(),
                n,
                page,
            )
            return None
        return host_indices[::page].tolist()

    # -- the zero-copy interface (``"interface_v1": 1``) ---------------------------------------
    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        return self._store().count(keys) if keys else 0

    def batch_get_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        if not keys:
            return []
        starts = self._starts(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)
        store = self._store()
        began = time.perf_counter()
        got = store.read(keys, [store.host_page(t) for t in starts])
        self._record("prefetch", got, began)
        return [i < got for i in range(len(keys))]

    def batch_set_v1(self, keys: list[str], host_indices, extra_info=None) -> list[bool]:
        if not keys:
            return []
        starts = self._starts(len(keys), host_indices)
        if starts is None:
            return [False] * len(keys)
        store = self._store()
        prefix = getattr(extra_info, "prefix_keys", None)
        began = time.perf_counter()
        ok = store.write(
            keys, [store.host_page(t) for t in starts], parent=prefix[-1] if prefix else None
        )
        self._record("backup", len(keys) if ok else 0, began)
        return [ok] * len(keys)

    # -- hybrid models' extra pools (v2) -------------------------------------------------------
    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """A hybrid model's extra pool: a Mamba pool's state pages (:mod:`._states`) or a
        sliding-window pool's pages (:mod:`._pages`, as the KV pool's); any other pool is
        said once and served as a miss (its transfers False, a hit needing it none)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == "kv" or host_pool is self.mem_pool_host:
            return
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

        try:
            if isinstance(host_pool, MambaPoolHost):
                store = self._state_store(host_pool, name)
            else:
                store = self._page_store(host_pool, name)
        except ValueError as exc:
            self.unsupported[name] = str(exc)
            log.warning(
                "kvbroker: HiCache pool %r is not stored (%s): a hit that needs it is a miss",
                name,
                exc,
            )
            return
        self.pools[name] = store
        log.info("kvbroker: HiCache pool %r stored in namespace %s", name, store.namespace)

    def _state_store(self, pool, name: str) -> StateStore:
        sharding = Sharding.of(self.config, None)  # its pp / cp suffix
        probe = StateStore(
            self.link,
            "-",
            cache_salt="",
            pool=pool,
            tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
            tag="",
        )
        namespace = namespace_for(
            self.model,
            pool=f"{type(pool).__name__}.{name}",
            layout=pool.layout,
            dtype="state",
            geometry=probe.format.meta()["parts"],
            total_kv_heads=None,
            page_size=1,
            format_tag=None,
            prefix=self.prefix,
        )
        return StateStore(
            self.link,
            namespace,
            cache_salt=self.cache_salt,
            pool=pool,
            tp_rank=self.config.tp_rank,
            tp_size=self.config.tp_size,
            tag=f".{name}{sharding.extra}",
            checksum=self.checksum,
            warnings=self.warnings,
        )

    def _pool(self, name) -> PageStore | StateStore | None:
        name = str(name)
        if name == "kv":
            return self.store
        store = self.pools.get(name)
        if store is None:
            self.warnings.warn(
                f"v2_{name}",
                "HiCache pool %r is not stored by kvbroker (%s): served as a miss",
                name,
                self.unsupported.get(name, "it was never registered"),
            )
        return store

    def _slots(self, store, n: int, host_indices) -> list[int] | None:
        """The host positions of ``n`` pages of ``store`` (a token for pages, a slot for
        states), or None (said) when ``host_indices`` does not hold ``n`` pages."""
        page = store.geometry.page_size if isinstance(store, PageStore) else 1
        if host_indices is None or host_indices.numel() != n * page:
            self.warnings.warn(
                "bad_call",
                "host_indices hold %s entries for %d pages of %d: the batch is skipped",
                None if host_indices is None else host_indices.numel(),
                n,
                page,
            )
            return None
        return host_indices[::page].tolist()

    def batch_exists_v2(self, keys: list[str], pool_transfers=None, extra_info=None):
        """The longest prefix of ``keys`` whose KV pages, and every pool's pages as its hit
        policy asks, the node holds: ``all_pages`` pools over the whole prefix (one match),
        ``trailing_pages`` pools (Mamba, SWA: ``len(transfer.keys)`` pages) over the pages
        before each stop point, every stop point being judged (one round trip per pool)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransferResult

        kv = self.batch_exists(keys, extra_info)
        hits = {"kv": kv} if kv else {}
        restorable = list(range(1, kv + 1))
        for transfer in pool_transfers or ():
            if not restorable:
                break
            name, store = str(transfer.name), self._pool(transfer.name)
            if store is None:
                restorable = []
                break
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = store.count(keys[:kv])
                serves = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                held = store.present(keys[:kv])
                serves = {p for p in range(1, kv + 1) if all(held[max(0, p - window) : p])}
                boundary = max(serves, default=0)
            else:  # BLOCK_GROUPS (DeepSeek V4's compressed pools): not stored
                self.warnings.warn(
                    f"policy_{name}",
                    "HiCache pool %r asks hit policy %s, which kvbroker does not serve: a miss",
                    name,
                    transfer.hit_policy,
                )
                restorable = []
                break
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in serves]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def batch_get_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer_v2(t, extra_info, write=False) for t in transfers}

    def batch_set_v2(self, transfers, extra_info=None) -> dict[str, list[bool]]:
        return {str(t.name): self._transfer_v2(t, extra_info, write=True) for t in transfers}

    def _transfer_v2(self, transfer, extra_info, *, write: bool) -> list[bool]:
        """One pool's pages: the leading ones copied (get), or all of them or none (set)."""
        keys = list(transfer.keys or ())
        try:
            return self._move(transfer, keys, extra_info, write=write)
        except Exception:  # noqa: BLE001 - an exception would end SGLang's backup thread
            log.exception(
                "kvbroker: HiCache %s of pool %r failed; served as a miss",
                "set" if write else "get",
                str(transfer.name),
            )
            return [False] * len(keys)

    def _move(self, transfer, keys: list[str], extra_info, *, write: bool) -> list[bool]:
        store = self._pool(transfer.name) if keys else None
        starts = self._slots(store, len(keys), transfer.host_indices) if store else None
        if starts is None:
            return [False] * len(keys)
        if isinstance(store, PageStore):
            starts = [store.host_page(t) for t in starts]
        if write:
            if isinstance(store, StateStore):
                ok = store.write(keys, starts)
            else:  # pages of a chain: parented on the caller's page before them
                prefix = getattr(extra_info, "prefix_keys", None)
                ok = store.write(keys, starts, parent=prefix[-1] if prefix else None)
            return [ok] * len(keys)
        got = store.read(keys, starts)
        return [i < got for i in range(len(keys))]

    # -- the older interface: flat page tensors (SGLang's get_data_page(flat=True)) -----------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location=None, target_sizes=None):
        found = self.batch_get([key], [target_location])
        return found[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list:
        if not keys:
            return []
        store = self._store()
        try:
            pages = [Source.flat_page(t, store.geometry) for t in target_locations]
        except (TypeError, ValueError) as exc:
            self.warnings.warn("bad_call", "batch_get: %s; the batch is a miss", exc)
            return [None] * len(keys)
        got = store.read(keys, pages)
        return [t if i < got else None for i, t in enumerate(target_locations)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self, keys: list[str], values=None, target_locations=None, target_sizes=None
    ) -> bool:
        if not keys:
            return True
        store = self._store()
        try:
            if len(values) != len(keys):
                raise ValueError(f"{len(values)} values for {len(keys)} keys")
            pages = [Source.flat_page(v, store.geometry) for v in values]
        except (TypeError, ValueError) as exc:
            self.warnings.warn("bad_call", "batch_set: %s; the batch is not stored", exc)
            return False
        return store.write(keys, pages)

    # -- operations ------------------------------------------------------------------------
    def clear(self) -> bool:
        """Evict this rank's pages of the namespace (every engine's that cuts heads as this
        one does), and of each extra pool's; pages being read are kept. False when the broker
        is down."""
        stores = [s for s in (self.store, *self.pools.values()) if s is not None]
        return all([s.clear() for s in stores])

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call: pages per batch and GB/s of each
        prefetch and backup (SGLang's metrics collector reads them)."""
        cls = _metrics()
        if cls is None:
            return None
        metrics = cls()
        with self._stats_lock:
            for name, values in self._metrics.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics

    def stats(self) -> dict[str, int]:
        """Totals since start: pages read, written, found already stored, skipped; errors
        (an extra pool's under its name: ``mamba.read_pages``...)."""
        totals = self.store.totals() if self.store is not None else {}
        for name, store in self.pools.items():
            totals.update({f"{name}.{k}": v for k, v in store.totals().items()})
        return totals

    def _record(self, kind: str, pages: int, began: float) -> None:
        if not self.config.enable_storage_metrics or not pages:
            return
        seconds = time.perf_counter() - began
        nbytes = pages * self._store().page_nbytes
        with self._stats_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def close(self) -> None:
        for store in (self.store, *self.pools.values()):
            if store is not None:
                store.settle()  # the last batch's seal: its reply, before the connection ends
        self.link.close()

    def __repr__(self) -> str:
        return f"KVBrokerStorage(namespace={self.namespace!r})"
