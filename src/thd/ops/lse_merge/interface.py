"""Launcher and dispatch for the LSE merge."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from thd._triton import runs_triton
from thd.ops.lse_merge.reference import merge_partials_reference

__all__ = ["merge_partials"]


def _merge_two(
    a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    import triton

    from thd.ops.lse_merge.kernels import _lse_merge_fwd_kernel

    (out_a, lse_a), (out_b, lse_b) = a, b
    out_a, out_b = (o if o.stride(-1) == 1 else o.contiguous() for o in (out_a, out_b))
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    num_rows, num_heads, head_dim_v = out_a.shape
    out = torch.empty(out_a.shape, dtype=dtype, device=out_a.device)
    lse = torch.empty_like(lse_a)
    if out.numel() == 0:
        return out, lse
    block_dv = triton.next_power_of_2(head_dim_v)
    block_t = max(1, min(64, 8192 // block_dv))
    _lse_merge_fwd_kernel[(triton.cdiv(num_rows, block_t), num_heads)](
        out_a, lse_a, out_b, lse_b, out, lse, num_rows,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_T=block_t,
    )  # fmt: skip
    return out, lse


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Merge per-step ``(out_i [T, H, Dv], lse_i [H, T] fp32)`` into ``(out, lse)``.

    ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i``, computed in
    fp32; ``out`` is returned in ``dtype``. With more than two parts the merge folds left to
    right through fp32 intermediates. Rows that are ``-inf`` in every part stay ``-inf``, with
    exact-zero output (never NaN). Capture-safe: no host sync.
    """
    if len(parts) == 1:
        return parts[0][0].to(dtype), parts[0][1]
    if not runs_triton(parts[0][0]):
        return merge_partials_reference(parts, dtype)
    acc = parts[0]
    for i, part in enumerate(parts[1:], start=2):
        acc = _merge_two(acc, part, dtype if i == len(parts) else torch.float32)
    return acc
