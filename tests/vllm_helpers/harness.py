"""vLLM's own Scheduler with kvbroker's connector, and worker-side connectors driven by a
fake model (no forward pass, no engine): the shape of vLLM's tests/v1/kv_connector/unit.

The fake model makes KV that depends on the KV before it, read back from the paged cache:
``kv(p) = 0.5 * kv(p - 1) + emb[token p]`` per (layer, K/V, head). So a block that was not
loaded, or loaded wrong, poisons every later position unless vLLM recomputes it; the final
cache equals :meth:`FakeModel.truth` only if every load and recompute was right.

Caches are laid out like vLLM's CPU backend: per layer ``[blocks, heads, block, 2*dim]``
views of one buffer, each (block, head) holding its K rows then its V rows.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS = 2  # the tiny model's KV heads
DIM = 32
EOS = 511
_hash_ready = False


class ThreadAgreement:
    """The TP ranks' load agreement (vLLM: a MIN all-reduce over the TP group) for ranks run
    as threads of this process."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(max(ranks, 1), timeout=30)
        self._counts: list[list[int] | None] = [None] * ranks

    def for_rank(self, rank: int):
        def agree(counts: list[int]) -> list[int]:
            self._counts[rank] = list(counts)
            self._barrier.wait()
            out = [min(c) for c in zip(*self._counts, strict=True)]
            self._barrier.wait()  # every rank has read before the next step writes
            return out

        return agree


class FakeModel:
    def __init__(self, seed: int = 0, vocab: int = 512) -> None:
        rng = np.random.default_rng(seed)
        self.emb = rng.standard_normal((vocab, len(LAYERS), 2, HEADS, DIM)).astype(np.float32)

    def truth(self, tokens) -> np.ndarray:
        """``[tokens, layers, 2, heads, dim]`` as an uninterrupted computation makes it."""
        out = np.zeros((len(tokens), len(LAYERS), 2, HEADS, DIM), np.float32)
        prev = np.zeros(out.shape[1:], np.float32)
        for p, t in enumerate(tokens):
            prev = 0.5 * prev + self.emb[t]
            out[p] = prev
        return out


def vllm_config(
    model: str,
    *,
    role: str,
    socket: str,
    tp: int = 1,
    extra: dict | None = None,
    batched_tokens: int = 512,
    blocks: int = 64,
) -> VllmConfig:
    config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBrokerConnector",
            kv_connector_module_path="kvbroker.integrations.vllm",
            kv_role=role,
            kv_connector_extra_config={"socket": socket, "retry_min": 0.05, **(extra or {})},
        ),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    config.cache_config.num_gpu_blocks = blocks
    return config


def kv_cache_config(heads_per_rank: int, blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                list(LAYERS),
                FullAttentionSpec(
                    block_size=BLOCK,
                    num_kv_heads=heads_per_rank,
                    head_size=DIM,
                    dtype=torch.float32,
                ),
            )
        ],
    )


class Engine:
    """A scheduler (vLLM's) and one worker connector + paged cache per TP rank."""

    def __init__(
        self,
        model_dir: str,
        *,
        role: str,
        socket: str,
        tp: int = 1,
        extra: dict | None = None,
        batched_tokens: int = 512,
        blocks: int = 64,
        fake: FakeModel | None = None,
        monkeypatch=None,
    ) -> None:
        from kvbroker.integrations.vllm import connector as conn_mod

        global _hash_ready
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        self.config = vllm_config(
            model_dir,
            role=role,
            socket=socket,
            tp=tp,
            extra=extra,
            batched_tokens=batched_tokens,
            blocks=blocks,
        )
        self.tp = tp
        per_rank = max(1, HEADS // tp)
        kcc = kv_cache_config(per_rank, blocks)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
        )
        self.fake = fake or FakeModel()
        self.workers, self.caches, self.heads = [], [], []
        agreement = ThreadAgreement(tp)
        for rank in range(tp):
            if monkeypatch is not None:
                monkeypatch.setattr(conn_mod, "_tp_rank", lambda r=rank: r)
                monkeypatch.setattr(
                    conn_mod,
                    "_tp_agreement",
                    lambda size, r=rank: agreement.for_rank(r) if size > 1 else None,
                )
            worker = conn_mod.KVBrokerConnector(self.config, KVConnectorRole.WORKER, kcc)
            raw = torch.zeros(
                len(LAYERS) * blocks * per_rank * BLOCK * 2 * DIM, dtype=torch.float32
            )
            per_layer = raw.view(len(LAYERS), blocks, per_rank, BLOCK, 2 * DIM)
            caches = {name: per_layer[i] for i, name in enumerate(LAYERS)}
            worker.register_kv_caches(caches)
            self.workers.append(worker)
            self.caches.append(per_layer.view(len(LAYERS), blocks, per_rank, 2, BLOCK, DIM))
            first = rank * per_rank if tp <= HEADS else rank // (tp // HEADS)
            self.heads.append(slice(first, first + per_rank))
        self._ids = 0
        self.tables: dict[str, list[int]] = {}  # each request's blocks, as last scheduled
        self._recv_reports: Counter[str] = Counter()  # ranks that reported a load over

    @property
    def connector(self):
        return self.scheduler.connector

    def add(
        self,
        tokens,
        *,
        max_tokens: int = 1,
        cache_salt: str | None = None,
        lora_request=None,
        extra_args: dict | None = None,
    ) -> str:
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
        params.update_from_generation_config({}, EOS)
        req = Request(
            request_id=f"r{self._ids}",
            prompt_token_ids=list(tokens),
            sampling_params=params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        self.scheduler.add_request(req)
        return req.request_id

    # -- one engine step ------------------------------------------------------------------
    def step(self, *, before_load=None, layers_to_run=None) -> dict:
        out = self.scheduler.schedule()
        mro, done = self.execute(out, before_load=before_load, layers_to_run=layers_to_run)
        self.scheduler.update_from_output(out, mro)
        return done

    def execute(self, out, *, before_load=None, layers_to_run=None):
        """The workers' half of one step of ``out`` (a scheduler output): bind, load, the
        fake forward with its save hooks, save. Returns the ModelRunnerOutput for
        ``update_from_output`` (async scheduling calls it later) and what :meth:`step`
        returns."""
        meta = out.kv_connector_metadata
        for w in self.workers:
            w.bind_connector_metadata(meta)
        if before_load is not None:
            before_load(out)
        # Each rank's start_load in a thread of its own, as vLLM's worker processes run it:
        # the ranks agree on what loaded (a collective) before the forward.
        if self.tp > 1:
            with ThreadPoolExecutor(self.tp) as pool:
                list(pool.map(lambda w: w.start_load_kv(None), self.workers))
        else:
            self.workers[0].start_load_kv(None)
        work = []  # (req id, start, end)
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            self.tables[req_id] = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            work.append((req_id, req.num_computed_tokens - n, req.num_computed_tokens))
        run = range(len(LAYERS)) if layers_to_run is None else layers_to_run
        for layer in run:
            for rank, w in enumerate(self.workers):
                for req_id, start, end in work:
                    self._forward(rank, layer, req_id, start, end)
                w.save_kv_layer(LAYERS[layer], None, None)
        invalid: set[int] = set()
        stats = []
        loaded = set()  # background loads every rank has reported over (vLLM's aggregation)
        for w in self.workers:
            w.wait_for_save()
            # in vLLM's order: a background load's failed blocks are reported at the latest
            # in the step that reports it finished
            _sending, recving = w.get_finished(set(out.finished_req_ids))
            for req_id in recving or ():
                self._recv_reports[req_id] += 1
                if self._recv_reports[req_id] == self.tp:
                    del self._recv_reports[req_id]
                    loaded.add(req_id)
            invalid |= w.get_block_ids_with_load_errors()
            stats.append(w.get_kv_connector_stats())
            w.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            sampled.append([7] if req.num_computed_tokens >= req.num_prompt_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                invalid_block_ids=invalid, finished_recving=loaded or None
            ),
        )
        return mro, {"output": out, "invalid": invalid, "stats": stats, "loaded": loaded}

    def _forward(self, rank: int, layer: int, req_id: str, start: int, end: int) -> None:
        req = self.scheduler.requests[req_id]
        tokens = req.all_token_ids
        table = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        cache = self.caches[rank][layer]  # [block, head, kv, slot, dim]
        heads = self.heads[rank]
        for p in range(start, end):
            if p:
                b, s = table[(p - 1) // BLOCK], (p - 1) % BLOCK
                prev = cache[b, :, :, s, :].numpy()  # [head, kv, dim]
            else:
                prev = 0
            new = 0.5 * prev + self.fake.emb[tokens[p], layer][:, heads].transpose(1, 0, 2)
            cache[table[p // BLOCK], :, :, p % BLOCK, :] = torch.from_numpy(
                np.ascontiguousarray(new)
            )

    def run(self, max_steps: int = 100, **kw) -> list[dict]:
        steps = []
        while self.scheduler.has_unfinished_requests() and len(steps) < max_steps:
            steps.append(self.step(**kw))
            if not steps[-1]["output"].num_scheduled_tokens:
                time.sleep(0.002)  # only requests waiting for their background loads
        assert not self.scheduler.has_unfinished_requests(), "requests did not finish"
        return steps

    def cached_kv(self, req_id: str, tokens) -> np.ndarray:
        """The KV this engine computed or loaded for ``tokens`` of a request: ``[tokens,
        layers, 2, heads, dim]`` assembled from every rank's blocks (freed blocks keep their
        bytes until reused)."""
        table = self.tables[req_id]
        out = np.zeros((len(tokens), len(LAYERS), 2, HEADS, DIM), np.float32)
        for rank in range(self.tp):
            cache = self.caches[rank]
            for p in range(len(tokens)):
                blk = cache[:, table[p // BLOCK], :, :, p % BLOCK, :].numpy()  # [L, head, kv, dim]
                out[p, :, :, self.heads[rank]] = blk.transpose(0, 2, 1, 3)
        return out

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.connector.shutdown()
