"""Head-sharding arithmetic for tensor parallelism (``docs/design.md``). Pure functions, no I/O.

H is the model's number of KV heads, from the model config (never heads-per-rank × TP).

- ``shard_heads(rank, tp, H)``: heads ``[rank·H/tp, (rank+1)·H/tp)``; when tp > H, heads are
  replicated and rank r holds the single head ``r div (tp/H)`` (div, not mod).
- ``claim_plan(H, P, D, d)``: which prefill ranks decode rank ``d`` reads, and which heads from
  each, offsets relative to each side's shard start. A head replicated on several prefill
  ranks is read from exactly one copy; decode ranks spread over the copies.
- Latent (MLA) caches have no head axis: pass ``H = None``. Every rank holds the whole latent
  and decode rank d reads the copy of prefill rank ``d mod P``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadRequest

__all__ = ["Piece", "shard_heads", "claim_plan", "readers_of", "contributing_ranks"]


@dataclass(frozen=True)
class Piece:
    """A head range decode rank copies from one prefill shard: ``count`` heads starting at
    ``src_head`` of the prefill shard, landing at ``dst_head`` of the decode shard."""

    prefill_rank: int
    src_head: int
    dst_head: int
    count: int


def _check_tp(rank: int, tp: int, heads: int | None) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise BadRequest(f"tp size must be a positive int, not {tp!r}")
    if not isinstance(rank, int) or not 0 <= rank < tp:
        raise BadRequest(f"tp rank {rank!r} is outside [0, {tp})")
    if heads is None:
        return
    if not isinstance(heads, int) or heads < 1:
        raise BadRequest(f"total KV heads must be a positive int, not {heads!r}")
    if tp <= heads and heads % tp:
        raise BadRequest(f"{heads} KV heads cannot be split evenly over {tp} TP ranks")
    if tp > heads and tp % heads:
        raise BadRequest(f"{tp} TP ranks cannot replicate {heads} KV heads evenly")


def shard_heads(rank: int, tp: int, heads: int | None) -> range:
    """The KV heads TP rank ``rank`` of ``tp`` holds; ``range(0, 1)`` for a latent cache."""
    _check_tp(rank, tp, heads)
    if heads is None:
        return range(0, 1)
    if tp <= heads:
        per = heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank // (tp // heads)  # replicated: tp/H consecutive ranks share one head
    return range(head, head + 1)


def _holders(head: int, tp: int, heads: int) -> range:
    """The TP ranks that hold ``head``."""
    if tp <= heads:
        rank = head // (heads // tp)
        return range(rank, rank + 1)
    copies = tp // heads
    return range(head * copies, (head + 1) * copies)


def claim_plan(heads: int | None, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Piece]:
    """The pieces decode rank ``decode_rank`` assembles, in decode-head order.

    Consecutive heads from the same prefill rank are merged, so each contributing prefill
    shard yields one piece: both shards are contiguous head ranges.
    """
    _check_tp(0, prefill_tp, heads)
    need = shard_heads(decode_rank, decode_tp, heads)
    if heads is None:
        return [Piece(decode_rank % prefill_tp, 0, 0, 1)]
    pieces: list[Piece] = []
    for head in need:
        holders = _holders(head, prefill_tp, heads)
        rank = holders[decode_rank % len(holders)]  # spread decode ranks over the copies
        src = head - shard_heads(rank, prefill_tp, heads).start
        dst = head - need.start
        last = pieces[-1] if pieces else None
        if last and last.prefill_rank == rank and last.src_head + last.count == src:
            pieces[-1] = Piece(rank, last.src_head, last.dst_head, last.count + 1)
        else:
            pieces.append(Piece(rank, src, dst, 1))
    return pieces


def contributing_ranks(
    heads: int | None, prefill_tp: int, decode_tp: int, decode_rank: int
) -> list[int]:
    """The prefill ranks decode rank ``decode_rank`` reads, in order, without repeats."""
    return list(
        dict.fromkeys(p.prefill_rank for p in claim_plan(heads, prefill_tp, decode_tp, decode_rank))
    )


def readers_of(prefill_rank: int, heads: int | None, prefill_tp: int, decode_tp: int) -> int:
    """How many decode ranks read prefill rank ``prefill_rank``'s shard (0: nobody needs it)."""
    _check_tp(prefill_rank, prefill_tp, heads)
    return sum(
        prefill_rank in contributing_ranks(heads, prefill_tp, decode_tp, d)
        for d in range(decode_tp)
    )
