"""Pure-torch padding masks and zeroing: the oracle for tests and the fallback, not fast.

:func:`zero_padding_reference` walks the sequences on the host (oracle only).
:func:`valid_row_mask` and :func:`zero_padding_masked_` are device-side and capture-safe; the
latter is the fallback when the Triton kernel cannot run (CPU without the interpreter, rows
that are not contiguous).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["valid_row_mask", "zero_padding_masked_", "zero_padding_reference"]


def valid_row_mask(cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, num_rows: int) -> Tensor:
    """Bool ``[num_rows]``: True on real rows. Row ``t`` is real iff it lies in slot ``b``
    (found by ``searchsorted`` over the slot ends) and ``t - cup[b] < L_b``; rows at or beyond
    ``cup[-1]`` fall in a virtual slot ``B`` of length 0.
    """
    device = cu_seqlens.device
    rows = torch.arange(num_rows, dtype=torch.int64, device=device)
    if cu_seqlens_padded is None:
        return rows < cu_seqlens[-1]
    cup = cu_seqlens_padded.long()
    slot = torch.searchsorted(cup[1:], rows, right=True)
    lengths = torch.cat((cu_seqlens[1:] - cu_seqlens[:-1], cu_seqlens.new_zeros(1))).long()
    return rows - cup[slot] < lengths[slot]


def _row_mask_view(mask: Tensor, x: Tensor) -> Tensor:
    return mask.view(-1, *([1] * (x.dim() - 1)))


def zero_padding_masked_(
    x: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, pad_between_seqs: bool
) -> Tensor:
    """Zero the padding rows of ``x`` in place with ``masked_fill_`` (no host sync).

    With ``pad_between_seqs`` every row outside a sequence's real prefix is cleared; without,
    only rows at or beyond ``cu_seqlens[-1]``.
    """
    num_rows = x.shape[0]
    if pad_between_seqs:
        keep = valid_row_mask(cu_seqlens, cu_seqlens_padded, num_rows)
    else:
        keep = torch.arange(num_rows, device=cu_seqlens.device) < cu_seqlens[-1]
    x.masked_fill_(_row_mask_view(~keep.to(x.device), x), 0)
    return x


def zero_padding_reference(
    x: Tensor, cu_seqlens: Tensor, cu_seqlens_padded: Tensor | None, pad_between_seqs: bool = True
) -> Tensor:
    """Copy of ``x`` with padding rows zeroed, by a host loop over the sequences (oracle)."""
    out = x.clone()
    cu = cu_seqlens.tolist()
    if not pad_between_seqs or cu_seqlens_padded is None:
        out[cu[-1] :] = 0
        return out
    cup = cu_seqlens_padded.tolist()
    for b in range(len(cu) - 1):
        out[cup[b] + cu[b + 1] - cu[b] : cup[b + 1]] = 0
    out[cup[-1] :] = 0
    return out
