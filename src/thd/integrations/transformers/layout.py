"""THD layouts of the batches transformers hands to an attention function.

The attention function sees ``query [B, H, S, D]``; its rows, flattened to ``[B*S, H, D]``, are
described here by ``cu_seqlens`` / ``cu_seqlens_padded`` (see ``README.md``, "The layout"):

- packed (``B == 1``) from the ``cu_seq_lens_q/k`` and ``max_length_q/k`` kwargs of
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: no host sync when the maximum
  lengths are given;
- packed from ``position_ids`` alone (a document starts wherever the position does not continue
  the previous one, as in ``transformers.masking_utils.find_packed_sequence_indices``): built
  on the device, but the number of documents (and the longest, unless ``max_length_q`` is
  given) is one host sync, paid once per forward (the layout is cached by tensor identity, so
  the other layers reuse it);
- right-padded (``B`` rows, a 2-D padding mask): each row is a slot of ``S`` rows,
  ``cu_seqlens_padded = arange(B + 1) * S`` and ``cu_seqlens`` the cumulative mask row sums; no
  unpad/pad copies and no host sync;
- dense (no mask, no packing): ``B`` full rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from thd.errors import ThdValueError

__all__ = ["Layout", "resolve_layout"]


@dataclass(frozen=True)
class Layout:
    """Arguments of ``thd.attention`` that describe the rows of one call."""

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Tensor
    cu_seqlens_q_padded: Tensor | None
    cu_seqlens_kv_padded: Tensor | None
    max_seqlen_q: int | None
    max_seqlen_kv: int | None

    def kwargs(self) -> dict[str, Tensor | int | None]:
        """The fields as ``thd.attention``'s keyword arguments (the tensors themselves, no copies)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _as_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]


def _cu(x: Tensor) -> Tensor:
    return x.reshape(-1).to(torch.int32)


def _slots(batch: int, length: int, device: torch.device) -> Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


def dense(batch: int, q_len: int, kv_len: int, device: torch.device) -> Layout:
    """``B`` sequences that fill their rows (causal is bottom-right aligned, so KV caches work)."""
    return Layout(_slots(batch, q_len, device), _slots(batch, kv_len, device), None, None, q_len, kv_len)


def right_padded(mask: Tensor, q_len: int, kv_len: int) -> Layout:
    """Rows of a right-padded batch as slots of ``S`` rows; ``mask`` is the bool ``[B, S]`` padding mask."""
    if q_len != kv_len or mask.shape[-1] != kv_len:
        raise ThdValueError(
            f"thd attention: a padding mask needs query length == key length == mask length, got "
            f"{q_len}, {kv_len}, {mask.shape[-1]} (padded batches with a KV cache are not supported; "
            "generate with batch size 1 or use attn_implementation='sdpa' for generation)"
        )
    batch = mask.shape[0]
    cu = torch.zeros(batch + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(mask.sum(-1, dtype=torch.int32), dim=0, dtype=torch.int32, out=cu[1:])
    slots = _slots(batch, q_len, mask.device)
    return Layout(cu, cu, slots, slots, q_len, kv_len)


def from_cu_seq_lens(kwargs: Mapping[str, Any]) -> Layout:
    """Packed layout from the flash-attention kwargs (``cu_seq_lens_k`` defaults to ``_q``)."""
    cu_q = _cu(kwargs["cu_seq_lens_q"])
    cu_k = kwargs.get("cu_seq_lens_k")
    cu_kv = cu_q if cu_k is None else _cu(cu_k)
    max_q = _as_int(kwargs.get("max_length_q"))
    max_kv = _as_int(kwargs.get("max_length_k", max_q if cu_k is None else None))
    return Layout(cu_q, cu_kv, None, None, max_q, max_kv)


class _LastLayout:
    """One-entry cache: the layout derived from a tensor, reused while that same tensor (same
    object, unchanged version) comes back, i.e. by every layer of one forward."""

    def __init__(self) -> None:
        self._ref: weakref.ref[Tensor] | None = None
        self._key: tuple[int, int | None] = (-1, None)
        self._layout: Layout | None = None

    def get(self, source: Tensor, max_seqlen: int | None) -> Layout | None:
        if self._ref is None or self._ref() is not source or self._key != (source._version, max_seqlen):
            return None
        return self._layout

    def put(self, source: Tensor, max_seqlen: int | None, layout: Layout) -> None:
        self._ref, self._key, self._layout = weakref.ref(source), (source._version, max_seqlen), layout


_position_cache = _LastLayout()


def from_position_ids(position_ids: Tensor, max_seqlen: int | None) -> Layout:
    """Packed layout from ``position_ids [1, T]``: a document starts at row 0 and wherever the
    position is not the previous one plus one. One host sync (the number of documents, and the
    longest one when ``max_seqlen`` is not given); cached per ``position_ids`` tensor."""
    compiling = torch.compiler.is_compiling()
    if not compiling and (hit := _position_cache.get(position_ids, max_seqlen)) is not None:
        return hit
    pos = position_ids.reshape(-1)
    rows = torch.arange(pos.numel(), device=pos.device)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    doc = torch.cumsum(starts, 0) - 1  # document of each row, non-decreasing
    if max_seqlen is None:
        first = torch.cummax(torch.where(starts, rows, 0), 0).values  # first row of each row's document
        count, longest = torch.stack((doc[-1] + 1, (rows - first).max() + 1)).tolist()
    else:
        count, longest = int(doc[-1]) + 1, max_seqlen
    # cu[d] = first row whose document is >= d (cu[count] = T): no nonzero, no second sync.
    cu = torch.searchsorted(doc, torch.arange(count + 1, device=pos.device), out_int32=True)
    layout = Layout(cu, cu, None, None, longest, longest)
    if not compiling:
        _position_cache.put(position_ids, max_seqlen, layout)
    return layout


def _is_row(position_ids: object, length: int) -> bool:
    """Plain ``[1, S]`` positions (not multimodal ``[3, B, S]`` ones)."""
    return (
        isinstance(position_ids, Tensor)
        and position_ids.numel() == length
        and position_ids.shape[-1] == length
    )


def resolve_layout(
    attention_mask: Tensor | None,
    batch: int,
    q_len: int,
    kv_len: int,
    device: torch.device,
    kwargs: Mapping[str, Any],
) -> Layout:
    """The layout of one attention call, from the mask and the forward's kwargs (see the module docs)."""
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ThdValueError(
                "thd attention: attention_mask: expected the 2-D padding mask [B, S] that the 'thd' mask "
                f"function returns, got shape {list(attention_mask.shape)} "
                "(custom 4-D masks are not supported)"
            )
        return right_padded(attention_mask.to(device=device, dtype=torch.bool), q_len, kv_len)
    if kwargs.get("cu_seq_lens_q") is not None:
        if batch != 1:
            raise ThdValueError(
                f"thd attention: cu_seq_lens_q needs a packed batch of batch size 1, got batch size {batch}"
            )
        return from_cu_seq_lens(kwargs)
    position_ids = kwargs.get("position_ids")
    if batch == 1 and q_len == kv_len and q_len > 1 and _is_row(position_ids, q_len):
        return from_position_ids(position_ids, _as_int(kwargs.get("max_length_q")))
    return dense(batch, q_len, kv_len, device)
