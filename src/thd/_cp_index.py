"""Pure device-side index math of the load-balanced CP layout (no reads, no distributed).

A leaf module: it imports only torch, :mod:`thd.layout` and :mod:`thd.errors`, so the ring plan
op (:mod:`thd.ops.ring_plan`) can use it without loading :mod:`thd.cp` (the ring and
``torch.distributed`` process groups). :mod:`thd.cp.partition` re-exports the public functions
and adds value validation.

Slot ``b`` of length ``P_b`` is cut into ``2 * cp_size`` chunks of ``c_b = P_b / (2 * cp_size)``
rows; rank ``r`` holds chunk ``r`` then chunk ``2 * cp_size - 1 - r`` of every slot. Slot lengths
are trusted here (validate them with :func:`thd.layout.validate`); for an invalid layout the
results are garbage but every row index stays inside ``[0, num_rows)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from thd.layout import check_cp, check_cu_metadata

__all__ = ["all_rank_cu_seqlens", "local_cu_seqlens_padded", "rank_cu_seqlens", "rank_rows"]


def local_cu_seqlens_padded(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """Slot offsets of every rank's local buffer: ``cu_seqlens_padded // cp_size`` (int32)."""
    check_cu_metadata("local_cu_seqlens_padded", cu_seqlens_padded, None)
    check_cp("local_cu_seqlens_padded", cp_size)
    return torch.div(cu_seqlens_padded, cp_size, rounding_mode="floor")


def rank_rows(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, num_rows: int) -> Tensor:
    """Global row of each local row of rank ``cp_rank``: int64 ``[num_rows // cp_size]``.

    No argument checks and no device reads (capture-safe). Reserved capacity
    ``[cu_seqlens_padded[-1], num_rows)`` is one more slot. Indices are clamped to
    ``[0, num_rows)``, so even an invalid layout never indexes outside the buffer.
    """
    device = cu_seqlens_padded.device
    local_rows = num_rows // cp_size
    if cp_size == 1:
        return torch.arange(num_rows, dtype=torch.int64, device=device)
    cup = torch.cat((cu_seqlens_padded.long(), cu_seqlens_padded.new_full((1,), num_rows, dtype=torch.int64)))
    cup_local = torch.div(cup, cp_size, rounding_mode="floor")
    j = torch.arange(local_rows, dtype=torch.int64, device=device)
    slot = torch.searchsorted(cup_local[1:], j, right=True).clamp_(max=cup.shape[0] - 2)
    start_local = cup_local[slot]
    chunk = torch.div(cup_local[slot + 1] - start_local, 2, rounding_mode="floor")
    offset = j - start_local
    first = offset < chunk
    rows = cup[slot] + torch.where(
        first, cp_rank * chunk + offset, (2 * cp_size - 1 - cp_rank) * chunk + (offset - chunk)
    )
    return rows.clamp_(0, max(num_rows - 1, 0))


def rank_cu_seqlens(
    cu_seqlens: Tensor,
    cu_seqlens_padded: Tensor,
    cp_size: int,
    cp_rank: int,
    *,
    first_half: bool = True,
    second_half: bool = True,
) -> Tensor:
    """Cumulative real-row counts of rank ``cp_rank``'s local slots: int32 ``[B+1]``.

    ``cu_seqlens_padded`` is the GLOBAL slot-offset tensor (local offsets are
    :func:`local_cu_seqlens_padded`). With ``c_b = P_b / (2*cp_size)`` the first half (chunk
    ``r``) holds ``clamp(L_b - r*c_b, 0, c_b)`` real rows and the second half (chunk
    ``2*cp_size - 1 - r``) ``clamp(L_b - (2*cp_size - 1 - r)*c_b, 0, c_b)``; each sequence
    contributes the halves selected by ``first_half``/``second_half``. The real rows of a local
    slot are a prefix of it, so offsets come from the padded layout and lengths from here.
    Device-side, capture-safe.

    Example (cp=2, L=[5, 8], P=[8, 8])::

        >>> cu = torch.tensor([0, 5, 13], dtype=torch.int32)
        >>> cup = torch.tensor([0, 8, 16], dtype=torch.int32)
        >>> rank_cu_seqlens(cu, cup, 2, 1).tolist()
        [0, 3, 7]
    """
    fn = "rank_cu_seqlens"
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded)
    check_cp(fn, cp_size, cp_rank)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk = torch.div(cu_seqlens_padded[1:] - cu_seqlens_padded[:-1], 2 * cp_size, rounding_mode="floor")
    counts = torch.zeros_like(lengths)
    if first_half:
        counts += torch.minimum((lengths - cp_rank * chunk).clamp_(min=0), chunk)
    if second_half:
        counts += torch.minimum((lengths - (2 * cp_size - 1 - cp_rank) * chunk).clamp_(min=0), chunk)
    out = torch.zeros_like(cu_seqlens)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=out[1:])
    return out


def all_rank_cu_seqlens(cu_seqlens: Tensor, cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """:func:`rank_cu_seqlens` of every rank and half in one batched computation.

    Returns int32 ``[3, cp_size, B+1]``: index 0 both halves, 1 the first half only, 2 the
    second half only; ``out[h, r]`` equals ``rank_cu_seqlens(..., cp_size, r, ...)`` for that
    selection. A handful of kernel launches however large ``cp_size`` is (the ring builds its
    whole plan from it). Device-side, capture-safe.
    """
    fn = "all_rank_cu_seqlens"
    check_cu_metadata(fn, cu_seqlens, cu_seqlens_padded)
    check_cp(fn, cp_size)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1])[None, :]  # [1, B]
    chunk = torch.div(cu_seqlens_padded[1:] - cu_seqlens_padded[:-1], 2 * cp_size, rounding_mode="floor")[
        None, :
    ]
    ranks = torch.arange(cp_size, device=cu_seqlens.device, dtype=cu_seqlens.dtype)[:, None]  # [cp, 1]
    first = torch.minimum((lengths - ranks * chunk).clamp_(min=0), chunk)  # [cp, B]
    second = torch.minimum((lengths - (2 * cp_size - 1 - ranks) * chunk).clamp_(min=0), chunk)
    counts = torch.stack((first + second, first, second))  # [3, cp, B]
    out = cu_seqlens.new_zeros(3, cp_size, cu_seqlens.shape[0])
    torch.cumsum(counts, dim=2, dtype=torch.int32, out=out[:, :, 1:])
    return out
