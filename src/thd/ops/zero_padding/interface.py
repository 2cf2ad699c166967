"""Launcher and op :func:`zero_padding_`: explicit ``pad_between_seqs``, no detection.

The public :func:`thd.padding.zero_padding_` wraps it and detects the flag when not given.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from thd._runtime.config import interpreting
from thd._runtime.families import runs_triton
from thd._runtime.launcher import launcher_for
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import check_cu_metadata
from thd.ops.zero_padding.reference import zero_padding_masked_

__all__ = ["check_args", "zero_padding_"]

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# dtypes the kernel writes directly; others of the same element size go through an integer view
# (zero has the same bit pattern in every dtype).
_NATIVE = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    }
)
_TARGET_PROGRAMS_PER_SM = 4
_BLOCK = 4096  # elements written per program iteration on the GPU
# The interpreter runs programs one after another: few programs, big blocks (tests may lower them).
_INTERPRETER_BLOCK = 1024
_INTERPRETER_PROGRAMS = 1


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _rows_contiguous(x: Tensor) -> bool:
    """True when each row ``x[i]`` is one dense block of memory."""
    expected = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _kernel_view(x: Tensor) -> Tensor | None:
    """``x`` (or a same-size integer view of it) if the Triton kernel can zero it, else None."""
    if not runs_triton(x):
        return None
    if not (x.is_contiguous() or _rows_contiguous(x)):
        return None
    if x.dtype in _NATIVE:
        return x
    if x.is_complex() or x.element_size() not in _INT_VIEW:
        return None
    return x.view(_INT_VIEW[x.element_size()])


def _launch(x: Tensor, cu: Tensor, cup: Tensor, pad_between_seqs: bool) -> None:
    """Zero the padding rows of ``x`` (non-empty, from :func:`_kernel_view`) with the kernel."""
    from thd.ops.zero_padding.kernels import _zero_padding_fwd_kernel  # Triton on first use only

    num_rows = x.shape[0]
    row_width = x.numel() // num_rows
    num_seqs = cu.shape[0] - 1
    num_slots = num_seqs if pad_between_seqs else 0
    is_flat = x.stride(0) == row_width or x.is_contiguous()
    if interpreting():
        block, target = _INTERPRETER_BLOCK, _INTERPRETER_PROGRAMS
    else:
        block, target = _BLOCK, _TARGET_PROGRAMS_PER_SM * _num_sms(x.device.index or 0)
    block_c = min(_next_pow2(row_width), block)
    block_r = max(1, block // block_c)
    max_splits = max(1, -(-num_rows * row_width // block))
    splits_tail = min(max_splits, target)
    splits_slot = min(max_splits, max(1, target // max(num_slots, 1)))
    grid = (num_slots * splits_slot + splits_tail,)
    args = (x, cu, cup, num_rows, num_seqs, num_slots, splits_slot, splits_tail, x.stride(0))
    shape = {"ROW_WIDTH": row_width, "IS_FLAT": is_flat, "TAIL_FROM_PADDED": pad_between_seqs}
    tiling = {"BLOCK": block, "BLOCK_R": block_r, "BLOCK_C": block_c}
    launcher_for(_zero_padding_fwd_kernel).run(grid, *args, **shape, **tiling, num_warps=4)


def check_args(
    fn: str, x: object, cu_seqlens: object, cu_seqlens_padded: object, valid_end: object
) -> Tensor:
    """Host-only argument checks of :func:`zero_padding_` (no device read); returns ``x``."""
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded)
    if not isinstance(x, Tensor):
        raise ThdTypeError(f"{fn}: x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ThdValueError(f"{fn}: x shape: expected [T, ...] with at least one dim, got {list(x.shape)}")
    assert isinstance(cu_seqlens, Tensor)
    if cu_seqlens.device != x.device:
        raise ThdValueError(f"{fn}: cu_seqlens device: expected {x.device} (as x), got {cu_seqlens.device}")
    if valid_end is not None and (
        isinstance(valid_end, bool) or not isinstance(valid_end, int) or not 0 <= valid_end <= x.shape[0]
    ):
        raise ThdValueError(
            f"{fn}: valid_end: expected an int in [0, x.shape[0] = {x.shape[0]}], got {valid_end!r}"
        )
    return x


def zero_padding_(
    x: Tensor,
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor | None = None,
    *,
    pad_between_seqs: bool,
    valid_end: int | None = None,
) -> Tensor:
    """Zero every padding row of ``x`` in place and return ``x`` (the op: no detection).

    Args:
        x: ``[T, ...]``, rows on dim 0, any dtype. Each row must be contiguous for the Triton
            path (``x`` may be a strided view along dim 0); other layouts use a
            ``masked_fill_`` fallback.
        cu_seqlens: int32 ``[B+1]``, cumulative real lengths, on ``x``'s device.
        cu_seqlens_padded: int32 ``[B+1]`` slot offsets, or ``None`` (no slot padding).
        pad_between_seqs: ``True`` clears slot padding ``[cup[b] + L_b, cup[b+1])`` and the
            tail ``[cup[-1], T)``; ``False`` clears only the tail ``[cu_seqlens[-1], T)``.
            Ignored (``False``) when ``cu_seqlens_padded`` is ``None``. The public
            :func:`thd.padding.zero_padding_` detects it when not given.
        valid_end: optional host int promising that rows ``>= valid_end`` are padding and that
            rows below it are described by the layout. Rows ``[valid_end, T)`` are cleared by
            slicing; with ``pad_between_seqs=False`` that is all (``valid_end == T`` does nothing),
            otherwise the kernel handles the slot padding below ``valid_end``.

    Capture-safe: no host sync. Values are not validated here; see :func:`thd.layout.validate`.
    On CUDA, and on CPU when ``TRITON_INTERPRET=1``, a Triton kernel writes only the padding
    rows; otherwise the device-side ``masked_fill_`` fallback runs.
    """
    fn = "zero_padding_"
    check_args(fn, x, cu_seqlens, cu_seqlens_padded, valid_end)
    if not isinstance(pad_between_seqs, bool):
        raise ThdTypeError(f"{fn}: pad_between_seqs: expected a bool, got {type(pad_between_seqs).__name__}")
    pad = pad_between_seqs and cu_seqlens_padded is not None
    target = x
    if valid_end is not None:
        if valid_end < x.shape[0]:
            x[valid_end:].zero_()
        if not pad:
            return x
        target = x[:valid_end]
    if target.numel() == 0:
        return x
    cup = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    view = _kernel_view(target)
    if view is not None:
        _launch(view, cu_seqlens, cup, pad)
    else:
        zero_padding_masked_(target, cu_seqlens, cup, pad)
    return x
