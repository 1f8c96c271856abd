"""Claims that land while the engine computes: :meth:`GpuClient.land` and its finisher.

A blocking :meth:`GpuClient.claim` waits for its copies before it returns, because its read
lease must outlive them. :meth:`GpuClient.land` returns as soon as the copies are queued, so
the engine's next forward pass runs while they land: group ``g`` of the destination tensors
has its own CUDA event, and a layer waits (on the GPU, not the CPU) only for its own group.

Who owns what, and who frees it, when:

- The read lease passes from the caller to the :class:`Landing` when ``land`` returns. The
  GpuClient's finisher thread releases it once the copies are done (a CUDA event it waits on
  off the caller's thread), then runs the caller's ``after`` (e.g. counting a consume). A
  failed copy releases the lease without consuming and skips ``after``.
- The destination tensors are the caller's. They are marked as used by the copy stream
  (``record_stream``), so dropping them before they landed cannot hand their memory to
  another tensor while a copy still writes it.
- :meth:`GpuClient.close` waits for every landing first: the pools stay registered and mapped
  until no copy reads them.

Nothing here checks the bytes (no ``verify``): a check that ends after the engine has used
them could not keep it from using them.

What comes later than with a blocking claim: a failed copy, or a lease that ended under the
copies (its TTL ran out, the connection broke), is known only after the engine has used the
bytes: ``finish()`` raises it, and the finisher logs it either way. The finisher shares the
Client's one connection. Its release is a one-way request, sent without waiting for a call in
progress on the caller's thread, and the daemon serves releases past a claim of the same
connection that waits (``passes_a_wait`` in the op table): a claim with ``wait=`` does not
hold it back. Only a lease near the end of its TTL, or one whose copy failed (released
without counting the consume), is released with a round trip (its reply says whether it had
ended), and that one waits for such a call to return. Close the
GpuClient (it waits for every landing) before its Client.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import KVBrokerError

__all__ = ["Landing", "Finisher"]

log = logging.getLogger("kvbroker")


class Landing:
    """Copies queued from a read lease into the caller's tensors, group by group.

    ``ready(g)`` is the CUDA event recorded after group ``g``'s copies, ``done`` after the
    last (both on the GpuClient's copy stream). ``wait_for(g, stream)`` makes ``stream``
    (default: the current one) wait for group ``g`` without blocking the CPU. ``finish()``
    blocks until the lease is released and ``after`` has run, raising what failed.
    """

    def __init__(
        self, lease: Any, events: Sequence[Any], done: Any, after: Callable[[], None] | None
    ) -> None:
        self.lease = lease
        self.done = done
        self._events = list(events)
        self._after = after
        self._after_lock = threading.Lock()  # cancel_after() against the finisher taking it
        self._finished = threading.Event()
        self.error: BaseException | None = None

    def ready(self, group: int) -> Any:
        return self._events[group]

    def wait_for(self, group: int, stream: Any = None, *, device: Any = None) -> None:
        """``stream`` (default: the current one of ``device``) waits for group ``group``.
        A CPU ``device`` has no stream to order: nothing to do (a tensor moved off the GPU
        by its reader, which ordered that move itself)."""
        import torch

        if stream is None and device is not None and torch.device(device).type != "cuda":
            return
        target = stream if stream is not None else torch.cuda.current_stream(device)
        target.wait_event(self._events[group])

    def cancel_after(self) -> bool:
        """Do not run ``after`` (the caller failed after handing the lease over: e.g. count
        no consume). True if it was dropped; False if the finisher had taken it (or there
        was none)."""
        with self._after_lock:
            dropped, self._after = self._after is not None, None
            return dropped

    @property
    def landed(self) -> bool:
        """True once every copy is done (the lease may still be on its way back)."""
        return bool(self.done.query())

    @property
    def finished(self) -> bool:
        """True once the lease is released and ``after`` has run (or failed)."""
        return self._finished.is_set()

    def finish(self, timeout: float | None = None) -> None:
        """Wait until the finisher has released the lease; raise what failed on the way
        (a copy, the release, ``after``)."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"lease {self.lease.id}: its copies did not land in {timeout} s")
        if self.error is not None:
            raise self.error

    def _complete(self) -> None:
        """On the finisher thread: wait for the copies, release, run ``after``."""
        try:
            try:
                self.done.synchronize()
            except BaseException:
                self.lease.release(consume=False)  # a failed copy does not count as a read
                raise
            self.lease.release()
            with self._after_lock:
                after, self._after = self._after, None
            if after is not None:
                after()
        except BaseException as exc:  # kept for finish(); logged in case nobody asks
            self.error = exc
            log.warning("a landing claim of lease %s failed: %s", self.lease.id, exc)
        finally:
            self._finished.set()


class Finisher:
    """One thread per GpuClient that completes its landings in the order they were queued
    (they were queued on one stream: they land in that order too)."""

    def __init__(self, device: Any = None) -> None:
        self._device = device  # the thread's current CUDA device (no context made on GPU 0)
        self._queue: queue.SimpleQueue[Landing | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, landing: Landing) -> None:
        with self._lock:
            if self._closed:
                raise KVBrokerError("the GpuClient is closed")
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="kvbroker-landing", daemon=True)
                thread.start()  # may raise (no thread to be had): nothing queued then
                self._thread = thread
            self._queue.put(landing)

    def _run(self) -> None:
        if self._device is not None:
            try:
                import torch

                torch.cuda.set_device(self._device)
            except Exception as exc:  # never fatal: a landing left unfinished hangs finish()
                log.warning(
                    "kvbroker-landing: cannot make %s current (%s); the copies are "
                    "waited for from the default device",
                    self._device,
                    exc,
                )
        while True:
            landing = self._queue.get()
            if landing is None:
                return
            landing._complete()

    def close(self) -> None:
        """Complete every landing queued so far, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()
