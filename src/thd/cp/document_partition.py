"""Buffers of a :class:`~thd.cp.documents.DocumentPlan`: per-rank layouts, partition, unpartition.

:func:`document_layout` turns a plan into rank ``r``'s :class:`DocumentLayout`: the gather index
of every buffer row into the global batch, the token positions, and the ``cu_seqlens`` of its
local documents (for :func:`thd.attention`) and of the ring documents (the GLOBAL ring layout
:func:`thd.cp.ring_attention` takes, and this rank's share of it). The rank's pieces go to the
device as one small table and are expanded there into the row index (a search, no host sync);
:func:`partition_documents` is then a device-side gather (``index_select`` and a
``masked_fill``): no host sync, capturable in a CUDA graph for a fixed buffer size (copy each
step's index into the captured one). :func:`unpartition_documents` is one gather by an index
built on the host from the plan.

The global batch is the caller's packed buffer: document ``d`` at rows ``[offsets[d],
offsets[d] + lengths[d])`` (default ``offsets``: the lengths back to back), anything else
padding, which is never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from thd.cp.documents import DocumentPlan
from thd.cp.partition import check_rows_tensor, local_cu_seqlens_padded, rank_cu_seqlens
from thd.errors import ThdTypeError, ThdValueError
from thd.layout import check_cp

__all__ = ["DocumentLayout", "document_layout", "partition_documents", "unpartition_documents"]


@dataclass(frozen=True, eq=False)
class DocumentLayout:
    """Rank ``cp_rank``'s buffer under a plan (every tensor on the layout's device).

    Rows ``[0, ring_rows)`` are the ring region (the ring documents' local slots, the layout of
    :func:`thd.cp.partition` over the ring documents alone), rows ``[ring_rows, rows)`` the
    local region: the local documents back to back from its row 0, then spare rows.
    """

    cp_size: int
    cp_rank: int
    rows: int
    ring_rows: int
    index: Tensor
    """int64 ``[rows]``: the global row of each buffer row (0 on padding rows)."""
    valid: Tensor
    """bool ``[rows]``: whether the row holds a real token."""
    positions: Tensor
    """int64 ``[rows]``: each token's position in its document (0 on padding rows)."""
    local_cu_seqlens: Tensor
    """int32 ``[n_local + 1]``: the local documents, rows counted from the local region's start
    (no padding between them, so it is also their ``cu_seqlens_padded``)."""
    local_max_seqlen: int
    ring_cu_seqlens: Tensor
    """int32 ``[n_ring + 1]``: cumulative real lengths of the ring documents (global)."""
    ring_cu_seqlens_padded: Tensor
    """int32 ``[n_ring + 1]``: their global slot offsets (slots multiples of ``2 * cp_size``)."""
    ring_max_seqlen: int
    ring_pad_between_seqs: bool
    ring_local_cu_seqlens: Tensor
    """int32 ``[n_ring + 1]``: this rank's real rows of each ring document (its local slots
    start at ``ring_local_cu_seqlens_padded``)."""
    ring_local_cu_seqlens_padded: Tensor

    @property
    def has_local(self) -> bool:
        return self.local_cu_seqlens.shape[0] > 1

    @property
    def has_ring(self) -> bool:
        return self.ring_cu_seqlens.shape[0] > 1


def _aranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, vectorized."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    begin = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.repeat(starts - begin, counts) + np.arange(total, dtype=np.int64)


def _offsets(plan: DocumentPlan, offsets: Sequence[int] | None, fn: str) -> np.ndarray:
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    if offsets is None:
        return np.concatenate(([0], np.cumsum(lengths)[:-1])) if lengths.size else lengths
    arr = np.asarray(offsets, dtype=np.int64)
    if arr.shape != lengths.shape:
        raise ThdValueError(
            f"{fn}: offsets: expected {lengths.shape[0]} document offsets, got shape {arr.shape}"
        )
    return arr


def _check_plan(fn: str, plan: object) -> DocumentPlan:
    if not isinstance(plan, DocumentPlan):
        raise ThdTypeError(
            f"{fn}: plan: expected a DocumentPlan (thd.cp.plan_documents), got {type(plan).__name__}"
        )
    return plan


def _cumsum32(values: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(
        np.concatenate(([0], np.cumsum(values, dtype=np.int64))), dtype=torch.int32, device=device
    )


def _buffer_rows(
    plan: DocumentPlan, rank: int, first_row: np.ndarray, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """``(index, valid, positions)`` of every buffer row, expanded on ``device`` from the rank's
    piece table (one small host-to-device copy; a search and a few elementwise ops)."""
    doc, start, stop, buffer_row = plan.piece_table(rank)
    table = (
        np.stack((buffer_row, stop - start, first_row[doc] + start, start)) if doc.size else np.zeros((4, 1))
    )
    t = torch.tensor(table, dtype=torch.int64, device=device)
    rows = torch.arange(plan.rows, dtype=torch.int64, device=device)
    piece = torch.searchsorted(t[0], rows, right=True) - 1
    at = piece.clamp(min=0)
    offset = rows - t[0][at]
    valid = (piece >= 0) & (offset < t[1][at])
    index = torch.where(valid, t[2][at] + offset, 0)
    positions = torch.where(valid, t[3][at] + offset, 0)
    return index, valid, positions


def document_layout(
    plan: DocumentPlan,
    rank: int,
    *,
    device: torch.device | str | None = None,
    offsets: Sequence[int] | None = None,
) -> DocumentLayout:
    """Rank ``rank``'s :class:`DocumentLayout` of ``plan`` on ``device`` (default CPU).

    ``offsets``: first global row of each document in the caller's packed buffer (default
    the lengths back to back). Host work on the pieces, small host-to-device copies and a few
    device ops over the buffer's rows; no device reads.
    """
    fn = "document_layout"
    plan = _check_plan(fn, plan)
    check_cp(fn, plan.cp_size, rank)
    device = torch.device("cpu") if device is None else torch.device(device)
    index, valid, positions = _buffer_rows(plan, rank, _offsets(plan, offsets, fn), device)
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    local = np.asarray(plan.local_documents[rank], dtype=np.int64)
    ring = np.asarray(plan.ring_documents, dtype=np.int64)
    ring_cu = _cumsum32(lengths[ring], device)
    ring_cup = _cumsum32(plan.ring_slots, device)
    ring_len = lengths[ring]
    return DocumentLayout(
        cp_size=plan.cp_size,
        cp_rank=rank,
        rows=plan.rows,
        ring_rows=plan.ring_rows,
        index=index,
        valid=valid,
        positions=positions,
        local_cu_seqlens=_cumsum32(lengths[local], device),
        local_max_seqlen=int(lengths[local].max()) if local.size else 0,
        ring_cu_seqlens=ring_cu,
        ring_cu_seqlens_padded=ring_cup,
        ring_max_seqlen=int(ring_len.max()) if ring.size else 0,
        ring_pad_between_seqs=bool(np.any(np.asarray(plan.ring_slots) != ring_len)),
        ring_local_cu_seqlens=rank_cu_seqlens(ring_cu, ring_cup, plan.cp_size, rank),
        ring_local_cu_seqlens_padded=local_cu_seqlens_padded(ring_cup, plan.cp_size),
    )


def partition_documents(x: Tensor, layout: DocumentLayout, *, padding_value: float = 0) -> Tensor:
    """This rank's buffer of the global rows ``x`` (``[T, ...]``): ``[layout.rows, ...]``, a copy.

    Padding rows get ``padding_value``; padding rows of ``x`` are never read into real rows.
    Two device ops (a gather and a masked fill), no host sync.
    """
    fn = "partition_documents"
    x = check_rows_tensor(fn, "x", x)
    if not isinstance(layout, DocumentLayout):
        raise ThdTypeError(f"{fn}: layout: expected a DocumentLayout, got {type(layout).__name__}")
    index, valid = layout.index.to(x.device), layout.valid.to(x.device)
    out = x.index_select(0, index)
    return out.masked_fill(~valid.view(-1, *([1] * (x.dim() - 1))), padding_value)


def unpartition_documents(
    shards: Sequence[Tensor],
    plan: DocumentPlan,
    *,
    num_rows: int | None = None,
    offsets: Sequence[int] | None = None,
) -> Tensor:
    """Reassemble the global ``[num_rows, ...]`` rows from every rank's buffer (``shards[r]``).

    ``num_rows`` defaults to the end of the last document; rows no document covers are exact
    zeros. One gather (index built on the host from the plan), no host sync.
    """
    fn = "unpartition_documents"
    plan = _check_plan(fn, plan)
    if isinstance(shards, Tensor) or not isinstance(shards, Sequence) or len(shards) != plan.cp_size:
        raise ThdValueError(f"{fn}: shards: expected a sequence of cp_size = {plan.cp_size} tensors")
    first = check_rows_tensor(fn, "shards[0]", shards[0])
    for r, s in enumerate(shards):
        s = check_rows_tensor(fn, f"shards[{r}]", s)
        if (
            s.shape != first.shape
            or s.shape[0] != plan.rows
            or s.dtype != first.dtype
            or s.device != first.device
        ):
            raise ThdValueError(
                f"{fn}: shards[{r}]: expected [{plan.rows}, ...] like shards[0] ({list(first.shape)}, "
                f"{first.dtype}, {first.device}), got {list(s.shape)}, {s.dtype}, {s.device}"
            )
    first_row = _offsets(plan, offsets, fn)
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    end = int((first_row + lengths).max()) if lengths.size else 0
    rows = end if num_rows is None else num_rows
    if rows < end:
        raise ThdValueError(f"{fn}: num_rows (={num_rows}): expected at least the documents' end {end}")
    flat = plan.cp_size * plan.rows
    source = np.full(rows, flat, dtype=np.int64)  # row `flat` of the stacked shards is a zero row
    for r in range(plan.cp_size):
        doc, start, stop, buffer_row = plan.piece_table(r)
        count = stop - start
        source[_aranges(first_row[doc] + start, count)] = _aranges(r * plan.rows + buffer_row, count)
    stacked = torch.cat([*shards, first.new_zeros((1, *first.shape[1:]))])
    return stacked.index_select(0, torch.from_numpy(source).to(first.device))
