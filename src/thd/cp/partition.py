"""Load-balanced ("dual-chunk") CP partitioning of a THD buffer, as pure device-side index math.

Every slot ``b`` of length ``P_b`` (from ``cu_seqlens_padded``) is cut into ``2 * cp_size``
chunks of ``c_b = P_b / (2 * cp_size)`` rows; rank ``r`` holds chunk ``r`` followed by chunk
``2 * cp_size - 1 - r`` of every slot, in slot order. The local buffer of every rank therefore
has slot offsets ``cu_seqlens_padded // cp_size`` (:func:`local_cu_seqlens_padded`) and, since
padding sits at the end of a slot, the real rows of each local slot (and of each half) are a
prefix whose length :func:`rank_cu_seqlens` gives.

Reserved capacity (``num_rows > cu_seqlens_padded[-1]``) is split as one more, all-padding slot,
so ``num_rows`` must be a multiple of ``2 * cp_size``; nothing is dropped or duplicated.
Nothing here reads device memory except when ``num_rows`` must be inferred (documented per
function); slot lengths are trusted: check them once per batch with :func:`thd.layout.validate`
(``cp_size=...``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from thd import _capture
from thd.errors import ThdValueError
from thd.layout import check_cp, check_cu_metadata, check_layout_values, check_num_rows

__all__ = [
    "all_rank_cu_seqlens",
    "local_cu_seqlens_padded",
    "partition",
    "partition_indices",
    "rank_cu_seqlens",
    "unpartition",
]


def local_cu_seqlens_padded(cu_seqlens_padded: Tensor, cp_size: int) -> Tensor:
    """Slot offsets of every rank's local buffer: ``cu_seqlens_padded // cp_size`` (int32)."""
    check_cu_metadata("local_cu_seqlens_padded", cu_seqlens_padded, None)
    check_cp("local_cu_seqlens_padded", cp_size)
    return torch.div(cu_seqlens_padded, cp_size, rounding_mode="floor")


def _resolve_num_rows(fn: str, cu_seqlens_padded: Tensor, num_rows: int | None, cp_size: int) -> int:
    if num_rows is not None:
        return check_num_rows(fn, num_rows, cp_size)
    if _capture.is_capturing():
        raise ThdValueError(
            f"{fn}: num_rows: expected an int during CUDA-graph capture, got None "
            "(inferring it from cu_seqlens_padded[-1] needs a device-to-host read)"
        )
    cup = cu_seqlens_padded.tolist()  # one D2H copy; the values are checked for free
    check_layout_values(fn, cup, None, num_rows=None, cp_size=cp_size)
    return check_num_rows(fn, cup[-1], cp_size)


def partition_indices(
    cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, *, num_rows: int | None = None
) -> Tensor:
    """Global row of each local row of rank ``cp_rank``: int64 ``[num_rows // cp_size]``.

    Local row ``j`` of slot ``b`` maps to ``cup[b] + r*c_b + j`` for ``j < c_b`` and to
    ``cup[b] + (2*cp_size - 1 - r)*c_b + (j - c_b)`` otherwise. ``num_rows`` (``T``, default
    ``cu_seqlens_padded[-1]``, which costs one device-to-host read and is refused during
    capture) may exceed ``cu_seqlens_padded[-1]``; the excess is partitioned as one more slot.
    Device-side and capture-safe when ``num_rows`` is given.

    Example (spec worked example, cp=2)::

        >>> cup = torch.tensor([0, 8, 16], dtype=torch.int32)
        >>> partition_indices(cup, 2, 1).tolist()
        [2, 3, 4, 5, 10, 11, 12, 13]
    """
    fn = "partition_indices"
    check_cu_metadata(fn, cu_seqlens_padded, None)
    check_cp(fn, cp_size, cp_rank)
    rows = _resolve_num_rows(fn, cu_seqlens_padded, num_rows, cp_size)
    device = cu_seqlens_padded.device
    local_rows = rows // cp_size
    if cp_size == 1:
        return torch.arange(rows, dtype=torch.int64, device=device)
    # Slots plus one (possibly empty) slot of reserved capacity [cup[-1], T).
    cup = torch.cat((cu_seqlens_padded.long(), cu_seqlens_padded.new_full((1,), rows, dtype=torch.int64)))
    cup_local = torch.div(cup, cp_size, rounding_mode="floor")
    j = torch.arange(local_rows, dtype=torch.int64, device=device)
    slot = torch.searchsorted(cup_local[1:], j, right=True)  # first slot whose local end > j
    start_local = cup_local[slot]
    chunk = torch.div(cup_local[slot + 1] - start_local, 2, rounding_mode="floor")
    offset = j - start_local
    first = offset < chunk
    return cup[slot] + torch.where(
        first, cp_rank * chunk + offset, (2 * cp_size - 1 - cp_rank) * chunk + (offset - chunk)
    )


def partition(
    x: Tensor, cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, *, num_rows: int | None = None
) -> Tensor:
    """Rows of ``x`` (dim 0, ``T`` rows) held by rank ``cp_rank``: ``[T // cp_size, ...]``, a copy.

    ``num_rows`` defaults to ``x.shape[0]``; if given it must equal it.
    """
    fn = "partition"
    if num_rows is not None and num_rows != x.shape[0]:
        raise ThdValueError(f"{fn}: num_rows (={num_rows}): expected x.shape[0] = {x.shape[0]}")
    idx = partition_indices(cu_seqlens_padded, cp_size, cp_rank, num_rows=x.shape[0])
    return x.index_select(0, idx.to(x.device))


def unpartition(
    shards: Sequence[Tensor], cu_seqlens_padded: Tensor, cp_size: int, *, num_rows: int | None = None
) -> Tensor:
    """Exact inverse of :func:`partition`: reassemble ``[T, ...]`` from the ``cp_size`` shards.

    ``shards[r]`` is rank ``r``'s ``[T // cp_size, ...]`` buffer; ``num_rows`` defaults to
    ``cp_size * shards[0].shape[0]`` and, if given, must equal it.
    """
    fn = "unpartition"
    check_cp(fn, cp_size)
    if len(shards) != cp_size:
        raise ThdValueError(f"{fn}: shards: expected cp_size = {cp_size} tensors, got {len(shards)}")
    local = shards[0].shape[0]
    for r, s in enumerate(shards):
        if s.shape != shards[0].shape:
            raise ThdValueError(
                f"{fn}: shards[{r}] shape: expected {list(shards[0].shape)} (as shards[0]), "
                f"got {list(s.shape)}"
            )
    rows = cp_size * local
    if num_rows is not None and num_rows != rows:
        raise ThdValueError(f"{fn}: num_rows (={num_rows}): expected cp_size * shards[0].shape[0] = {rows}")
    device = shards[0].device
    idx = torch.cat(
        [partition_indices(cu_seqlens_padded, cp_size, r, num_rows=rows).to(device) for r in range(cp_size)]
    )
    out = shards[0].new_empty((rows, *shards[0].shape[1:]))
    out.index_copy_(0, idx, torch.cat(list(shards)))
    return out


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
