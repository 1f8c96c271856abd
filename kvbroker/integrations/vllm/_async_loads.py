"""Loads that run beside the engine's steps (``load_async``): one thread, in submission order.

With ``"load_async": true`` the scheduler side tells vLLM a request's blocks load
asynchronously: vLLM parks the request (``WAITING_FOR_REMOTE_KVS``) and keeps stepping the
others, and each worker reports the request through ``get_finished`` once its load is over,
whether it loaded every block or not. The blocks it could not load are reported by
``get_block_ids_with_load_errors`` in that same step at the latest, and vLLM recomputes them.
So a step never waits for another request's copies.

Who owns what, and when it is freed:

- the engine blocks a load writes belong to vLLM, which neither runs the request nor frees
  them (not even when the request is aborted) until every worker has reported it finished;
  a load is reported only after its last copy completed (``load_cuda`` synchronizes its
  streams), so nothing writes into a block vLLM got back;
- the read lease a load takes is held by this module's thread for the copies only;
- the client a load uses is the link's client of the step that started it; the worker drains
  the loads in flight before its link closes that client (a closed client unmaps its pools);
- the thread is this object's: :meth:`close` waits for every load in flight, then stops it;
- vLLM's sleep mode discards the cache the loads write into: the worker waits for the loads
  in flight first (:meth:`drain_lost`), and reports each as failed after the wake-up, so vLLM
  recomputes a request that outlived the sleep.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from concurrent.futures.thread import BrokenThreadPool
from dataclasses import dataclass
from typing import Any

__all__ = ["AsyncLoads", "Finished", "Lost"]


@dataclass(frozen=True)
class Finished:
    """A load that is over: ``result`` is what its function returned, or what it raised."""

    spec: Any  # the plan's LoadSpec
    client: Any  # the client it used (None: the broker was unavailable when it started)
    result: Any


@dataclass(frozen=True)
class Lost:
    """The result of a load whose copies completed into memory that was then discarded."""

    why: str


class AsyncLoads:
    """A worker's loads in flight, run one at a time on a thread of their own."""

    def __init__(self, initializer: Callable[[], None] | None = None) -> None:
        self._initializer = initializer
        self._pool = self._new_pool()
        self._running: list[tuple[Any, Any, Future]] = []

    def _new_pool(self) -> ThreadPoolExecutor:
        # One thread: the loads share the host's copy bandwidth and the DMA engines anyway,
        # and one at a time they finish in the order vLLM parked their requests.
        return ThreadPoolExecutor(
            1, thread_name_prefix="kvbroker-load", initializer=self._initializer
        )

    def submit(self, spec: Any, client: Any, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` for ``spec`` after the loads submitted before it. A thread that
        failed to start is replaced, once per submission; a load no thread can take (or
        submitted after :meth:`close`) ends at once, failed."""
        try:
            try:
                future = self._pool.submit(fn, *args)
            except BrokenThreadPool:
                self._pool.shutdown(wait=False)  # (its failed loads are already settled)
                self._pool = self._new_pool()
                future = self._pool.submit(fn, *args)
        except Exception as exc:  # noqa: BLE001 - BrokenThreadPool, or submitted after close
            self.fail(spec, client, exc)
            return
        self._running.append((spec, client, future))

    def fail(self, spec: Any, client: Any, exc: BaseException) -> None:
        """``spec`` ends now, failed with ``exc`` (reported by the next :meth:`finished`)."""
        future: Future = Future()
        future.set_exception(exc)
        self._running.append((spec, client, future))

    def finished(self) -> list[Finished]:
        """The loads that ended since the last call, in submission order (each once)."""
        done, running = [], []
        for spec, client, future in self._running:
            if future.done():
                exc = future.exception()
                done.append(Finished(spec, client, exc if exc is not None else future.result()))
            else:
                running.append((spec, client, future))
        self._running = running
        return done

    def drain(self) -> None:
        """Wait until every load submitted so far has ended (they stay to be reported)."""
        wait([future for _, _, future in self._running])

    def drain_lost(self, why: str) -> None:
        """:meth:`drain`, then mark every load that completed as :class:`Lost` (``why``):
        the memory it wrote into is gone (vLLM's sleep mode discarded the KV cache). Those
        that failed keep their failure."""
        self.drain()
        lost = Lost(why)
        for i, (spec, client, future) in enumerate(self._running):
            if future.exception() is None:
                ended: Future = Future()
                ended.set_result(lost)
                self._running[i] = (spec, client, ended)

    @property
    def pending(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Wait for the loads in flight (they write into the engine's cache and read pools
        the client maps), then stop the thread."""
        self._pool.shutdown(wait=True)
