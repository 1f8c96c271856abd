"""The scheduler half of the connector: lookups, and what each engine step loads and saves.

Duck-typed against vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` (no vLLM
import), so it can be driven directly.

- ``get_num_new_matched_tokens`` (consumer roles) asks the broker once per TP layout it
  may read (this engine's TP size, then ``peer_tp_sizes``; one round trip in the usual
  case) how many leading blocks of the prompt every shard the workers will need holds. It
  copies nothing and holds nothing: the read lease the match takes is released at once
  (pipelined, no second round trip). Block hashes are computed once per request. Asking
  again gives the same answer unless the broker changed meanwhile.
- ``update_state_after_alloc`` turns a positive answer into a load of those blocks into the
  blocks vLLM just allocated, carried to the workers by the next ``build_connector_meta``.
  By default loads are synchronous: the workers load in ``start_load_kv``, before the step's
  forward, so the request runs in the step that loads it. With ``load_async`` the answer
  tells vLLM the load is asynchronous: vLLM parks the request until every worker reports
  its load over (``get_finished``) and meanwhile steps the other requests without waiting
  for those copies (:mod:`._async_loads`).
- Sessions: a request naming one (``kv_transfer_params`` or the sampling parameters'
  ``extra_args``: ``{"kvbroker": {"session": "conv-42", "retain": "10m", "priority": 2}}``)
  has its lookup renew that session and retain the blocks it finds, and its saved blocks
  retained by it (:func:`kvbroker.blocks.retention`): kept past plain LRU while the
  conversation is idle between turns. A malformed one is warned about and ignored.
- Producer roles save every full prompt block once the step computing it has run, plus the
  prompt's partial last block (the tail, see :mod:`._format`) once the whole prompt is in.
  Saves complete within the step (``wait_for_save``), so ``request_finished`` never delays
  freeing a request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvbroker import blocks
from kvbroker.errors import BadRequest, KVBrokerError
from kvbroker.prefix import PrefixCache

from .._link import BrokerLink, Warnings
from ._format import PromptKeys, prompt_keys
from ._handoff import HandoffConfig, find_runs

__all__ = ["LoadSpec", "SaveSpec", "SchedulerSide", "StepPlan"]


@dataclass
class LoadSpec:
    """Load the blocks ``hashes`` into engine blocks ``block_ids`` (same length; no hashes:
    a load that could not be planned, every block failed); ``background``: beside the
    engine's steps, reported by ``get_finished`` (load_async)."""

    req_id: str
    hashes: list[str]
    block_ids: list[int]
    background: bool = False
    # Same-node handoff (:mod:`._handoff`): the ring runs holding the leading blocks, and
    # the position of ``hashes[0]`` in the prompt's keys (the runs' coordinates).
    ring: tuple = ()
    first: int = 0


@dataclass
class SaveSpec:
    """Publish blocks ``(hash, parent hash or None, engine block id)`` of one request."""

    req_id: str
    items: list[tuple[str, str | None, int]]
    retain: dict | None = None  # the request's session (kvbroker.blocks.retention)


@dataclass
class StepPlan:
    """What the workers load and save in one engine step (the connector metadata).

    ``acknowledged``: engine blocks whose failed load the scheduler side has taken into
    account (``SchedulerSide.load_failed``) since the previous plan. A plan built before
    that (vLLM's async scheduling plans step t+1 before it hears of step t's failures) still
    saves blocks computed from them: the workers drop such saves until a plan acknowledges
    the failure (:mod:`._worker`)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    acknowledged: set[int] = field(default_factory=set)


@dataclass
class _Req:
    keys: PromptKeys | None  # None: nothing to look up or save (no token ids)
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # full prompt blocks already handed to the workers for saving
    tail_saved: bool = False
    lookup: tuple[int, int] | None = None  # (local computed tokens, external tokens) asked
    asked_at: int | None = None  # the local computed tokens of the last lookup (kept)
    loading: frozenset[int] = frozenset()  # engine blocks of its background load in flight
    ring: tuple = ()  # the ring runs the last lookup found (same-node handoff)
    # Its background load failed: vLLM put it back in the queue, and a hit found again is
    # loaded synchronously (a failure then is recomputed in place, not parked again). For
    # the rest of the request's life: a preempted one looked up again loads synchronously.
    sync_only: bool = False
    retain: dict | None = None  # the session it names (kvbroker.blocks.retention), if any


def request_session(request: Any) -> dict | None:
    """The session a request names, as ``blocks.retention`` gives it (None: none): its
    ``kv_transfer_params["kvbroker"]``, else its sampling parameters' ``extra_args``'
    ``kvbroker`` map, or their flat ``kvbroker_session``, ``kvbroker_retain``,
    ``kvbroker_priority`` (what an OpenAI server's ``vllm_xargs`` can carry: no maps).
    BadRequest when it names one badly."""
    for params in (
        getattr(request, "kv_transfer_params", None),
        getattr(getattr(request, "sampling_params", None), "extra_args", None),
    ):
        if not isinstance(params, dict):
            continue
        asked = params.get("kvbroker")
        if asked is None and "kvbroker_session" in params:
            asked = {
                k: params[f"kvbroker_{k}"]
                for k in ("session", "retain", "priority")
                if f"kvbroker_{k}" in params
            }
        if asked is None:
            continue
        if not isinstance(asked, dict) or set(asked) - {"session", "retain", "priority"}:
            raise BadRequest(f"kvbroker: expected {{session, retain, priority}}, got {asked!r}")
        return blocks.retention(asked.get("session"), asked.get("retain"), asked.get("priority"))
    return None


def request_salt(request: Any) -> str:
    """What besides the token ids decides a prompt's KV: ``cache_salt``, the LoRA adapter
    and multimodal inputs (by their content hashes)."""
    salt = getattr(request, "cache_salt", None) or ""
    extra = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extra.append(f"lora={getattr(lora, 'lora_name', None) or getattr(lora, 'name', '')}")
    for feature in getattr(request, "mm_features", None) or ():
        extra.append(
            f"mm={getattr(feature, 'identifier', '')}@"
            f"{getattr(getattr(feature, 'mm_position', None), 'offset', '')}"
        )
    return salt if not extra else "\x1f".join([salt, *extra])


def match_count(
    pc: PrefixCache, hashes: list[str], layouts, retain: dict | None, *, latent: bool = False
) -> int:
    """Leading blocks of ``hashes`` that every shard of some TP layout of ``layouts`` (tried in
    order) holds, through ``pc`` (rank 0 of TP 1): only a count, the worker takes its own lease
    when it loads. ``retain``: the request's session (:func:`request_session`), renewed; it
    retains what is found. Raises KVBrokerError."""
    session = (
        {}
        if retain is None
        else {
            "session": retain["session"],
            "retain": retain.get("for"),
            "priority": retain.get("priority"),
        }
    )
    best = 0
    for source in layouts:
        m = pc.match_kv(
            range(len(hashes) * pc.block_size + 1),
            hashes=hashes,
            source_tp_size=source,
            latent=latent,
            hold=False,
            **session,
        )
        best = max(best, m.num_blocks)
        if best == len(hashes):
            break
    return best


class SchedulerSide:
    def __init__(
        self,
        *,
        link: BrokerLink,
        namespace: str,
        block_size: int,
        total_kv_heads: int | None,
        latent: bool,
        tp_size: int,
        peer_tp_sizes: tuple[int, ...] = (),
        save: bool,
        load: bool,
        warnings: Warnings,
        load_async: bool = False,
        handoff: HandoffConfig | None = None,
    ) -> None:
        self.link, self.namespace, self.block_size = link, namespace, block_size
        self.handoff = handoff or HandoffConfig()
        self.tp_size = tp_size
        self.total_kv_heads = None if latent else total_kv_heads
        self.latent = latent
        self.layouts = tuple(dict.fromkeys((tp_size, *peer_tp_sizes)))
        self.save, self.load = save, load
        self.load_async = load_async
        self.warnings = warnings
        self.reqs: dict[str, _Req] = {}
        self.pending_loads: list[LoadSpec] = []
        self.acknowledged: set[int] = set()  # failed loads heard of, for the next plan
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
                st = _Req(
                    prompt_keys(
                        list(tokens),
                        self.block_size,
                        namespace=self.namespace,
                        cache_salt=request_salt(request),
                    )
                )
            try:
                st.retain = request_session(request)
            except BadRequest as exc:  # the request is served, its blocks are not retained
                self.warnings.warn(
                    "bad_session", "request %s: %s; not retained", request.request_id, exc
                )
            self.reqs[request.request_id] = st
        return st

    def finished(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)

    # -- lookup ----------------------------------------------------------------------------
    def matched_blocks(self, hashes: list[str], retain: dict | None = None) -> int:
        """Leading blocks of ``hashes`` that every shard of some readable TP layout holds;
        0 when the broker is unavailable (the link goes down and retries later). ``retain``:
        the request's session, renewed; it retains what is found."""
        client = self.link.get()
        if client is None or not hashes:
            return 0
        self.lookups += 1
        pc = PrefixCache(
            client,
            namespace=self.namespace,
            block_size=self.block_size,
            tp_rank=0,
            tp_size=1,
            total_kv_heads=self.total_kv_heads,
        )
        try:
            best = match_count(pc, hashes, self.layouts, retain, latent=self.latent)
        except KVBrokerError as exc:
            self.lookup_errors += 1
            self.link.fail(exc)
            if self.link.up:  # not a connection problem: say what it was
                self.warnings.warn(
                    "lookup_failed", "prefix lookup failed (%s): computing the prompt instead", exc
                )
            return 0
        return best

    def ring_runs(self, keys: list[str]) -> list:
        """The leading runs of the prompt's ``keys`` a same-node producer handed off into the
        GPU rings for every rank of this engine (:func:`._handoff.find_runs`); [] when the
        broker is unavailable or the lookup fails (the host path is asked then)."""
        client = self.link.get()
        if client is None or not keys:
            return []
        try:
            return find_runs(
                client,
                self.namespace,
                keys,
                heads=self.total_kv_heads,
                consumer_tp=self.tp_size,
                producer_tps=self.layouts,
            )
        except KVBrokerError as exc:
            self.lookup_errors += 1
            self.link.fail(exc)
            if self.link.up:
                self.warnings.warn(
                    "ring_lookup_failed",
                    "ring lookup failed (%s): looking in the host pools only",
                    exc,
                )
            return []

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if not self.load:
            return 0, False
        st = self.state(request)
        st.lookup = None
        st.ring = ()
        st.asked_at = num_computed_tokens
        keys = st.keys
        if keys is None or keys.num_tokens < 2:
            return 0, False
        first = num_computed_tokens // self.block_size
        if first >= len(keys.keys) or keys.tokens_of(len(keys.keys)) <= num_computed_tokens:
            return 0, False
        # Same-node handoff first: the runs a producer put in the rings (the host path then
        # loads what they do not cover); the host pools' own answer when they hold more.
        runs = self.ring_runs(keys.keys) if self.handoff.on else []
        ring_end = runs[-1].start + runs[-1].count if runs else 0
        st.ring = tuple(runs) if ring_end > first else ()
        if ring_end >= len(keys.keys):
            matched = ring_end
        else:
            matched = max(ring_end, first + self.matched_blocks(keys.keys[first:], st.retain))
        external = keys.tokens_of(matched) - num_computed_tokens
        if external <= 0:
            return 0, False
        st.lookup = (num_computed_tokens, external)
        return external, self.load_async and not st.sync_only

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        asked = None
        if st is not None:
            asked, st.lookup = st.lookup, None
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        background = self.load_async and (st is None or not st.sync_only)
        # vLLM now counts those tokens as computed (and, answered asynchronously, parked the
        # request until the workers report a load): where no load can be planned, one that
        # fails whole goes to the workers, so vLLM hears of it and computes them.
        if asked is None or st is None or st.keys is None:
            # (not reached with vLLM 0.32, which allocates right after a positive lookup)
            # Only the blocks of the tokens counted as loaded: the ones before them may be
            # local prefix-cache hits that running requests share.
            if st is not None and st.asked_at is not None:
                first = st.asked_at // self.block_size
                last = -(-(st.asked_at + num_external_tokens) // self.block_size)
                self._plan_load(request.request_id, st, [], block_ids[first:last], background)
            elif background:  # the allocation is the hit's blocks: the external ones last
                n = -(-num_external_tokens // self.block_size)
                self._plan_load(request.request_id, st, [], block_ids[-n:], True)
            return
        local = asked[0]
        first = local // self.block_size
        last = -(-(local + num_external_tokens) // self.block_size)
        hashes = st.keys.keys[first:last]
        ids = block_ids[first:last]
        if len(ids) != len(hashes):
            self.warnings.warn(
                "plan_mismatch",
                "request %s: %d blocks allocated for %d blocks to load; not loading",
                request.request_id,
                len(ids),
                len(hashes),
            )
            self._plan_load(request.request_id, st, [], ids or block_ids[first:], background)
            return
        self._plan_load(request.request_id, st, hashes, ids, background, st.ring, first)
        st.ring = ()

    def _plan_load(
        self,
        req_id: str,
        st: _Req | None,
        hashes: list[str],
        ids: list[int],
        background: bool,
        ring: tuple = (),
        first: int = 0,
    ) -> None:
        self.pending_loads.append(LoadSpec(req_id, hashes, ids, background, ring, first))
        if background and st is not None:
            st.loading = frozenset(ids)

    def loads_finished(self, req_ids) -> None:
        """The workers reported these requests' background loads over."""
        for req_id in req_ids:
            st = self.reqs.get(req_id)
            if st is not None:
                st.loading = frozenset()

    def load_failed(self, invalid_block_ids: set[int]) -> None:
        """Workers could not load these blocks: vLLM recomputes them, and from the first of
        them on a request's blocks are saved again once recomputed (the workers dropped the
        failed step's saves of that request, and of every request sharing those blocks, until
        a plan built after this call acknowledges them)."""
        self.acknowledged |= invalid_block_ids
        for st in self.reqs.values():
            if st.loading & invalid_block_ids:
                st.sync_only = True
            hit = [i for i, b in enumerate(st.block_ids) if b in invalid_block_ids]
            if hit:
                st.saved = min(st.saved, hit[0])
                if (
                    st.keys is not None
                    and st.keys.tail
                    and hit[0] <= st.keys.num_tokens // self.block_size
                ):
                    st.tail_saved = False

    # -- the step's plan ------------------------------------------------------------------
    def build(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan(loads=self.pending_loads, acknowledged=self.acknowledged)
        self.pending_loads, self.acknowledged = [], set()
        # (Finished requests were forgotten in request_finished, which vLLM calls for each:
        # its finished_req_ids may name an id a new request reuses by now.)
        if not self.save:
            return plan
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is None:  # never seen by on_new_request/lookup: nothing known about it
                continue
            st.block_ids = list(new.block_ids[0])
            self._plan_save(
                new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0), plan
            )
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan_save(
                req_id, st, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plan
            )
        return plan

    def _plan_save(self, req_id: str, st: _Req, computed: int, plan: StepPlan) -> None:
        keys = st.keys
        if keys is None:
            return
        bs, n = self.block_size, keys.num_tokens
        full = min(computed, n) // bs
        items = []
        for b in range(st.saved, min(full, len(st.block_ids))):
            items.append((keys.hashes[b], keys.hashes[b - 1] if b else None, st.block_ids[b]))
        st.saved = max(st.saved, min(full, len(st.block_ids)))
        if keys.tail and not st.tail_saved and computed >= n:
            k = n // bs
            if k < len(st.block_ids):
                items.append((keys.tail, keys.hashes[k - 1] if k else None, st.block_ids[k]))
                st.tail_saved = True
        if items:
            plan.saves.append(SaveSpec(req_id, items, st.retain))
