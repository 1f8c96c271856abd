"""Kind-1 checksums (:mod:`kvbroker._wire.checksum`) of tensors' bytes, computed where they lie.

:func:`checksums` takes contiguous tensors (CUDA for the point of it; CPU tensors run the same
kernel under ``TRITON_INTERPRET=1``, which is how the tests check it) and returns, per tensor,
the value the CPU's :func:`kvbroker._wire.checksum.digest` gives for the same bytes, bit for
bit, with one kernel launch for all of them and one device-to-host copy of the chunk digests
(8 bytes per MiB) at the end.

The kernel (Triton) runs one program per chunk (:data:`kvbroker._wire.checksum.CHUNK`, 1 MiB):
xxh3_64's long-input loop, the secret-keyed 32x32->64-bit multiply-accumulate of 8 lanes over
64-byte stripes, is additive within each 1 KiB block, so a program loads a block as a
``[16 stripes, 4, 2 lanes]`` tile of uint64, reduces it over the stripes in registers, adds the lane-swapped data sums, and
scrambles its 8 accumulators (one multiply per lane per KiB); then the last stripe (read as
bytes: it may sit at any offset) and the merge into one 64-bit value. Each chunk's bytes are
read once from device memory. A buffer's last chunk, when it is 240 bytes or shorter, takes
xxh3's short-input paths: those few bytes are copied to the host and hashed there. The
combining hash over the chunk digests runs on the host too.

A torch fallback (``backend="torch"``, :mod:`kvbroker._client.gpu_checksum_torch`) computes
the same with int64 tensor arithmetic, for devices Triton does not run on.

Addresses: tensors whose first byte is not 8-byte aligned are copied to an aligned buffer
first (PyTorch's own allocations always are). Non-contiguous tensors are refused: the
checksum is of bytes as they lie, and what a strided tensor's bytes "are" is the caller's
choice (``.contiguous()``).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import xxhash

from .gpu_checksum_torch import _s64, torch_long, torch_long_all
from .kernels import _interpret, select_backend, triton_available
from .._wire import checksum as _cs
from ..errors import KVBrokerError

__all__ = [
    "GROUP",
    "NUM_WARPS",
    "Pending",
    "Prepared",
    "checksum",
    "checksums",
    "prepare",
    "segment_digests",
    "select_backend",
    "start",
    "start_rows",
    "triton_available",
]

# Shipped launch settings (benchmarks/bench_integrity_gpu.py records what it ran with).
NUM_WARPS = 1  # measured on an H100: 1 warp per program 0.725 ms for 2 GiB, 4 warps 2.9 ms
GROUP = 4  # 1 KiB blocks per loop iteration of a program
_LE64 = struct.Struct("<Q")

# -- xxh3 constants (xxhash.h, v0.8) -------------------------------------------------------------
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_MX1 = 0x165667919E3779F9
_INIT_ACC = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)


def _r64(offset: int) -> int:
    return struct.unpack_from("<Q", _SECRET, offset)[0]


# The kernels' constant table, as uint64 values (passed to the device as int64 bit patterns):
# [0, 24)  the secret read as uint64 at 8-byte steps: stripe s, lane i is keyed by entry s + i
# [24, 32) the scramble keys (secret + 128)     [32, 40) the last stripe's keys (secret + 121)
# [40, 48) the merge keys (secret + 11)         [48, 56) the initial accumulators
# 56: PRIME32_1   57: PRIME64_1   58: PRIME_MX1
_KEYS = (
    [_r64(8 * j) for j in range(24)]
    + [_r64(128 + 8 * i) for i in range(8)]
    + [_r64(121 + 8 * i) for i in range(8)]
    + [_r64(11 + 8 * i) for i in range(8)]
    + list(_INIT_ACC)
    + [_P32_1, _P64_1, _MX1]
)
_KEY_STRIPE, _KEY_SCRAMBLE, _KEY_LAST, _KEY_MERGE, _KEY_INIT = 0, 24, 32, 40, 48
_KEY_P32_1, _KEY_P64_1, _KEY_MX1 = 56, 57, 58


# -- Triton ----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _triton():
    """(triton, kernel), or None when Triton is absent."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # ImportError, or a broken install on a CPU-only host
        return None

    @triton.jit
    def _xxh3_chunks(addrs, lens, keys, out, GROUP: tl.constexpr):
        pid = tl.program_id(0)
        base = tl.load(addrs + pid)  # int64: the chunk's first byte (8-byte aligned)
        n = tl.load(lens + pid)  # int64: its length, 240 < n <= CHUNK
        words = base.to(tl.pointer_type(tl.uint64))
        raw = base.to(tl.pointer_type(tl.uint8))

        s = tl.arange(0, 16)[:, None, None]  # stripe within a 1 KiB block
        lane3 = tl.arange(0, 4)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
        lane = tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :]  # [4, 2]: lanes 0..7
        half = tl.arange(0, 2)[None, :]
        k_stripe = tl.load(keys + s + lane3).to(tl.uint64, bitcast=True)  # [16, 4, 2]
        k_scramble = tl.load(keys + 24 + lane).to(tl.uint64, bitcast=True)
        k_last = tl.load(keys + 32 + lane).to(tl.uint64, bitcast=True)
        k_merge = tl.load(keys + 40 + lane).to(tl.uint64, bitcast=True)
        acc = tl.load(keys + 48 + lane).to(tl.uint64, bitcast=True)
        p32_1 = tl.load(keys + 56).to(tl.uint64, bitcast=True)
        p64_1 = tl.load(keys + 57).to(tl.uint64, bitcast=True)
        mx1 = tl.load(keys + 58).to(tl.uint64, bitcast=True)

        offs = s * 8 + lane3  # uint64 word of (stripe, lane) within a block
        nb = (n - 1) // 1024  # whole blocks, each followed by a scramble
        # GROUP blocks per iteration: [GROUP, 16, 4, 2] words in flight, reduced over the
        # stripes in one go, then GROUP accumulate+scramble steps on [4, 2] registers
        g4 = tl.arange(0, GROUP)[:, None, None, None]
        g3 = tl.arange(0, GROUP)[:, None, None]
        goffs = g4 * 128 + offs[None, :, :, :]
        groups = nb // GROUP
        for gi in range(0, groups):
            x = tl.load(words + gi * (GROUP * 128) + goffs)
            dk = x ^ k_stripe[None, :, :, :]
            prod = dk.to(tl.uint32).to(tl.uint64) * (dk >> 32)
            sums = tl.sum(x, axis=1)  # [GROUP, 4, 2]
            pair = tl.sum(sums, axis=2)  # [GROUP, 4]: lane 2q + lane 2q+1
            # acc[i] += multiply of lane i; acc[i ^ 1] += data of lane i
            blk = (pair[:, :, None] - sums) + tl.sum(prod, axis=1)
            for g in tl.static_range(GROUP):
                acc = acc + tl.sum(tl.where(g3 == g, blk, 0), axis=0)
                acc = (acc ^ (acc >> 47) ^ k_scramble) * p32_1
        for b in range(groups * GROUP, nb):  # the whole blocks left over
            x = tl.load(words + b * 128 + offs)
            dk = x ^ k_stripe
            prod = dk.to(tl.uint32).to(tl.uint64) * (dk >> 32)
            sums = tl.sum(x, axis=0)  # [4, 2]
            pair = tl.sum(sums, axis=1)
            acc = acc + (pair[:, None] - sums) + tl.sum(prod, axis=0)
            acc = (acc ^ (acc >> 47) ^ k_scramble) * p32_1
        # the last block's whole stripes but its last, without a scramble
        stripes = ((n - 1) - nb * 1024) // 64
        keep = s < stripes
        x = tl.load(words + nb * 128 + offs, mask=keep, other=0)
        dk = x ^ k_stripe
        prod = tl.where(keep, dk.to(tl.uint32).to(tl.uint64) * (dk >> 32), 0)
        sums = tl.sum(x, axis=0)
        pair = tl.sum(sums, axis=1)
        acc = acc + (pair[:, None] - sums) + tl.sum(prod, axis=0)
        # the last 64 bytes (any alignment), keyed by secret + 121
        byte = tl.arange(0, 8)[None, None, :]
        b8 = tl.load(raw + (n - 64) + lane[:, :, None] * 8 + byte).to(tl.uint64)
        v = tl.sum(b8 << (byte * 8).to(tl.uint64), axis=2)  # [4, 2] little-endian words
        dk = v ^ k_last
        pair = tl.sum(v, axis=1)
        acc = acc + (pair[:, None] - v) + dk.to(tl.uint32).to(tl.uint64) * (dk >> 32)
        # merge: sum over pairs of mul128_fold64(acc[2q] ^ key, acc[2q+1] ^ key), avalanche
        a = acc ^ k_merge
        lo = tl.sum(tl.where(half == 0, a, 0), axis=1)  # [4]
        hi = tl.sum(tl.where(half == 1, a, 0), axis=1)
        m32 = 0xFFFFFFFF
        a_lo = lo & m32
        a_hi = lo >> 32
        b_lo = hi & m32
        b_hi = hi >> 32
        ll = a_lo * b_lo
        hl = a_hi * b_lo
        lh = a_lo * b_hi
        hh = a_hi * b_hi
        cross = (ll >> 32) + (hl & m32) + lh
        upper = (hl >> 32) + (cross >> 32) + hh
        lower = (cross << 32) | (ll & m32)
        r = n.to(tl.uint64) * p64_1 + tl.sum(lower ^ upper, axis=0)
        r = r ^ (r >> 37)
        r = r * mx1
        r = r ^ (r >> 32)
        tl.store(out + pid, r.to(tl.int64, bitcast=True))

    return triton, _xxh3_chunks


# -- the plan: which chunks go where ---------------------------------------------------------
def _flat(t):
    """``t``'s bytes as a flat uint8 tensor (a view)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def _prepare(tensors):
    """(tensors to hash, their byte sizes, their addresses): non-contiguous tensors refused,
    misaligned ones (an odd view of a uint8 buffer) replaced by an aligned copy."""
    kept, sizes, ptrs = [], [], []
    for t in tensors:
        if not t.is_contiguous():
            raise KVBrokerError(
                "checksum of a non-contiguous tensor: its bytes are not one run; pass "
                "t.contiguous() (the checksum is of the bytes as they will lie in the buffer)"
            )
        n = t.nbytes
        ptr = t.data_ptr()
        if n and ptr % 8:  # the allocator's blocks are aligned; views at odd offsets are not
            t = _flat(t).clone()
            ptr = t.data_ptr()
        kept.append(t)
        sizes.append(n)
        ptrs.append(ptr)
    return kept, sizes, ptrs


class _Plan:
    """Where each tensor's chunks go: the kernel takes every chunk longer than SHORT_MAX
    bytes (``longs`` per tensor, in order); a last chunk of SHORT_MAX bytes or fewer is hashed
    on the host (``shorts``: its length, else 0)."""

    def __init__(self, sizes) -> None:
        import numpy as np

        self.sizes = np.asarray(sizes, dtype=np.int64)
        full, tail = np.divmod(self.sizes, _cs.CHUNK)
        self.longs = full + (tail > _cs.SHORT_MAX)
        self.shorts = np.where((tail > 0) & (tail <= _cs.SHORT_MAX), tail, 0)

    def table(self, ptrs):
        """int64 ``[2, chunks]``: address and length of every long chunk."""
        import numpy as np

        longs = self.longs
        total = int(longs.sum())
        owner = np.repeat(np.arange(len(longs)), longs)
        first = np.cumsum(longs) - longs
        at = (np.arange(total, dtype=np.int64) - first[owner]) * _cs.CHUNK
        addr = np.asarray(ptrs, dtype=np.int64)[owner] + at
        return np.stack([addr, np.minimum(self.sizes[owner] - at, _cs.CHUNK)])


class Pending:
    """Checksums queued on a stream: :meth:`result` waits for them and returns the values.

    Holds the tensors it hashes (and any aligned copies) until then, so their memory is not
    reused under the kernel.
    """

    def __init__(self, kept, plan, long_digests, tails, done) -> None:
        self._kept = kept
        self._plan = plan
        self._long = long_digests  # host int64 tensor or array [chunks]
        self._tails = tails  # host uint8 tensor (the short last chunks, concatenated) or None
        self._done = done  # a CUDA event, or None
        self._values: list[int] | None = None

    def wait(self) -> None:
        """Wait for the queued work (the tensors may be reused afterwards)."""
        if self._done is not None:
            self._done.synchronize()

    def result(self) -> list[int]:
        import numpy as np

        if self._values is not None:
            return self._values
        if self._done is not None:
            self._done.synchronize()
        longs = self._long if isinstance(self._long, np.ndarray) else self._long.numpy()
        raw = longs.view("<u8").tobytes()  # 8 bytes per chunk: one copy, then bytes slices
        tails = None if self._tails is None else self._tails.numpy()
        plan = self._plan
        out, at, tail_at = [], 0, 0
        le64, h = _LE64.pack, xxhash.xxh3_64_intdigest
        for n, count, short in zip(
            plan.sizes.tolist(), plan.longs.tolist(), plan.shorts.tolist(), strict=True
        ):
            digests = raw[8 * at : 8 * (at + count)]
            at += count
            if short:
                digests += le64(h(tails[tail_at : tail_at + short]))
                tail_at += short
            # kvbroker._wire.checksum.combine, inlined: xxh3_64(le64(n) || le64(d_i)...)
            out.append(h(le64(n) + digests))
        self._values = out
        self._kept = self._long = self._tails = None
        return out


def start(tensors: Sequence[Any], *, backend: str | None = None, stream: Any = None) -> Pending:
    """Queue the checksums of contiguous tensors (all on one device) on ``stream`` (default:
    the current stream), after whatever is already queued there; returns at once on CUDA.

    The chunk digests come back to pinned host memory on the same stream; the caller may run
    other work meanwhile (a device-to-host DMA of the same tensors on another stream, say) and
    call :meth:`Pending.result`, which waits for them.
    """
    return prepare(tensors, backend=backend, stream=stream).launch(stream)


def start_rows(tensor: Any, *, stream: Any = None) -> Pending:
    """:func:`start` of ``tensor[0], tensor[1], ...`` — each row of a contiguous CUDA tensor
    (a batch of equal blocks, say) — with the set-up done in a few array operations instead
    of one pass per row; the same values. Rows whose bytes are not 8-byte aligned go through
    :func:`start`."""
    import numpy as np
    import torch

    rows = tensor.shape[0] if tensor.dim() else 0
    n = tensor.nbytes // rows if rows else 0
    if (
        not rows
        or not tensor.is_contiguous()
        or tensor.device.type != "cuda"
        or tensor.data_ptr() % 8
        or n % 8
        or select_backend(tensor) != "triton"
    ):
        return start([tensor[j] for j in range(rows)], stream=stream)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        plan = _Plan(np.full(rows, n, dtype=np.int64))
        ptrs = tensor.data_ptr() + n * np.arange(rows, dtype=np.int64)
        longs = _launch_long(plan, _upload_table(plan, ptrs, tensor.device), tensor.device)
        short = int(plan.shorts[0])  # every row's last `short` bytes, row after row
        tails = tensor.reshape(rows, -1).view(torch.uint8)[:, n - short :] if short else None
        return _to_host([tensor], plan, longs, tails)


def prepare(tensors: Sequence[Any], *, backend: str | None = None, stream: Any = None) -> Prepared:
    """Set up the checksums of ``tensors`` without starting them: the table of their chunks
    goes to the device on ``stream`` now; :meth:`Prepared.launch` queues the kernel later, on
    another stream if wanted. For hashing bytes that a DMA will write: the table's small
    host-to-device copy is queued before that DMA (behind it, it would wait for all of it).
    The tensors must keep their addresses until then."""
    import torch

    tensors = list(tensors)
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(t.device != device for t in tensors):
        raise KVBrokerError("checksums: all tensors must be on one device")
    backend = backend or (select_backend(*tensors) if tensors else "torch")
    if backend not in ("triton", "torch"):
        raise KVBrokerError(f"unknown backend {backend!r}")
    return Prepared(tensors, device, backend, stream)


class Prepared:
    """Checksums set up by :func:`prepare`, started by :meth:`launch`."""

    def __init__(self, tensors, device, backend: str, stream: Any) -> None:
        self.tensors, self.device, self.backend = tensors, device, backend
        self._table = None
        # A misaligned tensor is hashed from an aligned copy, made at launch (after the bytes
        # are there): its table is made then too.
        aligned = all(t.nbytes == 0 or t.data_ptr() % 8 == 0 for t in tensors)
        if backend == "triton" and device.type == "cuda" and aligned:
            import torch

            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                kept, sizes, ptrs = _prepare(tensors)
                plan = _Plan(sizes)
                self._table = (kept, sizes, plan, _upload_table(plan, ptrs, device))

    def launch(self, stream: Any = None) -> Pending:
        """Queue the kernel on ``stream`` (default: the current one), after what is queued
        there, and the digests' copy back; returns at once on CUDA."""
        import torch

        cuda = self.device.type == "cuda"
        ctx = torch.cuda.stream(stream) if cuda and stream is not None else contextlib.nullcontext()
        with ctx:
            if self._table is not None:
                kept, sizes, plan, table = self._table
                longs = _launch_long(plan, table, self.device)
            else:  # on the stream: an aligned copy of a misaligned tensor is made here
                kept, sizes, ptrs = _prepare(self.tensors)
                plan = _Plan(sizes)
                if self.backend == "triton":
                    longs = _launch_long(plan, _upload_table(plan, ptrs, self.device), self.device)
                else:
                    longs = torch_long_all(kept, plan, self.device, _keys(self.device))
            shorts = [
                _flat(t)[n - k :]
                for t, n, k in zip(kept, sizes, plan.shorts.tolist(), strict=True)
                if k
            ]
            tails = torch.cat(shorts) if shorts else None
            self._table = None
            if not cuda:
                return Pending(kept, plan, longs.numpy(), tails, None)
            return _to_host(kept, plan, longs, tails)


def _to_host(kept, plan, longs, tails) -> Pending:
    """The digests (and the short tails' bytes, flattened) copied to pinned host memory on
    the current stream, without waiting: the :class:`Pending` that waits for them."""
    import torch

    host = torch.empty(longs.shape, dtype=longs.dtype, pin_memory=True)
    host.copy_(longs, non_blocking=True)
    if tails is not None:
        pinned = torch.empty(tails.shape, dtype=tails.dtype, pin_memory=True)
        tails = pinned.copy_(tails, non_blocking=True).view(-1)
    done = torch.cuda.Event()
    done.record()
    return Pending(kept, plan, host, tails, done)


def checksums(tensors: Sequence[Any], *, backend: str | None = None) -> list[int]:
    """The kind-1 checksum value of each contiguous tensor's bytes, in order.

    All tensors must be on one device. The work is queued on the current stream, after
    whatever is already there (a caller hashing a tensor that another stream writes makes the
    current stream wait for it first); returns once the values are on the host.
    """
    return start(tensors, backend=backend).result()


def checksum(tensor: Any, *, backend: str | None = None) -> int:
    """The kind-1 checksum value of one contiguous tensor's bytes."""
    return checksums([tensor], backend=backend)[0]


def segment_digests(
    tensor: Any, starts: Sequence[int], lengths: Sequence[int], *, backend: str | None = None
):
    """xxh3_64 of byte ranges ``[start, start + length)`` of a contiguous tensor, each longer
    than SHORT_MAX bytes and starting 8-byte aligned in memory: what the kernel computes per
    chunk, for any chunk length (tests and benchmarks). A uint64 numpy array."""
    import numpy as np
    import torch

    kept, _, (ptr,) = _prepare([tensor])
    t = kept[0]
    backend = backend or select_backend(t)
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(starts) != len(lengths) or (lengths <= _cs.SHORT_MAX).any():
        raise KVBrokerError(f"segments must be longer than {_cs.SHORT_MAX} bytes")
    if ((ptr + starts) % 8).any() or (starts + lengths > t.numel() * t.element_size()).any():
        raise KVBrokerError("segments must start 8-byte aligned and lie within the tensor")
    if backend == "triton":
        _, kernel = _triton()
        table = torch.from_numpy(np.stack([ptr + starts, lengths])).to(t.device)
        out = torch.empty(len(starts), dtype=torch.int64, device=t.device)
        if len(starts):
            kernel[(len(starts),)](
                table[0], table[1], _keys(t.device), out, GROUP=GROUP, num_warps=NUM_WARPS
            )
    else:
        f = _flat(t)
        keys = _keys(t.device)
        out = torch.cat(
            [
                torch_long(f[a : a + n].view(1, -1), keys)
                for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)
            ]
            or [torch.empty(0, dtype=torch.int64, device=t.device)]
        )
    return out.cpu().numpy().view(np.uint64)


_KEYS_ON: dict[Any, Any] = {}


def _keys(device):
    import torch

    found = _KEYS_ON.get(device)
    if found is None:
        found = _KEYS_ON[device] = torch.tensor(
            [_s64(k) for k in _KEYS], dtype=torch.int64, device=device
        )
    return found


def _upload_table(plan, ptrs, device):
    """The chunk table (int64 ``[2, chunks]``: address, length) on ``device``, copied on the
    current stream (None: no long chunk)."""
    import torch

    if not int(plan.longs.sum()):
        return None
    if device.type != "cuda" and not _interpret():
        raise KVBrokerError("backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    host = torch.from_numpy(plan.table(ptrs))
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _launch_long(plan, table, device):
    """int64 tensor on ``device``: the xxh3_64 of every long chunk, tensor after tensor
    (queued on the current stream)."""
    import torch

    found = _triton()
    if found is None:
        raise KVBrokerError("backend 'triton' asked for, but triton is not importable")
    _, kernel = found
    count = int(plan.longs.sum())
    if not count:
        return torch.empty(0, dtype=torch.int64, device=device)
    out = torch.empty(count, dtype=torch.int64, device=device)
    kernel[(count,)](table[0], table[1], _keys(device), out, GROUP=GROUP, num_warps=NUM_WARPS)
    return out
