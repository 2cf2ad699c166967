"""Sequence spans and tile geometry shared by the ``tl`` and the Gluon attention kernels.

``@triton.jit`` helpers made only of scalar and elementwise operations, so a ``@gluon.jit`` kernel
calls them as well (they take its semantics and layouts) and every call is inlined. Memory safety:
every row range read from ``cu_seqlens`` is clamped to the tensor's rows (:func:`span`).

Visibility: query ``i`` of a sequence sees key ``j`` iff ``j - i`` lies in ``[d_lo, d_hi]``
(:func:`sequence_pair`), a side bounded only where the kernel says so (``HAS_LO`` / ``HAS_HI``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["padding_span", "sequence_pair", "span", "tile_ranges", "visible"]


@triton.jit
def span(cu_ptr, cup_ptr, b, num_rows, WIDE: tl.constexpr = False):
    """(first row, real length) of sequence ``b``, clamped to the rows ``[0, num_rows)``; the first
    row as int64 with ``WIDE`` (for int64 pointer arithmetic), else int32 like the length."""
    lo = tl.load(cu_ptr + b).to(tl.int64)
    hi = tl.load(cu_ptr + b + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(cup_ptr + b).to(tl.int64), 0), num_rows)
    length = tl.minimum(tl.maximum(hi - lo, 0), num_rows - start)
    if not WIDE:
        start = start.to(tl.int32)
    return start, length.to(tl.int32)


@triton.jit
def padding_span(cu_ptr, cup_ptr, b, num_seqs, num_rows, WIDE: tl.constexpr = False):
    """Padding rows ``[lo, hi)`` of slot ``b`` (clamped to the tensor); ``b == num_seqs`` is the
    tail. int64 bounds with ``WIDE``, else int32."""
    if b < num_seqs:
        start, length = span(cu_ptr=cu_ptr, cup_ptr=cup_ptr, b=b, num_rows=num_rows, WIDE=WIDE)
        lo = start + length
        hi = tl.load(cup_ptr + b + 1).to(tl.int64)
        hi = tl.minimum(tl.maximum(hi, lo), num_rows)
        if not WIDE:
            hi = hi.to(tl.int32)
    else:
        lo = tl.minimum(tl.maximum(tl.load(cup_ptr + b).to(tl.int64), 0), num_rows)
        if WIDE:
            hi = num_rows.to(tl.int64)
        else:
            lo = lo.to(tl.int32)
            hi = num_rows
    return lo, hi


@triton.jit
def sequence_pair(
    cu_q_ptr,
    cup_q_ptr,
    cu_k_ptr,
    cup_k_ptr,
    pos_q_ptr,
    pos_k_ptr,
    b,
    rows_q,
    rows_k,
    window_left,
    window_right,
    HAS_POSITIONS: tl.constexpr,
    WIDE: tl.constexpr = False,
):
    """Sequence ``b``'s query and key spans (:func:`span`) and its visible band ``[d_lo, d_hi]`` of
    ``key index - query index``: around ``Lk - Lq`` (bottom-right alignment), or around
    ``pos_q[b] - pos_k[b]`` when the rows' first positions are given."""
    q_start, seqlen_q = span(cu_ptr=cu_q_ptr, cup_ptr=cup_q_ptr, b=b, num_rows=rows_q, WIDE=WIDE)
    k_start, seqlen_k = span(cu_ptr=cu_k_ptr, cup_ptr=cup_k_ptr, b=b, num_rows=rows_k, WIDE=WIDE)
    if HAS_POSITIONS:  # noqa: SIM108 -- a constexpr branch
        offset = tl.load(pos_q_ptr + b) - tl.load(pos_k_ptr + b)
    else:
        offset = seqlen_k - seqlen_q
    return q_start, seqlen_q, k_start, seqlen_k, offset - window_left, offset + window_right


@triton.jit
def tile_ranges(
    t0, t_last, d_lo, d_hi, partners, BLOCK: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr
):
    """Partner tiles of own indices ``[t0, t_last]`` where partner ``p`` is visible from ``t`` iff
    ``p - t`` lies in ``[d_lo, d_hi]`` (a side unbounded unless ``HAS_LO`` / ``HAS_HI``) and
    ``0 <= p < partners``. Returns ``(a, b, c, end)``: ``[a, b)`` and ``[c, end)`` need a mask,
    ``[b, c)`` is seen in full by every own index; all but ``end`` are multiples of ``BLOCK``."""
    lo = 0
    full_lo = 0
    end = partners
    full_hi = partners
    if HAS_LO:
        lo = tl.maximum(t0 + d_lo, 0)
        full_lo = tl.maximum(t_last + d_lo, 0)
    if HAS_HI:
        end = tl.maximum(tl.minimum(t_last + d_hi + 1, partners), 0)
        full_hi = tl.maximum(tl.minimum(t0 + d_hi + 1, partners), 0)
    a = (lo // BLOCK) * BLOCK
    b = tl.cdiv(full_lo, BLOCK) * BLOCK
    c = (full_hi // BLOCK) * BLOCK
    if c <= b:  # no tile is seen in full: one masked stage
        b = a
        c = a
    end = tl.maximum(end, c)
    return a, b, c, end


@triton.jit
def visible(r, c, num_keys, d_lo, d_hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Mask of visible (query ``r``, key ``c``) pairs, ``r`` and ``c`` broadcast against each other:
    ``c < num_keys`` and ``c - r`` within the bounded sides of ``[d_lo, d_hi]``."""
    seen = c < num_keys
    if HAS_LO:
        seen = seen & (c - r >= d_lo)
    if HAS_HI:
        seen = seen & (c - r <= d_hi)
    return seen
