"""The worker's saves: a step's blocks copied out of vLLM's KV cache into broker leases, layer by
layer or from a CUDA staging copy, and sealed at the step's end (:class:`._worker.WorkerSide`'s
save steps)."""

from __future__ import annotations

from kvbroker.errors import (
    KVBrokerError,
    PoolFull,
    QuotaExceeded,
)
from ._paged import (
    HostSave,
    SaveItem,
)


class _Skipped:
    """The step's save was given up (broker down or full, or aborted)."""

    done = True


class WorkerSaves:
    """The save steps of :class:`._worker.WorkerSide` (a mixin, as :class:`HandoffWorker` is)."""

    # -- saving ----------------------------------------------------------------------------
    def _items(self, by_request: bool = False) -> list:
        # A request whose load failed holds unloaded blocks, and KV computed after them from
        # garbage; so does any request from the first of those blocks in it on. None of it
        # is saved until a plan acknowledges the failure (see the module docstring).
        failed = {f.req_id for f in self._failures}
        tainted = frozenset().union(*(f.blocks for f in self._failures))
        out: list[tuple[str, list[SaveItem]]] = []
        for spec in self._plan.saves:
            if spec.req_id in failed:
                continue
            out.append((spec.req_id, items := []))
            for h, parent, block in spec.items:  # in the request's block order
                if block in tainted:
                    break
                items.append(SaveItem(h, parent, block, spec.retain))
        return out if by_request else [item for _, items in out for item in items]

    def _begin_save(self) -> HostSave | None:
        if self._save is None:
            client = self._client()
            if client is None:
                self._skip(len(self._items()), "the broker is unavailable")
                self._save = _Skipped()
                return None
            save = HostSave(client, self.namespace, self.fmt, self.cache, self._items())
            try:
                save.reserve()
            except KVBrokerError as exc:
                self._save_refused(len(save.items), exc)
                self._save = _Skipped()
                return None
            self._save = save
        return None if isinstance(self._save, _Skipped) else self._save

    def _skip(self, blocks: int, why: str) -> None:
        self.stats["skipped_save_blocks"] += blocks
        self.warnings.warn(
            "save_skipped", "skipped saving %d block(s) (%s); the engine keeps serving", blocks, why
        )

    def _save_refused(self, blocks: int, exc: KVBrokerError) -> None:
        """The broker refused a save of ``blocks`` blocks: they are skipped. No room (PoolFull,
        QuotaExceeded) is only that; any other broker error is counted and tells the link."""
        if not isinstance(exc, (PoolFull, QuotaExceeded)):
            self.stats["broker_errors"] += 1
            self._link_failed(exc)
        self._skip(blocks, f"{type(exc).__name__}: {exc}")

    def save_layer(self, layer_name: str) -> None:
        index = self.layer_index.get(layer_name)
        if index is None:
            return
        self._hooks_active = True
        self._layers_seen.add(index)
        plan = self._plan
        if plan is None or not plan.saves or self.device != "cpu":
            return
        save = self._begin_save()
        if save is None:
            return
        try:
            save.copy_layer(index)
        except Exception as exc:  # noqa: BLE001
            self._abort_save(f"copying layer {index} failed: {type(exc).__name__}: {exc}")

    def _abort_save(self, why: str) -> None:
        save = self._save
        if isinstance(save, HostSave) and not save.done:
            save.abort()
            self._skip(len(save.items), why)
        self._save = _Skipped()

    def wait_for_save(self) -> None:
        plan = self._plan
        if plan is None or not plan.saves or self.fmt is None:
            return
        if isinstance(self._save, _Skipped):
            return
        if self._hooks_active and len(self._layers_seen) < self.fmt.num_layers:
            # The forward pass did not reach every layer (it raised): the blocks are not
            # all written. Abort rather than publish garbage.
            why = f"only {len(self._layers_seen)} of {self.fmt.num_layers} layers ran this step"
            if self._save is None:
                self._skip(len(self._items()), why)
                self._save = _Skipped()
            else:
                self._abort_save(why)
            return
        if self.device != "cpu":
            self._save_cuda()
            return
        save = self._begin_save()
        if save is None:
            return
        try:
            for layer in range(self.fmt.num_layers):  # layers save_layer did not copy
                save.copy_layer(layer)
            save.seal()
        except KVBrokerError as exc:
            self.stats["broker_errors"] += 1
            self._abort_save(f"{type(exc).__name__}: {exc}")
            self._link_failed(exc)
            return
        except Exception as exc:  # noqa: BLE001
            self._abort_save(f"{type(exc).__name__}: {exc}")
            return
        self._count_saved(save.new_blocks, save.existing)

    def _count_saved(self, new: int, existing: int) -> None:
        self.stats["saved_blocks"] += new
        self.stats["saved_tokens"] += new * self.block_size
        self.stats["saved_bytes"] += new * self.fmt.block_nbytes
        self.stats["existing_blocks"] += existing

    def _save_cuda(self) -> None:
        from ._cuda import save_cuda

        items = self._items()
        client = self._client()
        if client is None:
            self._skip(len(items), "the broker is unavailable")
            return
        try:
            g = self._gpu_client(client)
            if self.handoff.on and items:  # (._handoff) the GPU rings first
                items = self._hand_off(g, self._items(by_request=True), items)
            new, existing = save_cuda(
                client, self.namespace, self.fmt, self.cache, items, stream=g.stream
            )
        except (PoolFull, QuotaExceeded) as exc:
            self._skip(len(items), f"{type(exc).__name__}: {exc}")
            return
        except KVBrokerError as exc:
            self.stats["broker_errors"] += 1
            self._link_failed(exc)
            self._skip(len(items), f"{type(exc).__name__}: {exc}")
            return
        self._count_saved(new, existing)
