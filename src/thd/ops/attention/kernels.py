"""Triton kernels for varlen THD attention (FlashAttention-2 style online softmax).

Only ``@triton.jit`` code lives here; launch logic is in ``interface.py``.

Grid convention for every kernel: ``(row blocks, heads, sequences + 1)``. Axis 0 walks
the row blocks of one (head, sequence) pair from the last block to the first, so under a
causal mask the heaviest tiles of a sequence start first. Padding rows are never loaded
(masked loads with ``other=0``); instead each program first writes the fill value (0 for
outputs and gradients, ``-inf`` for ``lse``) into its share of the padding rows of its slot,
``[cup[b] + L_b, cup[b+1])``, and the extra sequence index ``B`` covers the tail
``[cup[B], T)``. So padding costs work proportional to its size, and no separate cleanup
launch is needed. Each program then computes row blocks ``first, first + grid0, ...`` of its
sequence: one block when ``max_seqlen`` bounds the real lengths, more when it does not, so
an underestimated ``max_seqlen`` costs time, never correctness.

With ``ACCUMULATE`` the forward kernel continues a normalised partial result instead of
starting from nothing: it reads ``(out, lse)`` of its real rows, folds this launch's keys into
them with the same online softmax, and writes them back in place; it writes no other row (a
ring step merges into the previous steps' result without a separate merge pass).

Causal masking is bottom-right aligned: query ``i`` sees key ``j`` iff
``j <= i + (Lk - Lq)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "_attention_bwd_dkdv_kernel",
    "_attention_bwd_dq_kernel",
    "_attention_bwd_preprocess_kernel",
    "_attention_fwd_kernel",
]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 bit patterns as integers: compute in fp32 there.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _sequence_bounds(cu_ptr, cup_ptr, b):
    """(first slot row, real length) of sequence ``b``."""
    lo = tl.load(cu_ptr + b)
    hi = tl.load(cu_ptr + b + 1)
    start = tl.load(cup_ptr + b)
    return start, hi - lo


@triton.jit
def _padding_span(cu_ptr, cup_ptr, b, num_seqs, num_rows):
    """Padding rows ``[lo, hi)`` of slot ``b``; ``b == num_seqs`` is the tail."""
    is_slot = b < num_seqs
    slot_start = tl.load(cup_ptr + b)
    length = tl.load(cu_ptr + b + 1, mask=is_slot, other=0) - tl.load(cu_ptr + b, mask=is_slot, other=0)
    slot_end = tl.load(cup_ptr + b + 1, mask=is_slot, other=0)
    return slot_start + length, tl.where(is_slot, slot_end, num_rows)


@triton.jit
def _fill_rows(
    base_ptr,
    stride_t,
    lo,
    hi,
    step,
    value,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
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
def _fwd_inner(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_m,
    offs_d,
    offs_dv,
    n_lo,
    n_hi,
    seqlen_k,
    causal_offset,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        cols = start_n + offs_n
        if MASKED:
            mask_n = cols < seqlen_k
            k = tl.load(
                k_base + cols[:, None] * stride_kt + offs_d[None, :],
                mask=mask_n[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
        else:
            k = tl.load(
                k_base + cols[:, None] * stride_kt + offs_d[None, :],
                mask=offs_d[None, :] < HEAD_DIM,
                other=0.0,
            )  # [BLOCK_N, BLOCK_D]
        qk = _dot(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        if MASKED:
            visible = mask_n[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(
                v_base + cols[:, None] * stride_vt + offs_dv[None, :],
                mask=mask_n[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0,
            )  # [BLOCK_N, BLOCK_DV]
        else:
            v = tl.load(
                v_base + cols[:, None] * stride_vt + offs_dv[None, :],
                mask=offs_dv[None, :] < HEAD_DIM_V,
                other=0.0,
            )  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    cup_q_ptr,
    cup_k_ptr,
    num_rows_q,
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
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    num_m_blocks = tl.num_programs(0)
    m_block_first = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    num_seqs = tl.num_programs(2) - 1
    out_head = out_ptr + head * stride_oh
    lse_head = lse_ptr + head * stride_lse_h
    if not ACCUMULATE:  # accumulating leaves every row outside this launch's real rows as it is
        pad_lo, pad_hi = _padding_span(cu_q_ptr, cup_q_ptr, b, num_seqs, num_rows_q)
        _fill_rows(
            out_head,
            stride_ot,
            pad_lo + m_block_first * BLOCK_M,
            pad_hi,
            num_m_blocks * BLOCK_M,
            0.0,
            HEAD_DIM_V,
            BLOCK_DV,
            BLOCK_M,
        )
        _fill_rows(
            lse_head,
            1,
            pad_lo + m_block_first * BLOCK_M,
            pad_hi,
            num_m_blocks * BLOCK_M,
            float("-inf"),
            1,
            1,
            BLOCK_M,
        )
    if b == num_seqs:
        return
    q_start, seqlen_q = _sequence_bounds(cu_q_ptr, cup_q_ptr, b)
    k_start, seqlen_k = _sequence_bounds(cu_k_ptr, cup_k_ptr, b)
    causal_offset = seqlen_k - seqlen_q
    kv_head = head // GROUP
    for m_block in range(m_block_first, tl.cdiv(seqlen_q, BLOCK_M), num_m_blocks):
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_m = offs_m < seqlen_q
        q_base = q_ptr + q_start.to(tl.int64) * stride_qt + head * stride_qh
        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        q = tl.load(
            q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
            mask=mask_m[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]

        out_base = out_head + q_start.to(tl.int64) * stride_ot
        if ACCUMULATE:
            # Resume from a normalised partial (out, lse): m = lse (log2 domain), l = 1, acc = out;
            # a row with lse = -inf has seen no key yet (l = 0, out is 0 there).
            lse_prev = tl.load(lse_head + q_start + offs_m, mask=mask_m, other=float("-inf"))
            m_i = lse_prev * LOG2E
            l_i = tl.where(lse_prev == float("-inf"), 0.0, 1.0)
            acc = tl.load(
                out_base + offs_m[:, None] * stride_ot + offs_dv[None, :],
                mask=mask_m[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0,
            ).to(tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        qk_scale = sm_scale * LOG2E

        # Keys every row of this tile sees (in bounds, unmasked), then the masked remainder.
        if IS_CAUSAL:
            full_end = tl.minimum(seqlen_k, m_block * BLOCK_M + causal_offset + 1)
            visible_end = tl.minimum(seqlen_k, (m_block + 1) * BLOCK_M + causal_offset)
        else:
            full_end = seqlen_k
            visible_end = seqlen_k
        full_end = tl.maximum(full_end, 0)
        n_full = (full_end // BLOCK_N) * BLOCK_N
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            offs_m,
            offs_d,
            offs_dv,
            0,
            n_full,
            seqlen_k,
            causal_offset,
            qk_scale,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_V,
            False,
            IS_CAUSAL,
            UPCAST,
        )
        acc, m_i, l_i = _fwd_inner(
            acc,
            m_i,
            l_i,
            q,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            offs_m,
            offs_d,
            offs_dv,
            n_full,
            visible_end,
            seqlen_k,
            causal_offset,
            qk_scale,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_V,
            True,
            IS_CAUSAL,
            UPCAST,
        )

        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
        tl.store(
            out_base + offs_m[:, None] * stride_ot + offs_dv[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask_m[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        )
        tl.store(lse_head + q_start + offs_m, lse, mask=mask_m)


@triton.jit
def _attention_bwd_preprocess_kernel(
    out_ptr,
    do_ptr,
    delta_ptr,
    cu_q_ptr,
    cup_q_ptr,
    stride_ot,
    stride_oh,
    stride_dot,
    stride_doh,
    stride_delta_h,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = _sequence_bounds(cu_q_ptr, cup_q_ptr, b)
    for m_block in range(tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), tl.num_programs(0)):
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask = (offs_m < seqlen_q)[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        o = tl.load(
            out_ptr
            + q_start.to(tl.int64) * stride_ot
            + head * stride_oh
            + offs_m[:, None] * stride_ot
            + offs_dv[None, :],
            mask=mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_DV]
        do = tl.load(
            do_ptr
            + q_start.to(tl.int64) * stride_dot
            + head * stride_doh
            + offs_m[:, None] * stride_dot
            + offs_dv[None, :],
            mask=mask,
            other=0.0,
        )  # [BLOCK_M, BLOCK_DV]
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(delta_ptr + head * stride_delta_h + q_start + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _load_lse(lse_base, offs_m, seqlen_q):
    # Rows past the end and rows that saw no key get +inf so that exp2(qk - lse) == 0.
    lse = tl.load(lse_base + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * LOG2E


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    stride_qt,
    stride_dot,
    offs_n,
    offs_d,
    offs_dv,
    m_lo,
    m_hi,
    seqlen_q,
    causal_offset,
    qk_scale,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(m_lo, m_hi, BLOCK_M):
        offs_m = start_m + offs_m0
        mask_m = offs_m < seqlen_q
        q = tl.load(
            q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
            mask=mask_m[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        do = tl.load(
            do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
            mask=mask_m[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )  # [BLOCK_M, BLOCK_DV]
        lse = _load_lse(lse_base, offs_m, seqlen_q)  # [BLOCK_M]
        delta = tl.load(delta_base + offs_m, mask=mask_m, other=0.0)  # [BLOCK_M]
        qk_t = _dot(k, tl.trans(q), UPCAST) * qk_scale  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(qk_t - lse[None, :])
        if MASKED:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_offset, p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, UPCAST)
        dp_t = _dot(v, tl.trans(do), UPCAST)  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, UPCAST)
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
    cu_q_ptr,
    cu_k_ptr,
    cup_q_ptr,
    cup_k_ptr,
    num_rows_k,
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
    stride_lse_h,
    sm_scale,
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    num_n_blocks = tl.num_programs(0)
    n_block_first = num_n_blocks - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    num_seqs = tl.num_programs(2) - 1
    pad_lo, pad_hi = _padding_span(cu_k_ptr, cup_k_ptr, b, num_seqs, num_rows_k)
    dk_head = dk_ptr + kv_head * stride_dkh
    dv_head = dv_ptr + kv_head * stride_dvh
    _fill_rows(
        dk_head,
        stride_dkt,
        pad_lo + n_block_first * BLOCK_N,
        pad_hi,
        num_n_blocks * BLOCK_N,
        0.0,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
    )
    _fill_rows(
        dv_head,
        stride_dvt,
        pad_lo + n_block_first * BLOCK_N,
        pad_hi,
        num_n_blocks * BLOCK_N,
        0.0,
        HEAD_DIM_V,
        BLOCK_DV,
        BLOCK_N,
    )
    if b == num_seqs:
        return
    k_start, seqlen_k = _sequence_bounds(cu_k_ptr, cup_k_ptr, b)
    q_start, seqlen_q = _sequence_bounds(cu_q_ptr, cup_q_ptr, b)
    causal_offset = seqlen_k - seqlen_q
    for n_block in range(n_block_first, tl.cdiv(seqlen_k, BLOCK_N), num_n_blocks):
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_n = offs_n < seqlen_k
        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        k = tl.load(
            k_base + offs_n[:, None] * stride_kt + offs_d[None, :],
            mask=mask_n[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
            mask=mask_n[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        qk_scale = sm_scale * LOG2E

        # Query rows that see some key of this block, and those that see all of them.
        if IS_CAUSAL:
            m_lo = tl.maximum(n_block * BLOCK_N - causal_offset, 0)
            m_lo = (m_lo // BLOCK_M) * BLOCK_M
            m_full = tl.maximum(n_block * BLOCK_N + BLOCK_N - 1 - causal_offset, 0)
            m_full = tl.minimum(tl.cdiv(m_full, BLOCK_M) * BLOCK_M, tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M)
            m_full = tl.maximum(m_full, m_lo)
        else:
            m_lo = 0
            m_full = 0
        for g in range(GROUP):
            head = kv_head * GROUP + g
            q_base = q_ptr + q_start.to(tl.int64) * stride_qt + head * stride_qh
            do_base = do_ptr + q_start.to(tl.int64) * stride_dot + head * stride_doh
            lse_base = lse_ptr + head * stride_lse_h + q_start
            delta_base = delta_ptr + head * stride_lse_h + q_start
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                lse_base,
                delta_base,
                stride_qt,
                stride_dot,
                offs_n,
                offs_d,
                offs_dv,
                m_lo,
                m_full,
                seqlen_q,
                causal_offset,
                qk_scale,
                BLOCK_M,
                HEAD_DIM,
                HEAD_DIM_V,
                True,
                UPCAST,
            )
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                lse_base,
                delta_base,
                stride_qt,
                stride_dot,
                offs_n,
                offs_d,
                offs_dv,
                m_full,
                seqlen_q,
                seqlen_q,
                causal_offset,
                qk_scale,
                BLOCK_M,
                HEAD_DIM,
                HEAD_DIM_V,
                False,
                UPCAST,
            )
        dk = dk * sm_scale
        tl.store(
            dk_head + k_start.to(tl.int64) * stride_dkt + offs_n[:, None] * stride_dkt + offs_d[None, :],
            dk.to(dk_ptr.dtype.element_ty),
            mask=mask_n[:, None] & (offs_d[None, :] < HEAD_DIM),
        )
        tl.store(
            dv_head + k_start.to(tl.int64) * stride_dvt + offs_n[:, None] * stride_dvt + offs_dv[None, :],
            dv.to(dv_ptr.dtype.element_ty),
            mask=mask_n[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
        )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    offs_m,
    offs_d,
    offs_dv,
    n_lo,
    n_hi,
    seqlen_k,
    causal_offset,
    qk_scale,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(n_lo, n_hi, BLOCK_N):
        cols = start_n + offs_n0
        mask_n = cols < seqlen_k
        k = tl.load(
            k_base + cols[:, None] * stride_kt + offs_d[None, :],
            mask=mask_n[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_base + cols[:, None] * stride_vt + offs_dv[None, :],
            mask=mask_n[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )  # [BLOCK_N, BLOCK_DV]
        qk = _dot(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_M, BLOCK_N]
        p = tl.exp2(qk - lse[:, None])
        if MASKED:
            visible = mask_n[None, :]
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            p = tl.where(visible, p, 0.0)
        dp = _dot(do, tl.trans(v), UPCAST)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, UPCAST)
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
    num_rows_q,
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
    seq_bucket,  # autotune key only
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    num_m_blocks = tl.num_programs(0)
    m_block_first = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    num_seqs = tl.num_programs(2) - 1
    pad_lo, pad_hi = _padding_span(cu_q_ptr, cup_q_ptr, b, num_seqs, num_rows_q)
    dq_head = dq_ptr + head * stride_dqh
    _fill_rows(
        dq_head,
        stride_dqt,
        pad_lo + m_block_first * BLOCK_M,
        pad_hi,
        num_m_blocks * BLOCK_M,
        0.0,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
    )
    if b == num_seqs:
        return
    q_start, seqlen_q = _sequence_bounds(cu_q_ptr, cup_q_ptr, b)
    k_start, seqlen_k = _sequence_bounds(cu_k_ptr, cup_k_ptr, b)
    causal_offset = seqlen_k - seqlen_q
    kv_head = head // GROUP
    for m_block in range(m_block_first, tl.cdiv(seqlen_q, BLOCK_M), num_m_blocks):
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_m = offs_m < seqlen_q
        q_base = q_ptr + q_start.to(tl.int64) * stride_qt + head * stride_qh
        do_base = do_ptr + q_start.to(tl.int64) * stride_dot + head * stride_doh
        k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
        v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        q = tl.load(
            q_base + offs_m[:, None] * stride_qt + offs_d[None, :],
            mask=mask_m[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        do = tl.load(
            do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
            mask=mask_m[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
            other=0.0,
        )  # [BLOCK_M, BLOCK_DV]
        lse = _load_lse(lse_ptr + head * stride_lse_h + q_start, offs_m, seqlen_q)  # [BLOCK_M]
        delta = tl.load(delta_ptr + head * stride_lse_h + q_start + offs_m, mask=mask_m, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        qk_scale = sm_scale * LOG2E

        if IS_CAUSAL:
            full_end = tl.minimum(seqlen_k, m_block * BLOCK_M + causal_offset + 1)
            visible_end = tl.minimum(seqlen_k, (m_block + 1) * BLOCK_M + causal_offset)
        else:
            full_end = seqlen_k
            visible_end = seqlen_k
        full_end = tl.maximum(full_end, 0)
        n_full = (full_end // BLOCK_N) * BLOCK_N
        dq = _dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            offs_m,
            offs_d,
            offs_dv,
            0,
            n_full,
            seqlen_k,
            causal_offset,
            qk_scale,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_V,
            False,
            IS_CAUSAL,
            UPCAST,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_kt,
            stride_vt,
            offs_m,
            offs_d,
            offs_dv,
            n_full,
            visible_end,
            seqlen_k,
            causal_offset,
            qk_scale,
            BLOCK_N,
            HEAD_DIM,
            HEAD_DIM_V,
            True,
            IS_CAUSAL,
            UPCAST,
        )
        dq = dq * sm_scale
        tl.store(
            dq_head + q_start.to(tl.int64) * stride_dqt + offs_m[:, None] * stride_dqt + offs_d[None, :],
            dq.to(dq_ptr.dtype.element_ty),
            mask=mask_m[:, None] & (offs_d[None, :] < HEAD_DIM),
        )
