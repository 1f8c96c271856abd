"""The torch fallback of :mod:`kvbroker._client.gpu_checksum` (``backend="torch"``): the same
chunk digests with int64 tensor arithmetic (one pass over the chunk for the stripe sums, then
a loop over the 1 KiB blocks for the scrambles), for devices Triton does not run on. It is
slower than the kernel and allocates temporaries of about twice the bytes of the slab
(``_TORCH_SLAB``) it works on.
"""

from __future__ import annotations

from .._wire import checksum as _cs

# xxh3's PRIME64_1, and the slab of bytes hashed at a time (temporaries: about twice that)
_P64_1 = 0x9E3779B185EBCA87
_TORCH_SLAB = 64 * 1024 * 1024

__all__ = ["torch_long", "torch_long_all"]


def _s64(x: int) -> int:
    """The int64 with the bit pattern of the uint64 ``x``."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _shr(x, k: int):
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


_M32 = 0xFFFFFFFF


def _mul32x32(dk):
    """(dk & 0xFFFFFFFF) * (dk >> 32), as uint64 bit patterns in int64."""
    return (dk & _M32) * _shr(dk, 32)


def _swap_lanes(x):
    """x[..., i ^ 1]."""
    shape = x.shape
    return x.reshape(*shape[:-1], 4, 2).flip(-1).reshape(shape)


def torch_long_all(kept, plan, device, keys):
    """The long chunks' digests of ``kept`` (``plan``'s), on ``device``; ``keys``: the secret
    as int64 words there."""
    import torch

    digests = []
    per_slab = max(1, _TORCH_SLAB // _cs.CHUNK)
    for t, n, count in zip(kept, plan.sizes.tolist(), plan.longs.tolist(), strict=True):
        if not count:
            continue
        f = t.detach().reshape(-1).view(torch.uint8)
        full = n // _cs.CHUNK
        for c0 in range(0, full, per_slab):
            c1 = min(full, c0 + per_slab)
            digests.append(torch_long(f[c0 * _cs.CHUNK : c1 * _cs.CHUNK].view(c1 - c0, -1), keys))
        if count > full:
            digests.append(torch_long(f[full * _cs.CHUNK :].view(1, -1), keys))
    if not digests:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.cat(digests)


def _words(rows, start: int, nbytes: int):
    """Bytes ``[start, start + nbytes)`` of each row of ``rows`` as int64 words ``[C, nbytes / 8]``
    (a view where the row length allows, else a copy)."""
    import torch

    C, L = rows.shape
    if L % 8 == 0:
        return rows.view(torch.int64)[:, start // 8 : (start + nbytes) // 8]
    # only a buffer's last chunk has such a length, and it comes alone
    return torch.stack([r[start : start + nbytes].contiguous().view(torch.int64) for r in rows])


def torch_long(rows, keys):
    """xxh3_64 of each row of the uint8 tensor ``rows`` ([C, L], L > 240, rows 8-byte
    aligned), as int64 bit patterns ``[C]``."""
    import torch

    C, L = rows.shape
    k_stripe = keys[:24].unfold(0, 8, 1)[:16]  # [16, 8]: entry s + lane
    k_scramble, k_last = keys[24:32], keys[32:40]
    k_merge, acc = keys[40:48], keys[48:56].repeat(C, 1)
    p32_1, p64_1, mx1 = (int(keys[i]) for i in (56, 57, 58))
    nb = (L - 1) // 1024
    stripes = ((L - 1) - nb * 1024) // 64
    if nb:
        x = _words(rows, 0, nb * 1024).view(C, nb, 16, 8)  # whole blocks
        dk = x ^ k_stripe
        block = _swap_lanes(x.sum(dim=2)) + _mul32x32(dk).sum(dim=2)  # [C, nb, 8]
        del x, dk
        for b in range(nb):
            a = acc + block[:, b]
            a = a ^ _shr(a, 47)
            acc = (a ^ k_scramble) * p32_1
    if stripes:
        x = _words(rows, nb * 1024, stripes * 64).view(C, stripes, 8)
        dk = x ^ k_stripe[:stripes]
        acc = acc + _swap_lanes(x.sum(dim=1)) + _mul32x32(dk).sum(dim=1)
    last = rows[:, L - 64 :].contiguous().view(C, 8, 8).to(torch.int64)
    shifts = torch.arange(0, 64, 8, device=rows.device, dtype=torch.int64)
    v = (last << shifts).sum(dim=2)  # [C, 8]: disjoint bytes, so the sum is their OR
    acc = acc + _swap_lanes(v) + _mul32x32(v ^ k_last)
    a = acc ^ k_merge
    lo, hi = a[:, 0::2], a[:, 1::2]  # [C, 4]
    a_lo, a_hi, b_lo, b_hi = lo & _M32, _shr(lo, 32), hi & _M32, _shr(hi, 32)
    ll, hl, lh, hh = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = _shr(ll, 32) + (hl & _M32) + lh
    upper = _shr(hl, 32) + _shr(cross, 32) + hh
    lower = (cross << 32) | (ll & _M32)
    r = (lower ^ upper).sum(dim=1) + _s64(L * _P64_1)
    r = r ^ _shr(r, 37)
    r = r * mx1
    return r ^ _shr(r, 32)
