"""Triton kernel: merge two partial attention results ``(out_a, lse_a)``, ``(out_b, lse_b)``."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_lse_merge_fwd_kernel"]


@triton.jit
def _lse_merge_fwd_kernel(
    out_a_ptr,
    lse_a_ptr,
    out_b_ptr,
    lse_b_ptr,
    out_ptr,
    lse_ptr,
    num_rows,
    stride_oa_t,
    stride_oa_h,
    stride_ob_t,
    stride_ob_h,
    stride_o_t,
    stride_o_h,
    stride_la_h,
    stride_lb_h,
    stride_l_h,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program: ``BLOCK_T`` rows of one head. Weights are in [0, 1], so rows that are
    exact zeros in both parts stay exact zeros, and ``-inf`` on both sides stays ``-inf``;
    a NaN lse on either side gives NaN."""
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_DV)
    mask_t = offs_t < num_rows
    lse_a = tl.load(lse_a_ptr + head * stride_la_h + offs_t, mask=mask_t, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + head * stride_lb_h + offs_t, mask=mask_t, other=float("-inf"))
    hi = tl.maximum(lse_a, lse_b)
    hi = tl.where(hi == float("-inf"), 0.0, hi)
    w_a = tl.exp(lse_a - hi)
    w_b = tl.exp(lse_b - hi)
    total = w_a + w_b
    has_any = total != 0.0  # True for NaN, which then propagates to lse and out
    inv = tl.where(has_any, 1.0 / tl.where(has_any, total, 1.0), 0.0)
    lse = tl.where(has_any, hi + tl.log(tl.where(has_any, total, 1.0)), float("-inf"))
    tl.store(lse_ptr + head * stride_l_h + offs_t, lse, mask=mask_t)
    rows = offs_t.to(tl.int64)[:, None]
    mask = mask_t[:, None] & (offs_d[None, :] < HEAD_DIM_V)
    o_a = tl.load(out_a_ptr + rows * stride_oa_t + head * stride_oa_h + offs_d[None, :], mask=mask, other=0.0)
    o_b = tl.load(out_b_ptr + rows * stride_ob_t + head * stride_ob_h + offs_d[None, :], mask=mask, other=0.0)
    merged = o_a.to(tl.float32) * (w_a * inv)[:, None] + o_b.to(tl.float32) * (w_b * inv)[:, None]
    tl.store(
        out_ptr + rows * stride_o_t + head * stride_o_h + offs_d[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=mask,
    )  # [BLOCK_T, BLOCK_DV]
