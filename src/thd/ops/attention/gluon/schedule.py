"""The persistent forward's work list, built on the device from ``cu_seqlens`` (no host sync).

One item per (sequence, query tile): ``seq[i]``, ``blk[i]`` for ``i < count[0]``, ordered by tile
index from the highest down (under a causal mask a sequence's tile ``m`` sees ``m + 1`` key tiles,
so this is longest first), sequences in order within one tile index. Item ``(b, m)`` lands at
``#{items with a higher tile index} + #{b' < b with more than m tiles}``, computed per item by one
program per sequence, so the list costs one small launch. Lengths are clamped as the attention
kernels clamp them (``geometry.span``) and nothing is written past ``capacity``. ``count[1]`` and
``count[2]`` are zeroed: the forward's dynamic order counts its tickets and finished programs there.

``SEQUENCE_MAJOR`` orders the list by sequence instead, each sequence's tiles from the highest
index down: item ``(b, m)`` lands at ``#{tiles of sequences before b} + (tiles of b) - 1 - m``. The
programs running at once then read one sequence's keys instead of every long sequence's (an
experiment for long documents, whose keys per head outgrow L2 when several are read together).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["build_work_list"]


@triton.jit
def _num_tiles(cu_ptr, cup_ptr, b, valid, num_rows, BLOCK_M: tl.constexpr):
    lo = tl.load(cu_ptr + b, mask=valid, other=0).to(tl.int64)
    hi = tl.load(cu_ptr + b + 1, mask=valid, other=0).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(cup_ptr + b, mask=valid, other=0).to(tl.int64), 0), num_rows)
    length = tl.minimum(tl.maximum(hi - lo, 0), num_rows - start)
    return tl.where(valid, tl.cdiv(length, BLOCK_M), 0).to(tl.int32)


@triton.jit
def build_work_list(
    cu_ptr,
    cup_ptr,
    seq_ptr,
    blk_ptr,
    count_ptr,
    num_seqs,
    num_rows,
    capacity,
    BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SEQUENCE_MAJOR: tl.constexpr = False,
):
    b = tl.program_id(0)
    me = b + tl.zeros([1], tl.int32)
    own = tl.sum(_num_tiles(cu_ptr, cup_ptr, me, me < num_seqs, num_rows, BLOCK_M), 0)
    offs_b = tl.arange(0, BLOCK_B)
    offs_t = tl.arange(0, BLOCK_T)
    for t0 in range(0, own, BLOCK_T):
        tiles = t0 + offs_t
        higher = tl.zeros([BLOCK_T], tl.int64)  # items with a higher tile index
        before = tl.zeros([BLOCK_T], tl.int64)  # sequences before b with this tile
        for c0 in range(0, num_seqs, BLOCK_B):
            others = c0 + offs_b
            n = _num_tiles(cu_ptr, cup_ptr, others, others < num_seqs, num_rows, BLOCK_M)
            if SEQUENCE_MAJOR:  # every tile of the sequences before b, then b's from the top down
                earlier = tl.where(others < b, n, 0)
                before += tl.sum(earlier.to(tl.int64), 0) + tl.zeros([BLOCK_T], tl.int64)
            else:
                above = tl.maximum(n[None, :] - 1 - tiles[:, None], 0)
                higher += tl.sum(above.to(tl.int64), 1)
                earlier = (n[None, :] > tiles[:, None]) & (others[None, :] < b)
                before += tl.sum(earlier.to(tl.int64), 1)
        if SEQUENCE_MAJOR:
            higher = (own - 1 - tiles).to(tl.int64)
        pos = higher + before
        ok = (tiles < own) & (pos < capacity)
        tl.store(seq_ptr + pos, b + tl.zeros([BLOCK_T], tl.int32), mask=ok)
        tl.store(blk_ptr + pos, tiles, mask=ok)
    if b == 0:
        total = tl.zeros([1], tl.int64)
        for c0 in range(0, num_seqs, BLOCK_B):
            others = c0 + offs_b
            n = _num_tiles(cu_ptr, cup_ptr, others, others < num_seqs, num_rows, BLOCK_M)
            total += tl.sum(n.to(tl.int64), 0)
        tl.store(count_ptr + tl.zeros([1], tl.int32), tl.minimum(total, capacity).to(tl.int32))
        tl.store(count_ptr + 1 + tl.arange(0, 2), tl.zeros([2], tl.int32))  # the dynamic order's counters
