"""``KVBrokerConnector``: kvbroker as a vLLM (v1) KV connector.

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVBrokerConnector",
      "kv_role": "kv_both", "kv_connector_extra_config": {"socket": "/run/kvbroker/kvbroker.sock"}}'

vLLM finds the name through kvbroker's ``vllm.general_plugins`` entry point (:mod:`.plugin`);
where kvbroker is not installed (only on ``PYTHONPATH``) add
``"kv_connector_module_path": "kvbroker.integrations.vllm"``.

Roles: ``kv_producer`` saves the KV of every prompt it computes; ``kv_consumer`` loads the
longest prefix of each prompt the node holds instead of computing it; ``kv_both`` does both
(prefix reuse across data-parallel ranks or engines). ``kv_connector_extra_config`` keys:

- ``socket``: the daemon's socket (default: ``$KVBROKER_SOCKET``, then kvbroker's defaults);
- ``namespace``: prefix of the broker namespace (default ``vllm``; under ``[isolation]``
  tenant mode use one the engine's user may write, e.g. ``"USER/vllm"``);
- ``model_id``: the model's identity in the namespace (default: the model path or name);
- ``peer_tp_sizes``: TP sizes of the other engines whose blocks this one may read (a decode
  engine with TP 2 reading a prefill engine with TP 4: ``[4]``; a hybrid model's state groups:
  where :func:`._groups.state_splits` knows their sharding, else refused at start);
- ``timeout`` (seconds, default 5): the longest a broker call may take before the broker
  is treated as down; ``retry_min`` / ``retry_max`` (seconds, default 1 / 30): the first and
  the longest wait between reconnection attempts while it is down;
- ``load_async`` (default false): load beside the engine's steps. vLLM parks a request
  whose blocks are loading and steps the others meanwhile, so no step waits for another
  request's copies; the request itself runs a step or two later than with a synchronous
  load, which copies before the forward of the step that runs it (:mod:`._async_loads`);
- ``handoff`` (default ``"off"``), ``handoff_tp_size``, ``handoff_rings``, ``handoff_ttl``:
  same-node P/D, GPU to GPU through the daemon's staging rings (``serve --gpu-ring``), with
  ``"ring"`` (the host pools only for what a ring has no room for) or ``"ring+host"`` (the
  host pools keep a copy too, for later reuse); CUDA caches of single-group models
  (:mod:`._handoff`);
- ``kv_load_failure_policy`` (default ``"recompute"``): what vLLM does with blocks that could
  not be loaded (evicted since the lookup, broker down). The connector sets vLLM's
  ``kv_transfer_config.kv_load_failure_policy`` to this, because vLLM's own default,
  ``"fail"``, fails the request, which suits a transfer that must arrive, not a cache.

Hybrid models (sliding-window, Mamba or linear-attention layers beside full attention:
Gemma-3/4, gpt-oss, Qwen3-Next, Granite-4...) are served with vLLM's hybrid KV cache manager
on (the connector implements ``SupportsHMA``): one KV cache group per kind of layer, each with
its own keys, format and block size, sliding windows loaded alone, Mamba states saved and
loaded whole at prefill checkpoints, every load asynchronous (:mod:`._groups`, :mod:`._hybrid`,
:mod:`._hybrid_worker`, :mod:`._state`; host or CUDA caches). A model with one full-attention
group keeps the single-group path below, namespace, keys and format unchanged.

Which parts run where, what they hold, and who owns every buffer: :mod:`._scheduler`
(lookups and the per-step plan, in the scheduler process), :mod:`._worker` and
:mod:`._paged` (the copies, in each worker), :mod:`._link` (the broker being down or full).
In short: vLLM owns its paged blocks and may reuse a block as soon as the step that loads or
saves it is over (every copy completes within that step; nothing is kept), or, for a
background load, once every worker has reported it finished (after its last copy); the
broker owns every published block; a save holds write leases only during its step and a load
one read lease only while it copies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .._extra import unknown_keys
from .._link import BrokerLink, LinkWords, Warnings
from . import log
from ._format import namespace_for
from ._groups import check_peer_layouts, groups_of, hybrid_namespace
from ._handoff import HANDOFF_KEYS, HandoffConfig
from ._hybrid import HybridScheduler
from ._hybrid_worker import HybridWorker
from ._scheduler import SchedulerSide, StepPlan
from ._worker import STAT_KEYS, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# What the broker being down means for a vLLM engine (kvbroker.integrations._link).
_LINK_WORDS = LinkWords(
    down="the engine keeps serving without it (prompts are computed, KV is not saved)",
    back="saving and loading KV resume",
)

__all__ = ["KVBrokerConnector", "KVBrokerMetadata", "KVBrokerStats"]

# Every kv_connector_extra_config key the connector reads (the module docstring says each);
# another is logged at start as unknown (a misspelling would silently mean the default).
EXTRA_KEYS = (
    "socket",
    "namespace",
    "model_id",
    "peer_tp_sizes",
    "timeout",
    "retry_min",
    "retry_max",
    "load_async",
    "kv_load_failure_policy",
    *HANDOFF_KEYS,
)


class KVBrokerMetadata(KVConnectorMetadata):
    """One step's :class:`~._scheduler.StepPlan`, scheduler -> workers (pickled)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KVBrokerStats(KVConnectorStats):
    """Per-interval worker counters: blocks/tokens/bytes loaded and saved, blocks whose load
    failed (recomputed), saves skipped (broker down or full), broker errors."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVBrokerStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in STAT_KEYS}
        out["loaded_MiB"] = round(out.pop("loaded_bytes") / 2**20, 2)
        out["saved_MiB"] = round(out.pop("saved_bytes") / 2**20, 2)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no TP group (a single process, a test)
        return 0


def _tp_agreement(tp_size: int):
    """The workers' :data:`~._worker.Agreement` over vLLM's TP group: a MIN all-reduce of
    the per-load counts on the group's CPU (gloo) side. None with TP 1."""
    if tp_size <= 1:
        return None

    def agree(counts: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        t = torch.tensor(counts, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        return t.tolist()

    return agree


# Parallelisms whose ranks hold KV that the keys (which name only the TP rank) cannot tell
# apart: pipeline stages hold different layers, context-parallel ranks different tokens.
_UNSUPPORTED_PARALLEL = (
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
)


def _check_parallelism(parallel_config: Any) -> None:
    for name in _UNSUPPORTED_PARALLEL:
        size = getattr(parallel_config, name, 1) or 1
        if size > 1:
            raise ValueError(
                f"KVBrokerConnector does not support {name} > 1 (it is {size}): its block keys "
                "name the TP rank only, so the KV of different pipeline stages or "
                "context-parallel ranks would share keys"
            )


def _is_classic(groups: list) -> bool:
    """One group of full attention (MLA included): the single-group path, whose namespace,
    keys and block format are those of every earlier kvbroker."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec)


class KVBrokerConnector(KVConnectorBase_V1, SupportsHMA):
    """kvbroker as vLLM's KV connector; see the module docstring."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        extra = dict(config.kv_connector_extra_config or {})
        for unknown in unknown_keys(extra, EXTRA_KEYS):
            log.warning("KVBrokerConnector: kv_connector_extra_config key %s is ignored", unknown)
        _check_parallelism(vllm_config.parallel_config)
        model_config = vllm_config.model_config
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if not groups:
            raise ValueError("KVBrokerConnector needs the engine's KV cache config")
        self._latent = bool(model_config.use_mla)
        self._block_size = vllm_config.cache_config.block_size
        total_heads = model_config.get_total_num_kv_heads()
        self._total_kv_heads = None if self._latent else total_heads
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        model_id = str(extra.get("model_id") or model_config.model)
        prefix = str(extra.get("namespace", "vllm"))
        self._groups = None  # the hybrid path's (several groups, or one that is not full)
        if _is_classic(groups):
            spec = groups[0].kv_cache_spec
            self._namespace = namespace_for(
                model_id,
                dtype=str(spec.dtype).removeprefix("torch."),
                block_size=self._block_size,
                num_layers=len(groups[0].layer_names),
                total_kv_heads=total_heads,
                head_size=spec.head_size,
                latent=self._latent,
                prefix=prefix,
            )
        else:
            self._groups = groups_of(
                kv_cache_config,
                tp_size=tp_size,
                total_kv_heads=total_heads,
                use_mla=self._latent,
                hf_config=getattr(model_config, "hf_text_config", None),
            )
            self._namespace = hybrid_namespace(model_id, self._groups, prefix=prefix)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        peers = tuple(int(p) for p in extra.get("peer_tp_sizes", ()))
        if self._groups and peers:
            check_peer_layouts(self._groups, peers)  # ValueError naming a group it cannot
        socket = extra.get("socket") or os.environ.get("KVBROKER_SOCKET") or None
        timeout = float(extra.get("timeout", 5.0))
        retry = {
            "retry_min": float(extra.get("retry_min", 1.0)),
            "retry_max": float(extra.get("retry_max", 30.0)),
        }
        self._warnings = Warnings(log)
        kv_role = config.kv_role
        # vLLM fails a request whose KV did not load by default ("fail"): right for a P/D
        # transfer that must arrive, wrong for a cache, where a block evicted since the lookup
        # is a miss. The blocks are recomputed instead, unless the extra config insists.
        policy = extra.get("kv_load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure_policy must be 'recompute' or 'fail', not {policy!r}"
            )
        config.kv_load_failure_policy = policy
        load_async = extra.get("load_async", False)
        if not isinstance(load_async, bool):
            raise ValueError(f"load_async must be true or false, not {load_async!r}")
        handoff = HandoffConfig.from_extra(extra)
        if handoff.on and self._groups:
            raise ValueError(
                "KVBrokerConnector: handoff serves models with one full-attention "
                "KV cache group; this model's groups go through the host pools"
            )
        save, load = kv_role in ("kv_producer", "kv_both"), kv_role in ("kv_consumer", "kv_both")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._registered: tuple[dict[str, Any], str] | None = None  # (kv caches, backend)
        if role == KVConnectorRole.SCHEDULER:
            link = BrokerLink(
                socket,
                name=f"vllm-scheduler-{os.getpid()}",
                role=kv_role,
                map_pools=False,
                timeout=timeout,
                **retry,
                warnings=self._warnings,
                words=_LINK_WORDS,
            )
            if self._groups:
                self._scheduler = HybridScheduler(
                    link=link,
                    namespace=self._namespace,
                    groups=self._groups,
                    tp_size=self._tp_size,
                    peer_tp_sizes=peers,
                    save=save,
                    load=load,
                    warnings=self._warnings,
                )
            else:
                self._scheduler = SchedulerSide(
                    link=link,
                    namespace=self._namespace,
                    block_size=self._block_size,
                    total_kv_heads=self._total_kv_heads,
                    latent=self._latent,
                    tp_size=self._tp_size,
                    peer_tp_sizes=peers,
                    save=save,
                    load=load,
                    warnings=self._warnings,
                    load_async=load_async,
                    handoff=handoff,
                )
        else:
            tp_rank = _tp_rank()
            link = BrokerLink(
                socket,
                name=f"vllm-worker-tp{tp_rank}of{self._tp_size}",
                role=kv_role,
                map_pools=True,
                timeout=timeout,
                **retry,
                warnings=self._warnings,
                words=_LINK_WORDS,
            )
            if self._groups:
                self._worker = HybridWorker(
                    groups=self._groups,
                    link=link,
                    namespace=self._namespace,
                    block_size=self._block_size,
                    tp_rank=tp_rank,
                    tp_size=self._tp_size,
                    peer_tp_sizes=peers,
                    warnings=self._warnings,
                )
            else:
                self._worker = WorkerSide(
                    link=link,
                    namespace=self._namespace,
                    block_size=self._block_size,
                    total_kv_heads=self._total_kv_heads,
                    latent=self._latent,
                    tp_rank=tp_rank,
                    tp_size=self._tp_size,
                    peer_tp_sizes=peers,
                    warnings=self._warnings,
                    agree=_tp_agreement(self._tp_size),
                    handoff=handoff,
                )
        log.info(
            "kvbroker: %s connector, role %s, namespace %s, socket %s",
            role.name.lower(),
            kv_role,
            self._namespace,
            socket or "default",
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # saves complete within their step: nothing is ever pending

    # -- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        if self._scheduler is not None:
            self._scheduler.state(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVBrokerMetadata(self._scheduler.build(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        if connector_output.invalid_block_ids:
            self._scheduler.load_failed(set(connector_output.invalid_block_ids))
        if connector_output.finished_recving:
            self._scheduler.loads_finished(connector_output.finished_recving)
        failed = getattr(connector_output, "failed_recving", None)
        if failed and self._groups:
            self._scheduler.loads_failed(failed)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # (SupportsHMA) saves complete within their step: no group's blocks are held
        self._scheduler.finished(request.request_id)
        return False, None

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._registered = (kv_caches, self._backend_name(kv_caches))
        self._worker.register(*self._registered)

    # vLLM >= 0.33's sleep mode (supports_sleep_mode: the base class's True). Before the KV
    # cache is discarded (CuMem allocator: unmapped, later mapped back at the same addresses),
    # and after it is back; its tensors stay the same objects.
    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.release_cache()

    def restore_kv_caches(self) -> None:
        if self._worker is not None and self._registered is not None:
            self._worker.restore_cache(*self._registered)

    def _backend_name(self, kv_caches: dict[str, Any]) -> str:
        context = self._vllm_config.compilation_config.static_forward_context
        for name in kv_caches:
            layer = context.get(name)
            backend = getattr(layer, "attn_backend", None)
            if backend is not None:
                return backend.get_name()
        first = next(iter(kv_caches.values()))
        return "CPU_ATTN" if first.device.type == "cpu" else "FLASH_ATTN"

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVBrokerMetadata)
            self._worker.bind(connector_metadata.plan)

    def clear_connector_metadata(self) -> None:
        if self._worker is not None:
            self._worker.unbind()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a load runs before the forward (start_load_kv) or for a parked request

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # (saves never outlive their step: nothing to report as sent)
        return None, self._worker.finished_loads() if self._worker is not None else None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        if isinstance(self._worker, HybridWorker):
            # vLLM takes a hybrid model's load failures per request only (its block ids
            # are per group): it recomputes these
            results.failed_recving = self._worker.failed_loads()
        return results

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        try:
            self._worker.wait_for_save()
        finally:
            self._worker.report_if_due()  # the totals `kvbroker stat` shows for this worker

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KVBrokerStats | None:
        if self._worker is None:
            return None
        stats = KVBrokerStats(data=self._worker.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBrokerStats:
        return KVBrokerStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.link.close()
