"""Attention over a document-aware CP buffer: local documents plain, ring documents through the ring.

:func:`document_attention` runs the local region of a :class:`~thd.cp.document_partition.
DocumentLayout` with :func:`thd.attention` (whole documents, no exchange) and only the ring
region with :func:`thd.cp.ring_attention`. On CUDA the local attention is queued first, on a
side stream forked from the current one, so it runs while the ring computes and waits for its
exchanges (autograd runs its backward on that stream too, beside the ring's backward); the
current stream joins it before the output is used, the inputs are marked as used on the side
stream (``record_stream``) so their memory is not reused under it, and no host sync is added
(the fork and the join are stream waits, capturable in a CUDA graph). On CPU the two parts run
one after the other. Both parts write exact zeros on padding rows and never read padding rows
of q, k, v.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from thd.cp.document_partition import DocumentLayout
from thd.errors import ThdTypeError, ThdValueError
from thd.ops.attention.keywords import SCORE_ARGS, ScoreArgs, Unpack, check_keywords

__all__ = ["document_attention"]

_STREAMS: dict[int, torch.cuda.Stream] = {}


def _local_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def _used_on(stream: torch.cuda.Stream, tensors: tuple[object, ...]) -> None:
    """Mark the caller's CUDA tensors as read on ``stream``: the allocator then reuses their memory
    only after the work queued there when they are freed, the backward's included (autograd runs
    the local documents' backward on ``stream`` and frees their saved inputs afterwards)."""
    for t in tensors:
        if isinstance(t, Tensor) and t.is_cuda:
            t.record_stream(stream)


def _region_attention(
    attend: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    region: tuple[Tensor, Tensor, int],
    keywords: dict[str, object],
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``attend`` (:func:`thd.attention` or :func:`thd.cp.ring_attention`) over
    one region of the buffer: self-attention on its ``(cu_seqlens, cu_seqlens_padded, max_seqlen)``."""
    cu, cup, max_seqlen = region
    out, lse = attend(
        q,
        k,
        v,
        cu,
        cu,
        cu_seqlens_q_padded=cup,
        cu_seqlens_kv_padded=cup,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        return_lse=True,
        **keywords,
    )
    return out, lse


def _local_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: DocumentLayout, variants: dict[str, object]
) -> tuple[Tensor, Tensor]:
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
) -> tuple[Tensor, Tensor]:
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
    return_lse: bool = False,
    overlap: bool = True,
    **scores: Unpack[ScoreArgs],
) -> Tensor | tuple[Tensor, Tensor]:
    """Self-attention of this rank's buffer (``[layout.rows, H, D]`` from
    :func:`thd.cp.partition_documents`); differentiable.

    Args:
        q, k, v: ``[rows, Hq, D]``, ``[rows, Hkv, D]``, ``[rows, Hkv, Dv]`` (GQA: ``Hq % Hkv == 0``).
        layout: this rank's :class:`DocumentLayout` (``thd.cp.document_layout``).
        group: the CP process group (default: the world group; its size must be
            ``layout.cp_size``); used only when the plan has ring documents.
        causal, softmax_scale, window_size, softcap, sinks: as for :func:`thd.attention` (but
            ``causal`` defaults to True; windows are over each whole document). ``sinks``' gradient
            on each rank is its part: sum it over the group as for :func:`thd.cp.ring_attention`.
        return_lse: also return the log-sum-exp of the scores.
        overlap: on CUDA, run the local documents on a side stream during the ring.

    Returns:
        ``out [rows, Hq, Dv]`` with exact zeros on padding rows and, with ``return_lse``,
        ``lse [Hq, rows]`` fp32 with ``-inf`` on padding rows (as :func:`thd.attention`'s); the
        backward gives exact zeros on the padding rows of ``dq``, ``dk``, ``dv``.
    """
    fn = "document_attention"
    check_keywords(fn, scores, SCORE_ARGS)
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
    variants: dict[str, object] = {"causal": True, **scores}  # thd.attention's default is not causal
    split = layout.ring_rows
    parts: list[tuple[Tensor, Tensor]] = []
    local: tuple[Tensor, Tensor] | None = None
    side = overlap and q.is_cuda and layout.has_local and layout.has_ring
    if side:
        current = torch.cuda.current_stream(q.device)
        stream = _local_stream(q.device)
        stream.wait_stream(current)
        _used_on(stream, (q, k, v, layout.local_cu_seqlens, scores.get("sinks")))
        with torch.cuda.stream(stream):
            local = _local_attention(q[split:], k[split:], v[split:], layout, variants)
    elif layout.has_local:
        local = _local_attention(q[split:], k[split:], v[split:], layout, variants)
    if layout.has_ring:
        parts.append(_ring(q[:split], k[:split], v[:split], layout, group, variants))
    if side:
        assert local is not None
        current.wait_stream(stream)
        for t in local:
            t.record_stream(current)
    if local is not None:
        parts.append(local)
    elif layout.rows > split or not parts:  # no local document: padding rows (or an empty buffer)
        rows = layout.rows - split
        parts.append(
            (
                q.new_zeros(rows, q.shape[1], v.shape[2]),
                torch.full((q.shape[1], rows), float("-inf"), dtype=torch.float32, device=q.device),
            )
        )
    out, lse = (
        parts[0]
        if len(parts) == 1
        else (torch.cat([o for o, _ in parts]), torch.cat([x for _, x in parts], 1))
    )
    return (out, lse) if return_lse else out
