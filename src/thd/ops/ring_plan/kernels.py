"""Triton kernel of the ring plan tables: one program per table row, no data-dependent branches."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_ring_plan_kernel"]


@triton.jit
def _ring_plan_kernel(
    cu_ptr, cup_ptr, out_ptr, num_seqs, cp, stride_row, EXACT: tl.constexpr, BLOCK: tl.constexpr
):
    """Row ``h * cp + j`` (``h``: 0 both halves, 1 first, 2 second): ``[0, 0, cumulative real
    counts of rank j]``; row ``3cp``: ``[0, local slot offsets]``; row ``3cp + 1``: ``[0, local
    half starts, local end]``."""
    row = tl.program_id(0)
    half = row // cp
    rank = row % cp
    two_cp = 2 * cp
    base = out_ptr + row * stride_row
    # Row predicates as vectors (the interpreter rejects scalar masks).
    rows = tl.zeros([BLOCK], dtype=tl.int32) + row
    is_count = rows < 3 * cp
    is_starts = rows == 3 * cp + 1
    lead = tl.arange(0, BLOCK)
    tl.store(base + lead, tl.zeros([BLOCK], dtype=tl.int32), mask=(lead == 0) | ((lead == 1) & is_count))
    carry = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_seqs + 1, BLOCK):
        b = start + tl.arange(0, BLOCK)  # sequence index; b == num_seqs is the final offset
        seq = b < num_seqs
        upto = b <= num_seqs
        cup_lo = tl.load(cup_ptr + b, mask=upto, other=0)
        cup_hi = tl.load(cup_ptr + b + 1, mask=seq, other=0)
        cu_hi = tl.load(cu_ptr + b + 1, mask=seq, other=0)
        # Offset rows (shifted by one): local slot offsets, or local half starts then the end.
        local_lo = cup_lo // cp
        offsets = tl.where(is_starts & seq, (local_lo + cup_hi // cp) // 2, local_lo)
        tl.store(base + 1 + b, offsets, mask=upto & (rows >= 3 * cp))
        # Count rows (shifted by two).
        if EXACT:
            cu_lo = tl.load(cu_ptr + b, mask=seq, other=0)
            length = cu_hi - cu_lo
            chunk = (cup_hi - cup_lo) // two_cp
            first = tl.minimum(tl.maximum(length - rank * chunk, 0), chunk)
            second = tl.minimum(tl.maximum(length - (two_cp - 1 - rank) * chunk, 0), chunk)
            count = tl.where(half == 0, first + second, tl.where(half == 1, first, second))
            count = tl.where(seq, count, 0)
            tl.store(base + 2 + b, tl.cumsum(count, 0) + carry, mask=seq & is_count)
            carry += tl.sum(count, 0)
        else:  # no padding: every chunk is full
            divisor = tl.where(half == 0, cp, two_cp)
            tl.store(base + 2 + b, cu_hi // divisor, mask=seq & is_count)
