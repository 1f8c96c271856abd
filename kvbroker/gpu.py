"""The GPU data path of a client: registered pools, one DMA per buffer, stream-ordered.

Who owns and frees what
-----------------------

- The daemon owns the pools; :class:`~kvbroker.Client` maps each pool once per process.
  :class:`GpuClient` pins each of those mappings with ``cudaHostRegister`` ONCE per process
  (a process-wide registry, refcounted per segment: registration costs ~50 ms per GiB, so it
  is paid at attach, never per transfer) and unregisters when the last :class:`GpuClient` of
  that segment is closed. Close the :class:`GpuClient` before its :class:`Client` (the
  ``with`` block does both in that order when it made the client): unmapping a registered
  range leaves it pinned in the driver.
- :meth:`GpuClient.publish` copies each CUDA tensor into its leased slice with ONE device→host
  copy on a side stream that first waits on an event recorded on the caller's stream (so it
  never reads KV the forward pass has not written yet), waits for the copies, then seals.
  Copies that continue each other on both sides (buffers that are views of one tensor) are
  merged into one DMA, issued through the CUDA driver (:func:`copy_runs`). Each buffer's
  checksum (on by default) is computed on the tensors' GPU by a Triton kernel on another
  stream, waiting on the same event, while the DMA runs, and recorded at seal
  (:mod:`kvbroker._client.gpu_integrity`). The source tensors are the caller's; the call
  returns only after the copies and the checksum kernels have read them.
- :meth:`GpuClient.claim` copies each buffer with ONE host→device copy into the caller's
  tensors on the side stream, makes the caller's stream wait on the copy's event (the engine
  cannot read KV before it has landed), waits for the copies (the lease must outlive them),
  then releases the lease. With ``verify=True`` the checksums are recomputed on the claimer's
  GPU from the destination tensors after the copies (objects sealed with the whole-buffer
  kind 0: on the CPU from the pool); a mismatch raises ChecksumMismatch after the bytes have
  landed in the caller's tensors, which must then not be used.
- :meth:`GpuClient.land` queues the same host→device copies from a read lease the caller
  holds and returns at once: the lease passes to the returned ``Landing``, and this
  GpuClient's finisher thread releases it (then runs the caller's ``after``, e.g. counting
  a consume) once the copies are done; each group of destination tensors has its own CUDA
  event, which a reader's stream waits on before reading them (``Landing.wait_for``; the
  transformers integration does it per layer). :meth:`GpuClient.close`
  waits for every landing first. ``kvbroker._client.gpu_landing`` says who frees what.
- :func:`host_tensors` gives torch CPU tensors over a lease's slices (zero-copy, valid only
  while the lease is); they are writable even for read leases: do not write through them.
- GPU staging rings (``kvbroker serve --gpu-ring SIZE``, :mod:`kvbroker._server.rings`): the
  daemon owns the device memory; a process maps each ring once (``cuIpcOpenMemHandle`` in the
  ring GPU's context; unmapped when its last GpuClient closes). :class:`RingRegion` is a region
  under a ring lease: scratch (staging for a gather or a scatter, given back on release),
  write (a ring-located object, :meth:`GpuClient.ring_publish`, owned by the daemon once
  sealed) or read (:meth:`GpuClient.ring_claim`: one copy per buffer, a peer copy over NVLink
  when the ring is on another GPU; a consume-claim frees the object on release).
- :func:`publish_shard_cuda` / :func:`claim_shards_cuda`: :mod:`kvbroker.kv`'s sharded objects
  from/to a paged CUDA cache, through a ring scratch region (or torch memory without a ring),
  one Triton gather/scatter per shard and one bulk DMA per shard.

Torch is imported inside functions only: ``import kvbroker`` never imports torch. On a host
without CUDA every entry point that needs it raises :class:`~kvbroker.errors.KVBrokerError`
saying so.

The code lives on the client side of the socket (``docs/design.md``):
:mod:`kvbroker._client.gpu_client` (GpuClient, registration), :mod:`kvbroker._client.gpu_rings`
(ring methods and regions), :mod:`kvbroker._client.gpu_copy` (the DMA engine) and
:mod:`kvbroker._client.gpu_shards` (the CUDA shard paths).
"""

from __future__ import annotations

from ._client.gpu_client import GpuClient, cuda_available, host_tensors, registered_segments
from ._client.gpu_client import _host_addresses  # noqa: F401  (benchmarks/bench_gpu.py)
from ._client.gpu_copy import _driver  # noqa: F401  (benchmarks/bench_gpu.py)
from ._client.gpu_copy import coalesce, copy_runs
from ._client.gpu_rings import RingRegion
from ._client.gpu_shards import claim_shards_cuda, publish_shard_cuda

__all__ = [
    "GpuClient",
    "RingRegion",
    "host_tensors",
    "cuda_available",
    "registered_segments",
    "publish_shard_cuda",
    "claim_shards_cuda",
    "copy_runs",
    "coalesce",
]
