"""The worker half of the connector: load into and save from this rank's paged KV cache.

No vLLM import (duck-typed; driven directly by the tests). Per engine step:

1. ``bind(plan)``: the scheduler's :class:`~._scheduler.StepPlan`.
2. ``start_load()``: every load of the plan. Each rank matches its own shards
   (:meth:`kvbroker.prefix.PrefixCache.match_kv`, resharding from another TP layout when
   needed) and loads the leading blocks it found; blocks it did not find (evicted since the
   lookup), or could not load (broker down, layout mismatch), are reported by
   ``load_errors()`` so vLLM recomputes them. Nothing is ever half-loaded: a block is
   reported unless its bytes were copied in full. A load is synchronous (done before the
   forward pass) unless the plan marks it ``background`` (``load_async``): those run on a
   thread of their own (:mod:`._async_loads`, which says who owns what meanwhile) and
   ``finished_loads()`` reports each once it is over.
3. ``save_layer(name)`` after each layer's attention: host caches copy that layer's K and V
   of the step's new blocks into their reserved extents (the reservation is made at the
   first layer: one round trip for the whole step).
4. ``wait_for_save()``: seals the step's blocks, but only if every layer was copied (a
   forward pass that died half-way leaves no half-written block: the step's reservations
   are aborted). CUDA caches gather and DMA every layer here.

The broker being down, full or slow never fails a step: loads become load errors (vLLM
recomputes), saves are skipped, each with a counted, rate-limited warning.

A failed load taints what is computed from it, and nothing tainted is published:

- The TP ranks agree on what loaded (``agree``: the least of every rank's count per load,
  one small all-reduce in steps that load). A rank whose own shards all loaded still
  computed its layers from another rank's unloaded heads (the all-reduce after attention),
  so every rank treats the load as failed where any rank's failed.
- The failed request's saves are dropped, and so is every other request's save from the
  first failed block in it on: vLLM's prefix cache hands the failed blocks to requests
  scheduled beside it.
- Both last until a plan acknowledges the failure (:attr:`~._scheduler.StepPlan.
  acknowledged`): under vLLM's async scheduling the next step was planned before the failure
  was known, and its saves would publish the request's next chunk, computed from the
  unloaded blocks. After that the scheduler side plans the saves again, from the recomputed
  blocks (``SchedulerSide.load_failed``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvbroker.errors import (
    BrokerUnavailable,
    KVBrokerError,
)

from .._link import CONNECTION_ERRORS, BrokerLink, Warnings
from . import log
from ._async_loads import AsyncLoads, Lost
from ._format import BlockFormat
from ._worker_save import WorkerSaves
from ._handoff import HANDOFF_STATS, HandoffConfig, HandoffWorker
from ._paged import (
    HostSave,
    attention_format,
    cuda_cache,
    distinct_layers,
    host_cache,
    interpret,
    load_host,
)

__all__ = ["WorkerSide"]

_UNPLANNED = "the scheduler side could not plan its load"
REPORT_EVERY = 2.0  # seconds between the worker's counter reports to the daemon
STAT_KEYS = (
    "loads",
    "loaded_blocks",
    "loaded_tokens",
    "loaded_bytes",
    "load_failed_blocks",
    "saved_blocks",
    "saved_tokens",
    "saved_bytes",
    "existing_blocks",
    "skipped_save_blocks",
    "broker_errors",
    "loaded_state_bytes",
    "saved_state_bytes",
    *HANDOFF_STATS,
)
# Steps a failed load taints saves for when no plan acknowledges it (a backstop: vLLM reports
# every step's invalid blocks to the scheduler side, whose next plan acknowledges them).
FAILURE_MEMORY = 16

# agree(loaded) -> the least count per load over every TP rank (each rank calls it with its
# own counts, in the same steps: a collective).
Agreement = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class _LoadFailure:
    req_id: str
    blocks: frozenset[int]
    step: int  # the worker's step count when it failed


class WorkerSide(HandoffWorker, WorkerSaves):
    def __init__(
        self,
        *,
        link: BrokerLink,
        namespace: str,
        block_size: int,
        total_kv_heads: int | None,
        latent: bool,
        tp_rank: int,
        tp_size: int,
        peer_tp_sizes: tuple[int, ...] = (),
        warnings: Warnings,
        agree: Agreement | None = None,
        handoff: HandoffConfig | None = None,
    ) -> None:
        self.link, self.namespace, self.block_size = link, namespace, block_size
        self.handoff = handoff or HandoffConfig()  # same-node P/D through the GPU rings
        self.agree = agree  # None: this rank's loads are the only ones (TP 1)
        self.total_kv_heads = None if latent else total_kv_heads
        self.latent = latent
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.peer_tp_sizes = tuple(peer_tp_sizes)
        self.warnings = warnings
        self.fmt: BlockFormat | None = None
        self.cache = None  # PagedKV (host) or a 6-d CUDA view
        self.device = "cpu"
        self.cuda_device = None  # the torch device of a CUDA cache
        self.layer_index: dict[str, int | None] = {}
        self.stats: Counter[str] = Counter()  # since vLLM last took them (its stats hook)
        self.totals: Counter[str] = Counter()  # taken before, for the broker's report
        self._reported_at = 0.0
        self._invalid: set[int] = set()
        self._failures: list[_LoadFailure] = []  # not yet acknowledged by a plan
        self._step = 0
        self._plan = None
        self._save: HostSave | None = None
        self._layers_seen: set[int] = set()
        self._hooks_active = False  # save_layer has been called in this process
        self._gpu = None  # kvbroker.gpu.GpuClient over the link's client (CUDA caches)
        self._ready = None  # CUDA: where the bound step's background loads may start (bind)
        self._loads: AsyncLoads | None = None  # background loads (load_async), made at the first
        self._load_stream = None  # their CUDA stream, made on (and used by) their thread only
        self._lost_client = None  # (loader thread) the client a load found the daemon lost on
        self._released = False  # release_cache (vLLM's sleep mode) until restore_cache

    # -- registration ----------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any], backend: str) -> None:
        """Learn vLLM's per-layer caches. Layers that share another layer's cache (vLLM's
        cross-layer KV sharing) are stored once."""
        tensors, self.layer_index = distinct_layers(kv_caches.items())
        if not tensors:
            raise KVBrokerError("register_kv_caches: no KV cache tensors")
        how = interpret(backend, latent=self.latent)
        self.fmt = attention_format(
            tensors,
            how,
            block_size=self.block_size,
            total_kv_heads=self.total_kv_heads,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )
        first = tensors[0]
        self.device = first.device.type
        self.cache = host_cache(tensors, how) if self.device == "cpu" else cuda_cache(tensors, how)
        self.cuda_device = None if self.device == "cpu" else first.device
        log.info(
            "kvbroker: %d layer(s) of %s cache (%s, %s), %d B per block, namespace %s",
            len(tensors),
            self.device,
            how,
            self.fmt.dtype,
            self.fmt.block_nbytes,
            self.namespace,
        )

    def release_cache(self) -> None:
        """Let go of the engine's KV cache: vLLM's sleep mode is about to discard it (its
        ``unregister_kv_caches``; ``register`` again after the wake-up). Waits for the
        background loads, which write into it, and reports each that completed as failed
        (what it loaded is discarded with the cache: vLLM recomputes a request that outlives
        the sleep); aborts a save left open; closes the CUDA registration of the pools (its
        streams synchronized first). Leases: a load's ended with its copies, a save's with
        the abort. Idempotent."""
        if self.cache is None:
            return
        self._released = True
        if self._loads is not None:
            self._loads.drain_lost("vLLM's sleep mode discarded the KV cache it loaded into")
        if self._save is not None and not self._save.done:
            self._abort_save("the KV cache was released for vLLM's sleep mode")
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self.cache = None
        self._ready = None

    def restore_cache(self, kv_caches: dict[str, Any], backend: str) -> None:
        """After the wake-up: :meth:`register` the same caches again. Idempotent."""
        if self._released:
            self.register(kv_caches, backend)
            self._released = False

    # -- per step --------------------------------------------------------------------------
    def bind(self, plan: Any) -> None:
        if self._released and (getattr(plan, "loads", None) or getattr(plan, "saves", None)):
            # vLLM steps no engine between unregister_kv_caches and restore_kv_caches
            raise KVBrokerError(
                "KVBrokerConnector: a step with loads or saves came while the "
                "KV cache was released for sleep mode (restore_kv_caches was "
                "not called)"
            )
        if self._save is not None and not self._save.done:  # a step that never finalized
            self._abort_save("the step ended before its save was sealed")
        self._plan = plan
        self._save = None
        self._layers_seen = set()
        self._step += 1
        self._ready = None
        if self.device != "cpu" and any(
            getattr(s, "background", False) for s in getattr(plan, "loads", ())
        ):
            # vLLM binds after the step's block zeroing and copy-on-write copies and before
            # its forward, which never touches a parked request's blocks: the background
            # loads of this step wait for what is queued now, and not for the forward.
            try:
                self._ready = _queued_on(self.cuda_device)
            except Exception:  # noqa: BLE001 - start_load tries again, and fails the loads
                self._ready = None
        acknowledged = getattr(plan, "acknowledged", None) or set()
        self._failures = [
            f
            for f in self._failures
            if not f.blocks <= acknowledged and self._step - f.step <= FAILURE_MEMORY
        ]

    def unbind(self) -> None:
        if self._save is not None and not self._save.done:
            self._abort_save("the step ended before its save was sealed")
        self._plan = None
        self._save = None

    def _client(self):
        return self.link.get()

    def _gpu_client(self, client):
        from kvbroker.gpu import GpuClient

        if self._gpu is None or self._gpu.client is not client:
            if self._gpu is not None:
                self._drain_loads()  # they copy from pools the old one registered
                self._gpu.close()
            self._gpu = GpuClient(client, device=self.cuda_device, own_client=False)
        return self._gpu

    def start_load(self) -> None:
        plan = self._plan
        if plan is None or not plan.loads or self.fmt is None:
            return
        # (every rank has the same plan: they all take the same branches, agree() included)
        later = [spec for spec in plan.loads if getattr(spec, "background", False)]
        if later:
            self._start_background(later)
        now = [spec for spec in plan.loads if not getattr(spec, "background", False)]
        if now:
            self._load_now(now)

    def _load_now(self, loads: list) -> None:
        own = []
        for spec in loads:  # every rank reaches agree() below, whatever fails here
            try:
                own.append(self._load(spec))
            except Exception as exc:  # noqa: BLE001 - _load catches the expected ones
                own.append(0)
                self.warnings.warn(
                    "load_failed",
                    "could not load request %s (%s: %s): vLLM recomputes it",
                    spec.req_id,
                    type(exc).__name__,
                    exc,
                )
        agreed = own
        if self.agree is not None:
            try:
                agreed = [min(a, b) for a, b in zip(own, self.agree(own), strict=True)]
            except Exception as exc:  # noqa: BLE001 - unknown: treat every load as failed
                agreed = [0] * len(own)
                self.warnings.warn(
                    "agree_failed",
                    "could not compare loads with the other "
                    "TP ranks (%s: %s): treating them as failed",
                    type(exc).__name__,
                    exc,
                )
        for spec, mine, n in zip(loads, own, agreed, strict=True):
            if n < len(spec.block_ids):
                failed = spec.block_ids[n:]
                self._invalid.update(failed)
                self._failures.append(_LoadFailure(spec.req_id, frozenset(failed), self._step))
                if mine >= len(spec.block_ids):
                    self.warnings.warn(
                        "load_failed_elsewhere",
                        "another TP rank could not "
                        "load %d of %d blocks of request %s: vLLM recomputes "
                        "them",
                        len(failed),
                        len(spec.block_ids),
                        spec.req_id,
                    )

    def _load(self, spec: Any) -> int:
        """Load ``spec`` into this rank's cache now; returns how many leading blocks loaded."""
        if not spec.hashes:
            return self._account(spec, 0, _UNPLANNED)
        client = self._client()
        if client is None:
            return self._account(spec, 0, "the broker is unavailable")
        try:
            stream = self._gpu_client(client).stream if self.device != "cpu" else None
            loaded = self._copy_in(spec, client, stream)
        except Exception as exc:  # noqa: BLE001 - a load must never fail the step
            return self._load_failed(spec, client, exc)
        return self._account(spec, loaded)

    def _copy_in(self, spec: Any, client: Any, stream: Any) -> int:
        if self.device == "cpu":
            return load_host(
                client,
                self.namespace,
                self.fmt,
                self.cache,
                spec.hashes,
                spec.block_ids,
                self.peer_tp_sizes,
            )
        return self._load_cuda(spec, client, stream)  # (._handoff: the rings first, if any)

    def _load_failed(self, spec: Any, client: Any, exc: BaseException) -> int:
        self.stats["broker_errors"] += 1
        if isinstance(exc, KVBrokerError):
            self._link_failed(exc, client)
        return self._account(spec, 0, f"{type(exc).__name__}: {exc}")

    def _account(
        self, spec: Any, loaded: int, why: str = "blocks were evicted since the lookup"
    ) -> int:
        """Count a load that is over (``loaded`` of its blocks; ``why`` the rest did not)."""
        n_want = len(spec.block_ids)
        self.stats["loads"] += 1
        self.stats["loaded_blocks"] += loaded
        self.stats["handoff_loaded_blocks"] += min(loaded, getattr(spec, "ring_loaded", 0))
        self.stats["loaded_tokens"] += loaded * self.block_size
        self.stats["loaded_bytes"] += loaded * self.fmt.block_nbytes
        if loaded < n_want:
            failed = n_want - loaded
            self.stats["load_failed_blocks"] += failed
            self.warnings.warn(
                "load_failed",
                "could not load %d of %d blocks of request %s (%s): vLLM recomputes them",
                failed,
                n_want,
                spec.req_id,
                why,
            )
        return loaded

    def _link_failed(self, exc: BaseException, client: Any = None) -> None:
        """``exc`` came from ``client`` (None: the link's current one): take the link down if
        it means the connection is gone, once no background load uses that client."""
        if client is not None and not self.link.holds(client):
            return  # an earlier connection's error: the link has moved on already
        if isinstance(exc, CONNECTION_ERRORS):
            self._drain_loads()  # closing the client unmaps the pools they copy from
        self.link.fail(exc)

    # -- background loads (load_async) ----------------------------------------------------
    def _start_background(self, specs: list) -> None:
        """Hand ``specs`` to the loader thread. Whatever fails here fails those loads (each
        reported over, its blocks recomputed), never the step."""
        client = self._client()
        if self._loads is None:
            self._loads = AsyncLoads(self._loader_started)
            log.info(
                "kvbroker: load_async: requests wait parked while their blocks load on "
                "this worker's loader thread"
            )
        ready = None
        if client is not None and self.device != "cpu":
            try:
                self._gpu_client(client)  # the pools registered for DMA, as for a load now
                # The loads write after what the engine had queued when the step was bound:
                # the zeroing of new blocks, and readers of blocks a finished request freed.
                # (bind records it for a plan with background loads)
                ready = self._ready or _queued_on(self.cuda_device)
            except Exception as exc:  # noqa: BLE001 - as a load now that fails
                for spec in specs:
                    self._loads.fail(spec, client, exc)
                return
        for spec in specs:
            self._loads.submit(spec, client, self._copy_in_background, spec, client, ready)

    def _loader_started(self) -> None:
        """On the loader thread, once: its CUDA device and the stream its copies go on."""
        if self.device == "cpu":
            return
        import torch

        torch.cuda.set_device(self.cuda_device)
        self._load_stream = torch.cuda.Stream(self.cuda_device)

    def _copy_in_background(self, spec: Any, client: Any, ready: Any) -> int:
        """On the loader thread: the copies of ``spec``, complete when this returns."""
        if client is None or not spec.hashes:
            return 0
        if client is self._lost_client:
            # A hung or dead daemon: the loads queued behind the one that found it fail at
            # once, instead of each waiting out its own timeout.
            raise BrokerUnavailable("an earlier load on this connection lost the daemon")
        try:
            if ready is None:
                return self._copy_in(spec, client, None)
            import torch

            stream = self._load_stream
            stream.wait_event(ready)
            with torch.cuda.stream(stream):
                return self._copy_in(spec, client, stream)
        except CONNECTION_ERRORS:
            self._lost_client = client
            raise

    def finished_loads(self) -> set[str] | None:
        """The requests whose background load ended since the last call (vLLM's
        ``get_finished``); the blocks they did not load go to :meth:`load_errors`, which
        vLLM asks in the same step."""
        if self._loads is None:
            return None
        done = set()
        for f in self._loads.finished():
            spec = f.spec
            if not self._planned(spec):
                loaded = self._account(spec, 0, _UNPLANNED)
            elif f.client is None:
                loaded = self._account(spec, 0, "the broker is unavailable")
            elif isinstance(f.result, Lost):
                loaded = self._account(spec, 0, f.result.why)
            elif isinstance(f.result, BaseException):
                loaded = self._load_failed(spec, f.client, f.result)
            else:
                loaded = self._account(spec, f.result)
            self._load_over(spec, loaded)
            done.add(spec.req_id)
        return done or None

    def _planned(self, spec: Any) -> bool:
        """Whether the scheduler side could plan ``spec`` (a load it could not fails)."""
        return bool(spec.hashes)

    def _load_over(self, spec: Any, loaded: int) -> None:
        """A background load ended with ``loaded`` leading blocks copied: vLLM recomputes
        the rest."""
        if loaded < len(spec.block_ids):
            self._invalid.update(spec.block_ids[loaded:])

    def _drain_loads(self) -> None:
        if self._loads is not None:
            self._loads.drain()

    def load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_stats(self) -> dict[str, int]:
        out = {k: self.stats.get(k, 0) for k in STAT_KEYS}
        self.totals.update(self.stats)
        self.stats.clear()
        return out

    def report_if_due(self, every: float = REPORT_EVERY) -> bool:
        """Tell the daemon this worker's totals (``kvbroker stat`` shows them per client), at
        most every ``every`` seconds; never raises (a broker that is down misses a report)."""
        now = time.monotonic()
        if now - self._reported_at < every:
            return False
        client = self.link.get()
        if client is None:
            return False
        self._reported_at = now
        totals = self.totals + self.stats
        try:
            client.ops.report({k: totals.get(k, 0) for k in STAT_KEYS})
        except KVBrokerError as exc:
            self._link_failed(exc)
            return False
        return True

    def close(self) -> None:
        if self._loads is not None:
            self._loads.close()  # they write into the engine's cache, from the client's pools
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self.link.close()


def _queued_on(device):
    """A CUDA event after what is queued on ``device``'s current stream now."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
