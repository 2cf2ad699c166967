"""Triton kernels for varlen THD attention (FlashAttention-2 style online softmax).

Only ``@triton.jit`` code lives here; tiles and grids are chosen in ``launch.py``.

Grid convention for every kernel: ``(row blocks, heads, sequences + 1)``. Axis 0 walks the
row blocks of one (head, sequence) pair from the last block to the first, so under a causal
mask the heaviest tiles of a sequence start first. Each program first writes the fill value
(0 for outputs and gradients, ``-inf`` for ``lse``) into its share of the padding rows of its
slot, ``[cup[b] + L_b, cup[b+1])``; the extra sequence index ``B`` covers the tail
``[cup[B], T)``. It then computes row blocks ``first, first + grid0, ...`` of its sequence:
one block when ``max_seqlen`` bounds the real lengths, more when it does not, so an
underestimated ``max_seqlen`` costs time, never correctness.

Memory safety: every row range read from ``cu_seqlens`` is clamped to the tensor's rows on
the device (``geometry.span``), so an invalid layout on the unvalidated path gives garbage in
the outputs but never a read or write outside q, k, v, out, lse or the gradients.

Tile loads: with ``TMA`` the inner loops read their tiles through device-side tensor
descriptors whose shape is one sequence's real rows (:func:`_row_source`): the copy engine
fills rows past the sequence with 0 and never touches them, so the same guarantee holds as for
the masked pointer loads (:func:`_load_rows`). The launcher chooses ``TMA`` per tile and only
where the tensors allow descriptors. ``WARP_SPEC`` asks Triton to warp-specialize the loops.

Visibility: query ``i`` of a sequence sees key ``j`` iff ``j - i`` lies in
``[off - left, off + right]`` with ``off = Lk - Lq`` (bottom-right alignment), or
``off = pos_q[b] - pos_k[b]`` with ``HAS_POSITIONS`` (the ring's chunks of a longer sequence). ``causal`` is
``right = 0``; ``HAS_LEFT`` / ``HAS_RIGHT`` say whether a side is bounded. The key loop of a
tile runs in three stages (``geometry.tile_ranges``): masked tiles on the left edge, tiles every
row sees in full (no mask), masked tiles on the right edge (the causal diagonal and the end).

Variants: ``SOFTCAP`` scores are ``softcap * tanh(s / softcap)``; ``HAS_SINKS`` adds
``exp(sink[h])`` to each row's softmax denominator (``lse`` then includes it). With
``ACCUMULATE`` the forward continues a normalised partial ``(out, lse)`` in place (a ring
step merges into earlier steps without a separate pass); the backward kernels with it add their
dQ, dK, dV to the rows' current values (a ring step of several launches sums them in one fp32
buffer each, without full-size partial gradients). The backward either writes dQ from
its own kernel (deterministic) or adds it with fp32 atomics from the dK/dV kernel
(``DQ_MODE`` 1: per-element atomics, 2: one bulk TMA reduction per tile; five matrix products
per tile instead of seven).
"""

from __future__ import annotations

import triton
import triton.language as tl

from thd.ops.attention.geometry import padding_span, sequence_pair, span, tile_ranges, visible
from thd.ops.attention.softmax_terms import fold_sink, scores_log2, store_delta

__all__ = [
    "_attention_bwd_dkdv_kernel",
    "_attention_bwd_dq_kernel",
    "_attention_bwd_preprocess_kernel",
    "_attention_fwd_kernel",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ----------------------------------------------------------------------------- small helpers


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns as integers: compute in fp32 there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with the matrix units accumulating into ``acc``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _program():
    """This program's ``(head, sequence b, number of sequences B)`` from grid axes 1 and 2 (the
    kernels' shared prologue; ``b == B`` is the program of the tail rows)."""
    return tl.program_id(1), tl.program_id(2), tl.num_programs(2) - 1


@triton.jit
def _rows_at(base_ptr, start, stride_t, head, stride_h):
    """Pointer to row ``start`` (int64 offset) of head ``head`` of a ``[T, H, D]`` tensor."""
    return base_ptr + start.to(tl.int64) * stride_t + head * stride_h


@triton.jit
def _fill_rows(
    base_ptr, stride_t, lo, hi, step, value, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr
):
    """Write ``value`` into rows ``lo, lo + BLOCK_R, ...`` (stepping by ``step``) below ``hi``."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_w = tl.arange(0, BLOCK_W)
    fill = tl.full([BLOCK_R, BLOCK_W], value, dtype=base_ptr.dtype.element_ty)
    for row0 in range(lo, hi, step):
        rows = row0 + offs_r
        tl.store(
            base_ptr + rows.to(tl.int64)[:, None] * stride_t + offs_w[None, :],
            fill,
            mask=(rows < hi)[:, None] & (offs_w[None, :] < WIDTH),
        )


@triton.jit
def _fill_padding(
    base_ptr,
    stride_t,
    cu_ptr,
    cup_ptr,
    b,
    num_seqs,
    num_rows,
    value,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """This program's share of the padding rows of slot ``b`` (grid axis 0 splits them)."""
    lo, hi = padding_span(cu_ptr=cu_ptr, cup_ptr=cup_ptr, b=b, num_seqs=num_seqs, num_rows=num_rows)
    first = tl.num_programs(0) - 1 - tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_R
    _fill_rows(base_ptr, stride_t, lo + first * BLOCK_R, hi, step, value, WIDTH, BLOCK_W, BLOCK_R)


@triton.jit
def _load_rows(
    base, rows, cols, stride_t, limit, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, MASK_ROWS: tl.constexpr
):
    """Rows ``rows`` (below ``limit`` when ``MASK_ROWS``) and columns ``< WIDTH`` of a ``[T, W]`` view;
    everything else reads as 0 and is never touched in memory."""
    ptrs = base + rows[:, None] * stride_t + cols[None, :]
    if MASK_ROWS:
        return tl.load(ptrs, mask=(rows < limit)[:, None] & (cols[None, :] < WIDTH), other=0.0)
    if WIDTH == BLOCK_W:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=cols[None, :] < WIDTH, other=0.0)


@triton.jit
def _row_source(
    base,
    num_rows,
    stride_t,
    WIDTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    TMA: tl.constexpr,
):
    """Where :func:`_load_tile` reads ``[BLOCK_R, BLOCK_W]`` tiles of the ``[num_rows, WIDTH]`` view at
    ``base``: a tensor descriptor (``TMA``: the copy engine reads rows and columns outside the view
    as 0 and never touches them in memory), or ``base`` itself."""
    if TMA:
        source = tl.make_tensor_descriptor(
            base,
            shape=[tl.maximum(num_rows, 1), WIDTH],
            strides=[stride_t, 1],
            block_shape=[BLOCK_R, BLOCK_W],
        )
    else:
        source = base
    return source


@triton.jit
def _load_tile(
    source,
    first,
    rows,
    cols,
    stride_t,
    limit,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """Rows ``first + [0, BLOCK_R)`` (= ``rows``) of a :func:`_row_source`; outside ``[0, limit)``
    and past ``WIDTH`` they read as 0."""
    if TMA:
        tile = source.load([first, 0])
    else:
        tile = _load_rows(source, rows, cols, stride_t, limit, WIDTH, BLOCK_W, MASK_ROWS)
    return tile


@triton.jit
def _store_rows(base, rows, cols, stride_t, limit, value, WIDTH: tl.constexpr):
    ptrs = base + rows[:, None] * stride_t + cols[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=(rows < limit)[:, None] & (cols[None, :] < WIDTH))


@triton.jit
def _stage_bounds(STAGE: tl.constexpr, a, b, c, end):
    """Tile range of one stage of :func:`tile_ranges`' split: ``[a, b)``, ``[b, c)`` or ``[c, end)``."""
    if STAGE == 0:
        return a, b
    elif STAGE == 1:
        return b, c
    else:
        return c, end


# ----------------------------------------------------------------------------- forward


@triton.jit
def _fwd_tiles(
    acc,
    m_i,
    l_i,
    q,
    k_src,
    v_src,
    stride_kt,
    stride_vt,
    rows,
    lo,
    hi,
    seqlen_k,
    d_lo,
    d_hi,
    sm_scale,
    softcap,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """Fold key tiles ``[lo, hi)`` into the online softmax ``(acc, m_i, l_i)`` of one query tile.

    ``FOLD_SCALE`` (a positive scale, no softcap): the row maximum is taken over the raw products
    and scaled once per row, and each probability is ``exp2`` of one fused multiply-add."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        cols = start_n + offs_n
        k = _load_tile(k_src, start_n, cols, offs_d, stride_kt, seqlen_k, HEAD_DIM, BLOCK_D, MASKED, TMA)
        if FOLD_SCALE:
            s = _dot(q, tl.trans(k), UPCAST)
            scale = sm_scale * LOG2E
        else:
            s, _ = scores_log2(_dot(q, tl.trans(k), UPCAST), sm_scale, softcap, SOFTCAP)
            scale = 1.0
        if MASKED:
            s = tl.where(
                visible(rows[:, None], cols[None, :], seqlen_k, d_lo, d_hi, HAS_LEFT, HAS_RIGHT),
                s,
                float("-inf"),
            )
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * scale - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_tile(v_src, start_n, cols, offs_dv, stride_vt, seqlen_k, HEAD_DIM_V, BLOCK_DV, MASKED, TMA)
        acc = _dot_acc(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    sinks_ptr,
    cu_q_ptr,
    cu_k_ptr,
    cup_q_ptr,
    cup_k_ptr,
    pos_q_ptr,
    pos_k_ptr,
    rows_q,
    rows_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lse_h,
    sm_scale,
    softcap,
    window_left,
    window_right,
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head, b, num_seqs = _program()
    out_head = out_ptr + head * stride_oh
    lse_head = lse_ptr + head * stride_lse_h
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _fill_padding(
            base_ptr=out_head,
            stride_t=stride_ot,
            cu_ptr=cu_q_ptr,
            cup_ptr=cup_q_ptr,
            b=b,
            num_seqs=num_seqs,
            num_rows=rows_q,
            value=0.0,
            WIDTH=HEAD_DIM_V,
            BLOCK_W=BLOCK_DV,
            BLOCK_R=BLOCK_M,
        )
        _fill_padding(
            base_ptr=lse_head,
            stride_t=1,
            cu_ptr=cu_q_ptr,
            cup_ptr=cup_q_ptr,
            b=b,
            num_seqs=num_seqs,
            num_rows=rows_q,
            value=float("-inf"),
            WIDTH=1,
            BLOCK_W=1,
            BLOCK_R=BLOCK_M,
        )
    if b == num_seqs:
        return
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr=cu_q_ptr,
        cup_q_ptr=cup_q_ptr,
        cu_k_ptr=cu_k_ptr,
        cup_k_ptr=cup_k_ptr,
        pos_q_ptr=pos_q_ptr,
        pos_k_ptr=pos_k_ptr,
        b=b,
        rows_q=rows_q,
        rows_k=rows_k,
        window_left=window_left,
        window_right=window_right,
        HAS_POSITIONS=HAS_POSITIONS,
    )
    kv_head = head // GROUP
    q_base = _rows_at(q_ptr, q_start, stride_qt, head, stride_qh)
    k_base = _rows_at(k_ptr, k_start, stride_kt, kv_head, stride_kh)
    v_base = _rows_at(v_ptr, k_start, stride_vt, kv_head, stride_vh)
    out_base = out_head + q_start.to(tl.int64) * stride_ot
    lse_base = lse_head + q_start
    k_src = _row_source(k_base, seqlen_k, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _row_source(v_base, seqlen_k, stride_vt, HEAD_DIM_V, BLOCK_N, BLOCK_DV, TMA)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    num_m_blocks = tl.num_programs(0)
    for m_block in range(num_m_blocks - 1 - tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), num_m_blocks):
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = rows < seqlen_q
        q = _load_rows(q_base, rows, offs_d, stride_qt, seqlen_q, HEAD_DIM, BLOCK_D, True)
        if ACCUMULATE:
            # Resume from a normalised partial (out, lse): m = lse (log2 domain), l = 1, acc = out;
            # a row with lse = -inf has seen no key yet (l = 0, out is 0 there).
            lse_prev = tl.load(lse_base + rows, mask=mask_m, other=float("-inf"))
            m_i = lse_prev * LOG2E
            l_i = tl.where(lse_prev == float("-inf"), 0.0, 1.0)
            acc = _load_rows(out_base, rows, offs_dv, stride_ot, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
            acc = acc.to(tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        last = tl.minimum(m_block * BLOCK_M + BLOCK_M, seqlen_q) - 1
        a, b_, c, end = tile_ranges(
            t0=m_block * BLOCK_M,
            t_last=last,
            d_lo=d_lo,
            d_hi=d_hi,
            partners=seqlen_k,
            BLOCK=BLOCK_N,
            HAS_LO=HAS_LEFT,
            HAS_HI=HAS_RIGHT,
        )
        for stage in tl.static_range(3):  # masked left edge, tiles seen in full, masked right edge
            lo, hi = _stage_bounds(stage, a, b_, c, end)
            acc, m_i, l_i = _fwd_tiles(
                acc=acc,
                m_i=m_i,
                l_i=l_i,
                q=q,
                k_src=k_src,
                v_src=v_src,
                stride_kt=stride_kt,
                stride_vt=stride_vt,
                rows=rows,
                lo=lo,
                hi=hi,
                seqlen_k=seqlen_k,
                d_lo=d_lo,
                d_hi=d_hi,
                sm_scale=sm_scale,
                softcap=softcap,
                BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                MASKED=stage != 1,
                HAS_LEFT=HAS_LEFT,
                HAS_RIGHT=HAS_RIGHT,
                SOFTCAP=SOFTCAP,
                FOLD_SCALE=FOLD_SCALE,
                UPCAST=UPCAST,
                TMA=TMA,
                WARP_SPEC=WARP_SPEC,
            )
        if HAS_SINKS:  # one extra denominator term exp(sink) with no value row
            m_i, l_i, alpha = fold_sink(m_i=m_i, l_i=l_i, sinks_ptr=sinks_ptr, head=head)
        has_keys = l_i != 0.0  # NaN rows stay NaN
        l_safe = tl.where(has_keys, l_i, 1.0)
        if HAS_SINKS:  # noqa: SIM108 -- acc's rescale folded into the normalisation: one pass over acc
            out = acc * (alpha / l_safe)[:, None]
        else:
            out = acc / l_safe[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        _store_rows(out_base, rows, offs_dv, stride_ot, seqlen_q, out, HEAD_DIM_V)
        tl.store(lse_base + rows, lse, mask=mask_m)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _attention_bwd_preprocess_kernel(
    out_ptr,
    do_ptr,
    delta_ptr,
    lse_ptr,
    sinks_ptr,
    dsink_rows_ptr,
    cu_q_ptr,
    cup_q_ptr,
    rows_q,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_lse_h,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``delta = rowsum(out * dout)`` per real row; with sinks also ``-exp(sink - lse) * delta``."""
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = span(cu_ptr=cu_q_ptr, cup_ptr=cup_q_ptr, b=b, num_rows=rows_q)
    o_base = _rows_at(out_ptr, q_start, stride_ot, head, stride_oh)
    do_base = _rows_at(do_ptr, q_start, stride_dot, head, stride_doh)
    offs_dv = tl.arange(0, BLOCK_DV)
    for m_block in range(tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), tl.num_programs(0)):
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        o = _load_rows(o_base, rows, offs_dv, stride_ot, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
        do = _load_rows(do_base, rows, offs_dv, stride_dot, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
        delta, at = store_delta(
            o=o, do=do, rows=rows, seqlen_q=seqlen_q, q_start=q_start, head=head, stride_lse_h=stride_lse_h,
            delta_ptr=delta_ptr,
        )  # fmt: skip
        if HAS_SINKS:
            lse = tl.load(lse_ptr + at, mask=rows < seqlen_q, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row without any term: p = 0
            sink = tl.load(sinks_ptr + head).to(tl.float32)
            p_sink = tl.exp(sink - lse)
            tl.store(dsink_rows_ptr + at, -p_sink * delta, mask=rows < seqlen_q)


@triton.jit
def _load_lse(lse_base, rows, seqlen_q):
    # Rows past the end and rows that saw no key get +inf so that exp2(s - lse) == 0.
    lse = tl.load(lse_base + rows, mask=rows < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * LOG2E


@triton.jit
def _ds_scaled(p, dp, delta, t, sm_scale, SOFTCAP: tl.constexpr):
    """d(loss)/d(raw q.k) from P, dP and the row term ``delta`` (softcap chain rule applied)."""
    ds = p * (dp - delta)
    if SOFTCAP:
        return ds * (sm_scale * (1.0 - t * t))
    return ds * sm_scale


@triton.jit
def _bwd_kv_tiles(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    lse_base,
    delta_base,
    dq_base,
    q_start,
    stride_qt,
    stride_dot,
    stride_dqt,
    cols,
    lo,
    hi,
    seqlen_q,
    seqlen_k,
    d_lo,
    d_hi,
    sm_scale,
    softcap,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DQ_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles ``[lo, hi)`` (and add dQ with atomics)."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in tl.range(lo, hi, BLOCK_M, warp_specialize=WARP_SPEC):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(q_src, start_m, rows, offs_d, stride_qt, seqlen_q, HEAD_DIM, BLOCK_D, MASKED, TMA)
        do = _load_tile(
            do_src, start_m, rows, offs_dv, stride_dot, seqlen_q, HEAD_DIM_V, BLOCK_DV, MASKED, TMA
        )
        lse = _load_lse(lse_base, rows, seqlen_q)
        delta = tl.load(delta_base + rows, mask=rows < seqlen_q, other=0.0)
        s_t, t_t = scores_log2(_dot(k, tl.trans(q), UPCAST), sm_scale, softcap, SOFTCAP)  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = tl.where(
                visible(rows[None, :], cols[:, None], seqlen_k, d_lo, d_hi, HAS_LEFT, HAS_RIGHT), p_t, 0.0
            )
        dv = _dot_acc(p_t.to(do.dtype), do, dv, UPCAST)
        dp_t = _dot(v, tl.trans(do), UPCAST)  # [BLOCK_N, BLOCK_M]
        ds_t = _ds_scaled(p_t, dp_t, delta[None, :], t_t, sm_scale, SOFTCAP).to(q.dtype)
        dk = _dot_acc(ds_t, q, dk, UPCAST)
        if DQ_MODE == 1:  # fp32 atomics per element
            dq = _dot(tl.trans(ds_t), k, UPCAST)  # [BLOCK_M, BLOCK_D]
            ptrs = dq_base + rows[:, None] * stride_dqt + offs_d[None, :]
            tl.atomic_add(
                ptrs, dq, mask=(rows < seqlen_q)[:, None] & (offs_d[None, :] < HEAD_DIM), sem="relaxed"
            )
        elif DQ_MODE == 2:  # one bulk (TMA) reduction per tile; rows past seqlen_q add exact zeros
            dq_base.atomic_add([q_start + start_m, 0], _dot(tl.trans(ds_t), k, UPCAST))
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dq_acc_ptr,
    cu_q_ptr,
    cu_k_ptr,
    cup_q_ptr,
    cup_k_ptr,
    pos_q_ptr,
    pos_k_ptr,
    rows_q,
    rows_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    stride_dqt,
    stride_dqh,
    stride_lse_h,
    sm_scale,
    softcap,
    window_left,
    window_right,
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DQ_MODE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kv_head, b, num_seqs = _program()
    dk_head = dk_ptr + kv_head * stride_dkh
    dv_head = dv_ptr + kv_head * stride_dvh
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _fill_padding(
            base_ptr=dk_head,
            stride_t=stride_dkt,
            cu_ptr=cu_k_ptr,
            cup_ptr=cup_k_ptr,
            b=b,
            num_seqs=num_seqs,
            num_rows=rows_k,
            value=0.0,
            WIDTH=HEAD_DIM,
            BLOCK_W=BLOCK_D,
            BLOCK_R=BLOCK_N,
        )
        _fill_padding(
            base_ptr=dv_head,
            stride_t=stride_dvt,
            cu_ptr=cu_k_ptr,
            cup_ptr=cup_k_ptr,
            b=b,
            num_seqs=num_seqs,
            num_rows=rows_k,
            value=0.0,
            WIDTH=HEAD_DIM_V,
            BLOCK_W=BLOCK_DV,
            BLOCK_R=BLOCK_N,
        )
    if b == num_seqs:
        return
    # Query r sees key c iff c - r in [d_lo, d_hi], i.e. r - c in [-d_hi, -d_lo].
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr=cu_q_ptr,
        cup_q_ptr=cup_q_ptr,
        cu_k_ptr=cu_k_ptr,
        cup_k_ptr=cup_k_ptr,
        pos_q_ptr=pos_q_ptr,
        pos_k_ptr=pos_k_ptr,
        b=b,
        rows_q=rows_q,
        rows_k=rows_k,
        window_left=window_left,
        window_right=window_right,
        HAS_POSITIONS=HAS_POSITIONS,
    )
    k_base = _rows_at(k_ptr, k_start, stride_kt, kv_head, stride_kh)
    v_base = _rows_at(v_ptr, k_start, stride_vt, kv_head, stride_vh)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    num_n_blocks = tl.num_programs(0)
    for n_block in range(num_n_blocks - 1 - tl.program_id(0), tl.cdiv(seqlen_k, BLOCK_N), num_n_blocks):
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, offs_d, stride_kt, seqlen_k, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(v_base, cols, offs_dv, stride_vt, seqlen_k, HEAD_DIM_V, BLOCK_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        last = tl.minimum(n_block * BLOCK_N + BLOCK_N, seqlen_k) - 1
        a, b_, c, end = tile_ranges(
            t0=n_block * BLOCK_N,
            t_last=last,
            d_lo=-d_hi,
            d_hi=-d_lo,
            partners=seqlen_q,
            BLOCK=BLOCK_M,
            HAS_LO=HAS_RIGHT,
            HAS_HI=HAS_LEFT,
        )
        if last < n_block * BLOCK_N + BLOCK_N - 1:  # a partial key tile: mask every stage
            b_ = a
            c = a
        for g in range(GROUP):
            head = kv_head * GROUP + g
            q_base = _rows_at(q_ptr, q_start, stride_qt, head, stride_qh)
            do_base = _rows_at(do_ptr, q_start, stride_dot, head, stride_doh)
            lse_base = lse_ptr + head * stride_lse_h + q_start
            delta_base = delta_ptr + head * stride_lse_h + q_start
            q_src = _row_source(q_base, seqlen_q, stride_qt, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
            do_src = _row_source(do_base, seqlen_q, stride_dot, HEAD_DIM_V, BLOCK_M, BLOCK_DV, TMA)
            if DQ_MODE == 2:
                dq_base = tl.make_tensor_descriptor(
                    dq_acc_ptr + head * stride_dqh,
                    shape=[rows_q, HEAD_DIM],
                    strides=[stride_dqt, 1],
                    block_shape=[BLOCK_M, BLOCK_D],
                )
            else:
                dq_base = _rows_at(dq_acc_ptr, q_start, stride_dqt, head, stride_dqh)
            for stage in tl.static_range(3):  # masked left edge, tiles seen in full, masked right edge
                lo, hi = _stage_bounds(stage, a, b_, c, end)
                dk, dv = _bwd_kv_tiles(
                    dk=dk,
                    dv=dv,
                    k=k,
                    v=v,
                    q_src=q_src,
                    do_src=do_src,
                    lse_base=lse_base,
                    delta_base=delta_base,
                    dq_base=dq_base,
                    q_start=q_start,
                    stride_qt=stride_qt,
                    stride_dot=stride_dot,
                    stride_dqt=stride_dqt,
                    cols=cols,
                    lo=lo,
                    hi=hi,
                    seqlen_q=seqlen_q,
                    seqlen_k=seqlen_k,
                    d_lo=d_lo,
                    d_hi=d_hi,
                    sm_scale=sm_scale,
                    softcap=softcap,
                    BLOCK_M=BLOCK_M,
                    HEAD_DIM=HEAD_DIM,
                    HEAD_DIM_V=HEAD_DIM_V,
                    BLOCK_D=BLOCK_D,
                    BLOCK_DV=BLOCK_DV,
                    MASKED=stage != 1,
                    HAS_LEFT=HAS_LEFT,
                    HAS_RIGHT=HAS_RIGHT,
                    SOFTCAP=SOFTCAP,
                    DQ_MODE=DQ_MODE,
                    UPCAST=UPCAST,
                    TMA=TMA,
                    WARP_SPEC=WARP_SPEC,
                )
        dk_rows = dk_head + k_start.to(tl.int64) * stride_dkt
        dv_rows = dv_head + k_start.to(tl.int64) * stride_dvt
        if ACCUMULATE:  # add this launch's part to what the rows hold
            dk += _load_rows(dk_rows, cols, offs_d, stride_dkt, seqlen_k, HEAD_DIM, BLOCK_D, True).to(
                tl.float32
            )
            dv += _load_rows(dv_rows, cols, offs_dv, stride_dvt, seqlen_k, HEAD_DIM_V, BLOCK_DV, True).to(
                tl.float32
            )
        _store_rows(dk_rows, cols, offs_d, stride_dkt, seqlen_k, dk, HEAD_DIM)
        _store_rows(dv_rows, cols, offs_dv, stride_dvt, seqlen_k, dv, HEAD_DIM_V)


@triton.jit
def _bwd_q_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    k_src,
    v_src,
    stride_kt,
    stride_vt,
    rows,
    lo,
    hi,
    seqlen_k,
    d_lo,
    d_hi,
    sm_scale,
    softcap,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles ``[lo, hi)``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        cols = start_n + offs_n
        k = _load_tile(k_src, start_n, cols, offs_d, stride_kt, seqlen_k, HEAD_DIM, BLOCK_D, MASKED, TMA)
        v = _load_tile(v_src, start_n, cols, offs_dv, stride_vt, seqlen_k, HEAD_DIM_V, BLOCK_DV, MASKED, TMA)
        s, t = scores_log2(_dot(q, tl.trans(k), UPCAST), sm_scale, softcap, SOFTCAP)  # [BLOCK_M, BLOCK_N]
        p = tl.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(
                visible(rows[:, None], cols[None, :], seqlen_k, d_lo, d_hi, HAS_LEFT, HAS_RIGHT), p, 0.0
            )
        dp = _dot(do, tl.trans(v), UPCAST)
        ds = _ds_scaled(p, dp, delta[:, None], t, sm_scale, SOFTCAP).to(k.dtype)
        dq = _dot_acc(ds, k, dq, UPCAST)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    cu_q_ptr,
    cu_k_ptr,
    cup_q_ptr,
    cup_k_ptr,
    pos_q_ptr,
    pos_k_ptr,
    rows_q,
    rows_k,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_dot,
    stride_doh,
    stride_dqt,
    stride_dqh,
    stride_lse_h,
    sm_scale,
    softcap,
    window_left,
    window_right,
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    UPCAST: tl.constexpr,
    TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    head, b, num_seqs = _program()
    dq_head = dq_ptr + head * stride_dqh
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        _fill_padding(
            base_ptr=dq_head,
            stride_t=stride_dqt,
            cu_ptr=cu_q_ptr,
            cup_ptr=cup_q_ptr,
            b=b,
            num_seqs=num_seqs,
            num_rows=rows_q,
            value=0.0,
            WIDTH=HEAD_DIM,
            BLOCK_W=BLOCK_D,
            BLOCK_R=BLOCK_M,
        )
    if b == num_seqs:
        return
    q_start, seqlen_q, k_start, seqlen_k, d_lo, d_hi = sequence_pair(
        cu_q_ptr=cu_q_ptr,
        cup_q_ptr=cup_q_ptr,
        cu_k_ptr=cu_k_ptr,
        cup_k_ptr=cup_k_ptr,
        pos_q_ptr=pos_q_ptr,
        pos_k_ptr=pos_k_ptr,
        b=b,
        rows_q=rows_q,
        rows_k=rows_k,
        window_left=window_left,
        window_right=window_right,
        HAS_POSITIONS=HAS_POSITIONS,
    )
    kv_head = head // GROUP
    q_base = _rows_at(q_ptr, q_start, stride_qt, head, stride_qh)
    do_base = _rows_at(do_ptr, q_start, stride_dot, head, stride_doh)
    k_base = _rows_at(k_ptr, k_start, stride_kt, kv_head, stride_kh)
    v_base = _rows_at(v_ptr, k_start, stride_vt, kv_head, stride_vh)
    k_src = _row_source(k_base, seqlen_k, stride_kt, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
    v_src = _row_source(v_base, seqlen_k, stride_vt, HEAD_DIM_V, BLOCK_N, BLOCK_DV, TMA)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    num_m_blocks = tl.num_programs(0)
    for m_block in range(num_m_blocks - 1 - tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), num_m_blocks):
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        q = _load_rows(q_base, rows, offs_d, stride_qt, seqlen_q, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(do_base, rows, offs_dv, stride_dot, seqlen_q, HEAD_DIM_V, BLOCK_DV, True)
        lse = _load_lse(lse_ptr + head * stride_lse_h + q_start, rows, seqlen_q)
        delta = tl.load(delta_ptr + head * stride_lse_h + q_start + rows, mask=rows < seqlen_q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        last = tl.minimum(m_block * BLOCK_M + BLOCK_M, seqlen_q) - 1
        a, b_, c, end = tile_ranges(
            t0=m_block * BLOCK_M,
            t_last=last,
            d_lo=d_lo,
            d_hi=d_hi,
            partners=seqlen_k,
            BLOCK=BLOCK_N,
            HAS_LO=HAS_LEFT,
            HAS_HI=HAS_RIGHT,
        )
        for stage in tl.static_range(3):  # masked left edge, tiles seen in full, masked right edge
            lo, hi = _stage_bounds(stage, a, b_, c, end)
            dq = _bwd_q_tiles(
                dq=dq,
                q=q,
                do=do,
                lse=lse,
                delta=delta,
                k_src=k_src,
                v_src=v_src,
                stride_kt=stride_kt,
                stride_vt=stride_vt,
                rows=rows,
                lo=lo,
                hi=hi,
                seqlen_k=seqlen_k,
                d_lo=d_lo,
                d_hi=d_hi,
                sm_scale=sm_scale,
                softcap=softcap,
                BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM,
                HEAD_DIM_V=HEAD_DIM_V,
                BLOCK_D=BLOCK_D,
                BLOCK_DV=BLOCK_DV,
                MASKED=stage != 1,
                HAS_LEFT=HAS_LEFT,
                HAS_RIGHT=HAS_RIGHT,
                SOFTCAP=SOFTCAP,
                UPCAST=UPCAST,
                TMA=TMA,
                WARP_SPEC=WARP_SPEC,
            )
        dq_rows = dq_head + q_start.to(tl.int64) * stride_dqt
        if ACCUMULATE:  # add this launch's part to what the rows hold
            dq += _load_rows(dq_rows, rows, offs_d, stride_dqt, seqlen_q, HEAD_DIM, BLOCK_D, True).to(
                tl.float32
            )
        _store_rows(dq_rows, rows, offs_d, stride_dqt, seqlen_q, dq, HEAD_DIM)
