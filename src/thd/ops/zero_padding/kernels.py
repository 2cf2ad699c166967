"""Triton kernel that writes zeros into the padding rows of a THD buffer (and nothing else).

The launcher views ``x`` as an integer tensor of the same element size (zero has the same bit
pattern in every dtype). Programs ``[0, num_slots * SPLITS_SLOT)`` each take one slot ``b`` and
stride over its padding rows ``[cup[b] + L_b, cup[b+1])``; the last ``SPLITS_TAIL`` programs
stride over the tail ``[tail_start, T)``. Work therefore scales with the padding, not with ``T``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_zero_padding_fwd_kernel"]


@triton.jit
def _zero_flat(x_ptr, start, end, split, num_splits, ROW_WIDTH, BLOCK: tl.constexpr):
    """Rows are contiguous and adjacent: clear elements ``[start*W, end*W)`` in flat blocks."""
    # Counted loop so that offsets keep the divisibility of W and BLOCK (vectorized stores).
    e_end = end * ROW_WIDTH
    first = start * ROW_WIDTH + split * BLOCK
    step = num_splits * BLOCK
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=x_ptr.dtype.element_ty)  # [BLOCK]
    for i in range(0, tl.cdiv(e_end - first, step)):
        offs_e = first + i * step + offs
        tl.store(x_ptr + offs_e, zeros, mask=offs_e < e_end)


@triton.jit
def _zero_tiles(
    x_ptr,
    start,
    end,
    split,
    num_splits,
    ROW_WIDTH,
    stride_x_row,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows are contiguous but strided: clear ``[BLOCK_R, BLOCK_C]`` tiles of rows ``[start, end)``."""
    first = start + split * BLOCK_R
    step = num_splits * BLOCK_R
    offs_r = tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    zeros = tl.zeros([BLOCK_R, BLOCK_C], dtype=x_ptr.dtype.element_ty)  # [BLOCK_R, BLOCK_C]
    for i in range(0, tl.cdiv(end - first, step)):
        offs_m = first + i * step + offs_r
        mask_m = offs_m < end
        row_ptr = x_ptr + offs_m[:, None] * stride_x_row  # [BLOCK_R, 1]
        for c0 in range(0, ROW_WIDTH, BLOCK_C):
            offs_n = c0 + offs_c
            mask = mask_m[:, None] & (offs_n[None, :] < ROW_WIDTH)
            tl.store(row_ptr + offs_n[None, :], zeros, mask=mask)


@triton.jit(do_not_specialize=["num_rows", "num_seqs", "num_slots", "splits_slot", "splits_tail"])
def _zero_padding_fwd_kernel(
    x_ptr,
    cu_ptr,
    cup_ptr,
    num_rows,
    num_seqs,
    num_slots,
    splits_slot,
    splits_tail,
    stride_x_row,
    ROW_WIDTH: tl.constexpr,
    IS_FLAT: tl.constexpr,
    TAIL_FROM_PADDED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    num_slot_programs = tl.cast(num_slots, tl.int64) * splits_slot
    is_slot = pid < num_slot_programs
    b = tl.where(is_slot, pid // splits_slot, 0)
    # Slot b's padding: [cup[b] + cu[b+1] - cu[b], cup[b+1]); masked loads keep B = 0 in bounds.
    slot_start = (
        tl.load(cup_ptr + b, mask=is_slot, other=0).to(tl.int64)
        + tl.load(cu_ptr + b + 1, mask=is_slot, other=0).to(tl.int64)
        - tl.load(cu_ptr + b, mask=is_slot, other=0).to(tl.int64)
    )
    slot_end = tl.load(cup_ptr + b + 1, mask=is_slot, other=0).to(tl.int64)
    if TAIL_FROM_PADDED:
        tail_start = tl.load(cup_ptr + num_seqs).to(tl.int64)
    else:
        tail_start = tl.load(cu_ptr + num_seqs).to(tl.int64)
    rows_end = tl.cast(num_rows, tl.int64)
    end = tl.minimum(tl.where(is_slot, slot_end, rows_end), rows_end)
    start = tl.minimum(tl.maximum(tl.where(is_slot, slot_start, tail_start), 0), end)
    split = tl.where(is_slot, pid - b * splits_slot, pid - num_slot_programs)
    num_splits = tl.where(is_slot, tl.cast(splits_slot, tl.int64), tl.cast(splits_tail, tl.int64))
    if IS_FLAT:
        _zero_flat(x_ptr, start, end, split, num_splits, ROW_WIDTH, BLOCK)
    else:
        _zero_tiles(x_ptr, start, end, split, num_splits, ROW_WIDTH, stride_x_row, BLOCK_R, BLOCK_C)
