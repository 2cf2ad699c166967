"""Load-balanced ("dual-chunk") CP partitioning of a THD buffer.

Every slot ``b`` of length ``P_b`` (from ``cu_seqlens_padded``) is cut into ``2 * cp_size``
chunks of ``c_b = P_b / (2 * cp_size)`` rows; rank ``r`` holds chunk ``r`` followed by chunk
``2 * cp_size - 1 - r`` of every slot, in slot order. The local buffer of every rank therefore
has slot offsets ``cu_seqlens_padded // cp_size`` (:func:`local_cu_seqlens_padded`) and, since
padding sits at the end of a slot, the real rows of each local slot (and of each half) are a
prefix whose length :func:`rank_cu_seqlens` gives.

Reserved capacity (``num_rows > cu_seqlens_padded[-1]``) is split as one more, all-padding slot,
so ``num_rows`` must be a multiple of ``2 * cp_size``; nothing is dropped or duplicated.

:func:`partition_indices`, :func:`partition` and :func:`unpartition` check the slots
(``cu_seqlens_padded[0] == 0``, non-decreasing, every slot a multiple of ``2 * cp_size``, the
last slot inside the buffer) with one device-to-host read, like :func:`thd.layout.validate`
and under the same switches: skipped during CUDA-graph capture, on meta tensors and with
``THD_VALIDATE=0``; with ``THD_VALIDATE=device`` CUDA slots get an asynchronous device
assertion instead (:func:`thd.layout.set_device_validation`). Unchecked, an invalid layout
gives garbage rows but never reads outside the buffer, and :func:`unpartition` never returns
uninitialised memory. Meta slots work with meta rows only (shapes); with real rows they are a
:class:`~thd.errors.ThdValueError` (they hold no offsets to index with). The per-rank counts
(:func:`rank_cu_seqlens`, :func:`all_rank_cu_seqlens`) are pure device-side index math from
:mod:`thd._cp_index`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from thd import _capture
from thd import layout as _layout
from thd._cp_index import all_rank_cu_seqlens, local_cu_seqlens_padded, rank_cu_seqlens, rank_rows
from thd.errors import ThdTypeError, ThdValueError

__all__ = [
    "all_rank_cu_seqlens",
    "local_cu_seqlens_padded",
    "partition",
    "partition_indices",
    "rank_cu_seqlens",
    "unpartition",
]

_SLOT_NAMES = ("cu_seqlens_padded", "cu_seqlens_padded")


def _check_slots(fn: str, cu_seqlens_padded: Tensor, cp_size: int, num_rows: int) -> None:
    """Value checks of the slots against a buffer of ``num_rows`` rows (one device-to-host read)."""
    _layout.check_num_rows(fn, num_rows, cp_size)
    _layout.check_layout_async(fn, cu_seqlens_padded, None, num_rows=num_rows, cp_size=cp_size)
    if _layout.values_readable(cu_seqlens_padded):
        cup = cu_seqlens_padded.tolist()
        _layout.check_layout_values(fn, cup, None, num_rows=num_rows, cp_size=cp_size, names=_SLOT_NAMES)


def _resolve_num_rows(fn: str, cu_seqlens_padded: Tensor, num_rows: int | None, cp_size: int) -> int:
    """``num_rows`` checked against the slots, or ``cu_seqlens_padded[-1]`` (always read)."""
    if num_rows is not None:
        _check_slots(fn, cu_seqlens_padded, cp_size, num_rows)
        return num_rows
    if _capture.is_capturing():
        raise ThdValueError(
            f"{fn}: num_rows: expected an int during CUDA-graph capture, got None "
            "(inferring it from cu_seqlens_padded[-1] needs a device-to-host read)"
        )
    if cu_seqlens_padded.is_meta:
        raise ThdValueError(
            f"{fn}: num_rows: expected an int with a meta cu_seqlens_padded, got None "
            "(a meta tensor holds no cu_seqlens_padded[-1] to infer it from)"
        )
    cup = cu_seqlens_padded.tolist()  # one D2H copy; the values are checked for free
    _layout.check_layout_values(fn, cup, None, num_rows=None, cp_size=cp_size, names=_SLOT_NAMES)
    return _layout.check_num_rows(fn, cup[-1], cp_size)


def partition_indices(
    cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, *, num_rows: int | None = None
) -> Tensor:
    """Global row of each local row of rank ``cp_rank``: int64 ``[num_rows // cp_size]``.

    Local row ``j`` of slot ``b`` maps to ``cup[b] + r*c_b + j`` for ``j < c_b`` and to
    ``cup[b] + (2*cp_size - 1 - r)*c_b + (j - c_b)`` otherwise. ``num_rows`` (``T``, default
    ``cu_seqlens_padded[-1]``, refused during capture) may exceed ``cu_seqlens_padded[-1]``;
    the excess is partitioned as one more slot. One device-to-host read checks the slots
    (see the module docstring for when it is skipped); no read during capture.

    Example (spec worked example, cp=2)::

        >>> cup = torch.tensor([0, 8, 16], dtype=torch.int32)
        >>> partition_indices(cup, 2, 1).tolist()
        [2, 3, 4, 5, 10, 11, 12, 13]
    """
    fn = "partition_indices"
    _layout.check_cu_metadata(fn, cu_seqlens_padded, None, names=_SLOT_NAMES)
    _layout.check_cp(fn, cp_size, cp_rank)
    rows = _resolve_num_rows(fn, cu_seqlens_padded, num_rows, cp_size)
    return rank_rows(cu_seqlens_padded, cp_size, cp_rank, rows)


def check_rows_tensor(fn: str, name: str, x: object) -> Tensor:
    """``x`` if it is a tensor with at least one dim (rows), else a :class:`ThdError` naming it."""
    if not isinstance(x, Tensor):
        raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ThdValueError(
            f"{fn}: {name} shape: expected [T, ...] with at least one dim, got {list(x.shape)}"
        )
    return x


def partition(
    x: Tensor, cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, *, num_rows: int | None = None
) -> Tensor:
    """Rows of ``x`` (dim 0, ``T`` rows) held by rank ``cp_rank``: ``[T // cp_size, ...]``, a copy.

    ``num_rows`` defaults to ``x.shape[0]``; if given it must equal it. The slots are checked
    against ``x.shape[0]`` (one device-to-host read, skipped as described in the module docstring).
    """
    fn = "partition"
    x = check_rows_tensor(fn, "x", x)
    if num_rows is not None and num_rows != x.shape[0]:
        raise ThdValueError(f"{fn}: num_rows (={num_rows}): expected x.shape[0] = {x.shape[0]}")
    _layout.check_cu_metadata(fn, cu_seqlens_padded, None, names=_SLOT_NAMES)
    if not x.is_meta:  # meta slots give meta indices, which cannot index real rows
        _layout.check_not_meta(fn, cu_seqlens_padded, None, names=_SLOT_NAMES)
    _layout.check_cp(fn, cp_size, cp_rank)
    _check_slots(fn, cu_seqlens_padded, cp_size, x.shape[0])
    idx = rank_rows(cu_seqlens_padded, cp_size, cp_rank, x.shape[0])
    return x.index_select(0, idx.to(x.device))


def unpartition(
    shards: Sequence[Tensor], cu_seqlens_padded: Tensor, cp_size: int, *, num_rows: int | None = None
) -> Tensor:
    """Exact inverse of :func:`partition`: reassemble ``[T, ...]`` from the ``cp_size`` shards.

    ``shards[r]`` is rank ``r``'s ``[T // cp_size, ...]`` buffer; ``num_rows`` defaults to
    ``cp_size * shards[0].shape[0]`` and, if given, must equal it. Checked slots cover every
    row exactly once; when the check is skipped the result starts from zeros, so an invalid
    layout leaves zeros (never uninitialised memory) in the rows it does not cover.
    """
    fn = "unpartition"
    _layout.check_cp(fn, cp_size)
    if isinstance(shards, Tensor) or not isinstance(shards, Sequence):
        raise ThdTypeError(f"{fn}: shards: expected a sequence of tensors, got {type(shards).__name__}")
    if len(shards) != cp_size:
        raise ThdValueError(f"{fn}: shards: expected cp_size = {cp_size} tensors, got {len(shards)}")
    first = check_rows_tensor(fn, "shards[0]", shards[0])
    for r, s in enumerate(shards):
        s = check_rows_tensor(fn, f"shards[{r}]", s)
        if s.shape != first.shape:
            raise ThdValueError(
                f"{fn}: shards[{r}] shape: expected {list(first.shape)} (as shards[0]), got {list(s.shape)}"
            )
        if s.dtype != first.dtype or s.device != first.device:
            raise ThdValueError(
                f"{fn}: shards[{r}]: expected dtype {first.dtype} on {first.device} (as shards[0]), "
                f"got {s.dtype} on {s.device}"
            )
    rows = cp_size * first.shape[0]
    if num_rows is not None and num_rows != rows:
        raise ThdValueError(f"{fn}: num_rows (={num_rows}): expected cp_size * shards[0].shape[0] = {rows}")
    _layout.check_cu_metadata(fn, cu_seqlens_padded, None, names=_SLOT_NAMES)
    if not first.is_meta:
        _layout.check_not_meta(fn, cu_seqlens_padded, None, names=_SLOT_NAMES)
    checked = _layout.values_readable(cu_seqlens_padded)
    _check_slots(fn, cu_seqlens_padded, cp_size, rows)
    idx = torch.cat([rank_rows(cu_seqlens_padded, cp_size, r, rows) for r in range(cp_size)])
    shape = (rows, *first.shape[1:])
    # Checked slots are a permutation of the rows; unchecked ones may leave gaps: start from zeros.
    out = first.new_empty(shape) if checked else first.new_zeros(shape)
    out.index_copy_(0, idx.to(first.device), torch.cat(list(shards)))
    return out
