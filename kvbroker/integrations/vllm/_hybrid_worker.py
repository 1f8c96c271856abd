"""The worker half of the connector for hybrid models: per-group loads and saves.

No vLLM import (duck-typed). A :class:`~._worker.WorkerSide` whose cache is one per KV cache
group (:mod:`._groups`): attention groups are paged K/V caches read and written as on the
single-group path (:mod:`._paged`, one :class:`~._format.BlockFormat` per group, its own block
size), state groups are state pages (:mod:`._state`). Every group's layers alias vLLM's one
memory pool; a block id names the bytes of the group whose block table holds it.

Per engine step:

- loads all run in the background (:mod:`._hybrid` says why): each request's load copies
  every group's planned blocks (never the null block) and is reported by ``finished_loads``;
  one that did not copy every block is also reported by ``failed_loads`` (vLLM's
  ``failed_recving``), and vLLM recomputes the request. Nothing is reported per block.
- ``save_layer`` copies an attention layer's new blocks of its group into that group's
  reservation (made at its first layer, one round trip per group); state groups have no
  attention layer and no ``save_kv_layer`` call: ``wait_for_save`` copies their pages whole,
  then seals every group's blocks, only if every attention layer ran (else all abort).

CUDA caches take the classic path's staging and DMA (:mod:`._cuda`), per group: an attention
group is one ``(layer, kv, block, token, head, head_dim)`` view of its layers
(:func:`._paged.cuda_cache`: vLLM lays a group's layers at one stride in the pool the groups
share), loaded and saved by :func:`._cuda.load_cuda` / :func:`._cuda.save_cuda` as the
single-group path does; a state group's pages (:class:`._state.StatePages`) are gathered
whole into the same staging by ``save_cuda`` and loaded by :func:`._cuda.load_state_cuda`.
``save_layer`` copies nothing there: ``wait_for_save`` saves each group in turn once every
attention layer ran (a group sealed before a later one fails stays published: each of its
blocks is whole, and a lookup needs every group). Every byte crosses PCIe once each way.
"""

from __future__ import annotations

from typing import Any

from kvbroker import blocks
from kvbroker.errors import KVBrokerError, LayoutMismatch

from . import log
from ._format import BlockFormat
from ._groups import STATE, Group
from ._paged import (
    HostSave,
    SaveItem,
    attention_format,
    cuda_cache,
    distinct_layers,
    host_cache,
    interpret,
    load_host,
)
from ._state import (
    StatePages,
    StateSave,
    check_pages,
    load_state,
    load_state_resharded,
    state_format,
    state_pieces,
)
from ._worker import WorkerSide
from ._worker_save import _Skipped

NULL_BLOCK = 0  # vLLM's null block (a sliding group's skipped positions): never read or written

__all__ = ["HybridWorker"]


class HybridWorker(WorkerSide):
    """``staging_copier``: run the CUDA path (staging, ``copier`` for the DMA) on CPU caches,
    as the tests do to check it without a GPU (:func:`._paged.copier_for` ``("cpu")``)."""

    def __init__(self, *, groups: list[Group], staging_copier=None, **kwargs: Any) -> None:
        super().__init__(total_kv_heads=None, latent=False, **kwargs)
        self.groups = groups
        self._staging_copier = staging_copier
        self.staged = False  # the staging (CUDA) path: set by register
        self.formats: dict[int, BlockFormat | blocks.StateFormat] = {}
        self.caches: dict[int, Any] = {}  # attention: PagedKV; state: per layer, its pieces
        self.layer_of: dict[str, tuple[int, int] | None] = {}  # name -> (group, layer)
        self._group_saves: dict[int, Any] = {}
        self._failed_loads: set[str] = set()

    # -- registration ----------------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any], backend: str) -> None:
        how = interpret(backend, latent=False)
        devices = {
            t.device
            for g in self.groups
            for name in g.layer_names
            if name in kv_caches
            for t in (
                kv_caches[name] if isinstance(kv_caches[name], (list, tuple)) else [kv_caches[name]]
            )
        }
        if len(devices) > 1:
            raise KVBrokerError(
                f"register_kv_caches: the groups' caches lie on {len(devices)} devices"
            )
        device = next(iter(devices), None)
        self.device = "cpu" if device is None else device.type
        if self.device not in ("cpu", "cuda"):
            raise KVBrokerError(
                f"kvbroker's vLLM connector serves host (CPU) and CUDA caches, not {self.device}"
            )
        self.staged = self.device == "cuda" or self._staging_copier is not None
        for g in self.groups:
            missing = [n for n in g.layer_names if n not in kv_caches]
            if missing:
                raise KVBrokerError(
                    f"register_kv_caches: no cache for layer(s) {missing} of group {g.index}"
                )
            if g.kind == STATE:
                self._register_state(g, kv_caches)
            else:
                self._register_attention(g, kv_caches, how)
        self.fmt = self.formats[self.groups[0].index]  # (WorkerSide's checks: registered)
        self.cache = self.caches  # (WorkerSide's checks: not released for sleep mode)
        self.cuda_device = device if self.device == "cuda" else None
        total = sum(f.block_nbytes for f in self.formats.values())
        log.info(
            "kvbroker: hybrid model, %d KV cache groups (%s) on %s, %d B per block of "
            "every group, namespace %s",
            len(self.groups),
            ", ".join(f"{g.kind}/{g.block_size}" for g in self.groups),
            self.device,
            total,
            self.namespace,
        )

    def _register_attention(self, g: Group, kv_caches: dict[str, Any], how: str) -> None:
        tensors, index = distinct_layers((name, kv_caches[name]) for name in g.layer_names)
        for name, i in index.items():
            self.layer_of[name] = None if i is None else (g.index, i)
        self.formats[g.index] = attention_format(
            tensors,
            how,
            block_size=g.block_size,
            total_kv_heads=g.num_kv_heads,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            what=f"group {g.index}",
        )
        # the staging path reads the group's layers as one view (vLLM lays them out at one
        # stride in the pool); LayoutMismatch where they are not
        self.caches[g.index] = cuda_cache(tensors, how) if self.staged else host_cache(tensors, how)

    def _register_state(self, g: Group, kv_caches: dict[str, Any]) -> None:
        layers = []
        for name in g.layer_names:
            layers.append(state_pieces(kv_caches[name]))
            self.layer_of[name] = None  # (vLLM calls save_kv_layer for attention layers only)
        fmt = state_format(g, self.tp_rank, self.tp_size)
        pages = StatePages(layers)
        check_pages(fmt, pages)
        self.caches[g.index] = pages
        self.formats[g.index] = fmt

    def release_cache(self) -> None:
        """vLLM's sleep mode discards the cache (see :meth:`WorkerSide.release_cache`): the
        background loads are waited for and reported failed, open saves aborted, and every
        group's views dropped until ``register`` runs again. Idempotent."""
        if self.cache is None:
            return
        self._released = True
        if self._loads is not None:
            self._loads.drain_lost("vLLM's sleep mode discarded the KV cache it loaded into")
        self._abort_group_saves("the KV cache was released for vLLM's sleep mode")
        if self._gpu is not None:
            self._gpu.close()  # (its streams synchronized first)
            self._gpu = None
        self.caches = {}
        self.cache = None
        self._ready = None

    @property
    def _attention_layers(self) -> int:
        return sum(f.num_layers for f in self.formats.values() if isinstance(f, BlockFormat))

    # -- loads -----------------------------------------------------------------------------
    def start_load(self) -> None:
        plan = self._plan
        if plan is None or not plan.loads or not self.formats:
            return
        self._start_background(list(plan.loads))

    def _copy_in(self, spec: Any, client: Any, stream: Any) -> int:
        """Every group's blocks of ``spec``; returns how many were copied (all of them, or
        the copies stop at the first group that lacks a block)."""
        for load in spec.groups:  # the plan never names it; a plan that did is a bug
            if NULL_BLOCK in load.block_ids:
                raise LayoutMismatch(
                    f"request {spec.req_id}: a load into vLLM's null block (group {load.group})"
                )
        if self.staged:
            return self._copy_in_staged(spec, client, stream)
        done = 0
        for load in spec.groups:
            g = self.groups[load.group]
            fmt, cache = self.formats[g.index], self.caches[g.index]
            if g.kind == STATE:
                for key, block in zip(load.keys, load.block_ids, strict=True):
                    if not (
                        load_state(client, self.namespace, fmt, cache, key, block)
                        or self._load_resharded(client, g, key, block)
                    ):
                        return done
                    done += 1
                    self.stats["loaded_state_bytes"] += fmt.block_nbytes
                continue
            n = load_host(
                client, self.namespace, fmt, cache, load.keys, load.block_ids, self.peer_tp_sizes
            )
            done += n
            if n < len(load.block_ids):
                return done
        return done

    def _load_resharded(self, client: Any, g: Group, key: str, block: int) -> bool:
        """The state at ``key`` from another TP layout's pages (``peer_tp_sizes``)."""
        if not self.peer_tp_sizes or not g.reshardable:
            return False
        return load_state_resharded(
            client,
            self.namespace,
            g,
            self.caches[g.index],
            key,
            block,
            self.tp_rank,
            self.peer_tp_sizes,
        )

    def _copy_in_staged(self, spec: Any, client: Any, stream: Any) -> int:
        from ._cuda import load_cuda, load_state_cuda

        copier, done = self._staging_copier, 0
        for load in spec.groups:
            g = self.groups[load.group]
            fmt, cache = self.formats[g.index], self.caches[g.index]
            if g.kind == STATE:
                n = load_state_cuda(
                    client,
                    self.namespace,
                    fmt,
                    cache,
                    load.keys,
                    load.block_ids,
                    stream=stream,
                    copier=copier,
                )
                while n < len(load.block_ids) and self._load_resharded(
                    client, g, load.keys[n], load.block_ids[n]
                ):
                    n += 1
                self.stats["loaded_state_bytes"] += n * fmt.block_nbytes
            else:
                n = load_cuda(
                    client,
                    self.namespace,
                    fmt,
                    cache,
                    load.keys,
                    load.block_ids,
                    self.peer_tp_sizes,
                    stream=stream,
                    copier=copier,
                )
            done += n
            if n < len(load.block_ids):
                return done
        return done

    def _account(
        self, spec: Any, loaded: int, why: str = "blocks were evicted since the lookup"
    ) -> int:
        n_want = len(spec.block_ids)
        self.stats["loads"] += 1
        if loaded >= n_want and spec.groups:  # (a load the scheduler could not plan failed)
            self.stats["loaded_blocks"] += loaded
            self.stats["loaded_tokens"] += spec.tokens
            self.stats["loaded_bytes"] += sum(
                self._nbytes(g.group) * len(g.block_ids) for g in spec.groups
            )
            return loaded
        self.stats["load_failed_blocks"] += n_want
        self.warnings.warn(
            "load_failed",
            "could not load request %s whole (%d of %d blocks "
            "over its groups; %s): vLLM recomputes it",
            spec.req_id,
            loaded,
            n_want,
            why,
        )
        return loaded

    def _nbytes(self, group: int) -> int:
        return self.formats[group].block_nbytes

    def _planned(self, spec: Any) -> bool:
        return bool(spec.groups)

    def _load_over(self, spec: Any, loaded: int) -> None:
        # vLLM takes a model with several groups' failed loads per request only
        if loaded < len(spec.block_ids) or not spec.groups:
            self._failed_loads.add(spec.req_id)

    def failed_loads(self) -> set[str]:
        """Requests whose load ended without every block (reported with ``finished_loads``,
        in the same step at the latest): vLLM recomputes them."""
        out, self._failed_loads = self._failed_loads, set()
        return out

    def load_errors(self) -> set[int]:
        return set()  # vLLM takes no block-level failures from a model with several groups

    # -- saves -----------------------------------------------------------------------------
    def bind(self, plan: Any) -> None:
        self._abort_group_saves("the step ended before its save was sealed")
        super().bind(plan)
        self._group_saves = {}

    def unbind(self) -> None:
        self._abort_group_saves("the step ended before its save was sealed")
        super().unbind()

    def _saves_of(self, group: int) -> list:
        return [s for s in self._plan.saves if s.group == group]

    def _begin_group(self, group: int):
        save = self._group_saves.get(group)
        if save is not None:
            return None if isinstance(save, _Skipped) else save
        items = [
            (k, parent, b, s.retain) for s in self._saves_of(group) for k, parent, b in s.items
        ]
        client = self._client()
        g = self.groups[group]
        if client is None:
            self._skip(len(items), "the broker is unavailable")
            self._group_saves[group] = _Skipped()
            return None
        fmt, cache = self.formats[group], self.caches[group]
        if g.kind == STATE:
            save = StateSave(
                client, self.namespace, fmt, cache, [(k, b, r) for k, _, b, r in items]
            )
        else:
            save = HostSave(
                client,
                self.namespace,
                fmt,
                cache,
                [SaveItem(k, parent, b, r) for k, parent, b, r in items],
            )
        try:
            save.reserve()
        except KVBrokerError as exc:
            self._save_refused(len(items), exc)
            save = _Skipped()
        self._group_saves[group] = save
        return None if isinstance(save, _Skipped) else save

    def save_layer(self, layer_name: str) -> None:
        where = self.layer_of.get(layer_name)
        if where is None:
            return
        group, index = where
        self._hooks_active = True
        self._layers_seen.add(where)
        plan = self._plan
        if plan is None or not self._saves_of(group):
            return
        if self.staged:
            return  # wait_for_save gathers and DMAs every layer
        save = self._begin_group(group)
        if save is None:
            return
        try:
            save.copy_layer(index)
        except Exception as exc:  # noqa: BLE001
            self._abort_group_saves(
                f"copying layer {index} of group {group} failed: {type(exc).__name__}: {exc}"
            )

    def _abort_group_saves(self, why: str) -> None:
        for group, save in list(self._group_saves.items()):
            if not isinstance(save, _Skipped) and not save.done:
                save.abort()
                self._skip(len(save.items), why)
            self._group_saves[group] = _Skipped()

    def wait_for_save(self) -> None:
        plan = self._plan
        if plan is None or not plan.saves or not self.formats:
            return
        if self._hooks_active and len(self._layers_seen) < self._attention_layers:
            why = (
                f"only {len(self._layers_seen)} of {self._attention_layers} attention layers "
                "ran this step"
            )
            for group in {s.group for s in plan.saves} - set(self._group_saves):
                self._skip(sum(len(s.items) for s in self._saves_of(group)), why)
            self._abort_group_saves(why)
            return
        if self.staged:
            self._save_groups_staged(sorted({s.group for s in plan.saves}))
            return
        ready = []
        try:
            for group in sorted({s.group for s in plan.saves}):
                save = self._begin_group(group)
                if save is None:
                    continue
                if isinstance(save, StateSave):
                    save.copy()
                else:
                    for layer in range(save.fmt.num_layers):
                        save.copy_layer(layer)
                ready.append((group, save))
            for group, save in ready:
                save.seal()
                self._count_group(group, save.new_blocks, save.existing)
        except KVBrokerError as exc:
            self.stats["broker_errors"] += 1
            self._abort_group_saves(f"{type(exc).__name__}: {exc}")
            self._link_failed(exc)
        except Exception as exc:  # noqa: BLE001
            self._abort_group_saves(f"{type(exc).__name__}: {exc}")

    def _save_groups_staged(self, groups: list[int]) -> None:
        """Each group's blocks of the step through device staging and DMA (:mod:`._cuda`)."""
        from ._cuda import save_cuda

        for group in groups:
            items = [
                SaveItem(k, parent, b, s.retain)
                for s in self._saves_of(group)
                for k, parent, b in s.items
            ]
            if any(it.block_id == NULL_BLOCK for it in items):  # (never planned: a bug)
                self._skip(len(items), f"a save from vLLM's null block (group {group})")
                continue
            client = self._client()
            if client is None:
                self._skip(len(items), "the broker is unavailable")
                continue
            try:
                stream = self._gpu_client(client).stream if self.device == "cuda" else None
                new, existing = save_cuda(
                    client,
                    self.namespace,
                    self.formats[group],
                    self.caches[group],
                    items,
                    stream=stream,
                    copier=self._staging_copier,
                )
            except KVBrokerError as exc:
                self._save_refused(len(items), exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a save never fails the step
                self._skip(len(items), f"{type(exc).__name__}: {exc}")
                continue
            self._count_group(group, new, existing)

    def _count_group(self, group: int, new: int, existing: int) -> None:
        g = self.groups[group]
        self.stats["saved_blocks"] += new
        self.stats["saved_bytes"] += new * self._nbytes(group)
        self.stats["existing_blocks"] += existing
        if g.kind == STATE:
            self.stats["saved_state_bytes"] += new * self._nbytes(group)
        elif g is self.groups[self._token_group]:
            self.stats["saved_tokens"] += new * g.block_size

    @property
    def _token_group(self) -> int:
        """The group whose saved blocks count the saved tokens (the first attention one)."""
        return next(g.index for g in self.groups if g.kind != STATE)
