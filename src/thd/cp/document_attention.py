"""Attention over a document-aware CP buffer: local documents plain, ring documents through the ring.

:func:`document_attention` runs the local region of a :class:`~thd.cp.document_partition.
DocumentLayout` with :func:`thd.attention` (whole documents, no exchange) and only the ring
region with :func:`thd.cp.ring_attention`. On CUDA the local attention is queued on a side
stream forked from the current one, so it runs while the ring waits for its exchanges (and
autograd runs its backward on that stream too); the current stream joins it before the output
is used. Both parts write exact zeros on padding rows and never read padding rows of q, k, v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from thd.cp.document_partition import DocumentLayout
from thd.errors import ThdTypeError, ThdValueError

__all__ = ["document_attention"]

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _local_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _region_attention(
    attend: Callable[..., Tensor | tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    region: tuple[Tensor, Tensor, int],
    keywords: dict[str, object],
) -> Tensor:
    """``out`` of ``attend`` (:func:`thd.attention` or :func:`thd.cp.ring_attention`) over one
    region of the buffer: self-attention on its ``(cu_seqlens, cu_seqlens_padded, max_seqlen)``."""
    cu, cup, max_seqlen = region
    out = attend(
        q,
        k,
        v,
        cu,
        cu,
        cu_seqlens_q_padded=cup,
        cu_seqlens_kv_padded=cup,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        **keywords,
    )
    assert isinstance(out, Tensor)
    return out


def _local_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: DocumentLayout, variants: dict[str, object]
) -> Tensor:
    import thd

    cu = layout.local_cu_seqlens
    return _region_attention(thd.attention, q, k, v, (cu, cu, layout.local_max_seqlen), variants)


def _ring(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: DocumentLayout,
    group: dist.ProcessGroup | None,
    variants: dict[str, object],
) -> Tensor:
    from thd.cp import ring_attention  # the public entry point (on use: thd.cp imports this module)

    region = (layout.ring_cu_seqlens, layout.ring_cu_seqlens_padded, layout.ring_max_seqlen)
    keywords = {**variants, "group": group, "pad_between_seqs": layout.ring_pad_between_seqs}
    return _region_attention(ring_attention, q, k, v, region, keywords)


def document_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: DocumentLayout,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    overlap: bool = True,
) -> Tensor:
    """Self-attention of this rank's buffer (``[layout.rows, H, D]`` from
    :func:`thd.cp.partition_documents`); differentiable.

    Args:
        q, k, v: ``[rows, Hq, D]``, ``[rows, Hkv, D]``, ``[rows, Hkv, Dv]`` (GQA: ``Hq % Hkv == 0``).
        layout: this rank's :class:`DocumentLayout` (``thd.cp.document_layout``).
        group: the CP process group (default: the world group; its size must be
            ``layout.cp_size``); used only when the plan has ring documents.
        causal, softmax_scale, window_size, softcap, sinks: as for :func:`thd.attention` (windows
            are over each whole document). ``sinks``' gradient on each rank is its part: sum it
            over the group as for :func:`thd.cp.ring_attention`.
        overlap: on CUDA, run the local documents on a side stream during the ring.

    Returns:
        ``out [rows, Hq, Dv]`` with exact zeros on padding rows; the backward gives exact zeros
        on the padding rows of ``dq``, ``dk``, ``dv``.
    """
    fn = "document_attention"
    if not isinstance(layout, DocumentLayout):
        raise ThdTypeError(
            f"{fn}: layout: expected a DocumentLayout (thd.cp.document_layout), got {type(layout).__name__}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ThdTypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3 or t.shape[0] != layout.rows:
            raise ThdValueError(
                f"{fn}: {name} shape: expected [{layout.rows}, heads, head_dim] (layout.rows), "
                f"got {list(t.shape)}"
            )
    if (
        layout.has_ring
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group) != layout.cp_size
    ):
        raise ThdValueError(
            f"{fn}: group: expected {layout.cp_size} ranks (the plan's cp_size), "
            f"got {dist.get_world_size(group)}"
        )
    variants: dict[str, object] = {
        "causal": causal,
        "softmax_scale": softmax_scale,
        "window_size": window_size,
        "softcap": softcap,
        "sinks": sinks,
    }
    split = layout.ring_rows
    parts: list[Tensor] = []
    local_out: Tensor | None = None
    side = overlap and q.is_cuda and layout.has_local and layout.has_ring
    if side:
        current = torch.cuda.current_stream(q.device)
        stream = _local_stream(q.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            local_out = _local_attention(q[split:], k[split:], v[split:], layout, variants)
    elif layout.has_local:
        local_out = _local_attention(q[split:], k[split:], v[split:], layout, variants)
    if layout.has_ring:
        parts.append(_ring(q[:split], k[:split], v[:split], layout, group, variants))
    if side:
        assert local_out is not None
        current.wait_stream(stream)
        local_out.record_stream(current)
    if local_out is not None:
        parts.append(local_out)
    elif layout.rows > split:
        parts.append(q.new_zeros(layout.rows - split, q.shape[1], v.shape[2]))
    if not parts:  # an empty buffer
        return q.new_zeros(0, q.shape[1], v.shape[2])
    return parts[0] if len(parts) == 1 else torch.cat(parts)
