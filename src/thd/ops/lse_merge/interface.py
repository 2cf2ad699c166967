"""Launcher and dispatch for the LSE merge."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from thd._runtime.families import runs_triton
from thd._runtime.launcher import launcher_for
from thd.errors import ThdTypeError, ThdValueError
from thd.ops.lse_merge.reference import merge_partials_reference

__all__ = ["check_parts", "merge_partials"]


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
    launcher_for(_lse_merge_fwd_kernel).run(
        (triton.cdiv(num_rows, block_t), num_heads), out_a, lse_a, out_b, lse_b, out, lse, num_rows,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_b.stride(0), lse.stride(0),
        HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_T=block_t,
    )  # fmt: skip
    return out, lse


def check_parts(fn: str, parts: object, dtype: object) -> None:
    """Host-only checks: a non-empty sequence of ``(out [T, H, Dv], lse [H, T] fp32)`` pairs of one
    shape on one device, and a floating ``dtype``."""
    if isinstance(parts, Tensor) or not isinstance(parts, Sequence) or len(parts) == 0:
        got = f"{len(parts)} parts" if isinstance(parts, Sequence) else type(parts).__name__
        raise ThdValueError(f"{fn}: parts: expected a non-empty sequence of (out, lse) pairs, got {got}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ThdTypeError(f"{fn}: dtype: expected a floating torch.dtype, got {dtype!r}")
    first: Tensor | None = None
    for i, part in enumerate(parts):
        if not (isinstance(part, Sequence) and len(part) == 2 and all(isinstance(t, Tensor) for t in part)):
            raise ThdTypeError(f"{fn}: parts[{i}]: expected an (out, lse) pair of tensors, got {part!r:.80}")
        out, lse = part
        if out.dim() != 3 or not out.dtype.is_floating_point:
            raise ThdValueError(
                f"{fn}: parts[{i}] out: expected a floating [T, H, Dv] tensor, "
                f"got {out.dtype} {list(out.shape)}"
            )
        want_lse = [out.shape[1], out.shape[0]]
        if lse.dtype not in (torch.float32, torch.float64) or list(lse.shape) != want_lse:
            raise ThdValueError(
                f"{fn}: parts[{i}] lse: expected float32 (or float64) [H, T] = {want_lse}, "
                f"got {lse.dtype} {list(lse.shape)}"
            )
        first = out if first is None else first
        if out.shape != first.shape or out.device != first.device or lse.device != first.device:
            raise ThdValueError(
                f"{fn}: parts[{i}]: expected out {list(first.shape)} and lse on {first.device} "
                f"(as parts[0]), got out {list(out.shape)} on {out.device}, lse on {lse.device}"
            )


def merge_partials(parts: Sequence[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Merge per-step ``(out_i [T, H, Dv], lse_i [H, T] fp32)`` into ``(out, lse)``.

    ``lse = log(sum_i exp(lse_i))``, ``out = sum_i exp(lse_i - lse) * out_i``, computed in
    fp32; ``out`` is returned in ``dtype``. With more than two parts the merge folds left to
    right through fp32 intermediates. Rows that are ``-inf`` in every part stay ``-inf``, with
    exact-zero output (never NaN); a NaN lse in any part makes the row NaN. Capture-safe: no
    host sync. Raises :class:`~thd.errors.ThdValueError` / :class:`~thd.errors.ThdTypeError`
    naming the argument for an empty or malformed ``parts`` or a non-floating ``dtype``.
    """
    check_parts("merge_partials", parts, dtype)
    if len(parts) == 1:
        return parts[0][0].to(dtype), parts[0][1]
    if not runs_triton(parts[0][0]):
        return merge_partials_reference(parts, dtype)
    acc = parts[0]
    for i, part in enumerate(parts[1:], start=2):
        acc = _merge_two(acc, part, dtype if i == len(parts) else torch.float32)
    return acc
