"""Checksums on the GPU path: what a GPU publish records, and how a GPU claim verifies.

Used by :class:`kvbroker.gpu.GpuClient` (``publish``, ``claim(..., verify=True)``) and
:func:`kvbroker.gpu.publish_shard_cuda`. The checksum is :mod:`kvbroker._wire.checksum`'s;
which kind a client seals with is its ``checksum_kind`` (what the daemon's hello accepts).

- **Kind 1** (the default): the tensors are hashed where they lie, on their GPU
  (:func:`kvbroker._client.gpu_checksum.start`, one launch per device), on a stream that the
  caller makes wait for the bytes to be ready, so that the hash of a publish runs beside its
  device-to-host DMA and the hash of a claim right after its host-to-device DMA. The kernel
  reads each byte once from HBM (2 GiB in about 0.7 ms on an H100, where the DMA takes 40).
- **Kind 0** (a daemon that does not list kind 1, or an object sealed by an older client):
  xxh3_64 of the whole buffer is one chain, which no GPU program can split, so it is hashed on
  the CPU from the pool's bytes: after the DMA for a publish (one more read, on one core), and
  during the DMA for a claim (both only read the pool).

The tensors handed in are the caller's (or a staging region's); :class:`Sums` holds them
until :meth:`Sums.values` (or :meth:`Sums.wait`) has waited for every kernel reading them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._wire import checksum as _cs
from . import gpu_checksum as _gc

__all__ = ["PreparedVerify", "Sums", "mismatched", "prepare_verify", "start_seal", "start_verify"]


def _by_device(tensors: Mapping[str, Any]) -> dict[Any, list[str]]:
    groups: dict[Any, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(t.device, []).append(name)
    return groups


class Sums:
    """Checksums under way: kind-1 values computed on the devices (queued, not waited for),
    and the names whose checksum is a kind-0 hash of the pool's bytes, computed by
    :meth:`values` (or :meth:`host_values`)."""

    def __init__(
        self, order: list[str], kind1: list[tuple[list[str], Any]], kind0: list[str]
    ) -> None:
        self._order = order  # the names, in the caller's order
        self._pending = kind1  # [(names, gpu_checksum.Pending)], one per device
        self._kind0 = kind0

    @property
    def on_host(self) -> bool:
        """Whether some buffers are hashed on the CPU (kind 0)."""
        return bool(self._kind0)

    def host_values(self, host_views: Any) -> dict[str, Any]:
        """The kind-0 checksums, hashed now on this thread from ``host_views`` (the pool's
        bytes: a lease, or any mapping of name to a uint8 view)."""
        return {
            name: _cs.encode(_cs.legacy_digest(host_views[name]), _cs.KIND_XXH3)
            for name in self._kind0
        }

    def device_values(self) -> dict[str, Any]:
        """The kind-1 checksums, once their kernels are done (waits for them)."""
        out: dict[str, Any] = {}
        for names, pending in self._pending:
            for name, value in zip(names, pending.result(), strict=True):
                out[name] = _cs.encode(value, _cs.KIND_XXH3C)
        self._pending = []
        return out

    def values(self, host_views: Any) -> dict[str, Any]:
        """``{name: checksum in its wire form}``, in the order the tensors were given: the
        kind-0 ones hashed first (the CPU works while the GPU finishes), then the kind-1 ones."""
        return self.ordered({**self.host_values(host_views), **self.device_values()})

    def ordered(self, values: dict[str, Any]) -> dict[str, Any]:
        return {name: values[name] for name in self._order}

    def wait(self) -> None:
        """Wait for the kernels still reading the tensors (on a failure path: the values are
        not wanted, but the memory must not be reused under them)."""
        for _, pending in self._pending:
            pending.wait()


def _start(
    tensors: Mapping[str, Any], kind1: list[str], kind0: list[str], stream_for: Callable[[Any], Any]
) -> Sums:
    pending = []
    chosen = {n: tensors[n] for n in kind1}
    for device, names in _by_device(chosen).items():
        pending.append((names, _gc.start([chosen[n] for n in names], stream=stream_for(device))))
    return Sums([n for n in tensors if n in chosen or n in kind0], pending, kind0)


def start_seal(tensors: Mapping[str, Any], kind: int, stream_for: Callable[[Any], Any]) -> Sums:
    """Start the checksums of ``kind`` a publish of ``tensors`` (contiguous, as they will lie
    in the pool) records: kind 1 queued on each tensor's device, on ``stream_for(device)``
    (a stream already waiting for the bytes to be ready; None: the current one); kind 0 left
    to :meth:`Sums.values` over the pool's bytes once the copy is done."""
    names = list(tensors)
    if kind == _cs.KIND_XXH3C:
        return _start(tensors, names, [], stream_for)
    if kind == _cs.KIND_XXH3:
        return Sums(names, [], names)
    raise ValueError(f"unknown checksum kind {kind!r}")


def start_verify(
    tensors: Mapping[str, Any], recorded: Mapping[str, Any] | None, stream_for: Callable[[Any], Any]
) -> Sums:
    """Start recomputing the checksums recorded for the buffers claimed into ``tensors``:
    each buffer in the kind it was sealed with (buffers without one are not checked). Kind 1
    is hashed from ``tensors`` on their devices, on ``stream_for(device)`` (waiting for the
    copies into them); kind 0 by :meth:`Sums.values` from the pool's bytes."""
    kind1, kind0 = _split_by_kind(tensors, recorded)
    return _start(tensors, kind1, kind0, stream_for)


class PreparedVerify:
    """A verify set up by :func:`prepare_verify`: :meth:`launch` starts it."""

    def __init__(
        self, order: list[str], kind1: list[tuple[list[str], Any]], kind0: list[str]
    ) -> None:
        self._order, self._kind1, self._kind0 = order, kind1, kind0

    def launch(self, stream_for: Callable[[Any], Any]) -> Sums:
        """Queue the kind-1 kernels on ``stream_for(device)`` (a stream waiting for the
        bytes); returns the :class:`Sums` under way."""
        return Sums(
            self._order,
            [(names, p.launch(stream_for(p.device))) for names, p in self._kind1],
            self._kind0,
        )


def prepare_verify(
    tensors: Mapping[str, Any], recorded: Mapping[str, Any] | None, upload_stream: Any
) -> PreparedVerify:
    """:func:`start_verify` in two steps, for tensors a DMA is about to fill: the kind-1
    set-up (each device's chunk table, copied to it on ``upload_stream`` now, before the DMA
    is queued there) here, the kernels by :meth:`PreparedVerify.launch` once it is queued."""
    kind1, kind0 = _split_by_kind(tensors, recorded)
    chosen = {n: tensors[n] for n in kind1}
    prepared = [
        (names, _gc.prepare([chosen[n] for n in names], stream=upload_stream))
        for names in _by_device(chosen).values()
    ]
    return PreparedVerify([n for n in tensors if n in chosen or n in kind0], prepared, kind0)


def _split_by_kind(
    tensors: Mapping[str, Any], recorded: Mapping[str, Any] | None
) -> tuple[list[str], list[str]]:
    """The names with a recorded checksum: (kind 1, kind 0)."""
    kind1, kind0 = [], []
    for name in tensors:
        want = None if recorded is None else recorded.get(name)
        if want is None:
            continue
        (kind1 if _cs.parse(want)[0] == _cs.KIND_XXH3C else kind0).append(name)
    return kind1, kind0


def mismatched(computed: Mapping[str, Any], recorded: Mapping[str, Any]) -> list[str]:
    """Names whose computed checksum differs from the one recorded (wire forms, in the order
    of ``computed``)."""
    return [n for n, got in computed.items() if _cs.parse(got) != _cs.parse(recorded[n])]
