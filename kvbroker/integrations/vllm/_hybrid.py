"""The scheduler half of the connector for hybrid models (several KV cache groups, vLLM's
hybrid KV cache manager on): lookups across groups, and each step's loads and saves per group.

Duck-typed against vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput``, as
:mod:`._scheduler` (whose single-group path serves every model with one full-attention
group, unchanged). The groups: :mod:`._groups`.

- **Keys.** Each group keeps its own chain of block hashes over its own block size
  (:func:`._format.prompt_keys`, tails included), and a block's key names its group.
- **Lookups** (``get_num_new_matched_tokens``) find the longest hit ``T`` every group can
  serve: the least over the full-attention groups of the blocks the broker holds in a row;
  short of the whole prompt (``n - 1`` tokens, the P/D handoff) ``T`` is cut to a multiple of
  every group's block size; then every sliding-window group must hold its window before
  ``T`` (and only that), and every state group a state at ``T`` itself. Where one does not,
  ``T`` moves down to what it holds and is checked again (a few round trips at most).
- **Loads are always asynchronous**: vLLM parks the request until every worker reports its
  load over (``get_finished``), because (a) vLLM 0.32 cannot take block-level load failures
  from a model with several groups (its block ids are per group), only whole requests
  (``failed_recving``, then it recomputes the request), and (b) vLLM copies a Mamba state
  (``preprocess_mamba``) before ``start_load_kv``, so a state loaded within the step would
  come too late. A request whose load failed is never loaded again (it is recomputed).
  A load names, per group, the blocks to write and never the null block (id 0): a sliding
  group's blocks before the window and a state group's superseded states are not loaded.
- **Saves**: every attention block once the step computing it has run, in that step (vLLM
  frees a sliding group's out-of-window blocks as soon as the next step is scheduled), plus
  each group's partial last block of the prompt (the tail); a state group's state where the
  step ends a prefill chunk at a block boundary (the only place vLLM keeps one; align mode).
  Every sliding block is stored: a hit may end at any block boundary, and each sliding block
  is in the window of the hits ending in the ``window`` tokens after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbroker import blocks
from kvbroker.errors import KVBrokerError
from kvbroker.prefix import PrefixCache

from .._link import BrokerLink, Warnings
from ._format import PromptKeys, prompt_keys
from ._groups import FULL, SLIDING, STATE, Group, alignment
from ._scheduler import StepPlan, match_count, request_salt, request_session
from ._state import state_format

__all__ = ["GroupLoad", "GroupSave", "HybridLoad", "HybridScheduler"]

NULL_BLOCK = 0  # vLLM's null block: stands for skipped positions, never read or written
MAX_TRIES = 4  # lookups of a candidate hit (each one round trip per group checked)


@dataclass
class GroupLoad:
    """Load the blocks ``keys`` (the group's keys, not yet sharded) into engine blocks
    ``block_ids`` of group ``group`` (same length, none of them the null block)."""

    group: int
    keys: list[str]
    block_ids: list[int]


@dataclass
class HybridLoad:
    """One request's load, every group of it (``groups`` empty: a load that could not be
    planned, failed whole); always in the background (see the module docstring)."""

    req_id: str
    groups: list[GroupLoad]
    tokens: int
    background: bool = True

    @property
    def block_ids(self) -> list[int]:
        return [b for g in self.groups for b in g.block_ids]

    @property
    def hashes(self) -> list[str]:
        return [k for g in self.groups for k in g.keys]


@dataclass
class GroupSave:
    """Publish blocks ``(key, parent key or None, engine block id)`` of one request's
    group ``group`` (its keys, not yet sharded)."""

    req_id: str
    group: int
    items: list[tuple[str, str | None, int]]
    retain: dict | None = None  # the request's session (kvbroker.blocks.retention)


@dataclass
class _Req:
    keys: dict[int, PromptKeys] | None  # by block size; None: nothing to look up or save
    block_ids: list[list[int]] = field(default_factory=list)  # per group
    saved: list[int] = field(default_factory=list)  # per group: blocks handed to the workers
    tail_saved: list[bool] = field(default_factory=list)
    lookup: tuple[int, int] | None = None  # (local computed tokens, external tokens)
    no_load: bool = False  # a load of it failed: vLLM recomputes it, nothing more is loaded
    retain: dict | None = None  # the session it names (kvbroker.blocks.retention), if any

    @property
    def num_tokens(self) -> int:
        return next(iter(self.keys.values())).num_tokens


class HybridScheduler:
    def __init__(
        self,
        *,
        link: BrokerLink,
        namespace: str,
        groups: list[Group],
        tp_size: int,
        peer_tp_sizes: tuple[int, ...] = (),
        save: bool,
        load: bool,
        warnings: Warnings,
    ) -> None:
        self.link, self.namespace, self.groups = link, namespace, groups
        self.tp_size = tp_size
        # (a state group that cannot be resharded reads this TP layout only)
        self.layouts = tuple(dict.fromkeys((tp_size, *peer_tp_sizes)))
        self.save, self.load = save, load
        self.warnings = warnings
        self.align = alignment(groups)
        self.reqs: dict[str, _Req] = {}
        self.pending_loads: list[HybridLoad] = []
        self.lookups = 0
        self.lookup_errors = 0

    # -- per-request state -----------------------------------------------------------------
    def state(self, request: Any) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            tokens = getattr(request, "prompt_token_ids", None)
            if getattr(request, "prompt_embeds", None) is not None or not tokens:
                st = _Req(None)
            else:
                tokens, salt = list(tokens), request_salt(request)
                st = _Req(
                    {
                        b: prompt_keys(tokens, b, namespace=self.namespace, cache_salt=salt)
                        for b in sorted({g.block_size for g in self.groups})
                    }
                )
            k = len(self.groups)
            st.block_ids, st.saved, st.tail_saved = [[] for _ in range(k)], [0] * k, [False] * k
            try:
                st.retain = request_session(request)
            except KVBrokerError as exc:  # served, its blocks not retained
                self.warnings.warn(
                    "bad_session", "request %s: %s; not retained", request.request_id, exc
                )
            self.reqs[request.request_id] = st
        return st

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    # -- lookup ----------------------------------------------------------------------------
    def _count(self, group: Group, keys: list[str], retain: dict | None = None) -> int:
        """Leading keys of ``keys`` (group keys) that every shard some readable TP layout
        needs holds (a state group: this TP layout's rank 0). ``retain``: the request's
        session, renewed; it retains what is found. Raises KVBrokerError."""
        client = self.link.get()
        if client is None or not keys:
            return 0
        self.lookups += 1
        if group.kind == STATE:  # rank 0's pages of this TP layout, or every rank's of another
            fmt = state_format(group, 0, self.tp_size)
            best = blocks.match(
                client, self.namespace, fmt, keys, hold=False, retain=retain
            ).num_blocks
            for source in self.layouts if group.reshardable else ():
                if best == len(keys) or source == self.tp_size:
                    continue
                fmts = [state_format(group, q, source) for q in range(source)]
                wanted = [f.key(k) for k in keys for f in fmts]  # block-major, rank-minor
                found = blocks.match_keys(
                    client, self.namespace, wanted, hold=False, retain=retain
                ).num_blocks
                best = max(best, found // source)
            return best
        pc = PrefixCache(
            client,
            namespace=self.namespace,
            block_size=group.block_size,
            tp_rank=0,
            tp_size=1,
            total_kv_heads=group.num_kv_heads,
        )
        return match_count(pc, keys, self.layouts, retain)

    def _hit(self, st: _Req, local: int) -> int:
        """The longest hit (tokens) every group can serve after ``local`` computed tokens."""
        n = st.num_tokens
        cap = n - 1
        hit = cap
        for g in self.groups:
            if g.kind != FULL:
                continue
            keys = st.keys[g.block_size]
            first = local // g.block_size
            if first >= len(keys.keys):
                return 0
            m = first + self._count(g, [g.key(h) for h in keys.keys[first:]], st.retain)
            hit = min(hit, keys.tokens_of(m))
        for _ in range(MAX_TRIES):
            if hit < cap:
                hit = hit // self.align * self.align
            if hit <= local:
                return 0
            lower = self._check_windows(st, local, hit)
            if lower == hit:
                return hit
            hit = min(lower, hit - 1)
        return 0

    def _check_windows(self, st: _Req, local: int, hit: int) -> int:
        """``hit`` if every sliding group holds its window before it and every state group
        a state at it; else a lower hit worth checking."""
        for g in self.groups:
            keys = st.keys[g.block_size]
            if g.kind == SLIDING:
                m = -(-hit // g.block_size)  # blocks covering the hit (the tail included)
                s = max(g.first_needed(hit), local // g.block_size)
                want = [g.key(h) for h in keys.keys[s:m]]
                got = self._count(g, want, st.retain)
                if got < len(want):
                    return min(hit - 1, (s + got) * g.block_size)
            elif g.kind == STATE:
                if hit % g.block_size:
                    return hit // g.block_size * g.block_size
                b = hit // g.block_size - 1
                if not self._count(g, [g.key(keys.hashes[b])], st.retain):
                    return hit - g.block_size
        return hit

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.load:
            return 0, False
        st = self.state(request)
        st.lookup = None
        if st.keys is None or st.no_load or st.num_tokens < 2:
            return 0, False
        try:
            hit = self._hit(st, num_computed_tokens)
        except KVBrokerError as exc:
            self.lookup_errors += 1
            self.link.fail(exc)
            if self.link.up:
                self.warnings.warn(
                    "lookup_failed", "prefix lookup failed (%s): computing the prompt instead", exc
                )
            return 0, False
        external = hit - num_computed_tokens
        if external <= 0:
            return 0, False
        st.lookup = (num_computed_tokens, external)
        return external, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        asked = None
        if st is not None:
            asked, st.lookup = st.lookup, None
        if num_external_tokens <= 0:
            return
        per_group = [list(ids) for ids in blocks.get_block_ids()]
        if asked is None or st is None or st.keys is None or asked[1] != num_external_tokens:
            # vLLM parked the request for a load this side did not plan: fail it whole, so
            # vLLM recomputes it (not reached with vLLM 0.32, which allocates right after a
            # positive lookup)
            self.warnings.warn(
                "plan_mismatch",
                "request %s: %d external tokens were not looked up here; not loading",
                request.request_id,
                num_external_tokens,
            )
            self.pending_loads.append(HybridLoad(request.request_id, [], 0))
            if st is not None:
                st.no_load = True
            return
        local, external = asked
        hit = local + external
        loads = []
        for g, ids in zip(self.groups, per_group, strict=True):
            keys = st.keys[g.block_size]
            first = max(local // g.block_size, g.first_needed(hit))
            last = -(-hit // g.block_size)
            if g.kind == STATE:
                first = last - 1  # the state at the hit; the ones before it are superseded
            pairs = [
                (g.key(keys.keys[b]), ids[b])
                for b in range(first, min(last, len(ids)))
                if ids[b] != NULL_BLOCK
            ]
            if last > len(ids) or len(pairs) != last - first:
                self.warnings.warn(
                    "plan_mismatch",
                    "request %s, group %d: blocks %d..%d to load, vLLM allocated %s; not loading",
                    request.request_id,
                    g.index,
                    first,
                    last,
                    ids[first:last],
                )
                self.pending_loads.append(HybridLoad(request.request_id, [], 0))
                st.no_load = True
                return
            if pairs:
                loads.append(GroupLoad(g.index, [k for k, _ in pairs], [b for _, b in pairs]))
        self.pending_loads.append(HybridLoad(request.request_id, loads, external))

    def loads_finished(self, req_ids) -> None:
        return None  # nothing waits on it here: vLLM un-parks the request

    def loads_failed(self, req_ids) -> None:
        """These requests' loads failed: vLLM recomputes them, and they load nothing more."""
        for req_id in req_ids:
            st = self.reqs.get(req_id)
            if st is not None:
                st.no_load = True

    def load_failed(self, invalid_block_ids: set[int]) -> None:
        return None  # (block-level failures are never reported for several groups)

    # -- the step's plan ------------------------------------------------------------------
    def build(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan(loads=self.pending_loads)
        self.pending_loads = []
        if not self.save:
            return plan
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            self._plan_save(
                new.req_id, st, new.num_computed_tokens, scheduled.get(new.req_id, 0), plan
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = (
                    [list(ids) for ids in new_ids] if new_ids else [[] for _ in self.groups]
                )
            elif new_ids:
                for mine, more in zip(st.block_ids, new_ids, strict=True):
                    mine.extend(more)
            self._plan_save(
                req_id, st, cached.num_computed_tokens[i], scheduled.get(req_id, 0), plan
            )
        return plan

    def _plan_save(
        self, req_id: str, st: _Req, before: int, scheduled: int, plan: StepPlan
    ) -> None:
        if st.keys is None:
            return
        n = st.num_tokens
        computed = before + scheduled
        for g, ids in zip(self.groups, st.block_ids, strict=True):
            keys = st.keys[g.block_size]
            bs = g.block_size
            items = []
            if g.kind == STATE:
                # The state the step leaves is the one at its end: kept by vLLM (align mode)
                # only where the step ends a prefill chunk at a block boundary.
                end = min(computed, n)
                if scheduled and before < n and end % bs == 0 and end // bs > st.saved[g.index]:
                    b = end // bs - 1
                    if b < len(ids) and ids[b] != NULL_BLOCK:
                        items.append((g.key(keys.hashes[b]), None, ids[b]))
                    st.saved[g.index] = end // bs
            else:
                full = min(min(computed, n) // bs, len(ids))
                for b in range(st.saved[g.index], full):
                    if ids[b] != NULL_BLOCK:  # (a local hit outside the window)
                        items.append(
                            (
                                g.key(keys.hashes[b]),
                                g.key(keys.hashes[b - 1]) if b else None,
                                ids[b],
                            )
                        )
                st.saved[g.index] = max(st.saved[g.index], full)
                if keys.tail and not st.tail_saved[g.index] and computed >= n:
                    k = n // bs
                    if k < len(ids) and ids[k] != NULL_BLOCK:
                        items.append(
                            (g.key(keys.tail), g.key(keys.hashes[k - 1]) if k else None, ids[k])
                        )
                    st.tail_saved[g.index] = True
            if items:
                plan.saves.append(GroupSave(req_id, g.index, items, st.retain))
