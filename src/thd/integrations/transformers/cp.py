"""Context-parallel sharding of a packed transformers batch for ring attention.

:func:`shard_batch` takes one packed batch (``input_ids [1, T]``, document boundaries from
``cu_seq_lens_q`` or ``position_ids``, optional ``labels``), shifts the labels globally per
document (``shift_labels``: token ``t`` predicts token ``t + 1`` of its own document, the last
token of a document predicts nothing), pads every document at its end to a multiple of
``2 * cp`` and keeps this rank's load-balanced share of every document
(:func:`thd.cp.partition`: chunks ``rank`` and ``2*cp - 1 - rank``). The result is a dict of
model inputs; its :class:`CPLayout` (the global layout) travels to the attention function as
the ``thd_cp_layout`` kwarg.

``mode="documents"`` shards by a document-aware plan instead (:func:`thd.cp.plan_documents`):
short documents stay whole on one rank, only the long ones are split in the dual-chunk order and
ride the ring; the kwarg is then a :class:`DocumentCPLayout` and the registered attention
function runs :func:`thd.cp.document_attention`. Labels are shifted per document before
sharding in both modes.

Loss: the model returns ``sum(token losses of this rank) / N`` where ``N`` (the
``num_items_in_batch`` input) is the global count of real label tokens; ``all_reduce(SUM)`` over
the CP group gives the loss of the whole batch, and summing the parameter gradients over the
CP group (``all_reduce(SUM)``) gives its gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from thd.errors import ThdDistributedError, ThdValueError

if TYPE_CHECKING:
    from thd.cp import DocumentLayout, DocumentPlan

__all__ = ["LAYOUT_KWARG", "MODES", "CPLayout", "DocumentCPLayout", "shard_batch"]

MODES = ("uniform", "documents")

LAYOUT_KWARG = "thd_cp_layout"


@dataclass(frozen=True)
class CPLayout:
    """The global layout of a sharded batch (identical on every rank).

    ``cu_seqlens`` are the cumulative real document lengths, ``cu_seqlens_padded`` the slot
    offsets (every slot a multiple of ``2 * cp_size``), both int32 ``[B+1]`` on the model's
    device; ``max_seqlen`` is the longest document, ``num_label_tokens`` the global count of
    real label tokens.
    """

    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen: int
    pad_between_seqs: bool
    cp_size: int
    cp_rank: int
    num_label_tokens: int


@dataclass(frozen=True, eq=False)
class DocumentCPLayout:
    """The document-aware layout of a sharded batch: the plan (identical on every rank), this
    rank's :class:`thd.cp.DocumentLayout`, and the global count of real label tokens."""

    plan: DocumentPlan
    layout: DocumentLayout
    cp_size: int
    cp_rank: int
    num_label_tokens: int


def _row(x: object, name: str, length: int | None = None) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[0] != 1:
        shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ThdValueError(f"shard_batch: {name}: expected a packed [1, T] tensor, got {shape}")
    if length is not None and x.shape[1] != length:
        raise ThdValueError(
            f"shard_batch: {name}: expected [1, {length}] like input_ids, got {list(x.shape)}"
        )
    return x.reshape(-1)


def _document_ends(batch: Mapping[str, Any], length: int) -> list[int]:
    """``[0, end_0, end_1, ...]``: from ``cu_seq_lens_q``, else ``position_ids`` (a document starts
    wherever the position does not continue the previous one), else one document."""
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        ends = [int(x) for x in torch.as_tensor(cu).reshape(-1).tolist()]
        if not ends or ends[0] != 0 or ends[-1] != length or any(b < a for a, b in pairwise(ends)):
            raise ThdValueError(
                f"shard_batch: cu_seq_lens_q: expected non-decreasing offsets from 0 to {length}, got {ends}"
            )
        return ends
    pos = batch.get("position_ids")
    if pos is None:
        return [0, length]
    p = _row(pos, "position_ids", length).cpu()
    starts = (torch.nonzero(p[1:] != p[:-1] + 1).reshape(-1) + 1).tolist()
    return [0, *starts, length]


def _group_coords(
    group: dist.ProcessGroup | None, cp_size: int | None, cp_rank: int | None
) -> tuple[int, int]:
    if cp_size is not None or cp_rank is not None:
        if cp_size is None or cp_rank is None or not 0 <= cp_rank < cp_size:
            raise ThdValueError(f"shard_batch: expected 0 <= cp_rank < cp_size, got {cp_rank}, {cp_size}")
        return cp_size, cp_rank
    if not dist.is_available() or not dist.is_initialized():
        raise ThdDistributedError(
            "shard_batch: torch.distributed is not initialized (or pass cp_size, cp_rank)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def shard_batch(
    batch: Mapping[str, Any],
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    cp_size: int | None = None,
    cp_rank: int | None = None,
    mode: str = "uniform",
    plan_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """This rank's shard of a packed batch, as keyword arguments of the model's forward.

    Args:
        batch: ``input_ids [1, T]``; optional ``labels [1, T]`` (default ``input_ids``, in the
            usual unshifted convention), ``position_ids [1, T]`` and ``cu_seq_lens_q`` (document
            boundaries; without either the batch is one document). The output of
            ``DataCollatorWithFlattening`` fits as is.
        group: the CP process group (default: the world group).
        device: where the shard goes (default: ``input_ids.device``).
        pad_token_id: input id of the padding rows (they are never attended to, nor in the loss).
        ignore_index: label of tokens without a target.
        cp_size, cp_rank: shard without a process group (both or neither).
        mode: ``"uniform"`` (every document split over all ranks, ring attention) or
            ``"documents"`` (a :func:`thd.cp.plan_documents` plan: local documents whole, long
            ones on the ring).
        plan_options: keyword arguments of :func:`thd.cp.plan_documents` (``cost``,
            ``ring_threshold``, ``capacity``, ``tolerance``) in ``"documents"`` mode.

    Returns:
        ``input_ids``, ``position_ids``, ``labels`` and ``shift_labels`` (the same tensor:
        the shifted labels), all ``[1, T_padded / cp]``; ``num_items_in_batch`` (global count of
        real label tokens, so that the model's loss is this rank's share of the global mean);
        ``use_cache=False``; and ``thd_cp_layout`` (:class:`CPLayout`). In ``"documents"`` mode
        the rows are ``[1, plan.rows]`` and the layout a :class:`DocumentCPLayout`.
    """
    if mode not in MODES:
        raise ThdValueError(f"shard_batch: mode: expected one of {MODES}, got {mode!r}")
    if plan_options is not None and mode != "documents":
        raise ThdValueError("shard_batch: plan_options: only used with mode='documents'")
    cp, rank = _group_coords(group, cp_size, cp_rank)
    ids = _row(batch["input_ids"], "input_ids")
    length = ids.numel()
    device = ids.device if device is None else torch.device(device)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        raise ThdValueError("shard_batch: expected a packed batch without padding (attention_mask all ones)")
    ends = _document_ends(batch, length)
    lens = [b - a for a, b in pairwise(ends)]
    labels = _row(batch.get("labels", batch["input_ids"]), "labels", length)
    shifted = torch.full_like(labels, ignore_index)
    shifted[:-1] = labels[1:]
    nonempty = torch.tensor(
        [e for e, n in zip(ends[1:], lens, strict=True) if n > 0], dtype=torch.int64, device=ids.device
    )
    shifted[nonempty - 1] = ignore_index  # the last token of a document has no target
    num_items = int((shifted != ignore_index).sum())
    if mode == "documents":
        return _shard_documents(
            batch, ids, shifted, ends, cp, rank, device=device, pad_token_id=pad_token_id,
            ignore_index=ignore_index, num_items=num_items, plan_options=plan_options or {},
        )  # fmt: skip
    slots = [-(-n // (2 * cp)) * (2 * cp) for n in lens]
    cup = [0]
    for s in slots:
        cup.append(cup[-1] + s)
    i64 = {"dtype": torch.int64, "device": ids.device}
    docs = torch.arange(len(lens), **i64)
    doc_of_token = torch.repeat_interleave(docs, torch.tensor(lens, **i64))
    cu_t, cup_t = torch.tensor(ends, **i64), torch.tensor(cup, **i64)
    dest = cup_t[doc_of_token] + torch.arange(length, **i64) - cu_t[doc_of_token]

    slot_of_row = torch.repeat_interleave(docs, torch.tensor(slots, **i64))
    positions = torch.arange(cup[-1], **i64) - cup_t[slot_of_row]
    if batch.get("position_ids") is not None:
        positions[dest] = _row(batch["position_ids"], "position_ids", length).to(positions)
    padded = {
        "input_ids": torch.full((cup[-1],), pad_token_id, dtype=ids.dtype, device=ids.device).index_copy_(
            0, dest, ids
        ),
        "position_ids": positions,
        "shift_labels": torch.full((cup[-1],), ignore_index, **i64).index_copy_(0, dest, shifted.long()),
    }
    from thd.cp import partition  # on use, like the rest of thd.cp's device code

    cup32 = cup_t.to(torch.int32)
    local = {k: partition(v, cup32, cp, rank).to(device)[None] for k, v in padded.items()}
    layout = CPLayout(
        cu_seqlens=torch.tensor(ends, dtype=torch.int32, device=device),
        cu_seqlens_padded=cup32.to(device),
        max_seqlen=max(lens, default=0),
        pad_between_seqs=slots != lens,
        cp_size=cp,
        cp_rank=rank,
        num_label_tokens=num_items,
    )
    return _model_inputs(local, num_items, device, layout)


def _shard_documents(
    batch: Mapping[str, Any],
    ids: Tensor,
    shifted: Tensor,
    ends: list[int],
    cp: int,
    rank: int,
    *,
    device: torch.device,
    pad_token_id: int,
    ignore_index: int,
    num_items: int,
    plan_options: Mapping[str, Any],
) -> dict[str, Any]:
    """:func:`shard_batch` in ``"documents"`` mode (the batch's rows are the global buffer)."""
    from thd.cp import document_layout, partition_documents, plan_documents  # on use, as above

    lens = [b - a for a, b in pairwise(ends)]
    plan = plan_documents(lens, cp, **dict(plan_options))
    layout = document_layout(plan, rank, device=ids.device, offsets=ends[:-1])
    if batch.get("position_ids") is not None:
        positions = partition_documents(
            _row(batch["position_ids"], "position_ids", ids.numel()).long(), layout
        )
    else:
        positions = layout.positions
    local = {
        "input_ids": partition_documents(ids, layout, padding_value=pad_token_id),
        "position_ids": positions,
        "shift_labels": partition_documents(shifted.long(), layout, padding_value=ignore_index),
    }
    local = {k: v.to(device)[None] for k, v in local.items()}
    if torch.device(device) != ids.device:
        layout = document_layout(plan, rank, device=device, offsets=ends[:-1])
    return _model_inputs(local, num_items, device, DocumentCPLayout(plan, layout, cp, rank, num_items))


def _model_inputs(
    local: Mapping[str, Tensor], num_items: int, device: torch.device, layout: CPLayout | DocumentCPLayout
) -> dict[str, Any]:
    """The model's keyword arguments from this rank's ``[1, rows]`` tensors."""
    return {
        "input_ids": local["input_ids"],
        "position_ids": local["position_ids"],
        "labels": local["shift_labels"],
        "shift_labels": local["shift_labels"],
        "num_items_in_batch": torch.tensor(num_items, device=device),
        "use_cache": False,
        LAYOUT_KWARG: layout,
    }
